from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "run_figures.py"
_spec = importlib.util.spec_from_file_location("run_figures", SCRIPT)
assert _spec is not None
assert _spec.loader is not None
run_figures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_figures)


def _run(
    root: Path, schedule: str, learner_cores: list[int], walls: list[float], rewards: list[float]
) -> Path:
    root.mkdir()
    resources = {"rollout": {"cores": [0]}, "learner": {"cores": learner_cores}, "devices": 0}
    config = {"schedule": schedule, "resources": resources}
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    records = []
    for step, (wall, reward) in enumerate(zip(walls, rewards, strict=True)):
        parts = {"rollout_stage_s": wall / 2, "learner_busy_s": wall / 3}
        parts["learner_tail_s"] = wall / 4
        records.append({"step": step, "step_wall_s": wall, "reward_mean": reward, **parts})
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


def test_medians_ratios_and_rewards_against_the_baseline(tmp_path: Path) -> None:
    sync = _run(tmp_path / "a", "sync", [1], [70.0, 80.0, 60.0], [0.5, 0.25, 0.75])
    both = _run(tmp_path / "b", "sync", [0, 1], [50.0, 56.0, 49.0], [0.5, 0.25, 0.75])
    fast = _run(tmp_path / "c", "thundersync", [1], [35.0, 40.0, 60.0], [0.5, 0.25, 0.5])
    out = tmp_path / "figures.json"
    labelled = [f"sync={sync}", f"sync-both={both}", f"thundersync={fast}"]
    flags = ["--baseline", "sync", "--commit", "abc", "--command", "made so", "--out", str(out)]
    code = run_figures.main([*labelled, *flags])
    assert code == 0
    figures = json.loads(out.read_text())
    assert figures["command"] == "made so"
    assert figures["baseline"] == "sync"
    runs = figures["runs"]
    assert runs["sync-both"]["cores"]["learner"] == [0, 1]
    assert runs["sync"]["median"]["step_wall_s"] == 70.0
    assert runs["sync-both"]["speedup_vs_baseline"] == pytest.approx(70.0 / 50.0)
    assert runs["thundersync"]["speedup_vs_baseline"] == pytest.approx(70.0 / 40.0)
    assert runs["sync-both"]["baseline_reward_every_step"]
    assert not runs["thundersync"]["baseline_reward_every_step"]


def test_a_missing_baseline_or_an_unlabelled_run_is_refused(tmp_path: Path) -> None:
    sync = _run(tmp_path / "a", "sync", [1], [70.0], [0.5])
    common = ["--commit", "abc", "--command", "x", "--out", str(tmp_path / "f.json")]
    with pytest.raises(SystemExit):
        run_figures.main([f"sync={sync}", "--baseline", "thundersync", *common])
    with pytest.raises(SystemExit):
        run_figures.main([str(sync), "--baseline", "sync", *common])
    assert not (tmp_path / "f.json").exists()
