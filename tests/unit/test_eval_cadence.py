"""Run-folder contract: which checkpoints count as published, device-hours, the summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval.cadence import list_checkpoints, rebuild_summary
from eval.io import read_jsonl, write_jsonl


def checkpoint(run: Path, name: str, state: dict | None) -> Path:
    folder = run / "checkpoints" / name
    (folder / "model").mkdir(parents=True)
    if state is not None:
        (folder / "state.json").write_text(json.dumps(state))
    return folder


def state(step: int, **extra) -> dict:
    return {"step": step, "policy_version": step + 1, "extra": extra}


def test_published_checkpoints_by_step_with_device_hours(tmp_path):
    run = tmp_path / "my-run"
    checkpoint(run, "step-000010", state(10, device_hours=2.0, schedule="sync", run="r"))
    checkpoint(run, "step-000002", state(2, schedule="sync"))  # from metrics.jsonl
    checkpoint(run, "step-000020", None)  # no state.json: still being written
    checkpoint(run, ".step-000030.partial", state(30, device_hours=9.0))
    (run / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "device_hours": s * 0.25}) + "\n" for s in (1, 2, 3))
    )
    found = list_checkpoints(run)
    assert [(c.step, c.device_hours, c.policy_version) for c in found] == [
        (2, 0.5, 3),
        (10, 2.0, 11),
    ]
    assert found[0].run == "my-run"  # the folder name when extra.run is absent
    assert found[1].run == "r"
    assert found[0].model_dir == run / "checkpoints" / "step-000002" / "model"


def test_contract_violations_name_the_file(tmp_path):
    run = tmp_path / "run"
    with pytest.raises(FileNotFoundError, match="no checkpoints/ folder"):
        list_checkpoints(run)
    folder = checkpoint(run, "step-000004", state(5, device_hours=1.0))
    with pytest.raises(ValueError, match="step 5 does not match the folder name step-000004"):
        list_checkpoints(run)
    (folder / "state.json").write_text(json.dumps(state(4)))
    with pytest.raises(ValueError, match=r"state.json: no extra.device_hours, and .*metrics.jsonl"):
        list_checkpoints(run)
    (folder / "state.json").write_text("{")
    with pytest.raises(ValueError, match=r"step-000004/state.json: not JSON"):
        list_checkpoints(run)


def attempt_rows(step: int, device_hours: float, successes: dict[str, list[bool]]) -> list[dict]:
    tags = {"run": "r", "schedule": "sync", "objective": "grpo", "step": step, "k": 2}
    return [
        {"pool": "terminal" if task.startswith("t") else "swe", "task_id": task, "attempt": i,
         "success": ok, "device_hours": device_hours, **tags}
        for task, outcome in successes.items()
        for i, ok in enumerate(outcome)
    ]  # fmt: skip


def test_summary_is_rebuilt_from_the_step_files(tmp_path):
    run = tmp_path / "run"
    write_jsonl(run / "eval" / "step-000008.jsonl", attempt_rows(8, 2.0, {"t1": [True, True]}))
    rows = attempt_rows(4, 1.0, {"t1": [False, True], "t2": [False, False], "s1": [True, False]})
    write_jsonl(run / "eval" / "step-000004.jsonl", rows)
    lines = rebuild_summary(run)
    assert lines == read_jsonl(run / "eval" / "summary.jsonl")
    assert [(line["step"], line["device_hours"]) for line in lines] == [(4, 1.0), (8, 2.0)]
    first = lines[0]
    assert first["pass@1"] == pytest.approx((0.5 + 0.0 + 0.5) / 3)
    assert first["pass@2"] == pytest.approx(2 / 3)
    assert first["n_tasks"] == 3
    assert first["pools"]["terminal"] == {"pass@1": 0.25, "pass@2": 0.5, "n_tasks": 2}
    assert first["pools"]["swe"] == {"pass@1": 0.5, "pass@2": 1.0, "n_tasks": 1}
    assert (first["run"], first["schedule"], first["k"]) == ("r", "sync", 2)


def test_summary_refuses_a_step_file_with_too_few_attempts(tmp_path):
    run = tmp_path / "run"
    rows = attempt_rows(4, 1.0, {"t1": [True, True], "t2": [True]})
    write_jsonl(run / "eval" / "step-000004.jsonl", rows)
    with pytest.raises(ValueError, match=r"step-000004.jsonl: task 't2' has 1 attempts"):
        rebuild_summary(run)
