"""Launch a benchmark's worker on local ranks: one process per rank on this machine (gloo over
localhost, one thread each), the script run again with ``--worker [MODE] --out FILE`` and its own
arguments; rank 0 writes ``FILE`` (JSON), which is returned. Imported as a top-level module: this
folder is on ``sys.path`` when a benchmark runs as a script."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def launch_ranks(script: str, ranks: int, worker: list[str] | None = None, label: str = "") -> Any:
    """Run ``script`` on ``ranks`` local processes as its worker (``--worker`` and the ``worker``
    arguments, then this command line's own) and return what rank 0 wrote.

    Raises:
        SystemExit: a rank ended with a non-zero status (named, with ``label``).
    """
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for rank in range(ranks):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks))
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            argv = [sys.executable, script, "--worker", *(worker or []), "--out", str(out), *sys.argv[1:]]
            procs.append(subprocess.Popen(argv, env=env))
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"{label + ': ' if label else ''}ranks ended with {codes}")
        return json.loads(out.read_text())


def parse_or_work(
    parser: argparse.ArgumentParser, worker: Callable[[argparse.Namespace, Path], None]
) -> argparse.Namespace | None:
    """The command line's arguments, with the worker's own (``--worker``, ``--out FILE``) added; in a
    rank that :func:`launch_ranks` started, ``worker(args, FILE)`` runs here and ``None`` comes back."""
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args, args.out)
        return None
    return args


def report_and_end(out: Path, mine: Any) -> None:
    """In a launched rank: every rank's ``mine`` gathered, rank 0 writes them to ``out`` (JSON, what
    :func:`launch_ranks` returns), then the process group ends. All ranks."""
    import torch.distributed as dist

    from lightning_zero.comm import end_process_group

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(everyone))
    end_process_group()
