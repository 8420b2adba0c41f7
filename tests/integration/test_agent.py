"""The bash agent loop with real sandboxes and graders on Harbor-format fixture tasks.

The policy is scripted here (a fixed reply per trajectory and turn, token-exact) so each
path of the loop is exercised on purpose: a solved task, a parse error, a submit, the turn
limit, a truncated observation. A second test runs the same loop on vLLM's samples.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from thundersync_core.batch import parse_batch_lines
from thundersync_core.metrics import episode_intervals
from thundersync_core.policy import load_tokenizer
from thundersync_core.rollout.agent import PARSE_ERROR, Agent, AgentConfig, EpisodeSpec
from thundersync_core.rollout.engine import GenerationRequest, GenerationResult, SamplingConfig
from thundersync_core.rollout.grading import GraderError
from thundersync_core.rollout.sandbox import SandboxLimits, open_sandbox
from thundersync_core.rollout.tasks import load_terminal_task, load_terminal_tasks

pytestmark = pytest.mark.integration
TASKS = Path(__file__).parent.parent / "fixtures" / "tasks"


class ScriptedPolicy:
    """Replies from a script keyed by (trajectory id, turn); exact token ids, version 3."""

    def __init__(self, tokenizer, script: dict[str, list[str]]) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.policy_version = 3
        self.calls: list[int] = []

    def generate(
        self, requests: Sequence[GenerationRequest], sampling: SamplingConfig
    ) -> list[GenerationResult]:
        self.calls.append(len(requests))
        results = []
        for request in requests:
            trajectory, turn = request.request_id.rsplit("/", 1)
            text = self.script[trajectory][int(turn)]
            ids = self.tokenizer.encode(text, add_special_tokens=False)[: request.max_tokens]
            if len(ids) < request.max_tokens:
                ids.append(self.tokenizer.convert_tokens_to_ids("<|im_end|>"))
            results.append(
                GenerationResult(request.request_id, tuple(ids), (0.0,) * len(ids), "stop", 3)
            )
        return results

    def load_weights(self, path, version):
        raise NotImplementedError

    def close(self):
        pass


def run_agent(engine, tokenizer, specs, loop="rounds", **config):
    limits = SandboxLimits(timeout_s=10)
    agent = Agent(
        engine,
        tokenizer,
        lambda: open_sandbox("local", limits=limits),
        config=AgentConfig(**config),
        loop=loop,
    )
    try:
        return agent.run(specs)
    finally:
        agent.close()


def test_agent_paths_with_real_sandbox_and_grader(tiny_policy_dir):
    tokenizer = load_tokenizer(tiny_policy_dir)
    hello = load_terminal_task(TASKS / "write-hello")
    count = load_terminal_task(TASKS / "count-lines")
    script = {
        "solve": ["Writing it.\n```bash\necho hello > hello.txt\n```", "```bash\nsubmit\n```"],
        "confused": ["I am not sure what to do.", "```bash\nls\n```", "```bash\nls -la\n```"],
        "count": ["```bash\nwc -l < data.txt > count.txt\n```", "```bash\nsubmit\n```"],
        "noisy": ["```bash\nseq 1 20000\n```", "```bash\nsubmit\n```"],
    }
    engine = ScriptedPolicy(tokenizer, script)
    specs = [
        EpisodeSpec(hello, "hello", "solve"),
        EpisodeSpec(hello, "hello", "confused"),
        EpisodeSpec(count, "count", "count"),
        EpisodeSpec(count, "count", "noisy"),
    ]
    out = {
        t.trajectory_id: t
        for t in run_agent(engine, tokenizer, specs, max_turns=3, observation_tokens=64)
    }
    assert engine.calls[0] == 4  # every live trajectory's turn went out in one batched call
    assert out["solve"].reward == 1.0
    assert out["count"].reward == 1.0
    assert out["confused"].reward == 0.0
    assert out["noisy"].reward == 0.0
    assert out["solve"].metadata["finish_reason"] == "submitted"
    assert out["confused"].metadata["finish_reason"] == "max_turns"
    # Parse error observation on the turn without a block.
    confused = out["confused"]
    first_obs = tokenizer.decode(list(confused.segments[1].ids))
    assert PARSE_ERROR in first_obs
    # Exact tokens: action segments are the engine's ids, observations are never scored.
    solve = out["solve"]
    assert solve.segments[0].kind == "action"
    assert all(s.scored == (False,) * len(s.ids) for s in solve.segments if s.kind == "observation")
    assert solve.metadata["turn_versions"] == [3, 3]
    assert solve.policy_version == 3
    events = [e["event"] for e in solve.metadata["events"]]
    assert events[:5] == ["setup_start", "start", "generate_start", "generate_end", "exec_start"]
    assert events[-2:] == ["reward", "closed"]
    # A long output is cut to the budget around an elision marker, keeping head and tail.
    noisy_obs = out["noisy"].segments[1]
    assert len(noisy_obs.ids) <= 64 + 30  # budget plus the chat glue
    text = tokenizer.decode(list(noisy_obs.ids))
    assert "elided" in text
    assert "exit code: 0" in text
    assert "20000" in text


class _Failing:
    """A terminal task whose grader or setup raises, as a broken verifier image would."""

    def __init__(self, task, where: str) -> None:
        self.task, self.where = task, where
        self.task_id, self.instruction = task.task_id, task.instruction

    def setup(self, sandbox):
        if self.where == "setup":
            raise OSError("no space left on device")
        self.task.setup(sandbox)

    def grade(self, sandbox):
        raise ValueError("the verifier crashed")


def sandbox_folders() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("thundersync-sandbox-*"))


@pytest.mark.parametrize(
    ("where", "error", "match"),
    [
        ("grade", GraderError, r"trajectory t\d of task write-hello failed: ValueError"),
        ("setup", OSError, "no space left"),
    ],
)
def test_a_failing_grader_or_setup_stops_naming_it_and_leaves_no_sandbox(
    tiny_policy_dir, where, error, match
):
    tokenizer = load_tokenizer(tiny_policy_dir)
    task = _Failing(load_terminal_task(TASKS / "write-hello"), where)
    engine = ScriptedPolicy(tokenizer, {f"t{i}": ["```bash\nsubmit\n```"] for i in range(3)})
    before = sandbox_folders()
    with pytest.raises(error, match=match):
        run_agent(engine, tokenizer, [EpisodeSpec(task, "g", f"t{i}") for i in range(3)])
    assert sandbox_folders() == before


def test_a_command_that_hangs_is_killed_at_its_timeout_and_the_episode_goes_on(tiny_policy_dir):
    tokenizer = load_tokenizer(tiny_policy_dir)
    hello = load_terminal_task(TASKS / "write-hello")
    # A busy loop with a sleeper left behind: the whole tree must die at the timeout.
    hang = "```bash\nsleep 600 & while :; do :; done\n```"
    script = {"hang": [hang, "```bash\necho hello > hello.txt\n```", "```bash\nsubmit\n```"]}
    started = time.monotonic()
    [traj] = run_agent(
        ScriptedPolicy(tokenizer, script),
        tokenizer,
        [EpisodeSpec(hello, "g", "hang")],
        command_timeout_s=2,
    )
    assert time.monotonic() - started < 60
    observations = [tokenizer.decode(list(s.ids)) for s in traj.segments if s.kind == "observation"]
    assert "killed: timeout" in observations[0]
    assert traj.reward == 1.0  # the episode went on, and the later fix was graded


def test_limits_end_trajectories_with_reasons(tiny_policy_dir):
    tokenizer = load_tokenizer(tiny_policy_dir)
    hello = load_terminal_task(TASKS / "write-hello")
    long_reply = "```bash\n" + "echo " + "a" * 400 + "\n```"
    engine = ScriptedPolicy(tokenizer, {"t": [long_reply] * 5, "c": [long_reply] * 5})
    by_total = run_agent(
        engine,
        tokenizer,
        [EpisodeSpec(hello, "g", "t")],
        max_tokens_per_turn=40,
        max_total_tokens=100,
        max_turns=10,
    )
    assert by_total[0].metadata["finish_reason"] == "max_total_tokens"
    assert sum(len(s.ids) for s in by_total[0].segments if s.kind == "action") <= 100
    by_context = run_agent(
        engine,
        tokenizer,
        [EpisodeSpec(hello, "g", "c")],
        max_tokens_per_turn=40,
        max_context_tokens=260,
        max_turns=10,
    )
    traj = by_context[0]
    assert traj.metadata["finish_reason"] == "context_length"
    assert len(traj.prompt_ids) + sum(len(s.ids) for s in traj.segments) <= 260


def test_agent_on_vllm_samples(vllm_engine, tiny_policy_dir):
    tokenizer = load_tokenizer(tiny_policy_dir)
    tasks = load_terminal_tasks(TASKS)
    specs = [EpisodeSpec(t, t.task_id, f"{t.task_id}/{i}") for t in tasks for i in range(3)]
    trajectories = run_agent(vllm_engine, tokenizer, specs, max_turns=2, max_tokens_per_turn=24)
    assert len(trajectories) == 6
    for traj in trajectories:
        actions = [s for s in traj.segments if s.kind == "action"]
        assert actions
        assert traj.metadata["turn_versions"] == [vllm_engine.policy_version] * len(actions)
        assert [len(lp) for lp in traj.metadata["action_logprobs"]] == [len(a.ids) for a in actions]
        assert traj.metadata["finish_reason"] in {"submitted", "max_turns"}
        assert traj.reward in (0.0, 1.0)


def test_rollout_command_writes_a_learner_ready_batch(tiny_policy_dir, tmp_path):
    out = tmp_path / "rollouts.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "thundersync_core.cli", "rollout", "--tasks", str(TASKS),
         "--model", str(tiny_policy_dir), "--n", "2", "--engine", "hf", "--max-turns", "2",
         "--max-tokens-per-turn", "16", "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["trajectories"] == 4
    batch = parse_batch_lines(out.read_text().splitlines())
    assert {t.group_id for t in batch} == {"count-lines", "write-hello"}


def test_episodes_under_way_show_their_events_so_far(tiny_policy_dir):
    # A step that closes while later episodes run (the pipeline) names their time from this.
    tokenizer = load_tokenizer(tiny_policy_dir)
    hello = load_terminal_task(TASKS / "write-hello")
    script = {
        "a": ["```bash\necho hello > hello.txt\n```", "```bash\nsubmit\n```"],
        "b": ["```bash\nls\n```", "```bash\nsubmit\n```"],
    }
    engine = ScriptedPolicy(tokenizer, script)
    seen: list[tuple[float, list[list[dict]]]] = []
    agent = Agent(
        engine,
        tokenizer,
        lambda: open_sandbox("local", limits=SandboxLimits(timeout_s=10)),
        config=AgentConfig(max_turns=2),
    )
    generate = engine.generate

    def watched(requests, sampling):
        seen.append((time.time(), agent.in_flight_events()))
        return generate(requests, sampling)

    engine.generate = watched
    try:
        specs = [EpisodeSpec(hello, "g", "a"), EpisodeSpec(hello, "g", "b")]
        done = [t for t in agent.stream(specs) if hasattr(t, "reward")]
        assert agent.in_flight_events() == []  # every episode handed out
    finally:
        agent.close()
    assert len(done) == 2
    # Second round: both episodes set up, the first command run, the second call open.
    now, in_flight = seen[1]
    assert len(in_flight) == 2
    for events in in_flight:
        kinds = [e["event"] for e in events]
        assert kinds == ["setup_start", "start", "generate_start", "generate_end", "exec_start",
                         "exec_end", "generate_start"]  # fmt: skip
        parts = episode_intervals(events, open_until=now + 1.0)
        assert parts["generation"][-1] == (events[-1]["time"], now + 1.0)  # open until then
        assert len(episode_intervals(events)["generation"]) == 1  # without it: left out
        assert len(parts["sandbox"]) == 2  # set-up and the command
