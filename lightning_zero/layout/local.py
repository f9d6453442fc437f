"""The tensor a parameter's values live in on this rank: itself, or a ``DTensor``'s local shard.

Under tensor parallelism (``torch.distributed.tensor.parallel.parallelize_module``) a parameter is a
``DTensor``: its shape is the global one, and this rank's values are ``param._local_tensor``. The
engine buckets, binds and frees those local tensors (a local tensor's ``.data`` set to a view of a
flat buffer shares its storage, as a plain parameter's does), and keeps hooks, names and identity on
the parameter itself. Checked without importing ``torch.distributed.tensor``: when that module is not
imported, no ``DTensor`` exists.
"""

from __future__ import annotations

import sys

from torch import Tensor


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a ``DTensor`` (a tensor-parallel parameter or gradient)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local(tensor: Tensor) -> Tensor:
    """This rank's values of ``tensor``: its local shard if it is a ``DTensor``, else itself."""
    return tensor._local_tensor if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]
