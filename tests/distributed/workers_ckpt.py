"""Rank functions for the sharded checkpoint tests (importable by spawn)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_zero import ShardedAdamW, ZeroConfig
from lightning_zero.checkpoint import CheckpointError, read_meta, save_sharded
from lightning_zero.checkpoint.reshard import load_sharded, preflight
from lightning_zero.optim.full_state import gather_full_state
from tests.distributed.models import BlockNet, TinyNet, param_groups

NETS = {"tiny": TinyNet, "blocks": BlockNet}

GLOBAL_BATCH = 12  # divisible by 1, 2, 3, 4


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + step)
    return (
        torch.randn(GLOBAL_BATCH, 7, generator=g, dtype=torch.float64),
        torch.randn(GLOBAL_BATCH, 5, generator=g, dtype=torch.float64),
    )


def build(
    stage: int, amsgrad: bool = False, seed: int = 0, cap_mb: float = 0.0004, net: str = "tiny"
) -> tuple[torch.nn.Module, ShardedAdamW]:
    """``net="blocks"`` at stage 3: three blocks are units (buckets never span two)."""
    torch.manual_seed(seed)
    model = NETS[net]().double()
    units = {"min_unit_numel": 0} if stage == 3 else {}
    config = ZeroConfig(stage=stage, bucket_cap_mb=cap_mb, first_bucket_cap_mb=cap_mb / 2, **units)
    opt = ShardedAdamW(
        param_groups(model),
        lr=3e-2,
        amsgrad=amsgrad,
        config=config,
        param_order=model.parameters(),
        param_names={p: n for n, p in model.named_parameters()},
        module=model if stage == 3 else None,
    )
    return model, opt


def params_of(model: torch.nn.Module, opt: ShardedAdamW) -> dict[str, torch.Tensor]:
    """Full copies of the parameters (at stage 3 gathered for the read)."""
    with opt.full_parameters():
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def train(model: torch.nn.Module, opt: ShardedAdamW, steps: range, rank: int, world_size: int) -> None:
    per_rank = GLOBAL_BATCH // world_size
    for step in steps:
        x, y = global_batch(step)
        rows = slice(rank * per_rank, (rank + 1) * per_rank)
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()


def save_phase(
    rank: int, world_size: int, path: str, stage: int, steps: int, net: str = "tiny"
) -> dict[str, Any] | None:
    model, opt = build(stage, net=net)
    train(model, opt, range(steps), rank, world_size)
    save_sharded(opt.engine, path, {"global_step": steps}, {}, stage)
    return gather_full_state(opt.engine)


def resume_phase(
    rank: int,
    world_size: int,
    path: str,
    stage: int,
    start: int,
    steps: int,
    cap_mb: float = 0.0004,
    net: str = "tiny",
) -> dict[str, Any]:
    model, opt = build(stage, cap_mb=cap_mb, net=net)
    # scramble what the checkpoint must restore (the frozen layer is not in it)
    with torch.no_grad(), opt.full_parameters(writeback=True):
        for p in model.parameters():
            if p.requires_grad:
                p.normal_()
    meta = read_meta(path)
    preflight(opt.engine, Path(path), meta)
    load_sharded(opt.engine, Path(path), meta)
    loaded = gather_full_state(opt.engine)
    loaded_params = params_of(model, opt)
    train(model, opt, range(start, start + steps), rank, world_size)
    return {"loaded": loaded, "loaded_params": loaded_params, "final": params_of(model, opt)}


def load_error(rank: int, world_size: int, path: str, width: int = 13) -> str:
    """Try to load ``path`` into a (possibly different) model; the error text, or 'loaded'."""
    torch.manual_seed(0)
    model = TinyNet(width=width).double()
    opt = ShardedAdamW(
        param_groups(model),
        lr=3e-2,
        param_order=model.parameters(),
        param_names={p: n for n, p in model.named_parameters()},
    )
    before = [p.detach().clone() for p in model.parameters()]
    try:
        meta = read_meta(path)
        preflight(opt.engine, Path(path), meta)
        load_sharded(opt.engine, Path(path), meta)
    except CheckpointError as err:
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        return f"{err}\nunchanged={unchanged}"
    return "loaded"


def _private_view(directory: Path, redirect: bool) -> tuple[str, Path]:
    """Give this process its own view of ``directory`` (a fresh tmpfs in a private mount namespace):
    what a node-local disk is to a checkpoint directory another node writes into. With ``redirect``
    (or when the namespace cannot be made: no CAP_SYS_ADMIN), this rank's checkpoint writes go to a
    private directory instead. Returns how, and the directory that holds this rank's temporaries."""
    import ctypes
    import os

    libc = ctypes.CDLL(None, use_errno=True)
    clone_newns, ms_rec, ms_private = 0x00020000, 0x4000, 0x40000
    if (
        not redirect
        and libc.unshare(clone_newns) == 0
        and libc.mount(b"none", b"/", None, ms_rec | ms_private, None) == 0
        and libc.mount(b"tmpfs", os.fsencode(directory), b"tmpfs", 0, None) == 0
    ):
        return "mount namespace", directory
    import lightning_zero.checkpoint.format as checkpoint_format

    private = directory.parent / f"node-local-{os.getpid()}"
    original = checkpoint_format.StagedSave.write

    def write(self: Any, comm: Any) -> None:
        self.tmp = private / self.tmp.name  # this rank's files land where rank 0 cannot see them
        original(self, comm)

    checkpoint_format.StagedSave.write = write  # type: ignore[method-assign]
    return "redirected writes", private


