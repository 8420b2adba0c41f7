"""Evaluation end to end: the bash agent, real sandboxes (both backends), real graders, pass@k.

Pools: the two fixture terminal tasks and one minismith instance generated from the
built-in ``textkit`` project (a real mutation with real failing tests, ~3 s).

- A scripted engine emits, token for token, the reference command on attempt 0 (the
  task's solve.sh; for the SWE instance, the bug patch reversed), a wrong command on
  attempt 1 and nothing useful on attempt 2. Each task thus has exactly 1 success in 3,
  so pass@1 = 1/3 and pass@3 = 1 exactly; these come out of the verifiers and grade_swe
  in real sandboxes, so a broken setup, patch or grader changes them.
- The random tiny policy through the transformers engine scores 0 (a random byte stream
  does not write a fenced bash block that solves a task); the test checks the structure
  and that every attempt was graded with a reason.
- The checkpoint cadence evaluates each published checkpoint once.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from data_prep.generators.minismith import PROJECTS_DIR, generate, store_snapshot
from eval.cadence import evaluate_run
from eval.io import write_jsonl
from eval.passk import load_results, score
from eval.swe_tasks import load_swe_tasks
from eval.terminal_eval import EvalSettings, evaluate, summarize
from thundersync_core.cli import main
from thundersync_core.policy import load_model, load_tokenizer, save_policy
from thundersync_core.rollout.cli import make_engine
from thundersync_core.rollout.engine import GenerationRequest, GenerationResult, SamplingConfig
from thundersync_core.rollout.sandbox import SandboxUnavailable, open_sandbox
from thundersync_core.rollout.tasks import load_terminal_tasks

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        shutil.which("bwrap") is None,
        reason="bwrap not installed (Debian package 'bubblewrap'; `make test` installs it as root)",
    ),
]
TASKS = Path(__file__).parent.parent / "fixtures" / "tasks"


@pytest.fixture(scope="module")
def prep_dir(tmp_path_factory) -> Path:
    """A prep-layout folder: swe/dev.parquet (one minismith instance) and repos/."""
    root = tmp_path_factory.mktemp("prep")
    project = PROJECTS_DIR / "textkit"
    records = generate([project], seed=0, max_per_project=1, workers=2, progress=False)
    assert len(records) == 1
    store_snapshot(project, root / "repos")
    (root / "swe").mkdir()
    pq.write_table(pa.Table.from_pylist(records), root / "swe" / "dev.parquet")
    return root


def reference_commands(swe_task) -> dict[str, list[str]]:
    """task id -> the commands of attempts 0 (solves), 1 (wrong), 2 (does nothing)."""
    source = re.search(r"^\+\+\+ b/(\S+)", swe_task.bug_patch, re.MULTILINE).group(1)
    hello = (TASKS / "write-hello" / "solution" / "solve.sh").read_text()
    count = (TASKS / "count-lines" / "solution" / "solve.sh").read_text()
    return {
        "write-hello": [hello, "echo hi > hello.txt", "ls"],
        "count-lines": [count, "echo 0 > count.txt", "ls"],
        swe_task.task_id: [
            f"patch -p1 -R --batch <<'EOF'\n{swe_task.bug_patch}EOF",
            f"echo '# touched' >> {source}",
            "ls",
        ],
    }  # fmt: skip


class ScriptedEngine:
    """Turn 0: the planned command of (task, attempt); turn 1: submit. Exact token ids."""

    def __init__(self, tokenizer, commands: dict[str, list[str]]) -> None:
        self.tokenizer = tokenizer
        self.commands = commands
        self.policy_version = 7
        self.first_turn_seeds: dict[str, set[int]] = {}

    def _reply(self, request: GenerationRequest) -> str:
        task_id, attempt, turn = request.request_id.rsplit("/", 2)
        if turn != "0":
            return "```bash\nsubmit\n```"
        self.first_turn_seeds.setdefault(task_id, set()).add(request.seed)
        command = self.commands[task_id][int(attempt)].rstrip("\n")
        return f"```bash\n{command}\n```"

    def generate(
        self, requests: Sequence[GenerationRequest], sampling: SamplingConfig
    ) -> list[GenerationResult]:
        end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        results = []
        for request in requests:
            ids = self.tokenizer.encode(self._reply(request), add_special_tokens=False)
            assert len(ids) < request.max_tokens, "raise max_tokens_per_turn for this script"
            ids.append(end)
            results.append(
                GenerationResult(request.request_id, tuple(ids), (0.0,) * len(ids), "stop", 7)
            )
        return results

    def load_weights(self, path, version):
        raise NotImplementedError

    def close(self):
        pass


@pytest.fixture(params=["local", "docker"])
def backend(request) -> str:
    if request.param == "docker":
        try:
            open_sandbox("docker").close()
        except SandboxUnavailable as exc:
            pytest.skip(f"docker sandbox unavailable: {exc}")
    return request.param


def test_scripted_policy_solves_one_attempt_in_three(tiny_policy_dir, prep_dir, tmp_path, backend):
    """On Docker, the SWE instance's tests run in a container from the local image."""
    tokenizer = load_tokenizer(tiny_policy_dir)
    swe = load_swe_tasks(prep_dir / "swe" / "dev.parquet")
    pools = {"terminal": load_terminal_tasks(TASKS), "swe": swe}
    engine = ScriptedEngine(tokenizer, reference_commands(swe[0]))
    settings = EvalSettings(
        k=3,
        max_turns=2,
        max_tokens_per_turn=1024,
        max_total_tokens=2048,
        max_context_tokens=8192,
        backend=backend,
    )
    rows = evaluate(engine, tokenizer, pools, settings)
    assert len(rows) == 9
    by_task: dict[str, list[dict]] = {}
    for row in rows:
        by_task.setdefault(row["task_id"], []).append(row)
    for task_id, attempts in by_task.items():
        assert [r["attempt"] for r in attempts] == [0, 1, 2]
        assert [r["success"] for r in attempts] == [True, False, False], attempts
        assert [r["finish_reason"] for r in attempts] == ["submitted"] * 3
        assert all(r["turns"] == 2 and r["policy_version"] == 7 for r in attempts)
        assert len(engine.first_turn_seeds[task_id]) == 3  # distinct seeds per attempt
    swe_id = swe[0].task_id
    solved, wrong, idle = (r["reward_reason"] for r in by_task[swe_id])
    assert solved.startswith("all ")
    assert "FAIL_TO_PASS and" in solved
    assert wrong.startswith("FAIL_TO_PASS not passing")
    assert idle.startswith("empty diff")
    assert by_task["write-hello"][0]["reward_reason"] == "reward 1 from /logs/verifier/reward.txt"
    summary = summarize(rows, settings.ks)
    assert summary["pass@1"] == pytest.approx(1 / 3)
    assert summary["pass@3"] == pytest.approx(1.0)
    assert summary["n_tasks"] == 3
    assert summary["pools"]["swe"]["n_tasks"] == 1
    assert summary["per_task"][swe_id] == {
        "pool": "swe", "n": 3, "successes": 1, "pass@1": pytest.approx(1 / 3), "pass@3": 1.0,
    }  # fmt: skip
    # The per-attempt file is what `eval passk` reads.
    path = write_jsonl(tmp_path / "attempts.jsonl", rows)
    assert score(load_results(path), [1, 3]) == {
        "pass@1": pytest.approx(1 / 3), "pass@3": 1.0, "n_tasks": 3,
    }  # fmt: skip


