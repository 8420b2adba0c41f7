"""The prep stage: task pools in, validated benchmark-separated train/dev splits out.

    load -> language -> benchmark separation -> duplicates -> length -> validation -> split

Every stage's counts reconcile (in = kept + filtered + quarantined) and each stage takes in
what the previous one kept (``StageLog.check``). Outputs, in ``out``:

    swe/train.parquet, swe/dev.parquet            SWE-smith-schema records (+ split, group)
    terminal/train.parquet, terminal/dev.parquet  terminal task records (path -> tasks/<id>)
    tasks/<task_id>/                               the kept terminal task folders
    terminal/warmstart.parquet, warmstart/<id>/    warm-start-only tasks (``warm_start_pool``)
    repos/<repo>/<base_commit>/                    clean snapshots of generated repositories
    quarantine.jsonl, filtered.jsonl               every record not kept, with its reason
    manifest.json                                  sources, stage table, parameters, summary

Outputs depend only on the inputs and the config (no timestamps), so a re-run writes the
same bytes; timings are printed, not stored.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from data_prep import filters
from data_prep.config import PrepConfig, SWESource, TerminalSource
from data_prep.schema import Quarantined, SWESmithRecord, TerminalTaskRecord
from data_prep.sources.swe_bench import load_swe_bench, normalise_repo
from data_prep.sources.swe_smith import parse_rows, rows_from_file, rows_from_hub
from data_prep.sources.terminal import load_task_pool
from data_prep.split import in_dev
from data_prep.stages import StageLog

SWE, TERMINAL = "swe", "terminal"


def file_sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _say(message: str) -> None:
    print(f"[prep] {message}", flush=True)


# -- SWE pool ------------------------------------------------------------------------------
def _swe_rows(source: SWESource, config: PrepConfig, out: Path) -> tuple[list[Any], dict]:
    if source.kind == "file":
        assert source.path is not None
        return list(rows_from_file(source.path)), {"sha256": file_sha256(source.path)}
    if source.kind == "hub":
        rows = list(rows_from_hub(source.name, source.split, source.revision))
        return rows, {"split": source.split, "revision": source.revision or "default"}
    from data_prep.generators import minismith  # noqa: PLC0415 - generator only when asked

    projects = source.projects or minismith.builtin_projects()
    rows = minismith.generate(
        projects,
        seed=config.seed,
        max_per_project=source.max_per_project,
        workers=config.validation.workers,
        timeout_s=config.validation.timeout_s,
    )
    # Clean snapshots at repos/<repo>/<base_commit>, where validation and rollouts find them.
    commits = {p.name: minismith.store_snapshot(p, out / "repos").name for p in projects}
    return rows, {"generator": "minismith", "seed": config.seed, "base_commits": commits}


def load_swe(config: PrepConfig, out: Path, log: StageLog) -> tuple[list[SWESmithRecord], list]:
    records: list[SWESmithRecord] = []
    quarantined: list[Quarantined] = []
    manifest_sources = []
    n_in = 0
    for source in config.swe_sources:
        rows, version = _swe_rows(source, config, out)
        ok, bad = parse_rows(rows, source.name)
        n_in += len(rows)
        records += ok
        quarantined += bad
        manifest_sources.append(
            {"pool": SWE, **source.model_dump(mode="json"), **version, "records": len(rows)}
        )
    records, dupes = _unique_ids(records, lambda r: r.instance_id, SWE)
    log.loaded(SWE, n_in, len(records), quarantined + dupes)
    return sorted(records, key=lambda r: r.instance_id), manifest_sources


def _unique_ids(items: list, ident: Callable[[Any], str], source: str) -> tuple[list, list]:
    seen: set[str] = set()
    kept, dupes = [], []
    for item in items:
        if ident(item) in seen:
            dupes.append(Quarantined(source, ident(item), "id: the same id appears twice"))
        else:
            seen.add(ident(item))
            kept.append(item)
    return kept, dupes


def filter_swe(records: list[SWESmithRecord], config: PrepConfig, out: Path, log: StageLog):
    key = lambda r: r.instance_id  # noqa: E731
    verified = set()
    if config.swe_bench_verified is not None:
        evaluated, malformed = load_swe_bench(config.swe_bench_verified)
        # Malformed evaluation records cannot separate anything: say so in the quarantine.
        log.quarantine.extend(malformed)
        verified = {normalise_repo(r.repo) for r in evaluated}
    records = log.apply(SWE, "language", records, filters.swe_language, key)
    records = log.apply(SWE, "benchmark_separation", records, filters.swe_separation(verified), key)
    dedup = filters.exact_duplicates(lambda r: f"{normalise_repo(r.repo)}\n{r.patch}", key)
    records = log.apply(SWE, "duplicates", records, dedup, key)
    limits = config.filters
    length = filters.swe_length(limits.max_patch_chars, limits.max_problem_chars)
    records = log.apply(SWE, "length", records, length, key)
    if config.validation.enabled and records:
        from data_prep.validate_swe import repo_snapshot_lookup, validate_many  # noqa: PLC0415

        _say(f"validating {len(records)} SWE instances in the sandbox")
        verdicts = validate_many(
            [r.model_dump() for r in records],
            repo_snapshot_lookup(out / "repos"),
            workers=config.validation.workers,
            timeout_s=config.validation.timeout_s,
        )
        failed = {v.record_id: v.reason for v in verdicts if not v.ok}
        records = log.apply(
            SWE,
            "validation",
            records,
            lambda r: f"validation: {failed[r.instance_id]}" if r.instance_id in failed else None,
            key,
        )
    return records


# -- terminal pool -------------------------------------------------------------------------
def _terminal_records(source: TerminalSource, config: PrepConfig, scratch: Path):
    if source.kind == "dir":
        assert source.path is not None
        return (*load_task_pool(source.path, source.name), {"path": str(source.path)})
    from data_prep.generators import toyterm  # noqa: PLC0415

    target = scratch / source.name
    toyterm.generate(
        target, n_tasks=source.n_tasks, seed=config.seed, families=source.families
    )  # fmt: skip
    records, quarantined = load_task_pool(target, source.name)
    return records, quarantined, {"generator": "toyterm", "seed": config.seed}


def load_terminal(config: PrepConfig, scratch: Path, log: StageLog):
    records: list[TerminalTaskRecord] = []
    quarantined: list[Quarantined] = []
    manifest_sources = []
    for source in config.terminal_sources:
        ok, bad, version = _terminal_records(source, config, scratch)
        records += ok
        quarantined += bad
        digest = hashlib.sha256("".join(r.content_digest for r in ok).encode()).hexdigest()
        manifest_sources.append(
            {
                "pool": TERMINAL,
                **source.model_dump(mode="json"),
                **version,
                "records": len(ok) + len(bad),
                "content_sha256": digest,
            }
        )
    n_in = len(records) + len(quarantined)
    records, dupes = _unique_ids(records, lambda r: r.task_id, TERMINAL)
    log.loaded(TERMINAL, n_in, len(records), quarantined + dupes)
    return sorted(records, key=lambda r: r.task_id), manifest_sources


def filter_terminal(records: list[TerminalTaskRecord], config: PrepConfig, log: StageLog):
    key = lambda r: r.task_id  # noqa: E731
    eval_ids: set[str] = set()
    eval_text: set[str] = set()
    if config.terminal_eval_dir is not None:
        evals, _ = load_task_pool(config.terminal_eval_dir, "eval")
        eval_ids = {r.task_id for r in evals}
        eval_text = {filters.normalise_instruction(r.instruction) for r in evals}
    records = log.apply(TERMINAL, "language", records, filters.terminal_language, key)
    separation = filters.terminal_separation(eval_ids, eval_text)
    records = log.apply(TERMINAL, "benchmark_separation", records, separation, key)
    dedup = filters.exact_duplicates(lambda r: r.content_digest, key)
    records = log.apply(TERMINAL, "duplicates", records, dedup, key)
    limits = config.filters
    length = filters.terminal_length(limits.min_instruction_chars, limits.max_instruction_chars)
    records = log.apply(TERMINAL, "length", records, length, key)
    if config.validation.enabled and records:
        from data_prep.validate_terminal import validate_many  # noqa: PLC0415

        _say(f"validating {len(records)} terminal tasks in the sandbox")
        verdicts = validate_many(
            [Path(r.path) for r in records],
            workers=config.validation.workers,
            timeout_s=config.validation.timeout_s,
        )
        failed = {r.task_id: v.reason for r, v in zip(records, verdicts, strict=True) if not v.ok}
        records = log.apply(
            TERMINAL,
            "validation",
            records,
            lambda r: f"validation: {failed[r.task_id]}" if r.task_id in failed else None,
            key,
        )
    return records


# -- outputs -------------------------------------------------------------------------------
def _write_parquet(rows: Sequence[dict[str, Any]], schema: pa.Schema, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(list(rows), schema=schema)
    pq.write_table(table, path, compression="zstd")


SWE_SCHEMA = pa.schema([
    ("instance_id", pa.string()), ("repo", pa.string()), ("patch", pa.string()),
    ("FAIL_TO_PASS", pa.list_(pa.string())), ("PASS_TO_PASS", pa.list_(pa.string())),
    ("image_name", pa.string()), ("base_commit", pa.string()),
    ("problem_statement", pa.string()), ("created_at", pa.string()),
    ("group", pa.string()), ("split", pa.string()),
])  # fmt: skip
TERMINAL_SCHEMA = pa.schema([
    ("task_id", pa.string()), ("source", pa.string()), ("family", pa.string()),
    ("layout", pa.string()), ("instruction", pa.string()), ("path", pa.string()),
    ("difficulty", pa.string()), ("content_digest", pa.string()),
    ("group", pa.string()), ("split", pa.string()),
])  # fmt: skip


def write_swe(records: list[SWESmithRecord], config: PrepConfig, out: Path) -> dict[str, int]:
    rows = []
    for r in records:
        group = normalise_repo(r.repo)
        split = "dev" if in_dev(group, config.dev_fraction) else "train"
        rows.append({**r.model_dump(), "group": group, "split": split})
    for split in ("train", "dev"):
        _write_parquet(
            [x for x in rows if x["split"] == split], SWE_SCHEMA, out / SWE / f"{split}.parquet"
        )
    return dict(Counter(x["split"] for x in rows))


def write_terminal(records: list[TerminalTaskRecord], config: PrepConfig, out: Path):
    rows = []
    for r in records:
        dest = out / "tasks" / r.task_id
        if dest.exists():
            shutil.rmtree(dest)
        shutil.copytree(r.path, dest)
        group = r.family if config.terminal_dev_group == "family" else r.task_id
        split = "dev" if in_dev(group, config.dev_fraction) else "train"
        rows.append({
            "task_id": r.task_id, "source": r.source, "family": r.family, "layout": r.layout,
            "instruction": r.instruction, "path": f"tasks/{r.task_id}",
            "difficulty": r.difficulty, "content_digest": r.content_digest,
            "group": group, "split": split,
        })  # fmt: skip
    for split in ("train", "dev"):
        _write_parquet(
            [x for x in rows if x["split"] == split],
            TERMINAL_SCHEMA,
            out / TERMINAL / f"{split}.parquet",
        )
    return dict(Counter(x["split"] for x in rows))


# Generator seed of the warm-start pool: far from any seed a terminal source uses.
WARM_START_SEED_OFFSET = 1_000_003


def write_warm_start_pool(
    config: PrepConfig, kept: list[TerminalTaskRecord], scratch: Path, out: Path
) -> dict[str, int] | None:
    """Generate the warm-start-only tasks, drop any that repeats a kept or evaluation task's
    instruction, and write them to ``warmstart/`` and ``terminal/warmstart.parquet``.

    They are not validated here: the warm start runs every reference solution and keeps
    only the episodes its grader passes.
    """
    pool = config.warm_start_pool
    if pool is None:
        return None
    from data_prep.generators import toyterm  # noqa: PLC0415

    target = scratch / "warmstart"
    toyterm.generate(
        target, n_tasks=pool.n_tasks, seed=config.seed + WARM_START_SEED_OFFSET,
        families=pool.families,
    )  # fmt: skip
    records, quarantined = load_task_pool(target, "warmstart")
    taken = {filters.normalise_instruction(r.instruction) for r in kept}
    if config.terminal_eval_dir is not None:
        evals, _ = load_task_pool(config.terminal_eval_dir, "eval")
        taken |= {filters.normalise_instruction(r.instruction) for r in evals}
    fresh = [r for r in records if filters.normalise_instruction(r.instruction) not in taken]
    rows = []
    for r in sorted(fresh, key=lambda r: r.task_id):
        shutil.copytree(r.path, out / "warmstart" / r.task_id)
        rows.append({
            "task_id": r.task_id, "source": r.source, "family": r.family, "layout": r.layout,
            "instruction": r.instruction, "path": f"warmstart/{r.task_id}",
            "difficulty": r.difficulty, "content_digest": r.content_digest,
            "group": r.family, "split": "warmstart",
        })  # fmt: skip
    _write_parquet(rows, TERMINAL_SCHEMA, out / TERMINAL / "warmstart.parquet")
    return {
        "generated": len(records) + len(quarantined),
        "kept": len(rows),
        "repeats_a_kept_or_eval_task": len(records) - len(fresh),
        "malformed": len(quarantined),
    }


def _write_jsonl(rows: Sequence[dict[str, Any]], path: Path) -> None:
    path.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


# -- driver --------------------------------------------------------------------------------
def prepare(config: PrepConfig, out: Path) -> dict[str, Any]:
    """Run the whole prep stage into ``out`` (must be empty or absent); returns the manifest."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(
            f"--out {out}: not empty; choose a new folder (nothing is overwritten)"
        )
    out.mkdir(parents=True, exist_ok=True)
    log = StageLog()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        swe, swe_sources = load_swe(config, out, log)
        swe = filter_swe(swe, config, out, log)
        terminal, terminal_sources = load_terminal(config, Path(scratch), log)
        terminal = filter_terminal(terminal, config, log)
        log.check()
        splits = {SWE: write_swe(swe, config, out), TERMINAL: write_terminal(terminal, config, out)}
        warm = write_warm_start_pool(config, terminal, Path(scratch), out)
    _write_jsonl(
        [vars(q) for q in sorted(log.quarantine, key=lambda q: (q.source, q.record_id))],
        out / "quarantine.jsonl",
    )
    _write_jsonl(log.filtered, out / "filtered.jsonl")
    manifest = {
        "sources": swe_sources + terminal_sources,
        "stages": log.table(),
        "splits": splits,
        **({"warm_start_pool": warm} if warm is not None else {}),
        "parameters": config.model_dump(mode="json"),
        "quarantine": dict(
            sorted(Counter(f"{q.source}: {q.reason.split(':')[0]}" for q in log.quarantine).items())
        ),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    _say(f"done in {time.perf_counter() - start:.1f} s: {json.dumps(splits)}")
    return manifest
