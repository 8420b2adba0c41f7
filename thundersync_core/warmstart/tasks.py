"""Which terminal tasks a warm start trains on: folders or a prep run's parquet split.

A source is a Harbor task folder (it holds ``instruction.md``), a folder of task folders,
or a ``terminal/{train,dev}.parquet`` written by ``thundersync prep``, whose ``path``
column names each task folder relative to the prep output folder (the parquet's
grandparent).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from thundersync_core.rollout.tasks import (
    TaskFormatError,
    TerminalTask,
    load_terminal_task,
    load_terminal_tasks,
)
from thundersync_core.warmstart.examples import task_family

__all__ = ["collect_tasks", "task_paths_from_parquet"]


def task_paths_from_parquet(path: Path) -> list[Path]:
    import pyarrow.parquet as pq  # noqa: PLC0415 (only parquet sources need it)

    table = pq.read_table(path)
    if "path" not in table.column_names:
        raise TaskFormatError(f"--tasks {path}: no 'path' column (columns: {table.column_names})")
    roots = []
    for rel in table.column("path").to_pylist():
        candidates = [path.parent.parent / rel, path.parent / rel]
        found = next((c for c in candidates if (c / "instruction.md").is_file()), None)
        if found is None:
            raise TaskFormatError(f"--tasks {path}: task folder {rel!r} not found beside it")
        roots.append(found)
    return roots


def _tasks_of(source: Path) -> list[TerminalTask]:
    source = Path(source)
    if source.suffix == ".parquet":
        if not source.is_file():
            raise FileNotFoundError(f"--tasks {source}: no such parquet file")
        return [load_terminal_task(root) for root in task_paths_from_parquet(source)]
    if (source / "instruction.md").is_file():
        return [load_terminal_task(source)]
    return load_terminal_tasks(source)


def collect_tasks(
    sources: Sequence[Path], *, families: Sequence[str] | None = None, limit: int = 0
) -> list[TerminalTask]:
    """The tasks of every source, filtered by family, the first ``limit``; a task folder
    named by two sources counts once. Folders are told apart by path, not by task id: a
    prep run's warm-start pool reuses the ids of its train split for other tasks."""
    if not sources:
        raise ValueError("--tasks: give at least one task folder or parquet file")
    by_folder: dict[Path, TerminalTask] = {}
    for source in sources:
        for task in _tasks_of(source):
            by_folder.setdefault(task.root.resolve(), task)
    tasks = sorted(by_folder.values(), key=lambda t: t.task_id)  # stable: sources in order
    if families:
        wanted = set(families)
        tasks = [t for t in tasks if task_family(t) in wanted]
        if not tasks:
            raise ValueError(f"--families {sorted(wanted)}: no task of these families")
    if limit < 0:
        raise ValueError(f"--limit must be >= 0, got {limit}")
    return tasks[:limit] if limit else tasks
