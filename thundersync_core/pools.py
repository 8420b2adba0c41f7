"""Task pools of a prep run for training: the train and dev splits, dev selection, and the
tasks of each step (the data cursor is the step number)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

from thundersync_core.config import TrainConfig
from thundersync_core.runtime.rollout_worker import RolloutSpec

__all__ = ["dev_tasks", "load_pool", "plan_step"]


def _split_table(prep_dir: Path, split: str) -> Path:
    path = Path(prep_dir) / "terminal" / f"{split}.parquet"
    if not path.is_file():
        raise FileNotFoundError(
            f"tasks.prep_dir: {path} is missing (run `thundersync prep` or `make prep` first)"
        )
    return path


def load_pool(prep_dir: Path, split: str, families: Sequence[str] = ()) -> dict[str, Path]:
    """task id -> task folder for one split of the prepared terminal pool."""
    import pyarrow.parquet as pq  # noqa: PLC0415

    path = _split_table(prep_dir, split)
    rows = pq.read_table(path, columns=["task_id", "family", "path"]).to_pylist()
    # Task folders are stored relative to the prep folder.
    pool = {
        r["task_id"]: (Path(prep_dir) / r["path"]).resolve()
        for r in rows
        if not families or r["family"] in families
    }
    if not pool and split == "train":
        raise ValueError(f"tasks.families: no {split} task in {path} is of families {families}")
    return dict(sorted(pool.items()))


def dev_tasks(
    prep_dir: Path, families: Sequence[str], n: int, exclude: Sequence[Path] = ()
) -> tuple[list[str], int]:
    """(up to ``n`` dev task ids, how many dev tasks ``exclude`` left out).

    The ids take the families in turn (each family's tasks in id order), so a subset covers
    every family. ``exclude`` holds task sources as ``thundersync warm-start --tasks`` takes
    them; a dev task whose instruction repeats one of theirs is left out.
    """
    import pyarrow.parquet as pq  # noqa: PLC0415

    path = _split_table(prep_dir, "dev")
    if n == 0:
        return [], 0
    columns = ["task_id", "family", *(["instruction"] if exclude else [])]
    rows = pq.read_table(path, columns=columns).to_pylist()
    seen = {_normalise(text) for source in exclude for text in _instructions(Path(source))}
    by_family: dict[str, list[str]] = {}
    left_out = 0
    for r in sorted(rows, key=lambda r: r["task_id"]):
        if families and r["family"] not in families:
            continue
        if seen and _normalise(r["instruction"]) in seen:
            left_out += 1
            continue
        by_family.setdefault(r["family"], []).append(r["task_id"])
    lists = [by_family[f] for f in sorted(by_family)]
    order = [
        ids[i] for i in range(max(map(len, lists), default=0)) for ids in lists if i < len(ids)
    ]
    return order[:n], left_out


def _normalise(text: str) -> str:
    # As data_prep.filters.normalise_instruction: case and runs of white space do not count.
    return " ".join(text.lower().split())


def _instructions(source: Path) -> list[str]:
    """The instructions of one warm-start task source (a task folder, a folder of them, or a
    prep ``terminal/*.parquet``)."""
    from thundersync_core.warmstart.tasks import collect_tasks  # noqa: PLC0415

    if not source.exists():
        raise FileNotFoundError(f"tasks.dev_exclude: {source} is neither a task table nor a folder")
    try:
        return [task.instruction for task in collect_tasks([source])]
    except (ValueError, OSError) as exc:
        raise ValueError(
            f"tasks.dev_exclude: {source} is not a task table or task folder ({exc})"
        ) from exc


def plan_step(config: TrainConfig, task_ids: Sequence[str], step: int) -> list[RolloutSpec]:
    """The step's groups: a seeded pass over the pool per epoch; the cursor is the step."""
    per_epoch = max(len(task_ids) // config.groups_per_step, 1)
    epoch, slot = divmod(step, per_epoch)
    order = random.Random(config.seed * 100_003 + epoch).sample(list(task_ids), len(task_ids))
    chosen = [
        order[(slot * config.groups_per_step + g) % len(order)]
        for g in range(config.groups_per_step)
    ]
    return [
        RolloutSpec(task, f"s{step:05d}-g{g}-{task}", f"s{step:05d}-g{g}-{task}/{i}", batch=step)
        for g, task in enumerate(chosen)
        for i in range(config.group_size)
    ]
