"""A peer that hangs inside an all-reduce across replica groups, under Fabric with node-aware sharding.

Run by ``tests/distributed/test_faults.py`` as 4 ranks (``tests.launch.run_ranks``: Lightning's
environment, Fabric's own process group): ``ZeroFabricStrategy(shard_group_size=2, timeout=T)``, so
shard groups {0, 1} and {2, 3} and replica groups {0, 2} and {1, 3}, which the strategy creates. At
step 2 rank 3 sleeps ``HANG x T`` where it would issue its first all-reduce across the replicas: its
replica partner (rank 1) waits inside that collective, its shard partner (rank 2) inside the next
reduce-scatter, rank 0 on rank 1. Each rank writes ``rank<r>.json`` with the error it ended with and
the seconds from the start of step 2 to that error::

    python -m tests.distributed.hybrid_hang OUT_DIR TIMEOUT_S
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric

from lightning_zero import ZeroFabricStrategy
from tests.distributed.models import TinyNet, batch

FAULT_STEP = 2
HANG = 2.5  # the hang outlasts every peer's timeout by 1.5 timeouts


def _hang_before_first_all_reduce(replicas: Any, seconds: float) -> None:
    original = replicas.all_reduce

    def late(*args: Any, **kwargs: Any) -> Any:
        replicas.all_reduce = original  # once
        time.sleep(seconds)
        return original(*args, **kwargs)

    replicas.all_reduce = late


def main(out_dir: Path, timeout_s: float) -> None:
    torch.set_num_threads(1)
    strategy = ZeroFabricStrategy(
        stage=2, shard_group_size=2, timeout=timedelta(seconds=timeout_s), bucket_cap_mb=0.0004
    )
    fabric = Fabric(accelerator="cpu", devices=4, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    model, opt = fabric.setup(*(lambda m: (m, torch.optim.AdamW(m.parameters(), lr=1e-2)))(TinyNet()))
    engine = opt.optimizer.engine
    assert engine.groups.layout == "2x2", engine.groups.layout
    result: dict[str, Any] = {"error": None, "chain": []}
    fault_at = time.monotonic()
    try:
        for step in range(5):
            if step == FAULT_STEP:
                fault_at = time.monotonic()
                if fabric.global_rank == 3:
                    _hang_before_first_all_reduce(engine.groups.replicas, HANG * timeout_s)
            x, y = batch(step, 0, fabric.global_rank, 4, torch.float32)
            fabric.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
    except Exception as err:  # noqa: BLE001 - what a user would see, recorded
        result["error"] = f"{type(err).__name__}: {err}"
        cause: BaseException | None = err
        while cause is not None and len(result["chain"]) < 10:
            result["chain"].append(type(cause).__name__)
            cause = cause.__cause__ or cause.__context__
    result["seconds_after_fault"] = time.monotonic() - fault_at
    (out_dir / f"rank{fabric.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]))
    os._exit(0)  # do not wait in the process group's destructor for a dead peer
