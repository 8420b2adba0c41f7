"""Trace predictor: hand-computed two-rank cases, malformed traces, analytic consistency."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thundersync_core.perfmodel import TraceFormatError, predict_from_trace
from thundersync_core.perfmodel.trace import predict_files


def _two_rank_trace() -> dict:
    # rank 0: FIFO 1 + 2 = 3, max(3, 3) + 1 = 4; rank 1: 2 + 0.5 = 2.5, max(2.5, 5) + 1 = 6.
    return {
        "suffix_s": 0.5,
        "rollout_start_s": 0.0,
        "ranks": [
            {
                "sources": [
                    {"release_s": 3.0, "service_s": 1.0, "id": "g0/1"},
                    {"release_s": 1.0, "service_s": 2.0, "id": "g0/0"},
                ]
            },
            {
                "sources": [
                    {"release_s": 2.0, "service_s": 0.5, "id": "g1/0"},
                    {"release_s": 5.0, "service_s": 1.0, "id": "g1/1"},
                ]
            },
        ],
        "measured": {"sync_step_s": 9.0, "thundersync_step_s": 7.0},
    }


def test_two_ranks_by_hand() -> None:
    out = predict_from_trace(_two_rank_trace())
    # sync: last release 5 + max rank work 3 + suffix 0.5.
    assert out["sync"]["step_s"] == pytest.approx(8.5)
    assert out["sync"]["tail_s"] == pytest.approx(3.0)
    assert out["thundersync"]["step_s"] == pytest.approx(6.5)
    assert out["thundersync"]["tail_s"] == pytest.approx(1.0)
    # busy rank-time: services 4.5 + two ranks x suffix 0.5.
    assert out["sync"]["learner_idle_fraction"] == pytest.approx(1 - 5.5 / 17.0)
    assert out["thundersync"]["learner_idle_fraction"] == pytest.approx(1 - 5.5 / 13.0)
    assert out["predicted_speedup"] == pytest.approx(8.5 / 6.5)
    measured = out["measured"]
    assert measured["speedup"] == pytest.approx(9.0 / 7.0)
    # (predicted - measured) / measured: the prediction is 1.7% above the measurement.
    expected_error = (8.5 / 6.5 - 9.0 / 7.0) / (9.0 / 7.0)
    assert measured["speedup_relative_error"] == pytest.approx(expected_error)
    assert measured["speedup_relative_error"] == pytest.approx(0.01709, abs=1e-4)
    assert measured["thundersync_step_relative_error"] == pytest.approx(-0.5 / 7.0)
    assert measured["sync_step_relative_error"] == pytest.approx(-0.5 / 9.0)


def test_idle_rank_waits_for_late_release() -> None:
    # One rank gets all its work at 10 s: thundersync cannot beat sync there.
    trace = {
        "suffix_s": 0.0,
        "ranks": [
            {"sources": [{"release_s": 10.0, "service_s": 4.0}]},
            {"sources": [{"release_s": 1.0, "service_s": 1.0}]},
        ],
    }
    out = predict_from_trace(trace)
    assert out["thundersync"]["step_s"] == pytest.approx(14.0)
    assert out["sync"]["step_s"] == pytest.approx(14.0)
    assert "measured" not in out


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda t: t["ranks"][0]["sources"].append({"release_s": 1.0, "service_s": -1}),
            r"ranks\[0\]\.sources\[2\]\.service_s: must be a non-negative number",
        ),
        (
            lambda t: t["ranks"][1]["sources"][0].pop("release_s"),
            r"ranks\[1\]\.sources\[0\]\.release_s: missing",
        ),
        (
            lambda t: t["ranks"][1]["sources"][1].update(release_s=True),
            r"ranks\[1\]\.sources\[1\]\.release_s: must be a non-negative number",
        ),
        (
            lambda t: t["ranks"][0]["sources"][0].update(service_s=math.nan),
            r"ranks\[0\]\.sources\[0\]\.service_s",
        ),
        (lambda t: t.pop("suffix_s"), r"suffix_s: missing"),
        (lambda t: t.update(ranks={}), r"ranks: must be a non-empty list"),
        (lambda t: t["ranks"][0].pop("sources"), r"ranks\[0\]\.sources: must be a list"),
        (lambda t: t.update(rollout_start_s=2.5), r"ranks\[0\]\.sources\[1\]\.release_s"),
        (lambda t: t["measured"].update(sync_step_s="9"), r"measured\.sync_step_s"),
        (lambda t: t["ranks"][0]["sources"][0].update(id=3), r"ranks\[0\]\.sources\[0\]\.id"),
    ],
)
def test_malformed_traces_name_the_field(mutate, message: str) -> None:
    trace = _two_rank_trace()
    mutate(trace)
    with pytest.raises(TraceFormatError, match=message):
        predict_from_trace(trace)


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_two_rank_trace()))
    bad = tmp_path / "bad.json"
    trace = _two_rank_trace()
    trace["ranks"][0]["sources"][1]["service_s"] = -2
    bad.write_text(json.dumps(trace))
    with pytest.raises(TraceFormatError, match=r"bad\.json: ranks\[0\]\.sources\[1\]\.service_s"):
        predict_files([good, bad])
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(TraceFormatError, match=r"broken\.json: not valid JSON"):
        predict_files([broken])


def test_several_files_mean_error(tmp_path: Path) -> None:
    paths = []
    for i, measured_ts in enumerate((7.0, 6.0)):
        trace = _two_rank_trace()
        trace["measured"]["thundersync_step_s"] = measured_ts
        paths.append(tmp_path / f"t{i}.json")
        paths[-1].write_text(json.dumps(trace))
    out = predict_files(paths)
    errors = [out["files"][str(p)]["measured"]["speedup_relative_error"] for p in paths]
    assert out["mean_speedup_relative_error"] == pytest.approx(sum(errors) / 2)
    assert out["mean_abs_speedup_relative_error"] == pytest.approx(sum(map(abs, errors)) / 2)
    assert errors[0] != errors[1]


_source = st.fixed_dictionaries(
    {
        "release_s": st.floats(0.0, 100.0, allow_nan=False),
        "service_s": st.floats(0.0, 20.0, allow_nan=False),
    }
)
_rank = st.fixed_dictionaries({"sources": st.lists(_source, min_size=1, max_size=12)})


@settings(max_examples=150, deadline=None)
@given(ranks=st.lists(_rank, min_size=1, max_size=3), suffix_s=st.floats(0.0, 5.0))
def test_predictions_respect_the_analytic_bounds(ranks: list, suffix_s: float) -> None:
    out = predict_from_trace({"suffix_s": suffix_s, "ranks": ranks})
    tolerance = 1e-9 * (1.0 + out["sync"]["step_s"])
    assert out["thundersync"]["step_s"] <= out["sync"]["step_s"] + tolerance
    lower_s, upper_s = out["analytic"]["tail_bounds_s"]
    assert lower_s - tolerance <= out["thundersync"]["tail_s"] <= upper_s + tolerance
    for summary in (out["sync"], out["thundersync"]):
        assert -tolerance <= summary["learner_idle_fraction"] <= 1.0
