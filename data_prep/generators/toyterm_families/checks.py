"""Constructors for the checks a task's verifier runs (see ``verifier_runtime.py``).

A check is a plain JSON-like dict, ``{"kind": ..., **params}``, because it is written into
the task's ``tests/test_outputs.py`` as data; each constructor here mirrors one
``check_<kind>`` function there. Paths are relative to ``/app``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Check = dict[str, Any]


def text(path: str, expected: str) -> Check:
    return {"kind": "text", "path": path, "expected": expected}


def number(path: str, expected: int) -> Check:
    return {"kind": "number", "path": path, "expected": expected}


def lines(
    path: str, expected: Sequence[str], *, unordered: bool = False, paths: bool = False
) -> Check:
    return {
        "kind": "lines",
        "path": path,
        "expected": list(expected),
        "unordered": unordered,
        "paths": paths,
    }


def absent(path: str) -> Check:
    return {"kind": "absent", "path": path}


def isdir(path: str) -> Check:
    return {"kind": "isdir", "path": path}


def mode(path: str, mode_bits: int) -> Check:
    return {"kind": "mode", "path": path, "mode": mode_bits}


def tree(
    path: str, files: Mapping[str, str], *, exact: bool = True, missing_ok: bool = False
) -> Check:
    """The regular files below ``path`` are exactly ``files`` (relative to ``path``)."""
    if missing_ok and files:
        raise ValueError(f"tree {path!r}: missing_ok only makes sense for an empty file set")
    return {
        "kind": "tree",
        "path": path,
        "files": dict(files),
        "exact": exact,
        "missing_ok": missing_ok,
    }


def tar(path: str, files: Mapping[str, str], *, gzipped: bool = True) -> Check:
    return {"kind": "tar", "path": path, "files": dict(files), "gzipped": gzipped}


def gzip_text(path: str, expected: str) -> Check:
    return {"kind": "gzip", "path": path, "expected": expected}


def json_value(path: str, expected: Any) -> Check:
    return {"kind": "json", "path": path, "expected": expected}


def csv_rows(path: str, rows: Sequence[Sequence[str]]) -> Check:
    return {"kind": "csv", "path": path, "rows": [list(row) for row in rows]}


def case(
    stdout: str,
    *,
    args: Sequence[str] = (),
    stdin: str = "",
    files: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """One hidden input for ``program``: ``{dir}`` in ``args`` names the case's folder."""
    return {"args": list(args), "stdin": stdin, "files": dict(files or {}), "stdout": stdout}


def program(script: str, argv: Sequence[str], cases: Sequence[Mapping[str, Any]]) -> Check:
    """Run ``argv`` + each case's args (``script`` must exist under /app) on hidden inputs."""
    return {"kind": "program", "script": script, "argv": list(argv), "cases": list(cases)}
