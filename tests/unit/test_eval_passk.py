"""pass@k against hand-computed cases and exact fractions; results parsing refuses bad lines."""

from __future__ import annotations

import json
from fractions import Fraction
from math import comb

import pytest

from eval.passk import (
    AttemptResult,
    ResultsFormatError,
    parse_ks,
    parse_results,
    pass_at_k,
    pass_at_k_task,
    score,
)
from thundersync_core.cli import main


def exact(n: int, c: int, k: int) -> Fraction:
    """The definition, with exact integers: 1 - C(n-c, k) / C(n, k)."""
    return 1 - Fraction(comb(n - c, k), comb(n, k))


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (1, 0, 1, 0.0),
        (1, 1, 1, 1.0),
        (3, 1, 1, 1 / 3),  # pass@1 is the success rate
        (3, 1, 3, 1.0),  # n = k with one success: every draw holds it
        (3, 0, 3, 0.0),  # n = k, c = 0
        (3, 3, 2, 1.0),  # c = n
        (4, 2, 2, 1 - 1 / 6),  # C(2,2)/C(4,2) = 1/6
        (5, 1, 2, 1 - 6 / 10),  # C(4,2)/C(5,2) = 6/10
        (10, 3, 5, 1 - 21 / 252),  # C(7,5)/C(10,5)
        (5, 3, 3, 1.0),  # n - c = 2 < k = 3
    ],
)
def test_hand_computed_cases(n, c, k, expected):
    assert pass_at_k_task(n, c, k) == pytest.approx(expected, abs=1e-15)


@pytest.mark.parametrize(("c", "k"), [(0, 1), (1, 1), (1, 100), (7, 10), (50, 150), (199, 5)])
def test_large_n_matches_exact_fractions(c, k):
    # C(200, 100) ~ 9e58: the product form must agree with exact rationals to float precision.
    n = 200
    assert pass_at_k_task(n, c, k) == pytest.approx(float(exact(n, c, k)), rel=1e-12, abs=1e-15)


def test_very_large_n_stays_finite():
    value = pass_at_k_task(100_000, 3, 1000)
    assert value == pytest.approx(1 - (1 - 1000 / 100_000) ** 3, rel=1e-4)


def test_tasks_weigh_equally_whatever_their_attempt_count():
    counts = {"a": (2, 2), "b": (10, 0)}
    assert pass_at_k(counts, 1) == pytest.approx(0.5)


def test_task_with_fewer_than_k_attempts_is_refused_by_name():
    results = [AttemptResult("ok", i, False) for i in range(3)] + [AttemptResult("short", 0, True)]
    with pytest.raises(ValueError, match="task 'short' has 1 attempts, fewer than k=3"):
        score(results, [1, 3])
    assert score(results, [1])["n_tasks"] == 2


def test_invalid_arguments_are_refused():
    for n, c, k, message in [
        (3, 4, 1, "0 <= c <= n"),
        (3, -1, 1, "0 <= c <= n"),
        (3, 1, 0, "k must be >= 1"),
        (2, 1, 3, "needs at least 3 attempts"),
    ]:
        with pytest.raises(ValueError, match=message):
            pass_at_k_task(n, c, k)
    with pytest.raises(ValueError, match="no tasks"):
        pass_at_k({}, 1)
    for text in ["", "0", "1,1", "a,2"]:
        with pytest.raises(ValueError, match="--k"):
            parse_ks(text)
    assert parse_ks("1, 3,5") == [1, 3, 5]


def line(**fields) -> str:
    return json.dumps(fields)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", "line 2: not JSON"),
        ("[1, 2]", "line 2: expected a JSON object"),
        (line(attempt=0, success=True), "line 2: missing field 'task_id'"),
        (line(task_id="", attempt=0, success=True), "line 2: field 'task_id' is empty"),
        (line(task_id=3, attempt=0, success=True), "line 2: field 'task_id' must be str"),
        (line(task_id="a", success=True), "line 2: missing field 'attempt'"),
        (line(task_id="a", attempt="1", success=True), "line 2: field 'attempt' must be int"),
        (line(task_id="a", attempt=True, success=True), "line 2: field 'attempt' must be int"),
        (line(task_id="a", attempt=1, success=1), "line 2: field 'success' must be bool"),
        (line(task_id="a", attempt=1), "line 2: missing field 'success'"),
        (line(task_id="a", attempt=0, success=False), r"line 2: duplicate .*first on line 1"),
    ],
)
def test_malformed_lines_name_line_and_field(bad, message):
    lines = [line(task_id="a", attempt=0, success=True), bad]
    with pytest.raises(ResultsFormatError, match=message):
        parse_results(lines, "r.jsonl")


def test_cli_prints_pass_at_k(tmp_path, capsys):
    rows = [line(task_id="a", attempt=i, success=i == 0, reward=float(i == 0)) for i in range(3)]
    rows += ["", *(line(task_id="b", attempt=i, success=False) for i in range(3))]
    path = tmp_path / "results.jsonl"
    path.write_text("\n".join(rows) + "\n")
    assert main(["eval", "passk", "--results", str(path), "--k", "1,3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {"pass@1": pytest.approx((1 / 3 + 0) / 2), "pass@3": 0.5, "n_tasks": 2}


def test_cli_errors_name_the_line(tmp_path, capsys):
    path = tmp_path / "results.jsonl"
    path.write_text(line(task_id="a", attempt=0, success="yes") + "\n")
    assert main(["eval", "passk", "--results", str(path), "--k", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("thundersync eval: error: ")
    assert "line 1: field 'success' must be bool" in err
