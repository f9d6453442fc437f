"""Asynchronous sharded saves: snapshot on the training thread, write and commit on a background one.

Per rank, one save in flight at a time:

  1. ``save`` waits for the previous save (raising its failure), then snapshots on the calling thread
     everything this rank will write: its shards, the model tensors outside the buckets and
     Lightning's state (:class:`HostSnapshot`), and returns;
  2. a background thread writes, checksums, agrees with the other ranks and commits atomically: the
     blocking protocol of :mod:`lightning_zero.checkpoint.format`, unchanged; then it runs the removals that
     were requested meanwhile (:meth:`AsyncCheckpointWriter.remove_after_commit`);
  3. ``wait`` joins the thread, and the ranks exchange their outcome, so that a failure seen by one
     rank alone (a removal on rank 0) is raised on every rank.

Invariants:
  * what is written is the state at the moment ``save`` returned: every tensor is copied, and
    Lightning's state is copied container by container (tensors copied, other leaves deep-copied);
  * no checkpoint is removed while a commit is pending: a removal requested meanwhile runs after the
    commit, and not at all if the save failed, so the checkpoint it was to replace is kept;
  * the thread never touches the training process group: its collectives go over a dedicated gloo
    group, created (a collective) at the first save; ``wait`` uses that group only after the join.

Devices are decided in :class:`HostSnapshot` only: CPU tensors are cloned; CUDA tensors are copied
into pinned host memory without blocking, behind an event recorded on the device's current stream,
which the writer thread waits for before reading them; other devices are copied synchronously.

Limits: the extra host memory is one copy of this rank's shard state (plus the pinned buffers'
allocation cost on CUDA, paid at every save). A save while another is in flight blocks until the
first is committed. Every ``wait`` with ``agree=True`` must be made on all ranks at the same point.
"""

from __future__ import annotations

import copy
import os
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from lightning_zero.checkpoint.format import CheckpointError, StagedSave, stage_save
from lightning_zero.checkpoint.tensor_layout import checkpoint_comm
from lightning_zero.comm.communicator import Comm
from lightning_zero.comm.trace import span
from lightning_zero.engine.engine import ShardEngine


