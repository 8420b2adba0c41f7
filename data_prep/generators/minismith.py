"""minismith: SWE-smith-style bug instances made offline by mutating small Python projects.

A *project* is a folder holding a pure-Python package and its pytest suite: the ones in
``projects/`` ship with this repository, ``sdists.py`` fetches real ones from PyPI. For each
project:

1. the clean tree's suite runs once in the local sandbox; the tests that pass there are the
   only candidates for FAIL_TO_PASS and PASS_TO_PASS;
2. the body of every function of every non-test module is scanned with ``ast`` for mutation
   sites (``OPERATORS``). A mutation is a few character-range edits of the original text
   (one operator token, one literal, two adjacent statements), so comments and formatting
   stay as they were and the unified diff is minimal; a mutation whose result does not
   parse, or parses to the same program, is discarded;
3. mutations are tried in a seeded order, operators interleaved so that a capped project
   still gets a mix: the mutated tree's suite runs in a fresh sandbox with ``--junitxml``.
   A test passing clean and failing bugged is FAIL_TO_PASS, one passing in both is
   PASS_TO_PASS; a mutation without FAIL_TO_PASS (an equivalent or untested mutant) or
   whose run timed out is dropped;
4. the first ``max_per_project`` kept mutations of that order become records.

Records carry the SWE-smith fields: ``instance_id`` (``<project>.<base_commit>.<operator>
__<hash>``), ``repo`` (``minismith/<project>``), ``patch`` (the bug-introducing diff, for
``patch -p1`` or ``git apply``), ``FAIL_TO_PASS``, ``PASS_TO_PASS``, ``image_name`` ("": the
local sandbox needs none), ``base_commit`` (a content hash of the clean tree),
``problem_statement`` (an issue text naming the function and a failing test, never the
patch) and ``created_at``. The output is a function of the project files and the seed
alone: ids and timestamps are hashes, tests run under ``PYTHONHASHSEED=0``, memory
addresses are scrubbed from quoted failure messages, and the kept set is a prefix of the
seeded order whatever the number of workers.

Simplifications, and why:

- The clean suite runs once per project, not once per mutation: the clean tree is the same
  for every mutation of a project.
- A mutated run gets ``min(timeout_s, max(5 s, 10 x the clean run))``. Mutants that loop
  forever are common and would otherwise hold a worker for the full timeout; the wide
  margin keeps this, the only timing-dependent decision, stable across machines.
- Statement swaps take two adjacent simple statements of one block only where one writes a
  name the other uses: swapping independent statements cannot change behaviour, so those
  would only cost sandbox runs.
"""

from __future__ import annotations

import argparse
import ast
import bisect
import dataclasses
import difflib
import hashlib
import io
import itertools
import json
import logging
import math
import os
import random
import re
import shutil
import sys
import time
import tokenize
from collections import Counter, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar
from xml.etree import ElementTree

from tqdm import tqdm

from data_prep import validate_swe
from data_prep.generators import sdists
from thundersync_core.rollout.grading import (
    PYTEST_ENV,
    junit_key,
    parse_junit,
    pytest_argv,
)
from thundersync_core.rollout.sandbox import Sandbox, SandboxLimits, open_sandbox

__all__ = [
    "OPERATORS",
    "PROJECTS_DIR",
    "Edit",
    "MinismithError",
    "Mutation",
    "Project",
    "builtin_projects",
    "candidate_order",
    "find_mutations",
    "generate",
    "load_project",
    "make_patch",
    "problem_statement",
    "snapshot_dir",
    "store_snapshot",
    "tree_digest",
]

log = logging.getLogger(__name__)

