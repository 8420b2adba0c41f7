"""JSONL reading and atomic writing shared by the evaluation modules."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["read_jsonl", "write_jsonl"]


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every non-blank line of a JSONL file as an object; errors name the file and line."""
    rows = []
    for number, text in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} line {number}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path} line {number}: expected a JSON object")
        rows.append(row)
    return rows


def write_jsonl(path: Path, rows: Sequence[Mapping[str, Any]]) -> Path:
    """Write rows as JSONL atomically: a temporary sibling, then a rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(dict(row), sort_keys=True) + "\n" for row in rows))
    tmp.replace(path)
    return path
