"""minismith's mutation operators on hand-written modules, without a sandbox.

Every operator must give a program that parses and differs from the original, through a
diff that touches only the mutated function's lines and that ``patch -p1`` / ``git apply``
turn into exactly the mutated text. Enumeration, ordering and hashing must not depend on
anything but the inputs.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from data_prep.generators.minismith import (
    OPERATORS,
    Mutation,
    builtin_projects,
    candidate_order,
    find_mutations,
    load_project,
    make_patch,
    problem_statement,
    snapshot_dir,
    tree_digest,
)

SAMPLE = textwrap.dedent(
    '''\
    """One site for every operator."""


    def clamp(value, low, high):
        """Keep value within [low, high]."""
        if low > high:
            raise ValueError("empty range")
        if value < low:
            return low
        return min(value, high)


    def window(items, start, size):
        end = start + size
        return items[start:end]


    def both(a, b):
        return a and b


    def is_empty(items):
        if not items:
            return True
        return False


    def total(values):
        result = 0
        for value in values:
            result += value
        return result


    def scaled_head(items):
        head = items[1]
        head = head * 2
        return head


    def ratio(a, b):
        return divmod(a, b)  # a comment that must survive
    '''
)
PATH = "pkg/sample.py"
# Operators that edit one token or literal: the diff swaps one line for one line.
ONE_LINE_OPERATORS = sorted(set(OPERATORS) - {"remove_cond", "swap_stmts"})


def mutations_of(operator: str, source: str = SAMPLE) -> list[Mutation]:
    return [m for m in find_mutations(PATH, source) if m.operator == operator]


def mutated_lines(operator: str) -> set[str]:
    """The changed line of each one-line mutation of ``operator``, stripped."""
    found = set()
    for mutation in mutations_of(operator):
        before = SAMPLE.splitlines()
        after = mutation.apply(SAMPLE).splitlines()
        found |= {b.strip() for a, b in zip(before, after, strict=True) if a != b}
    return found


def changed_lines(patch: str) -> tuple[list[str], list[str]]:
    body = [line for line in patch.splitlines() if not line.startswith(("---", "+++"))]
    return [x[1:] for x in body if x.startswith("-")], [x[1:] for x in body if x.startswith("+")]


def function_span(source: str, name: str) -> range:
    node = next(
        n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == name
    )
    assert node.end_lineno is not None
    return range(node.lineno, node.end_lineno + 1)


def hunk_lines(patch: str) -> list[int]:
    """Old-file line numbers of the removed lines."""
    numbers, current = [], 0
    for line in patch.splitlines():
        if line.startswith("@@"):
            current = int(line.split()[1].split(",")[0].lstrip("-"))
        elif line.startswith("-") and not line.startswith("---"):
            numbers.append(current)
            current += 1
        elif line.startswith(" "):
            current += 1
    return numbers


def apply_with(tool: str, tmp_path: Path, relpath: str, source: str, patch: str) -> str:
    target = tmp_path / relpath
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(source.encode())
    argv = {"patch": ["patch", "-p1", "--batch"], "git": ["git", "apply", "-p1", "-"]}[tool]
    run = subprocess.run(argv, cwd=tmp_path, input=patch.encode(), capture_output=True, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    return target.read_bytes().decode()


TOOLS = [
    pytest.param(tool, marks=pytest.mark.skipif(shutil.which(tool) is None, reason=f"no {tool}"))
    for tool in ("patch", "git")
]


def test_every_operator_finds_a_site():
    assert {m.operator for m in find_mutations(PATH, SAMPLE)} == set(OPERATORS)


def test_mutations_parse_and_change_the_program():
    original = ast.dump(ast.parse(SAMPLE))
    for mutation in find_mutations(PATH, SAMPLE):
        assert ast.dump(ast.parse(mutation.apply(SAMPLE))) != original, mutation


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("operator", OPERATORS)
def test_each_diff_is_minimal_and_applies(operator, tool, tmp_path):
    for index, mutation in enumerate(mutations_of(operator)):
        mutated = mutation.apply(SAMPLE)
        patch = make_patch(PATH, SAMPLE, mutated)
        assert patch.startswith(f"diff --git a/{PATH} b/{PATH}\n--- a/{PATH}\n+++ b/{PATH}\n")
        removed, added = changed_lines(patch)
        if operator in ONE_LINE_OPERATORS:
            assert (len(removed), len(added)) == (1, 1), patch
        elif operator == "remove_cond":
            assert added == [], patch
            assert 1 <= len(removed) <= 3, patch
        else:
            assert len(removed) == len(added) == 1, patch
        span = function_span(SAMPLE, mutation.function)
        assert all(line in span for line in hunk_lines(patch)), patch
        assert apply_with(tool, tmp_path / str(index), PATH, SAMPLE, patch) == mutated


def test_token_swaps_keep_the_rest_of_the_line():
    assert "return divmod(b, a)  # a comment that must survive" in mutated_lines("swap_args")
    assert {"if value <= low:", "if low >= high:"} <= mutated_lines("swap_compare")
    assert "end = start - size" in mutated_lines("swap_arith")
    assert "result -= value" in mutated_lines("swap_arith")
    assert "return a or b" in mutated_lines("swap_boolop")


def test_condition_negation_adds_or_removes_not():
    assert {"if items:", "if not low > high:", "if not value < low:"} <= mutated_lines(
        "negate_cond"
    )


def test_off_by_one_moves_literals_and_slice_bounds():
    found = mutated_lines("off_by_one")
    assert {"head = items[0]", "head = items[2]", "result = 1", "head = head * 3"} <= found
    assert {"return items[start + 1:end]", "return items[start:end - 1]"} <= found
    assert "result = -1" not in found


def test_return_changes():
    assert {"return False", "return True", "return None"} <= mutated_lines("change_return")


def test_removed_condition_is_a_whole_if_block():
    removed = {
        changed_lines(make_patch(PATH, SAMPLE, m.apply(SAMPLE)))[0][0].strip()
        for m in mutations_of("remove_cond")
    }
    assert removed == {"if low > high:", "if value < low:", "if not items:"}


def test_statement_swap_needs_a_dependency():
    swaps = mutations_of("swap_stmts")
    assert [m.function for m in swaps] == ["scaled_head"]
    independent = "def f(a, b):\n    x = a + 1\n    y = b + 1\n    return x, y\n"
    assert mutations_of("swap_stmts", independent) == []


def test_fstrings_and_string_concatenation_are_left_alone():
    source = 'def label(n):\n    return f"{n + 1}" + "!"\n'
    assert [m.operator for m in find_mutations(PATH, source)] == ["change_return"]


@pytest.mark.parametrize("tool", TOOLS)
def test_non_ascii_crlf_and_missing_final_newline(tool, tmp_path):
    source = 'def f(n):\r\n    """Naïve café."""\r\n    return len("naïve") + n'
    mutations = find_mutations(PATH, source)
    target = next(m for m in mutations if m.operator == "swap_arith")
    mutated = target.apply(source)
    assert mutated.endswith('return len("naïve") - n')
    patch = make_patch(PATH, source, mutated)
    assert "\\ No newline at end of file" in patch
    assert apply_with(tool, tmp_path, PATH, source, patch) == mutated


def test_enumeration_is_deterministic():
    first = find_mutations(PATH, SAMPLE)
    assert first == find_mutations(PATH, SAMPLE)
    assert len({m.digest for m in first}) == len(first)
    assert len({m.apply(SAMPLE) for m in first}) == len(first)


def test_candidate_order_is_a_seeded_round_robin():
    mutations = find_mutations(PATH, SAMPLE)
    order = candidate_order(mutations, seed=3, salt="abc")
    assert sorted(order, key=lambda m: m.digest) == sorted(mutations, key=lambda m: m.digest)
    assert order == candidate_order(mutations, seed=3, salt="abc")
    assert order != candidate_order(mutations, seed=4, salt="abc")
    assert [m.operator for m in order[: len(OPERATORS)]] == list(OPERATORS)


def test_builtin_projects_mutate_cleanly():
    for root in builtin_projects():
        project = load_project(root)
        mutations = [
            m for path, text in project.sources.items() for m in find_mutations(path, text)
        ]
        assert {m.operator for m in mutations} == set(OPERATORS), project.name
        assert len(mutations) > 150, project.name
        assert project.test_files, project.name
        assert not any(path.startswith("tests/") for path in project.sources)


def test_tree_digest_and_snapshot(tmp_path):
    project = tmp_path / "proj"
    (project / "pkg" / "__pycache__").mkdir(parents=True)
    (project / "pkg" / "__init__.py").write_text("X = 1\n")
    before = tree_digest(project)
    (project / "pkg" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"cache")
    assert tree_digest(project) == before
    assert snapshot_dir(project, tmp_path / "copy") == before
    assert tree_digest(tmp_path / "copy") == before
    assert not (tmp_path / "copy" / "pkg" / "__pycache__").exists()
    (project / "pkg" / "__init__.py").write_text("X = 2\n")
    assert tree_digest(project) != before


def test_problem_statement_names_the_failure_but_not_the_fix():
    mutation = mutations_of("swap_compare")[0]
    patch = make_patch(PATH, SAMPLE, mutation.apply(SAMPLE))
    tests = ["tests/test_sample.py::test_clamp", "tests/test_sample.py::test_other"]
    text = problem_statement(mutation, tests, "AssertionError: assert 3 == 2 at 0x7f00aa")
    assert mutation.function in text
    assert tests[0] in text
    assert "0x..." in text
    assert "0x7f00aa" not in text
    assert "1 other test fails" in text
    _removed, added = changed_lines(patch)
    assert not any(line.strip() in text for line in added)
    assert text == problem_statement(mutation, tests, "AssertionError: assert 3 == 2 at 0x7f00aa")