PROJECTS_DIR = Path(__file__).parent / "projects"
OPERATORS = (
    "swap_arith",
    "swap_compare",
    "swap_boolop",
    "negate_cond",
    "remove_cond",
    "off_by_one",
    "swap_stmts",
    "change_return",
    "swap_args",
)
# Never part of a project's content: caches and build by-products.
_IGNORED_DIRS = frozenset(
    {".git", "__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".tox", ".minismith"}
)
_TEST_DIRS = frozenset({"tests", "test", "testing"})
_NOT_MUTATED_DIRS = _TEST_DIRS | {"docs", "doc", "examples", "benchmarks", "build", "dist"}
_NOT_MUTATED_FILES = frozenset({"setup.py", "conftest.py", "noxfile.py", "fabfile.py"})
_NEWLINE = re.compile(r"\r\n|\n")
_DIGEST_CHARS = 10
_BASE_COMMIT_CHARS = 12
_MIN_RUN_TIMEOUT_S = 5.0
_SLOWDOWN_ALLOWED = 10.0
# pytest runs as grade_swe runs it (grading.pytest_argv), so outcomes here are the ones
# rollouts see.
_REPORT = ".minismith/junit.xml"
_EPOCH = datetime(2024, 1, 1, tzinfo=UTC)
_SECONDS_PER_YEAR = 365 * 24 * 3600
_MESSAGE_CHARS = 300

T = TypeVar("T")
R = TypeVar("R")


class MinismithError(RuntimeError):
    """A project cannot be used: unreadable files, no passing tests, a broken suite."""


# -- mutations ------------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class Edit:
    """Replace ``source[start:end]`` (character offsets) with ``text``."""

    start: int
    end: int
    text: str


@dataclass(frozen=True)
class Mutation:
    """One bug: edits of one file, made by one operator inside one function."""

    path: str
    operator: str
    function: str
    line: int
    edits: tuple[Edit, ...]

    @property
    def digest(self) -> str:
        payload = json.dumps(
            [self.path, self.operator, [dataclasses.astuple(e) for e in self.edits]]
        )
        return hashlib.sha256(payload.encode()).hexdigest()[:_DIGEST_CHARS]

    def apply(self, source: str) -> str:
        return apply_edits(source, self.edits)


def apply_edits(source: str, edits: Sequence[Edit]) -> str:
    pieces, cursor = [], 0
    for edit in sorted(edits):
        if edit.start < cursor:
            raise ValueError(f"overlapping edits at offset {edit.start}")
        pieces += [source[cursor : edit.start], edit.text]
        cursor = edit.end
    return "".join([*pieces, source[cursor:]])


class _Source:
    """A file's text with ast positions (line, UTF-8 column) turned into character offsets."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.line_starts = [0] + [match.end() for match in _NEWLINE.finditer(text)]
        self.tokens = [
            (tok.string, self._offset_chars(*tok.start), self._offset_chars(*tok.end))
            for tok in tokenize.generate_tokens(io.StringIO(text).readline)
            if tok.type in (tokenize.OP, tokenize.NAME)
        ]
        self._token_starts = [start for _string, start, _end in self.tokens]

    def _offset_chars(self, lineno: int, col: int) -> int:
        return self.line_starts[lineno - 1] + col

    def _offset(self, lineno: int, col_bytes: int) -> int:
        line_start = self.line_starts[lineno - 1]
        if self.text[line_start : line_start + col_bytes].isascii():
            return line_start + col_bytes
        line_end = self.line_starts[lineno] if lineno < len(self.line_starts) else len(self.text)
        line = self.text[line_start:line_end]
        return line_start + len(line.encode()[:col_bytes].decode())

    def start(self, node: ast.AST) -> int:
        return self._offset(node.lineno, node.col_offset)  # type: ignore[attr-defined]

    def end(self, node: ast.AST) -> int:
        return self._offset(node.end_lineno, node.end_col_offset)  # type: ignore[attr-defined]

    def segment(self, node: ast.AST) -> str:
        return self.text[self.start(node) : self.end(node)]

    def tokens_between(self, low: int, high: int) -> list[tuple[str, int, int]]:
        first = bisect.bisect_left(self._token_starts, low)
        last = bisect.bisect_left(self._token_starts, high)
        return self.tokens[first:last]

    def replace_words(self, low: int, high: int, words: Sequence[str], new: str) -> Edit | None:
        """Replace the one run of tokens spelling ``words`` between two offsets."""
        tokens = self.tokens_between(low, high)
        runs = [
            index
            for index in range(len(tokens) - len(words) + 1)
            if [tok[0] for tok in tokens[index : index + len(words)]] == list(words)
        ]
        if len(runs) != 1:
            return None
        return Edit(tokens[runs[0]][1], tokens[runs[0] + len(words) - 1][2], new)

    def whole_lines(self, node: ast.stmt) -> tuple[int, int] | None:
        """(start, end) of the lines ``node`` fills alone, newline included, else None."""
        begin = self.line_starts[node.lineno - 1]
        if self.text[begin : self.start(node)].strip():
            return None
        assert node.end_lineno is not None
        if node.end_lineno >= len(self.line_starts):
            return None
        stop = self.line_starts[node.end_lineno]
        rest = self.text[self.end(node) : stop].strip()
        return (begin, stop) if not rest or rest.startswith("#") else None


@dataclass
class _Function:
    qualname: str
    node: ast.FunctionDef | ast.AsyncFunctionDef
    nodes: list[ast.AST] = field(default_factory=list)
    blocks: list[list[ast.stmt]] = field(default_factory=list)


_Finder = Callable[[_Source, _Function], Iterator[tuple[ast.AST, tuple[Edit, ...]]]]
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)


def _functions(node: ast.AST, prefix: str = "") -> Iterator[_Function]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            yield _own_parts(_Function(prefix + child.name, child))
            yield from _functions(child, f"{prefix}{child.name}.")
        elif isinstance(child, ast.ClassDef):
            yield from _functions(child, f"{prefix}{child.name}.")
        else:
            yield from _functions(child, prefix)


def _own_parts(function: _Function) -> _Function:
    """The nodes and statement blocks of a body, without nested scopes or f-strings.

    f-strings are skipped because Python 3.11 reports unreliable positions inside them.
    """
    stack: list[ast.AST] = list(reversed(function.node.body))
    while stack:
        node = stack.pop()
        if isinstance(node, (*_SCOPES, ast.JoinedStr)):
            continue
        function.nodes.append(node)
        stack.extend(reversed(list(ast.iter_child_nodes(node))))
    for owner in [function.node, *function.nodes]:
        for name in ("body", "orelse", "finalbody"):
            block = getattr(owner, name, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                function.blocks.append(block)
    return function


def _is_text(node: ast.AST) -> bool:
    return isinstance(node, ast.JoinedStr) or (
        isinstance(node, ast.Constant) and isinstance(node.value, str | bytes)
    )


_ARITH = {
    ast.Add: ("+", "-"),
    ast.Sub: ("-", "+"),
    ast.Mult: ("*", "//"),
    ast.FloorDiv: ("//", "*"),
    ast.Div: ("/", "*"),
    ast.Mod: ("%", "//"),
    ast.Pow: ("**", "*"),
}


def _swap_arith(src: _Source, fn: _Function) -> Iterator[tuple[ast.AST, tuple[Edit, ...]]]:
    """``a + b`` -> ``a - b`` (and ``+=``); string operands are left alone."""
    for node in fn.nodes:
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
            if _is_text(node.left) or _is_text(node.right):
                continue
            old, new = _ARITH[type(node.op)]
            edit = src.replace_words(src.end(node.left), src.start(node.right), [old], new)
        elif isinstance(node, ast.AugAssign) and type(node.op) in _ARITH:
            old, new = _ARITH[type(node.op)]
            edit = src.replace_words(
                src.end(node.target), src.start(node.value), [old + "="], new + "="
            )
        else:
            continue
        if edit is not None:
            yield node, (edit,)


_COMPARE = {
    ast.Lt: ("<", "<="),
    ast.LtE: ("<=", "<"),
    ast.Gt: (">", ">="),
    ast.GtE: (">=", ">"),
    ast.Eq: ("==", "!="),
    ast.NotEq: ("!=", "=="),
    ast.In: ("in", "not in"),
    ast.NotIn: ("not in", "in"),
    ast.Is: ("is", "is not"),
    ast.IsNot: ("is not", "is"),
}


def _swap_compare(src: _Source, fn: _Function) -> Iterator[tuple[ast.AST, tuple[Edit, ...]]]:
    """``<`` <-> ``<=``, ``==`` <-> ``!=``, ``in`` <-> ``not in``, ...: one operator each."""
    for node in fn.nodes:
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for index, op in enumerate(node.ops):
            old, new = _COMPARE[type(op)]
            low, high = src.end(operands[index]), src.start(operands[index + 1])
            edit = src.replace_words(low, high, old.split(), new)
            if edit is not None:
                yield node, (edit,)


def _swap_boolop(src: _Source, fn: _Function) -> Iterator[tuple[ast.AST, tuple[Edit, ...]]]:
    """``a and b`` <-> ``a or b`` (every operator of the chain)."""
    for node in fn.nodes:
        if not isinstance(node, ast.BoolOp):
            continue
        old, new = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
        pairs = itertools.pairwise(node.values)
        edits = [src.replace_words(src.end(a), src.start(b), [old], new) for a, b in pairs]
        if all(edit is not None for edit in edits):
            yield node, tuple(edit for edit in edits if edit is not None)


# Expressions that ``not X`` negates as a whole without parentheses.
_TIGHT = (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.Compare)


def _negate_cond(src: _Source, fn: _Function) -> Iterator[tuple[ast.AST, tuple[Edit, ...]]]:
    """The test of an ``if``/``while``/conditional expression negated (or un-negated)."""
    for node in fn.nodes:
        if not isinstance(node, ast.If | ast.While | ast.IfExp):
            continue
        test, start, end = node.test, src.start(node.test), src.end(node.test)
        if isinstance(test, ast.Constant):
            continue
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            following = src.tokens_between(start + len("not"), end)
            if following:
                yield node, (Edit(start, following[0][1], ""),)
        elif isinstance(test, _TIGHT):
            yield node, (Edit(start, start, "not "),)
        else:
            yield node, (Edit(start, start, "not ("), Edit(end, end, ")"))


def _remove_cond(src: _Source, fn: _Function) -> Iterator[tuple[ast.AST, tuple[Edit, ...]]]:
    """An ``if`` block without ``else`` deleted (a guard or special case forgotten)."""
    for block in fn.blocks:
        if len(block) < 2:
            continue
        for stmt in block:
            if not isinstance(stmt, ast.If) or stmt.orelse:
                continue
            lines = src.whole_lines(stmt)
            if lines is not None and src.text[src.start(stmt) :].startswith("if"):
                yield stmt, (Edit(lines[0], lines[1], ""),)


def _off_by_one(src: _Source, fn: _Function) -> Iterator[tuple[ast.AST, tuple[Edit, ...]]]:
    """An integer literal or a computed slice bound moved by one in either direction."""
    negated = {
        id(node.operand)
        for node in fn.nodes
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
    }
    for node in fn.nodes:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            if not src.segment(node).isdigit():
                continue
            for value in (node.value + 1, node.value - 1):
                if value >= 0 and not (value == 0 and id(node) in negated):
                    yield node, (Edit(src.start(node), src.end(node), str(value)),)
        elif isinstance(node, ast.Slice):
            for bound in (node.lower, node.upper):
                if bound is None or id(bound) in negated or isinstance(bound, ast.Constant):
                    continue
                if isinstance(bound, ast.UnaryOp) and isinstance(bound.operand, ast.Constant):
                    continue
                text = src.segment(bound)
                text = text if isinstance(bound, _TIGHT[:4]) else f"({text})"
                for shift in (" + 1", " - 1"):
                    yield bound, (Edit(src.start(bound), src.end(bound), text + shift),)


_SIMPLE_STMTS = (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Delete)


def _base_name(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute | ast.Subscript):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def _names(stmt: ast.stmt) -> tuple[set[str], set[str]]:
    """(names used, names written) by a statement; ``x.append(...)`` and ``x[i] = ...``
    count as writing ``x``."""
    used, written = set(), set()
    for node in ast.walk(stmt):
        if isinstance(node, ast.Name):
            used.add(node.id)
            if not isinstance(node.ctx, ast.Load):
                written.add(node.id)
        elif isinstance(node, ast.Attribute | ast.Subscript) and not isinstance(node.ctx, ast.Load):
            written.add(_base_name(node) or "")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            written.add(_base_name(node.func.value) or "")
    return used, written - {""}


def _interact(first: ast.stmt, second: ast.stmt) -> bool:
    used_1, written_1 = _names(first)
    used_2, written_2 = _names(second)
    return bool(written_1 & used_2 or written_2 & used_1)


def _is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)


def _swap_stmts(src: _Source, fn: _Function) -> Iterator[tuple[ast.AST, tuple[Edit, ...]]]:
    """Two adjacent simple statements of a block swapped where their order matters."""
    for block in fn.blocks:
        for first, second in itertools.pairwise(block):
            if not isinstance(first, _SIMPLE_STMTS) or not isinstance(second, _SIMPLE_STMTS):
                continue
            if _is_docstring(first) or not _interact(first, second):
                continue
            lines_1, lines_2 = src.whole_lines(first), src.whole_lines(second)
            if lines_1 is None or lines_2 is None:
                continue
            text = src.text
            swapped = (
                text[lines_2[0] : lines_2[1]]
                + text[lines_1[1] : lines_2[0]]
                + text[lines_1[0] : lines_1[1]]
            )
            yield first, (Edit(lines_1[0], lines_2[1], swapped),)


def _change_return(src: _Source, fn: _Function) -> Iterator[tuple[ast.AST, tuple[Edit, ...]]]:
    """``return True`` <-> ``return False``; ``return <expression>`` -> ``return None``."""
    for node in fn.nodes:
        if not isinstance(node, ast.Return) or node.value is None:
            continue
        value = node.value
        if isinstance(value, ast.Constant) and not isinstance(value.value, bool):
            continue
        new = str(not value.value) if isinstance(value, ast.Constant) else "None"
        yield node, (Edit(src.start(value), src.end(value), new),)


def _swap_args(src: _Source, fn: _Function) -> Iterator[tuple[ast.AST, tuple[Edit, ...]]]:
    """Two adjacent positional arguments of a call swapped."""
    for node in fn.nodes:
        if not isinstance(node, ast.Call) or len(node.args) < 2:
            continue
        if any(isinstance(arg, ast.Starred | ast.GeneratorExp) for arg in node.args):
            continue
        for left, right in itertools.pairwise(node.args):
            left_text, right_text = src.segment(left), src.segment(right)
            if left_text != right_text:
                yield (
                    node,
                    (
                        Edit(src.start(left), src.end(left), right_text),
                        Edit(src.start(right), src.end(right), left_text),
                    ),
                )


_FINDERS: dict[str, _Finder] = {
    "swap_arith": _swap_arith,
    "swap_compare": _swap_compare,
    "swap_boolop": _swap_boolop,
    "negate_cond": _negate_cond,
    "remove_cond": _remove_cond,
    "off_by_one": _off_by_one,
    "swap_stmts": _swap_stmts,
    "change_return": _change_return,
    "swap_args": _swap_args,
}
assert tuple(_FINDERS) == OPERATORS


def find_mutations(relpath: str, source: str) -> list[Mutation]:
    """Every distinct mutation of the functions in one module, in a canonical order.

    Raises SyntaxError if ``source`` does not parse.
    """
    # ast treats a lone CR as a line break and the offsets here do not: refuse, not misplace.
    if "\r" in source.replace("\r\n", ""):
        raise SyntaxError(f"{relpath}: lone carriage returns as line breaks are not supported")
    tree = ast.parse(source, filename=relpath)
    src = _Source(source)
    original = ast.dump(tree)
    seen: set[str] = set()
    found = []
    for function in _functions(tree):
        for operator, finder in _FINDERS.items():
            for node, edits in finder(src, function):
                mutated = apply_edits(source, edits)
                fingerprint = hashlib.sha256(mutated.encode()).hexdigest()
                if fingerprint in seen or not _changes_program(mutated, original):
                    continue
                seen.add(fingerprint)
                line = getattr(node, "lineno", function.node.lineno)
                found.append(
                    Mutation(relpath, operator, function.qualname, line, tuple(sorted(edits)))
                )
    return sorted(found, key=lambda m: (m.path, m.edits, m.operator))


def _changes_program(mutated: str, original_dump: str) -> bool:
    try:
        return ast.dump(ast.parse(mutated)) != original_dump
    except SyntaxError:
        return False


def _split_lines(text: str) -> list[str]:
    starts = [0] + [match.end() for match in _NEWLINE.finditer(text)]
    lines = [text[a:b] for a, b in itertools.pairwise([*starts, len(text)])]
    return [line for line in lines if line]


def make_patch(relpath: str, before: str, after: str) -> str:
    """A git-style unified diff (3 lines of context) that ``patch -p1`` and ``git apply`` take."""
    body = difflib.unified_diff(
        _split_lines(before), _split_lines(after), f"a/{relpath}", f"b/{relpath}", n=3
    )
    lines = [
        line if line.endswith("\n") else line + "\n\\ No newline at end of file\n" for line in body
    ]
    return f"diff --git a/{relpath} b/{relpath}\n" + "".join(lines)


def candidate_order(mutations: Sequence[Mutation], *, seed: int, salt: str) -> list[Mutation]:
    """Each operator's mutations shuffled by (seed, salt), then taken round-robin."""
    queues = []
    for operator in OPERATORS:
        queue = [m for m in mutations if m.operator == operator]
        random.Random(f"{seed}:{salt}:{operator}").shuffle(queue)
        queues.append(queue)
    rounds = itertools.zip_longest(*queues)
    return [m for round_ in rounds for m in round_ if m is not None]


# -- projects -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Project:
    """A project folder read once: its name, content hash, module sources and test files."""

    name: str
    root: Path
    base_commit: str
    sources: dict[str, str]
    test_files: tuple[str, ...]

    @property
    def repo(self) -> str:
        return f"minismith/{self.name}"


def builtin_projects() -> list[Path]:
    """The sample projects shipped in ``projects/``."""
    return sorted(path for path in PROJECTS_DIR.iterdir() if path.is_dir())


def project_files(root: Path) -> list[str]:
    """Relative POSIX paths of the project's content files, sorted; caches excluded."""
    found = []
    for folder, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _IGNORED_DIRS]
        for name in dirnames + filenames:
            path = Path(folder) / name
            if path.is_symlink():
                raise MinismithError(f"{path}: symlinks are not supported in a project")
            if name in filenames and not name.endswith(".pyc"):
                found.append(path.relative_to(root).as_posix())
    return sorted(found)


