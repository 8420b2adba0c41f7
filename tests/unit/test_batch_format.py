"""Malformed batch lines are refused with their line number and field."""

from __future__ import annotations

import json

import pytest

from thundersync_core.batch import (
    BatchFormatError,
    Segment,
    Trajectory,
    check_token_range,
    parse_batch_lines,
    trajectory_to_json,
)

GOOD = {
    "group_id": "g",
    "trajectory_id": "t0",
    "prompt_ids": [1, 2, 3],
    "segments": [{"kind": "action", "ids": [4, 5]}, {"kind": "observation", "ids": [6]}],
    "reward": 1.0,
}


def lines(*records):
    return [json.dumps(r) if isinstance(r, dict) else r for r in records]


def test_round_trip_and_default_masks():
    traj = parse_batch_lines(lines(GOOD))[0]
    assert traj.segments[0].scored == (True, True)
    assert traj.segments[1].scored == (False,)
    assert parse_batch_lines([trajectory_to_json(traj)])[0] == traj


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"reward": "NaN"}, "line 2: field reward"),
        ({"reward": None}, "line 2: field reward"),
        ({"prompt_ids": []}, "line 2: field prompt_ids"),
        ({"segments": [{"kind": "tool", "ids": [1]}]}, "line 2: field segments.0.kind"),
        ({"segments": [{"kind": "action", "ids": [1, 2], "scored": [True]}]}, "segments.0"),
        ({"segments": [{"kind": "observation", "ids": [1], "scored": [True]}]}, "never scored"),
        ({"segments": [{"kind": "action", "ids": [-1]}]}, "non-negative"),
        ({"rewards": 1.0}, "line 2: field rewards"),
        ({"trajectory_id": "t0"}, "line 2: field trajectory_id: 't0' already used on line 1"),
        ({"prompt_ids": [9]}, "line 2: field prompt_ids: differs from group 'g'"),
    ],
)
def test_malformed_line_is_named(change, expected):
    second = {**GOOD, "trajectory_id": "t1", **change}
    with pytest.raises(BatchFormatError, match=expected.replace("(", r"\(")):
        parse_batch_lines(lines(GOOD, second), source="b.jsonl")


def test_not_json_and_empty_file():
    with pytest.raises(BatchFormatError, match="line 1: not JSON"):
        parse_batch_lines(["{oops"])
    with pytest.raises(BatchFormatError, match="no trajectories"):
        parse_batch_lines(["", "  "])


def test_token_ids_beyond_the_vocabulary_are_refused():
    traj = Trajectory("g", "t9", (1, 2), (Segment.action([3, 5000]),), 0.0)
    with pytest.raises(BatchFormatError, match=r"'t9'.*5000 out of range for vocabulary of 1024"):
        check_token_range([traj], 1024)