def test_random_policy_run_command(tiny_policy_dir, prep_dir, tmp_path, capsys):
    out = tmp_path / "attempts.jsonl"
    argv = ["eval", "run", "--model", str(tiny_policy_dir), "--tasks", str(TASKS)]
    argv += ["--swe", str(prep_dir / "swe" / "dev.parquet"), "--k", "3", "--engine", "hf"]
    argv += ["--max-turns", "2", "--max-tokens-per-turn", "12", "--out", str(out)]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["engine"] == "HFEngine"
    assert summary["n_tasks"] == 3
    assert set(summary["pools"]) == {"terminal", "swe"}
    assert {"pass@1", "pass@3"} <= set(summary)
    assert 0.0 <= summary["pass@1"] <= summary["pass@3"] <= 1.0
    assert all(t["n"] == 3 for t in summary["per_task"].values())
    rows = [json.loads(t) for t in out.read_text().splitlines()]
    assert len(rows) == 9
    assert sorted((r["task_id"], r["attempt"]) for r in rows) == sorted(
        (t, a) for t in summary["per_task"] for a in range(3)
    )
    for row in rows:
        assert isinstance(row["reward_reason"], str)
        assert row["reward_reason"]
        assert row["finish_reason"] in {"submitted", "max_turns", "max_total_tokens"}
        assert 1 <= row["turns"] <= 2
        assert row["success"] == (row["reward"] >= 1.0)


def write_checkpoint(run: Path, step: int, policy: Path, device_hours: float | None) -> None:
    folder = run / "checkpoints" / f"step-{step:06d}"
    shutil.copytree(policy, folder / "model")
    extra = {"wall_s": step * 10.0, "run": "r1", "schedule": "thundersync", "objective": "grpo"}
    if device_hours is not None:
        extra["device_hours"] = device_hours
    state = {"step": step, "policy_version": step, "extra": extra}
    (folder / "state.json").write_text(json.dumps(state))