class HostSnapshot:
    """Copies in host memory, for a writer on another thread. The one place that picks devices."""

    def __init__(self) -> None:
        self._cuda_devices: set[torch.device] = set()

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor that owns a copy of ``t`` (for a CUDA ``t``: complete once :meth:`seal`'s
        wait has returned)."""
        t = t.detach()
        if t.device.type == "cuda":
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            host.copy_(t, non_blocking=True)  # ordered after the step that produced t on its stream
            self._cuda_devices.add(t.device)
            return host
        return t.to("cpu", copy=True)

    def tree(self, obj: Any) -> Any:
        """A copy of ``obj`` that later changes to ``obj`` cannot reach: containers are rebuilt (keeping
        their type), tensors copied by :meth:`tensor`, other values deep-copied."""
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj)
        if isinstance(obj, dict):
            out = copy.copy(obj)  # the same mapping type (OrderedDict, Lightning's AttributeDict, ...)
            for key, value in obj.items():
                out[key] = self.tree(value)
            return out
        if isinstance(obj, list):
            items = copy.copy(obj)
            items[:] = [self.tree(v) for v in obj]
            return items
        if isinstance(obj, tuple):
            values = [self.tree(v) for v in obj]
            return type(obj)(*values) if hasattr(obj, "_fields") else type(obj)(values)
        return copy.deepcopy(obj)

    def seal(self) -> Callable[[], None]:
        """Mark the end of the copies on each CUDA device's current stream.

        Returns:
            A function that blocks until every copy made so far is complete (call it on the writer thread).
        """
        events = []
        for device in self._cuda_devices:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            events.append(event)

        def ready() -> None:
            for event in events:
                event.synchronize()

        return ready


class AsyncCheckpointWriter:
    """Writes sharded checkpoints in a background thread, one at a time (see the module docstring)."""

    def __init__(self, timeout: timedelta | None = None) -> None:
        """``timeout``: of the writer's own process group (pass the training group's: a dead or hung
        peer then ends the background save within it, not torch's 30-minute default)."""
        self._timeout = timeout
        self._lock = threading.Lock()  # guards _busy, _removals and _error between the two threads
        self._busy = False  # a save is being written, or removals queued behind it are running
        self._removals: list[Callable[[], None]] = []
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._comm: Comm | None = None  # over a gloo group of its own, never the training one
        self._device: torch.device | None = None  # the training device, for the NVTX ranges

    @property
    def pending(self) -> bool:
        """Whether a save, or a removal queued behind it, is still running in the background."""
        with self._lock:
            return self._busy

    def save(
        self,
        engine: ShardEngine,
        path: str | os.PathLike[str],
        lightning_state: dict[str, Any],
        extra_tensors: dict[str, torch.Tensor],
        stage: int,
        aliases: dict[str, str] | None = None,
    ) -> None:
        """Snapshot this rank's part of the checkpoint at ``path``, then write it in the background.

        Must be called on all ranks. Waits for the previous save first.

        Args:
            engine: the sharded state to save (``ShardedAdamW.engine``).
            path: the checkpoint directory to create or replace.
            lightning_state: Lightning's state for ``meta.pt`` (copied here).
            extra_tensors: model tensors outside the buckets (copied here).
            stage: the ZeRO stage, recorded in ``meta.pt``.
            aliases: other keys of tied parameters (see :func:`~lightning_zero.checkpoint.format.stage_save`).

        Raises:
            CheckpointError: the previous save's failure, on every rank; nothing new is started.
        """
        self.wait()
        if self._comm is None:
            self._comm = checkpoint_comm(engine).new_group("gloo", self._timeout)  # at the first save
        snapshot = HostSnapshot()
        self._device = engine.world.device
        with span("checkpoint: stage", self._device):
            staged = stage_save(
                engine,
                path,
                snapshot.tree(lightning_state),
                extra_tensors,
                stage,
                copy_tensor=snapshot.tensor,
                aliases=aliases,
            )
        staged.before_write = snapshot.seal()
        # not a daemon: an interpreter that exits right after a save still finishes writing it
        thread = threading.Thread(target=self._run, args=(staged,), name="lightning-zero-save")
        with self._lock:
            self._busy = True
        try:
            thread.start()
        except BaseException:
            with self._lock:
                self._busy = False
            raise
        self._thread = thread

    def _run(self, staged: StagedSave) -> None:
        error: BaseException | None = None
        try:
            assert self._comm is not None
            staged.write(self._comm)
        except BaseException as err:  # noqa: BLE001 - raised by wait(), on every rank
            error = err
        while True:
            with self._lock:
                if error is not None or not self._removals:
                    self._removals.clear()  # after a failed save: keep what it was to replace
                    self._error, self._busy = error, False
                    return
                remove = self._removals.pop(0)
            try:
                remove()
            except BaseException as err:  # noqa: BLE001
                error = err

    def remove_after_commit(self, remove: Callable[[], None]) -> None:
        """Run ``remove`` (the deletion of a checkpoint) once no commit is pending.

        Now if no save is in flight; otherwise on the writer thread right after the commit, and not
        at all if that save failed (the checkpoint it was to replace stays). A failure of ``remove``
        is raised at the next :meth:`wait`, on every rank. Any rank may call it.

        Args:
            remove: deletes one checkpoint; it must not use collectives.
        """
        with self._lock:
            if self._busy:
                self._removals.append(remove)
                return
            if self._error is not None:
                return  # the save before it failed; its error is raised at the next wait
        try:
            remove()
        except Exception as err:  # noqa: BLE001 - raised by wait(), on every rank
            with self._lock:
                self._error = err

    def wait(self, agree: bool = True) -> None:
        """Block until the save in flight and the removals queued behind it are done.

        Args:
            agree: exchange outcomes over the writer's group so that every rank raises when any rank
                failed; it must then be called on all ranks at the same point (every save, load and
                end of fit is). ``False`` when this rank alone is unwinding from another error.

        Raises:
            CheckpointError: a failure of the background work (with ``agree``: on every rank, naming
                the ranks that failed); other exceptions from it are raised as they are.
        """
        if self._thread is not None:
            with span("checkpoint: wait", self._device):
                self._thread.join()
            self._thread = None
        with self._lock:
            error, self._error = self._error, None
        if agree and self._comm is not None and self._comm.world_size > 1:
            error = self._agreed(error)
        if error is not None:
            raise error

    def _agreed(self, error: BaseException | None) -> BaseException | None:
        """The failure every rank raises, given this rank's own (gathered on rank 0 of the writer's
        group, the failures broadcast: what a rank receives does not grow with the world size)."""
        assert self._comm is not None
        texts = self._comm.gather_object(None if error is None else f"{type(error).__name__}: {error}")
        failed: list[tuple[int, str]] = self._comm.broadcast_object(
            None if texts is None else [(rank, text) for rank, text in enumerate(texts) if text is not None]
        )
        if not failed:
            return None
        if error is not None and len(failed) == self._comm.world_size and len({t for _, t in failed}) == 1:
            return error  # the same failure everywhere: the write protocol already agreed on it
        agreed = CheckpointError(
            "a background checkpoint task failed:\n" + "\n".join(f"rank {r}: {t}" for r, t in failed)
        )
        agreed.__cause__ = error
        return agreed