def tree_digest(root: Path) -> str:
    """A short content hash of the project's files: its ``base_commit``."""
    digest = hashlib.sha256()
    for relpath in project_files(root):
        digest.update(relpath.encode() + b"\0")
        digest.update(hashlib.sha256((root / relpath).read_bytes()).digest())
    return digest.hexdigest()[:_BASE_COMMIT_CHARS]


def _project_name(root: Path) -> str:
    return re.sub(r"[^a-z0-9_-]+", "_", root.name.lower())


def _is_test_file(relpath: str) -> bool:
    name = PurePosixPath(relpath).name
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


def _is_mutated(relpath: str) -> bool:
    path = PurePosixPath(relpath)
    if path.suffix != ".py" or path.name in _NOT_MUTATED_FILES or _is_test_file(relpath):
        return False
    return not any(part in _NOT_MUTATED_DIRS for part in path.parts[:-1])


def load_project(root: Path) -> Project:
    root = Path(root).resolve()
    if not root.is_dir():
        raise MinismithError(f"project {root} is not a folder")
    files = project_files(root)
    test_files = tuple(path for path in files if _is_test_file(path))
    if not test_files:
        raise MinismithError(f"project {root} has no test_*.py or *_test.py files")
    sources = {}
    for relpath in filter(_is_mutated, files):
        with open(root / relpath, encoding="utf-8", newline="") as handle:
            sources[relpath] = handle.read()
    return Project(_project_name(root), root, tree_digest(root), sources, test_files)


