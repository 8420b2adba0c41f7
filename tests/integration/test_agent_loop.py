"""The overlapped agent loop (``rollout.agent_loop: overlapped``) against the rounds loop.

Real sandboxes and graders on the fixture tasks; the policy is scripted per (trajectory,
turn), so both loops must produce the same trajectories token for token, the same turns
(with the same ``last`` flags) and rewards: only when things happen may differ. What the
overlapped loop is for is checked on the episodes' own event times: an episode's next
generation starts while another's command is still running, which the rounds loop never
does (its next round waits for every command of the round).
"""

from __future__ import annotations

import time

import pytest

from tests.integration.test_agent import (
    TASKS,
    ScriptedPolicy,
    _Failing,
    run_agent,
    sandbox_folders,
)
from thundersync_core.policy import load_tokenizer
from thundersync_core.rollout.agent import Agent, AgentConfig, EpisodeSpec, TurnReady
from thundersync_core.rollout.engine import GenerationRequest, SamplingConfig
from thundersync_core.rollout.grading import GraderError
from thundersync_core.rollout.sandbox import SandboxLimits, open_sandbox
from thundersync_core.rollout.tasks import load_terminal_task

pytestmark = pytest.mark.integration
LOOPS = ["rounds", "overlapped"]

#: A slow command in one episode, quick ones in the others.
SCRIPT = {
    "slow": ["```bash\nsleep 1.5; echo hello > hello.txt\n```", "```bash\nsubmit\n```"],
    "quick": ["```bash\necho hi\n```", "```bash\necho hello > hello.txt\n```", "```bash\nls\n```"],
    "wrong": ["```bash\necho bye > hello.txt\n```", "```bash\nsubmit\n```"],
    "count": [
        "```bash\nwc -l < data.txt > count.txt\n```",
        "no block here",
        "```bash\nsubmit\n```",
    ],
}


class TimedPolicy(ScriptedPolicy):
    """The scripted policy taking 0.1 s a call, as an engine's generation does."""

    def generate(self, requests, sampling):
        time.sleep(0.1)
        return super().generate(requests, sampling)


def specs() -> list[EpisodeSpec]:
    hello = load_terminal_task(TASKS / "write-hello")
    count = load_terminal_task(TASKS / "count-lines")
    return [
        EpisodeSpec(hello, "hello", "slow"),
        EpisodeSpec(hello, "hello", "quick"),
        EpisodeSpec(hello, "hello", "wrong"),
        EpisodeSpec(count, "count", "count"),
    ]


def make_agent(engine, tokenizer, loop: str = "overlapped", **config) -> Agent:
    return Agent(
        engine,
        tokenizer,
        lambda: open_sandbox("local", limits=SandboxLimits(timeout_s=10)),
        config=AgentConfig(**config),
        loop=loop,
    )


def stream(tokenizer, loop: str, **kwargs):
    engine = TimedPolicy(tokenizer, SCRIPT)
    agent = make_agent(engine, tokenizer, loop, max_turns=3)
    try:
        events = list(agent.stream(specs(), **kwargs))
    finally:
        agent.close()
    return events, engine


def intervals(trajectory, start: str, end: str) -> list[tuple[float, float]]:
    events = trajectory.metadata["events"]
    opened = [e["time"] for e in events if e["event"] == start]
    closed = [e["time"] for e in events if e["event"] == end]
    return list(zip(opened, closed, strict=True))


def generation_during_a_command(trajectories) -> int:
    """How many generations of one episode began while another episode's command ran."""
    runs = {t.trajectory_id: intervals(t, "exec_start", "exec_end") for t in trajectories}
    count = 0
    for traj in trajectories:
        for begin, _ in intervals(traj, "generate_start", "generate_end"):
            count += any(
                a < begin < b
                for other, spans in runs.items()
                if other != traj.trajectory_id
                for a, b in spans
            )
    return count


@pytest.fixture(scope="module")
def both(tiny_policy_dir):
    tokenizer = load_tokenizer(tiny_policy_dir)
    return {loop: stream(tokenizer, loop) for loop in LOOPS}, tokenizer


def test_both_loops_make_the_same_trajectories_and_turns(both):
    runs, _ = both
    made = {}
    for loop, (events, _) in runs.items():
        trajectories = {e.trajectory_id: e for e in events if not isinstance(e, TurnReady)}
        turns = sorted(
            (e.turn.trajectory_id, e.turn.index, e.turn.segments, e.turn.last)
            for e in events
            if isinstance(e, TurnReady)
        )
        made[loop] = (trajectories, turns)
    rounds, overlapped = made["rounds"], made["overlapped"]
    assert rounds[0].keys() == overlapped[0].keys() == set(SCRIPT)
    for key, one in rounds[0].items():
        two = overlapped[0][key]
        assert (one.segments, one.reward, one.metadata["finish_reason"]) == (
            two.segments,
            two.reward,
            two.metadata["finish_reason"],
        ), key
    assert rounds[1] == overlapped[1]
    # Every episode's turns, the last one flagged once.
    assert sum(last for *_, last in overlapped[1]) == len(SCRIPT)
    # count, quick, slow, wrong
    assert [t.reward for _, t in sorted(overlapped[0].items())] == [1.0, 1.0, 1.0, 0.0]
    assert overlapped[0]["quick"].metadata["finish_reason"] == "max_turns"


def test_only_the_overlapped_loop_generates_while_a_command_runs(both):
    runs, _ = both
    trajectories = {
        loop: [e for e in events if not isinstance(e, TurnReady)]
        for loop, (events, _) in runs.items()
    }
    assert generation_during_a_command(trajectories["rounds"]) == 0
    # The quick episodes take their next turns while "slow" sleeps.
    assert generation_during_a_command(trajectories["overlapped"]) >= 2
    slow = next(t for t in trajectories["overlapped"] if t.trajectory_id == "slow")
    [(_, slept)] = intervals(slow, "exec_start", "exec_end")[:1]
    quick = next(t for t in trajectories["overlapped"] if t.trajectory_id == "quick")
    assert intervals(quick, "generate_start", "generate_end")[1][0] < slept


