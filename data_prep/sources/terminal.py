"""Terminal task folders: Harbor format (SETA-Env, Terminal-Bench 2) and the older layout.

Harbor: ``task.toml``, ``instruction.md``, ``environment/Dockerfile``, ``solution/solve.sh``,
``tests/test.sh``. Older Terminal-Bench: ``task.yaml`` (with ``instruction``),
``solution.sh``, ``run-tests.sh``, ``tests/``. A folder that is neither, or misses a part, is
quarantined naming the part.
"""

from __future__ import annotations

import hashlib
import tomllib
from pathlib import Path
from typing import Any

import yaml

from data_prep.schema import Quarantined, TerminalTaskRecord

HARBOR_PARTS = (
    "task.toml",
    "instruction.md",
    "environment/Dockerfile",
    "solution/solve.sh",
    "tests/test.sh",
)
TB_PARTS = ("task.yaml", "solution.sh", "run-tests.sh", "tests")


def folder_digest(root: Path) -> str:
    """sha256 over relative paths and contents of every file, in sorted order."""
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _family(task_id: str, metadata: dict[str, Any]) -> str:
    family = metadata.get("family")
    if isinstance(family, str) and family:
        return family
    # Without a declared family, the id up to its trailing number names it.
    stem = task_id.rstrip("0123456789").rstrip("-_")
    return stem or task_id


class _Malformed(ValueError):
    pass


def _read_harbor(root: Path) -> tuple[dict[str, Any], str]:
    missing = [p for p in HARBOR_PARTS if not (root / p).exists()]
    if missing:
        raise _Malformed(f"harbor task misses {', '.join(missing)}")
    try:
        config = tomllib.loads((root / "task.toml").read_text())
    except tomllib.TOMLDecodeError as exc:
        raise _Malformed(f"task.toml is not TOML ({exc})") from None
    metadata = config.get("metadata", {})
    instruction = (root / "instruction.md").read_text(encoding="utf-8", errors="replace")
    return metadata if isinstance(metadata, dict) else {}, instruction


def _read_terminal_bench(root: Path) -> tuple[dict[str, Any], str]:
    missing = [p for p in TB_PARTS if not (root / p).exists()]
    if missing:
        raise _Malformed(f"terminal-bench task misses {', '.join(missing)}")
    try:
        config = yaml.safe_load((root / "task.yaml").read_text()) or {}
    except yaml.YAMLError as exc:
        raise _Malformed(f"task.yaml is not YAML ({exc})") from None
    if not isinstance(config, dict) or not isinstance(config.get("instruction"), str):
        raise _Malformed("task.yaml has no instruction")
    return {k: v for k, v in config.items() if k != "instruction"}, config["instruction"]


def load_task_folder(root: Path, source: str) -> TerminalTaskRecord | Quarantined:
    try:
        if (root / "task.toml").exists():
            layout, (metadata, instruction) = "harbor", _read_harbor(root)
        elif (root / "task.yaml").exists():
            layout, (metadata, instruction) = "terminal-bench", _read_terminal_bench(root)
        else:
            raise _Malformed("neither task.toml (harbor) nor task.yaml (terminal-bench)")
        if not instruction.strip():
            raise _Malformed("empty instruction")
    except _Malformed as exc:
        return Quarantined(source, root.name, str(exc))
    return TerminalTaskRecord(
        task_id=root.name,
        source=source,
        family=_family(root.name, metadata),
        layout=layout,
        instruction=instruction.strip(),
        path=str(root),
        difficulty=str(metadata.get("difficulty", "")),
        content_digest=folder_digest(root),
        metadata={k: v for k, v in metadata.items() if isinstance(v, str | int | float | bool)},
    )


def load_task_pool(
    directory: Path, source: str
) -> tuple[list[TerminalTaskRecord], list[Quarantined]]:
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"terminal task pool {directory}: not a directory")
    records, quarantined = [], []
    for root in sorted(p for p in directory.iterdir() if p.is_dir()):
        loaded = load_task_folder(root, source)
        (quarantined if isinstance(loaded, Quarantined) else records).append(loaded)
    return records, quarantined