def snapshot_dir(project: Path, dest: Path) -> str:
    """Copy the clean project (caches excluded) into ``dest``; returns its ``base_commit``."""
    dest = Path(dest)
    if dest.exists() and any(dest.iterdir()):
        raise MinismithError(f"snapshot destination {dest} is not empty")
    for relpath in project_files(Path(project)):
        (dest / relpath).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(project) / relpath, dest / relpath)
    return tree_digest(Path(project))


def store_snapshot(project: Path, repos_root: Path) -> Path:
    """The clean tree at ``repos_root/minismith/<name>/<base_commit>``, written once.

    The folder name is the content hash, so an existing one is reused as it is; a new one
    is written beside it and renamed, so a crash never leaves a half-written snapshot.
    """
    base_commit = tree_digest(Path(project))
    target = Path(repos_root) / "minismith" / _project_name(Path(project)) / base_commit
    if target.is_dir():
        return target
    staging = target.with_name(f".{base_commit}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    snapshot_dir(Path(project), staging)
    staging.rename(target)
    return target


# -- running a suite ------------------------------------------------------------------------


@dataclass(frozen=True)
class _SuiteRun:
    outcomes: dict[str, str]
    messages: dict[str, str]
    duration_s: float
    problem: str | None = None


def _limits(timeout_s: float, output_bytes: int = 64 * 1024) -> SandboxLimits:
    # The CPU limit must not end a run before its wall-clock timeout does.
    cpu_s = math.ceil(timeout_s) + 1
    return SandboxLimits(
        timeout_s=timeout_s, memory_mb=2048, cpu_s=cpu_s, output_bytes=output_bytes
    )


def _collect(sandbox: Sandbox, project: Project, timeout_s: float) -> list[str]:
    run = sandbox.exec(
        pytest_argv("python3", None, project.test_files, ["--collect-only"]),
        timeout_s=timeout_s,
        env=PYTEST_ENV,
    )
    if run.exit_code != 0 or run.output_truncated:
        status = "timed out" if run.timed_out else f"exit {run.exit_code}"
        output = (run.stdout + run.stderr).strip()[-800:]
        raise MinismithError(
            f"project {project.root}: collecting tests failed ({status}): {output}"
        )
    return [line.strip() for line in run.stdout.splitlines() if "::" in line]


def _run_suite(
    sandbox: Sandbox, project: Project, node_ids: Sequence[str], timeout_s: float
) -> _SuiteRun:
    argv = pytest_argv("python3", _REPORT, project.test_files)
    run = sandbox.exec(argv, timeout_s=timeout_s, env=PYTEST_ENV)
    if run.timed_out:
        return _SuiteRun({}, {}, run.duration_s, f"timed out after {timeout_s:g} s")
    try:
        xml = sandbox.read_file(_REPORT)
        by_key = parse_junit(xml)
    except FileNotFoundError:
        stderr = run.stderr.strip()[-300:]
        return _SuiteRun(
            {}, {}, run.duration_s, f"no JUnit report (exit {run.exit_code}): {stderr}"
        )
    except ElementTree.ParseError as exc:
        return _SuiteRun({}, {}, run.duration_s, f"unreadable JUnit report: {exc}")
    keys = {node_id: junit_key(node_id) for node_id in node_ids}
    outcomes = {node_id: by_key.get(key, "missing") for node_id, key in keys.items()}
    by_message = _failure_messages(xml)
    messages = {node_id: by_message[key] for node_id, key in keys.items() if key in by_message}
    return _SuiteRun(outcomes, messages, run.duration_s)


def _failure_messages(xml_bytes: bytes) -> dict[tuple[str, str], str]:
    """(classname, name) -> the first line of its failure or error message."""
    messages: dict[tuple[str, str], str] = {}
    for case in ElementTree.fromstring(xml_bytes).iter("testcase"):
        for child in case:
            if child.tag in ("failure", "error") and child.get("message"):
                key = (case.get("classname", ""), case.get("name", ""))
                messages.setdefault(key, child.get("message", ""))
    return messages


@dataclass(frozen=True)
class _Baseline:
    passing: tuple[str, ...]
    duration_s: float


def _clean_baseline(project: Project, timeout_s: float) -> _Baseline:
    with open_sandbox(
        "local", limits=_limits(timeout_s, 16 << 20), workdir_from=project.root
    ) as sb:
        node_ids = _collect(sb, project, timeout_s)
        run = _run_suite(sb, project, node_ids, timeout_s)
    if run.problem is not None:
        raise MinismithError(f"project {project.root}: the clean suite is unusable: {run.problem}")
    passing = tuple(node_id for node_id in node_ids if run.outcomes[node_id] == "passed")
    if not passing:
        raise MinismithError(f"project {project.root}: no test passes on the clean tree")
    return _Baseline(passing, run.duration_s)


# -- records --------------------------------------------------------------------------------


def _scrub(message: str) -> str:
    first = message.strip().splitlines()[0] if message.strip() else ""
    first = re.sub(r"0x[0-9a-fA-F]+", "0x...", first)
    return first if len(first) <= _MESSAGE_CHARS else first[: _MESSAGE_CHARS - 3] + "..."


_TITLES = (
    "`{function}` is broken",
    "Regression in `{function}`",
    "`{function}` misbehaves",
    "Unexpected behaviour from `{function}`",
)


def problem_statement(mutation: Mutation, fail_to_pass: Sequence[str], message: str) -> str:
    """An issue text: the function, where it lives, a failing test and its message."""
    module = mutation.path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
    title = _TITLES[int(mutation.digest, 16) % len(_TITLES)].format(function=mutation.function)
    shown = _scrub(message)
    lines = [
        title,
        "",
        f"`{mutation.function}` in `{module}` no longer behaves as its tests expect.",
        f"`{fail_to_pass[0]}` fails" + (":" if shown else "."),
    ]
    if shown:
        lines += ["", "```", shown, "```"]
    others = len(fail_to_pass) - 1
    if others:
        verb = "tests fail" if others > 1 else "test fails"
        lines += ["", f"{others} other {verb} as well."]
    return "\n".join(lines) + "\n"


def _created_at(instance_id: str) -> str:
    seconds = int(hashlib.sha256(instance_id.encode()).hexdigest()[:12], 16) % _SECONDS_PER_YEAR
    return (_EPOCH + timedelta(seconds=seconds)).isoformat()


def _record(
    project: Project,
    mutation: Mutation,
    fail_to_pass: list[str],
    pass_to_pass: list[str],
    message: str,
) -> dict[str, Any]:
    source = project.sources[mutation.path]
    instance_id = f"{project.name}.{project.base_commit}.{mutation.operator}__{mutation.digest}"
    return {
        "instance_id": instance_id,
        "repo": project.repo,
        "patch": make_patch(mutation.path, source, mutation.apply(source)),
        "FAIL_TO_PASS": fail_to_pass,
        "PASS_TO_PASS": pass_to_pass,
        "image_name": "",
        "base_commit": project.base_commit,
        "problem_statement": problem_statement(mutation, fail_to_pass, message),
        "created_at": _created_at(instance_id),
    }


@dataclass(frozen=True)
class _Trial:
    """What running one mutation gave: a record, or why there is none."""

    outcome: str  # "kept", "survived" (no test failed), "timed out" or "no report"
    record: dict[str, Any] | None = None


def _try_mutation(
    project: Project, baseline: _Baseline, mutation: Mutation, timeout_s: float
) -> _Trial:
    mutated = mutation.apply(project.sources[mutation.path])
    with open_sandbox("local", limits=_limits(timeout_s), workdir_from=project.root) as sb:
        sb.write_file(mutation.path, mutated)
        run = _run_suite(sb, project, baseline.passing, timeout_s)
    if run.problem is not None:
        log.debug("%s %s dropped: %s", project.name, mutation.digest, run.problem)
        return _Trial("timed out" if run.problem.startswith("timed out") else "no report")
    fail_to_pass = [t for t in baseline.passing if run.outcomes[t] != "passed"]
    if not fail_to_pass:
        return _Trial("survived")
    pass_to_pass = [t for t in baseline.passing if run.outcomes[t] == "passed"]
    message = run.messages.get(fail_to_pass[0], "")
    return _Trial("kept", _record(project, mutation, fail_to_pass, pass_to_pass, message))


# -- generation -----------------------------------------------------------------------------


def _ordered_prefix(
    items: Sequence[T],
    work: Callable[[T], R],
    keep: Callable[[R], bool],
    *,
    workers: int,
    limit: int,
) -> list[R]:
    """``work`` over ``items`` in parallel, results in order, up to the ``limit``-th kept one.

    A bounded window of items runs ahead and results are consumed in order, so the answer
    does not depend on ``workers`` or on which run finishes first.
    """
    results: list[R] = []
    kept = 0
    pending: deque[Future[R]] = deque()
    queue = iter(items)
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="minismith")
    try:
        while kept < limit:
            for item in itertools.islice(queue, 2 * workers - len(pending)):
                pending.append(pool.submit(work, item))
            if not pending:
                break
            results.append(pending.popleft().result())
            kept += keep(results[-1])
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return results