def _saved_at_step_2(rank: int, world_size: int, root: Path) -> tuple[Any, Any]:
    """A 2-rank model trained 2 steps and saved to ``root/ckpt``."""
    model, opt = build(2)
    train(model, opt, range(2), rank, world_size)
    save_sharded(opt.engine, root / "ckpt", {"global_step": 2}, {}, 2)
    return model, opt


def _save_at_step_4(model: Any, opt: Any, rank: int, world_size: int, root: Path) -> str | None:
    """Train 2 more steps and save over ``root/ckpt``: the save's error, or ``None``."""
    train(model, opt, range(2, 4), rank, world_size)
    try:
        save_sharded(opt.engine, root / "ckpt", {"global_step": 4}, {}, 2)
    except CheckpointError as err:
        return str(err)
    return None


def node_local_save(rank: int, world_size: int, root: str, redirect: bool) -> dict[str, Any]:
    """A save into a directory every rank sees, then (rank 1 on "its own disk") a save over it."""
    root_path = Path(root)
    model, opt = _saved_at_step_2(rank, world_size, root_path)
    how, view = _private_view(root_path, redirect) if rank == 1 else (None, root_path)
    error = _save_at_step_4(model, opt, rank, world_size, root_path)
    return {
        "how": how,
        "error": error,
        "left": sorted(p.name for p in view.iterdir()) if view.is_dir() else [],
        "step": read_meta(root_path / "ckpt")["lightning"]["global_step"] if rank == 0 else None,
    }


def stale_size_save(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """A save into a directory every rank sees, then a save over it where rank 0 sees rank 1's shard file
    present but at half the size rank 1 wrote and reported (what a shared file system that has not yet
    made the whole write visible to another node shows: no sha256 is read at commit, only sizes)."""
    import lightning_zero.checkpoint.format as checkpoint_format

    root_path = Path(root)
    model, opt = _saved_at_step_2(rank, world_size, root_path)
    written: list[tuple[str, int]] = []
    if rank == 1:
        original = checkpoint_format._write  # noqa: SLF001

        def write(obj: Any, path: Path) -> tuple[str, int, str]:
            name, size, digest = original(obj, path)
            if name.startswith("shard-"):
                with open(path, "rb+") as f:
                    f.truncate(size // 2)  # what rank 0 will see
                written.append((name, size))
            return name, size, digest

        checkpoint_format._write = write  # type: ignore[attr-defined]  # noqa: SLF001
    error = _save_at_step_4(model, opt, rank, world_size, root_path)
    return {
        "error": error,
        "written": written,
        "left": sorted(p.name for p in root_path.iterdir()),
        "step": read_meta(root_path / "ckpt")["lightning"]["global_step"] if rank == 0 else None,
    }


def meta_read_once(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """``read_meta_once`` of a checkpoint and of a directory without ``meta.pt``: which ranks read the
    file (only rank 0 may), what each got; ``sharded_everywhere`` where every rank sees the
    checkpoint, where none does, and where the last rank is given a path without ``meta.pt``."""
    import lightning_zero.checkpoint.collective_read as collective_read
    from lightning_zero.comm import Comm

    _saved_at_step_2(rank, world_size, Path(root))
    reads = []
    original = collective_read.read_meta

    def counted(path: Any) -> Any:
        reads.append(str(path))
        return original(path)

    collective_read.read_meta = counted  # type: ignore[assignment]
    try:
        meta = collective_read.read_meta_once(Path(root) / "ckpt", Comm())
        try:
            collective_read.read_meta_once(Path(root) / "absent", Comm())
            error = None
        except CheckpointError as err:
            error = str(err)
    finally:
        collective_read.read_meta = original  # type: ignore[assignment]
    sharded = [collective_read.sharded_everywhere(Path(root) / name, Comm()) for name in ("ckpt", "absent")]
    try:
        mine = "absent" if rank == world_size - 1 else "ckpt"
        collective_read.sharded_everywhere(Path(root) / mine, Comm())
        mismatch = None
    except CheckpointError as err:
        mismatch = str(err)
    return {
        "reads": len(reads),
        "step": meta["lightning"]["global_step"],
        "error": error,
        "sharded": sharded,
        "mismatch": mismatch,
    }
