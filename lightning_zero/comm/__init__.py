"""Layer 2, communication: the only package that calls ``torch.distributed``.

:class:`Comm` is the one API the engine uses (collectives with element and byte counters and
timing); how a collective runs on the process group's backend is chosen in one place
(:mod:`lightning_zero.comm.backends`).
"""

from lightning_zero.comm.backends import end_process_group
from lightning_zero.comm.communicator import Comm
from lightning_zero.comm.groups import CommGroups, build_mesh, hybrid_mesh, tensor_groups, tensor_mesh
from lightning_zero.comm.handles import CommError, CommStats, collective_failures

__all__ = [
    "Comm",
    "CommError",
    "CommGroups",
    "CommStats",
    "build_mesh",
    "collective_failures",
    "end_process_group",
    "hybrid_mesh",
    "tensor_groups",
    "tensor_mesh",
]