def _generate_project(
    project: Project, *, seed: int, limit: int, workers: int, timeout_s: float, progress: bool
) -> list[dict[str, Any]]:
    baseline = _clean_baseline(project, timeout_s)
    mutations = [
        m for path, text in project.sources.items() for m in _mutations_of(project, path, text)
    ]
    order = candidate_order(mutations, seed=seed, salt=project.base_commit)
    run_timeout = min(timeout_s, max(_MIN_RUN_TIMEOUT_S, _SLOWDOWN_ALLOWED * baseline.duration_s))
    with tqdm(total=len(order), desc=project.name, unit="mutant", disable=not progress) as bar:

        def work(mutation: Mutation) -> _Trial:
            trial = _try_mutation(project, baseline, mutation, run_timeout)
            bar.update(1)
            return trial

        trials = _ordered_prefix(
            order, work, lambda trial: trial.record is not None, workers=workers, limit=limit
        )
    outcomes = Counter(trial.outcome for trial in trials)
    log.info(
        "%s: %d of %d mutations tried: %s", project.name, len(trials), len(order), dict(outcomes)
    )
    return [trial.record for trial in trials if trial.record is not None]


def _mutations_of(project: Project, relpath: str, source: str) -> list[Mutation]:
    try:
        return find_mutations(relpath, source)
    except (SyntaxError, tokenize.TokenError) as exc:
        log.warning("%s: %s is skipped, it does not parse here: %s", project.name, relpath, exc)
        return []


