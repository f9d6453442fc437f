"""The preparation pipeline behind `python -m recipes.prepare` and the text sources of the recipe.

Steps: resolve and check the inputs and the tokenizer (every bad value fails here, before any work,
naming it) -> claim the output directory (`recipes.data.preparation.plan`: a directory prepared from
other inputs or with another tokenizer or settings is refused, never overwritten) -> train BPE on the
corpus if the tokenizer is `bpe` -> tokenize the units (`recipes.data.preparation.documents`) in
`workers` processes, each unit into its own train and validation shard (`recipes.data.preparation.units`)
-> write `index.json` last (`recipes.data.shards` has the format).

Parallelism and determinism: units are fixed by the inputs and `shard_mb`; unit `i` always writes
`train-i.bin` and `val-i.bin` with the same bytes, so 1 and N processes give identical directories.
Idempotence: a re-run skips every unit whose shards are present with their recorded size and sha256
(`verify=False`: size only), rebuilds the others and rewrites the index. Memory: each process holds one
batch of documents and its token ids, never a unit or the corpus. Imports numpy only (no torch): pool
workers start fast.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from recipes.data.corpus import CorpusError
from recipes.data.preparation.documents import (
    HFSource,
    Unit,
    check_files,
    check_hf,
    plan_file_units,
    plan_hf_units,
    resolve_files,
    source_fingerprint,
)
from recipes.data.preparation.plan import (
    PrepareConfig,
    claim_directory,
    plan_key,
    plan_record,
    tokenizer_into_dir,
)
from recipes.data.preparation.units import UnitResult, UnitTask, limit_threads, reusable_result, run_unit
from recipes.data.shards import INDEX_NAME, TokenIndex, token_dtype, write_json_atomic
from recipes.data.tokenizer import TokenizerSpec, load_tokenizer_spec, resolve_tokenizer


@dataclass(frozen=True)
class PrepareSummary:
    """What `prepare` did."""

    directory: Path
    index: TokenIndex
    units: int
    reused_units: int
    new_tokens: int
    elapsed_s: float

    def line(self) -> str:
        tokens, docs = self.index.tokens, self.index.documents
        rate = (
            f"{self.new_tokens / max(self.elapsed_s, 1e-9):,.0f} tokens/s"
            if self.new_tokens
            else "nothing new"
        )
        return (
            f"prepared {self.directory}: {docs['train'] + docs['val']:,} documents "
            f"({docs['train']:,} train / {docs['val']:,} val), {tokens['train'] + tokens['val']:,} tokens "
            f"({tokens['train']:,} / {tokens['val']:,}), {len(self.index.shards)} shards of "
            f"{self.index.dtype}, {rate} in {self.elapsed_s:.1f} s; "
            f"{self.reused_units} of {self.units} units reused"
        )


def _run_units(tasks: list[UnitTask], workers: int, progress: bool, total_nbytes: int) -> list[UnitResult]:
    """Run every task, in this process or in a pool, updating a progress bar as units finish."""
    from tqdm.auto import tqdm

    bar = tqdm(
        total=total_nbytes or len(tasks),
        unit="B" if total_nbytes else "unit",
        unit_scale=True,
        desc="tokenizing",
        disable=not progress,
        dynamic_ncols=True,
    )
    results: list[UnitResult] = []
    tokens, start = 0, time.perf_counter()

    def done(result: UnitResult) -> None:
        nonlocal tokens
        results.append(result)
        tokens += 0 if result.reused else sum(s.tokens for s in result.shards)
        bar.update(result.nbytes if total_nbytes else 1)
        bar.set_postfix(tokens_per_s=f"{tokens / max(time.perf_counter() - start, 1e-9):,.0f}", refresh=False)

    try:
        pending = []
        for task in tasks:  # reuse checks here: sizes (and sha256) are cheap next to tokenizing
            reused = reusable_result(task)
            if reused is None:
                pending.append(task)
            else:
                done(reused)
        if workers == 1 or len(pending) <= 1:
            for task in pending:
                done(run_unit(task))
        else:
            context = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads
            with ProcessPoolExecutor(
                min(workers, len(pending)), mp_context=context, initializer=limit_threads
            ) as pool:
                for future in as_completed([pool.submit(run_unit, task) for task in pending]):
                    done(future.result())
    finally:
        bar.close()
    return sorted(results, key=lambda r: r.index)


def _resolve(config: PrepareConfig) -> tuple[list[Unit], HFSource | None, str, str, TokenizerSpec | None]:
    """Inputs -> units, and the tokenizer spec (None for BPE still to train); every check before work."""
    hf_source = None
    if config.dataset is not None:
        hf_source = HFSource(config.dataset, config.dataset_config, tuple(config.data_files), config.split)
        check_hf(hf_source, config.text_field)
        units, files = plan_hf_units(hf_source), []
        description = f"datasets.load_dataset({config.dataset!r}, split={config.split!r})"
    else:
        files = resolve_files(tuple(config.inputs))
        check_files(files, config.text_field)
        units = plan_file_units(files, max(1, int(config.shard_mb * 2**20)))
        more = f", ... ({len(config.inputs)} inputs)" if len(config.inputs) > 3 else ""
        shown = ", ".join(config.inputs[:3]) + more
        description = f"{shown} ({len(files)} files)"
    if not units:
        raise CorpusError(f"the inputs hold no text: {description}")
    spec = None
    if config.tokenizer != "bpe":
        spec = resolve_tokenizer(config.tokenizer, config.eos_token)
        loaded = load_tokenizer_spec(spec)  # fails now on a bad file or a missing end-of-document token
        if spec.kind == "hf":  # the copy in the output directory has no tokenizer_config.json beside it
            spec = dataclasses.replace(spec, eos_token=loaded.eos_token)  # type: ignore[attr-defined]
    return units, hf_source, description, source_fingerprint(files, hf_source), spec


def prepare(config: PrepareConfig) -> PrepareSummary:
    """Tokenize `config`'s inputs into `config.out` (see the module docstring); idempotent.

    Raises:
        CorpusError, TokenizerError, PrepareError: a bad input, tokenizer or output directory, before
            any shard is written.
    """
    start = time.perf_counter()
    units, hf_source, description, fingerprint, spec = _resolve(config)
    out = Path(config.out).expanduser()
    plan = plan_record(config, fingerprint, spec)
    claim_directory(out, plan)
    spec = tokenizer_into_dir(config, spec, out, units, hf_source)
    tokenizer = load_tokenizer_spec(spec)
    dtype = token_dtype(tokenizer.vocab_size)
    tasks = [
        UnitTask(
            i,
            unit,
            str(out),
            spec,
            dtype.name,
            config.val_fraction,
            config.text_field,
            hf_source,
            config.verify,
            plan_key({"unit": repr(unit), "tokenizer": tokenizer.identity, **plan}),
        )
        for i, unit in enumerate(units)
    ]
    total_nbytes = sum(p.nbytes for unit in units for p in unit)
    results = _run_units(tasks, config.workers, config.progress, total_nbytes)
    shards = tuple(s for r in results for s in r.shards)
    index = TokenIndex(
        dtype=dtype.name,
        tokenizer={
            "kind": spec.kind,
            "file": None if spec.path is None else Path(spec.path).name,
            "eos_token": spec.eos_token,
            "identity": tokenizer.identity,
            "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id,
        },
        max_token_id=max((s.max_token_id for s in shards), default=-1),
        documents={s: sum(r.documents[s] for r in results) for s in ("train", "val")},
        tokens={s: sum(x.tokens for x in shards if x.split == s) for s in ("train", "val")},
        val_fraction=config.val_fraction,
        source={"description": description, "fingerprint": fingerprint, "units": len(units)},
        shards=shards,
    )
    write_json_atomic(out / INDEX_NAME, index.to_json())
    summary = PrepareSummary(
        directory=out,
        index=index,
        units=len(units),
        reused_units=sum(r.reused for r in results),
        new_tokens=sum(s.tokens for r in results if not r.reused for s in r.shards),
        elapsed_s=time.perf_counter() - start,
    )
    if config.progress:
        print(summary.line(), flush=True)
    return summary