def live_span(trajectory) -> tuple[float, float]:
    """From the episode's set-up to its last action's end (a command's, or the reply's when
    it ended without one): the loop admits another episode only after that."""
    events = trajectory.metadata["events"]
    ends = [e["time"] for e in events if e["event"] in ("exec_end", "generate_end")]
    return events[0]["time"], max(ends)


def test_the_overlapped_loop_keeps_the_live_bound(tiny_policy_dir):
    tokenizer = load_tokenizer(tiny_policy_dir)
    events, engine = stream(tokenizer, "overlapped", max_live=2)
    done = [e for e in events if not isinstance(e, TurnReady)]
    assert len(done) == 4
    spans = [live_span(t) for t in done]
    for start, _ in spans:
        assert sum(a <= start < b for a, b in spans) <= 2
    assert all(n <= 2 for n in engine.calls)


@pytest.mark.parametrize(
    ("where", "error", "match"),
    [
        ("grade", GraderError, r"trajectory t\d of task write-hello failed: ValueError"),
        ("setup", OSError, "no space left"),
    ],
)
def test_overlapped_failures_name_the_task_and_leave_no_sandbox(
    tiny_policy_dir, where, error, match
):
    tokenizer = load_tokenizer(tiny_policy_dir)
    task = _Failing(load_terminal_task(TASKS / "write-hello"), where)
    script = {f"t{i}": ["```bash\nsleep 0.3\n```", "```bash\nsubmit\n```"] for i in range(4)}
    before = sandbox_folders()
    with pytest.raises(error, match=match):
        run_agent(
            ScriptedPolicy(tokenizer, script),
            tokenizer,
            [EpisodeSpec(task, "g", f"t{i}") for i in range(4)],
            loop="overlapped",
        )
    time.sleep(0.5)  # a set-up under way when the stream stopped closes its own sandbox
    assert sandbox_folders() == before


def test_an_episode_ended_before_its_first_action_is_still_graded(tiny_policy_dir):
    tokenizer = load_tokenizer(tiny_policy_dir)
    hello = load_terminal_task(TASKS / "write-hello")
    [traj] = run_agent(
        ScriptedPolicy(tokenizer, {"t": ["```bash\nls\n```"]}),
        tokenizer,
        [EpisodeSpec(hello, "g", "t")],
        loop="overlapped",
        max_context_tokens=8,  # shorter than the prompt
    )
    assert traj.metadata["finish_reason"] == "context_length"
    assert traj.segments == ()
    assert traj.reward == 0.0


def vllm_specs() -> list[EpisodeSpec]:
    hello = load_terminal_task(TASKS / "write-hello")
    count = load_terminal_task(TASKS / "count-lines")
    return [EpisodeSpec(t, t.task_id, f"{t.task_id}/{i}") for t in (hello, count) for i in range(4)]


def test_overlapped_loop_on_vllm_adds_requests_to_the_running_batch(vllm_engine, tiny_policy_dir):
    """vLLM takes each request into its running batch (``submit``, ``collect`` a step at a
    time). Weights may change only with no request in the engine: ``before_round`` runs
    only then, and while a swap is pending (here: always) no request is added until the
    engine has drained."""
    tokenizer = load_tokenizer(tiny_policy_dir)
    engine = vllm_engine
    collect, steps = engine.collect, []

    def counted():
        steps.append(engine.unfinished)
        return collect()

    swaps: list[int] = []
    agent = make_agent(engine, tokenizer, max_turns=2, max_tokens_per_turn=24)
    engine.collect = counted
    try:
        events = list(
            agent.stream(
                vllm_specs(),
                before_round=lambda: swaps.append(engine.unfinished),
                swap_pending=lambda: True,
            )
        )
    finally:
        del engine.collect
        agent.close()
    trajectories = [e for e in events if not isinstance(e, TurnReady)]
    assert sorted(t.trajectory_id for t in trajectories) == sorted(
        s.trajectory_id for s in vllm_specs()
    )
    for traj in trajectories:
        actions = [s for s in traj.segments if s.kind == "action"]
        assert actions
        assert traj.metadata["turn_versions"] == [engine.policy_version] * len(actions)
        assert [len(lp) for lp in traj.metadata["action_logprobs"]] == [len(a.ids) for a in actions]
        assert traj.metadata["finish_reason"] in {"submitted", "max_turns"}
        assert traj.reward in (0.0, 1.0)
    assert steps  # the engine was stepped, not called
    assert swaps
    assert set(swaps) == {0}
    assert engine.unfinished == 0


def test_a_stream_left_early_leaves_no_request_in_the_engine(vllm_engine, tiny_policy_dir):
    tokenizer = load_tokenizer(tiny_policy_dir)
    agent = make_agent(vllm_engine, tokenizer, max_turns=2, max_tokens_per_turn=24)
    before = sandbox_folders()
    try:
        stream = agent.stream(vllm_specs())
        first = next(stream)  # a turn: the others' requests are still in the engine
        assert isinstance(first, TurnReady)
        stream.close()
    finally:
        agent.close()
    assert vllm_engine.unfinished == 0
    request = GenerationRequest("after", (5, 6, 7), 4, 1)
    [result] = vllm_engine.generate([request], SamplingConfig(stop_token_ids=()))
    assert len(result.token_ids) == 4
    time.sleep(0.5)
    assert sandbox_folders() == before