def generate(
    projects: Sequence[Path],
    *,
    seed: int = 0,
    max_per_project: int = 20,
    workers: int = 2,
    timeout_s: float = 60.0,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """SWE-smith-schema records from mutations of ``projects``, sorted by ``instance_id``."""
    if workers < 1 or max_per_project < 0 or timeout_s <= 0:
        raise ValueError(
            f"need workers >= 1, max_per_project >= 0 and timeout_s > 0, got "
            f"{workers}, {max_per_project}, {timeout_s}"
        )
    loaded = [load_project(Path(root)) for root in projects]
    names = [project.name for project in loaded]
    if len(set(names)) != len(names):
        raise MinismithError(f"two projects share a name: {sorted(names)}")
    records = []
    for project in loaded:
        records += _generate_project(
            project,
            seed=seed,
            limit=max_per_project,
            workers=workers,
            timeout_s=timeout_s,
            progress=progress,
        )
    return sorted(records, key=lambda record: record["instance_id"])


# -- command line ---------------------------------------------------------------------------


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m data_prep.generators.minismith", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, required=True, help="JSONL file of records")
    parser.add_argument(
        "--project",
        type=Path,
        action="append",
        default=[],
        help="project folder (repeatable; default: the built-in ones)",
    )
    parser.add_argument(
        "--sdists-cache", type=Path, help="also use the pinned sdists, fetched into this folder"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-per-project", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per sandbox run")
    parser.add_argument(
        "--repos", type=Path, help="store clean snapshots at REPOS/<repo>/<base_commit>"
    )
    parser.add_argument(
        "--validate", action="store_true", help="validate every record (needs --repos)"
    )
    args = parser.parse_args(argv)
    if args.validate and args.repos is None:
        parser.error("--validate needs --repos")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    projects = list(args.project) or builtin_projects()
    if args.sdists_cache is not None:
        projects += sdists.fetch(args.sdists_cache)
    started = time.monotonic()
    records = generate(
        projects,
        seed=args.seed,
        max_per_project=args.max_per_project,
        workers=args.workers,
        timeout_s=args.timeout,
    )
    summary: dict[str, Any] = {
        "instances": len(records),
        "generate_s": round(time.monotonic() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(record) + "\n" for record in records))
    if args.repos is not None:
        for project in projects:
            store_snapshot(project, args.repos)
    if args.validate:
        started = time.monotonic()
        verdicts = validate_swe.validate_many(
            records, validate_swe.repo_snapshot_lookup(args.repos), workers=args.workers
        )
        summary["validated_ok"] = sum(verdict.ok for verdict in verdicts)
        summary["validate_s"] = round(time.monotonic() - started, 1)
        summary["rejected"] = {v.record_id: v.reason for v in verdicts if not v.ok}
    print(json.dumps(summary, indent=2))
    return 0 if summary.get("rejected", {}) == {} else 1


if __name__ == "__main__":
    sys.exit(main())