def test_cadence_evaluates_each_checkpoint_once(tiny_policy_dir, tmp_path):
    run = tmp_path / "run"
    write_checkpoint(run, 2, tiny_policy_dir, 0.5)
    write_checkpoint(run, 4, tiny_policy_dir, None)  # device-hours from metrics.jsonl
    (run / "checkpoints" / ".step-000006.partial").mkdir()  # not yet published
    metrics = [
        {"step": s, "step_wall_s": 9.0, "device_hours": s / 4, "reward_mean": 0.0}
        for s in range(1, 7)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    pools = {"terminal": load_terminal_tasks(TASKS)[:1]}
    settings = EvalSettings(k=2, max_turns=1, max_tokens_per_turn=8)
    made: list[Path] = []

    def engine_factory(model_dir: Path):
        made.append(model_dir)
        return make_engine("hf", model_dir)

    first = evaluate_run(run, pools, settings, engine_factory=engine_factory)
    assert first.evaluated == [2, 4]
    # One engine for the call: started on step 2, given step 4's weights.
    assert made == [run / "checkpoints" / "step-000002" / "model"]
    again = evaluate_run(run, pools, settings, engine_factory=engine_factory)
    assert (again.evaluated, again.skipped, len(made)) == ([], [2, 4], 1)
    write_checkpoint(run, 6, tiny_policy_dir, 1.75)
    third = evaluate_run(run, pools, settings, engine_factory=engine_factory)
    assert (third.evaluated, third.skipped, len(made)) == ([6], [2, 4], 2)
    summary = [json.loads(t) for t in (run / "eval" / "summary.jsonl").read_text().splitlines()]
    assert [(s["step"], s["device_hours"]) for s in summary] == [(2, 0.5), (4, 1.0), (6, 1.75)]
    for line in summary:
        assert line["run"] == "r1"
        assert line["schedule"] == "thundersync"
        assert line["n_tasks"] == 1
        assert {"pass@1", "pass@2"} <= set(line)
        assert line["pools"]["terminal"]["n_tasks"] == 1
    step_rows = [
        json.loads(t) for t in (run / "eval" / "step-000004.jsonl").read_text().splitlines()
    ]
    assert [(r["task_id"], r["attempt"], r["step"]) for r in step_rows] == [
        ("count-lines", 0, 4), ("count-lines", 1, 4),
    ]  # fmt: skip


class RecordingEngine:
    """The transformers engine, keeping every request's sampled tokens and version."""

    def __init__(self, model_dir: Path, log: dict[str, list], label: str) -> None:
        self.inner = make_engine("hf", model_dir)
        self.log, self.label = log, label

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        self.inner.policy_version = version

    def generate(self, requests, sampling):
        results = self.inner.generate(requests, sampling)
        for result in results:
            self.log.setdefault(self.label, []).append(
                (result.request_id, result.token_ids, result.policy_version)
            )
        return results

    def load_weights(self, path: Path, version: int) -> None:
        self.inner.load_weights(path, version)

    def close(self) -> None:
        self.inner.close()


def test_one_engine_for_many_checkpoints_samples_what_fresh_engines_sample(
    tiny_policy_dir, tmp_path
):
    # Step 4 holds other weights than step 2: a reused engine that kept step 2's weights
    # (or its prefix cache) would sample step 2's tokens again.
    other = tmp_path / "other-policy"
    model = load_model(tiny_policy_dir)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.5)
    save_policy(model, load_tokenizer(tiny_policy_dir), other)
    pools = {"terminal": load_terminal_tasks(TASKS)[:2]}
    settings = EvalSettings(k=2, max_turns=2, max_tokens_per_turn=16)
    samples: dict[str, list] = {}
    for mode in ("reused", "fresh"):
        run = tmp_path / mode
        write_checkpoint(run, 2, tiny_policy_dir, 0.5)
        made: list[Path] = []

        def factory(model_dir: Path, made=made, mode=mode):
            made.append(model_dir)
            return RecordingEngine(model_dir, samples, f"{mode}/{model_dir.parent.name}")

        if mode == "fresh":  # one call per checkpoint, so an engine each
            evaluate_run(run, pools, settings, engine_factory=factory)
        write_checkpoint(run, 4, other, 1.0)
        evaluate_run(run, pools, settings, engine_factory=factory)
        assert len(made) == (1 if mode == "reused" else 2)
    tokens = {label: [(r, t) for r, t, _ in rows] for label, rows in samples.items()}
    fresh_2, fresh_4 = tokens["fresh/step-000002"], tokens["fresh/step-000004"]
    assert tokens["reused/step-000002"] == fresh_2 + fresh_4
    assert fresh_2 != fresh_4
    versions = {label: [v for _, _, v in rows] for label, rows in samples.items()}
    assert (
        versions["reused/step-000002"]
        == versions["fresh/step-000002"] + versions["fresh/step-000004"]
    )
    assert set(versions["fresh/step-000004"]) == {4}  # the checkpoint's policy_version
