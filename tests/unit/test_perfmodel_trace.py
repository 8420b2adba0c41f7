"""Trace predictor: hand-computed two-rank cases, malformed traces, analytic consistency."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thundersync_core.perfmodel import TraceFormatError, predict_from_trace
from thundersync_core.perfmodel.fifo import fifo_finish
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


def test_a_slowed_server_finishes_what_is_left_at_full_rate() -> None:
    from thundersync_core.perfmodel.fifo import fifo_finish  # noqa: PLC0415

    # Half speed until 4 s: 0-2 s (1 s of work), then 2-4 s does 1 s of the next source's
    # 2 s, whose last 1 s runs at full speed (ends at 5); the third starts after the switch.
    out = fifo_finish([0.0, 0.5, 6.0], [1.0, 2.0, 1.0], slowdown=2.0, slow_until_s=4.0)
    assert out.finish_s == pytest.approx((2.0, 5.0, 7.0))
    assert out.busy_s == pytest.approx(6.0)
    assert out.idle_s == pytest.approx(1.0)
    plain = fifo_finish([0.0, 0.5, 6.0], [1.0, 2.0, 1.0])
    assert plain.finish_s == pytest.approx((1.0, 3.0, 7.0))
    with pytest.raises(ValueError, match="slowdown"):
        fifo_finish([0.0], [1.0], slowdown=0.0)


def test_contention_slows_only_thundersync_and_is_validated() -> None:
    trace = {
        "suffix_s": 0.0,
        "ranks": [
            {
                "sources": [
                    {"release_s": 1.0, "service_s": 2.0},
                    {"release_s": 3.0, "service_s": 1.0},
                ]
            }
        ],
    }
    plain = predict_from_trace(trace)
    slowed = predict_from_trace({**trace, "contention": {"learner_slowdown": 1.5}})
    assert slowed["sync"] == plain["sync"], "sync overlaps nothing: contention does not enter"
    # By hand: the first source runs 1-3 s at 2/3 speed (4/3 s of its 2 s done), the rest
    # at full speed to 3.667 s; the second from there to 4.667 s.
    assert slowed["thundersync"]["step_s"] == pytest.approx(4.0 + 2 / 3)
    assert plain["thundersync"]["step_s"] == pytest.approx(4.0)
    for bad in [{"learner_slowdown": 0}, {"learner_slowdown": -1.0}, "fast"]:
        with pytest.raises(TraceFormatError, match="contention"):
            predict_from_trace({**trace, "contention": bad})


def test_the_open_group_cap_holds_a_source_until_a_group_closes() -> None:
    from thundersync_core.perfmodel.fifo import grouped_finish  # noqa: PLC0415

    # One group open at a time. a/0 served 0-1; b/0 (released 0.5) is held while group a
    # waits for a/1 (released 3, served 3-4); a closes and b/0 is served 4-5.
    release, service, groups = [0.0, 0.5, 3.0], [1.0, 1.0, 1.0], ["a", "b", "a"]
    capped = grouped_finish(release, service, groups, 1)
    assert capped.finish_s == pytest.approx((1.0, 5.0, 4.0))
    assert capped.intervals == ((0.0, 1.0), (3.0, 4.0), (4.0, 5.0))
    assert capped.idle_s == pytest.approx(2.0)
    # Room for both groups: plain FIFO.
    room = grouped_finish(release, service, groups, 2)
    assert room.finish_s == pytest.approx(fifo_finish(release, service).finish_s)

    trace = {
        "suffix_s": 0.0,
        "max_open_groups": 1,
        "ranks": [
            {
                "sources": [
                    {"release_s": r, "service_s": w, "group": g}
                    for r, w, g in zip(release, service, groups, strict=True)
                ]
            }
        ],
    }
    out = predict_from_trace(trace)
    assert out["thundersync"]["step_s"] == pytest.approx(5.0)
    assert out["sync"]["step_s"] == pytest.approx(6.0), "sync: 3 s of work after the last release"
    del trace["ranks"][0]["sources"][1]["group"]
    with pytest.raises(TraceFormatError, match=r"sources\[1\]\.group: missing"):
        predict_from_trace(trace)
    with pytest.raises(TraceFormatError, match="max_open_groups"):
        predict_from_trace({**trace, "max_open_groups": 0})
