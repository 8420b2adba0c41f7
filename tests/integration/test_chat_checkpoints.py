"""Hugging Face chat checkpoints in real families' formats, end to end through vLLM CPU.

A tiny Qwen3-format and a tiny Llama-3-format checkpoint (tokenizers trained offline, chat
templates in those formats, stop tokens in generation_config.json) are taught the two
fixture tasks in their native tool-call syntax by the warm start, then roll out with vLLM:
the agent offers the ``bash`` and ``submit`` tools through the template, parses the calls
the model writes, runs the commands in the sandbox, sends observations back as tool
messages, and the grader scores each episode.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import train_config_file
from thundersync_core.batch import read_batch
from thundersync_core.config import RolloutConfig, load_config
from thundersync_core.policy.chat_formats import build_chat_checkpoint
from thundersync_core.policy.io import load_tokenizer
from thundersync_core.rollout.agent import Agent, AgentConfig, EpisodeSpec
from thundersync_core.rollout.chat import TemplateMismatch, chat_format, sampling_config
from thundersync_core.rollout.sandbox import SandboxLimits, open_sandbox
from thundersync_core.rollout.tasks import load_terminal_tasks
from thundersync_core.rollout.vllm_engine import VLLMEngine, vllm_available
from thundersync_core.train import train
from thundersync_core.warmstart import warm_start

pytestmark = pytest.mark.integration
FIXTURE_TASKS = Path(__file__).parent.parent / "fixtures" / "tasks"
CASES = {
    "qwen3": ({"action_format": "tool_calls", "enable_thinking": False}, "<tool_call>"),
    "llama3": ({"action_format": "tool_calls"}, '"parameters"'),
}


@pytest.fixture(scope="module")
def taught(tmp_path_factory) -> dict[str, Path]:
    """Per format, the tiny checkpoint taught the two fixture tasks in its tool-call syntax."""
    root = tmp_path_factory.mktemp("chat-policies")
    out = {}
    for fmt, (options, _) in CASES.items():
        base = build_chat_checkpoint(root / f"{fmt}-base", fmt, preset="micro", seed=1)
        summary = warm_start(
            [FIXTURE_TASKS],
            root / fmt,
            init_from=base,
            chat=options,
            steps=120,
            lr=3e-3,
            batch_size=2,
            log=lambda _: None,
        )
        assert summary["examples"] == 2
        out[fmt] = root / fmt
    return out


# The Qwen3 format's episodes run inside the training stage below (one engine start less).
@pytest.mark.parametrize("fmt", ["llama3"])
def test_native_tool_call_episodes_run_in_the_sandbox_and_are_graded(fmt, taught):
    if not vllm_available():
        pytest.skip("vLLM is not installed")
    options, call_marker = CASES[fmt]
    policy = taught[fmt]
    tokenizer = load_tokenizer(policy)
    rollout = RolloutConfig(**options, temperature=0.7, top_p=0.95)  # type: ignore[arg-type]
    chat = chat_format(tokenizer, policy, rollout)  # the start-up check passes
    engine = VLLMEngine(policy, max_model_len=1024)
    limits = SandboxLimits(timeout_s=10.0)
    agent = Agent(
        engine,
        tokenizer,  # type: ignore[arg-type]
        lambda: open_sandbox("local", limits=limits),
        config=AgentConfig(max_turns=3, max_tokens_per_turn=64, max_total_tokens=192),
        sampling=sampling_config(rollout, chat.stop_token_ids),
        chat=chat,
    )
    tasks = load_terminal_tasks(FIXTURE_TASKS)
    specs = [EpisodeSpec(t, t.task_id, f"{t.task_id}/{i}") for t in tasks for i in range(4)]
    try:
        trajectories = agent.run(specs)
    finally:
        agent.close()
        engine.close()
    assert len(trajectories) == 8
    first_replies = [
        tokenizer.decode(list(t.segments[0].ids), skip_special_tokens=True)  # type: ignore[attr-defined]
        for t in trajectories
    ]
    assert all(call_marker in reply for reply in first_replies), first_replies
    ran = [t for t in trajectories if any(e["event"] == "exec_start" for e in t.metadata["events"])]
    solved = [t for t in trajectories if t.reward == 1.0]
    assert ran, "no tool call was run in the sandbox"
    assert solved, [t.metadata["reward_reason"] for t in trajectories]
    assert all(t.metadata["reward_reason"] for t in trajectories)  # every episode graded
    assert {t.metadata["finish_reason"] for t in solved} == {"submitted"}
    # Observations went back as tool messages: Qwen's tool response, Llama's ipython turn.
    glue = tokenizer.decode(list(solved[0].segments[1].ids), skip_special_tokens=False)  # type: ignore[attr-defined]
    assert ("<tool_response>" if fmt == "qwen3" else "ipython") in glue


def test_a_checkpoint_folder_is_all_the_training_stage_needs(taught, tiny_prep_dir, tmp_path):
    """``policy.path`` = the Qwen3-format folder, tool calls, vLLM: two thundersync steps
    train, the checkpoints keep the template and stop tokens; the same folder with fenced
    bash blocks is refused at start, the first differing token named."""
    if not vllm_available():
        pytest.skip("vLLM is not installed")
    policy = taught["qwen3"]
    config = train_config_file(
        tmp_path,
        tiny_prep_dir,
        policy,
        schedule="thundersync",
        steps=2,
        rollout__engine="vllm",
        rollout__action_format="tool_calls",
        rollout__enable_thinking=False,
        rollout__max_model_len=1024,
    )
    out = tmp_path / "run"
    assert train(load_config(config), out)["status"] == "finished"
    batch = read_batch(next(iter(sorted((out / "batches").glob("*.jsonl")))))
    tokenizer = load_tokenizer(policy)
    replies = [tokenizer.decode(list(t.segments[0].ids)) for t in batch]  # type: ignore[attr-defined]
    assert sum("<tool_call>" in r for r in replies) >= len(replies) // 2
    # Calls ran in the sandbox, came back as tool responses, and were graded.
    assert any(
        "<tool_response>" in tokenizer.decode(list(t.segments[1].ids))  # type: ignore[attr-defined]
        for t in batch
        if len(t.segments) > 1
    )
    assert any(t.reward == 1.0 for t in batch)
    model = out / "checkpoints" / "step-000002" / "model"
    assert (model / "chat_template.jinja").read_text() == (
        policy / "chat_template.jinja"
    ).read_text()
    generation = json.loads((model / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 0]

    refused = train_config_file(
        tmp_path, tiny_prep_dir, policy, rollout__engine="vllm", rollout__enable_thinking=False
    )
    with pytest.raises(TemplateMismatch, match=r"differ at token \d+"):
        train(load_config(refused), tmp_path / "refused")
