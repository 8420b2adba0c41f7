"""The filters of the prep pipeline: each returns None to keep a record, or the reason not to.

Order matters only for cost: cheap text filters run before executable validation.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar

from data_prep.schema import SWESmithRecord, TerminalTaskRecord
from data_prep.sources.swe_bench import normalise_repo

Item = TypeVar("Item")
_DIFF_FILE = re.compile(r"^diff --git a/(\S+) b/", re.MULTILINE)


def swe_language(record: SWESmithRecord) -> str | None:
    """Python pools only: the bug patch must edit at least one .py file."""
    files = _DIFF_FILE.findall(record.patch)
    if not any(f.endswith(".py") for f in files):
        return f"language: patch edits no Python file ({', '.join(files[:3]) or 'no files'})"
    return None


def terminal_language(record: TerminalTaskRecord) -> str | None:
    """English instructions: at least 90% of the characters are ASCII."""
    ascii_share = sum(c.isascii() for c in record.instruction) / max(len(record.instruction), 1)
    if ascii_share < 0.9:
        return f"language: instruction is {ascii_share:.0%} ASCII (< 90%)"
    return None


def swe_separation(verified_repos: set[str]) -> Callable[[SWESmithRecord], str | None]:
    def reject(record: SWESmithRecord) -> str | None:
        repo = normalise_repo(record.repo)
        if repo in verified_repos:
            return f"benchmark separation: repository {repo} is evaluated by SWE-bench Verified"
        return None

    return reject


def normalise_instruction(text: str) -> str:
    return " ".join(text.lower().split())


def terminal_separation(
    eval_ids: set[str], eval_instructions: set[str]
) -> Callable[[TerminalTaskRecord], str | None]:
    def reject(record: TerminalTaskRecord) -> str | None:
        if record.task_id in eval_ids:
            return f"benchmark separation: task id {record.task_id} is an evaluation task"
        if normalise_instruction(record.instruction) in eval_instructions:
            return "benchmark separation: instruction matches an evaluation task"
        return None

    return reject


def exact_duplicates(
    key: Callable[[Item], str], ident: Callable[[Item], str]
) -> Callable[[Item], str | None]:
    """Reject an item whose key an earlier item had (stateful: apply once, in input order)."""
    first: dict[str, str] = {}

    def reject(item: Item) -> str | None:
        k = key(item)
        if k in first:
            return f"duplicate: exact duplicate of {first[k]}"
        first[k] = ident(item)
        return None

    return reject


def swe_length(
    max_patch_chars: int, max_problem_chars: int
) -> Callable[[SWESmithRecord], str | None]:
    def reject(record: SWESmithRecord) -> str | None:
        if len(record.patch) > max_patch_chars:
            return f"length: patch has {len(record.patch)} characters (> {max_patch_chars})"
        if len(record.problem_statement) > max_problem_chars:
            return f"length: problem statement > {max_problem_chars} characters"
        return None

    return reject


def terminal_length(min_chars: int, max_chars: int) -> Callable[[TerminalTaskRecord], str | None]:
    def reject(record: TerminalTaskRecord) -> str | None:
        n = len(record.instruction)
        if not min_chars <= n <= max_chars:
            return f"length: instruction has {n} characters (outside {min_chars}..{max_chars})"
        return None

    return reject
