"""The warm start: episodes in the agent's exact token format, the SFT loss, the CLI."""

from __future__ import annotations

import argparse
import inspect
import shutil
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from thundersync_core.cli import main
from thundersync_core.policy import build_model, build_tokenizer, load_tokenizer, save_policy
from thundersync_core.rollout.agent import Agent, AgentConfig, EpisodeSpec, format_observation
from thundersync_core.rollout.engine import GenerationRequest, GenerationResult, SamplingConfig
from thundersync_core.rollout.grading import GradeResult
from thundersync_core.rollout.sandbox.base import ExecResult, Sandbox, SandboxLimits
from thundersync_core.warmstart import cli as warmstart_cli
from thundersync_core.warmstart.examples import (
    SUBMIT_ACTION,
    AgentFormat,
    SolvedEpisode,
    action_text,
    solution_commands,
)
from thundersync_core.warmstart.sft import (
    STUDENT_STEPS,
    SFTConfig,
    _initial_policy,
    collate,
    example_tensors,
    sft_loss,
    shared_prefix_len,
    train_sft,
    warm_start,
)
from thundersync_core.warmstart.tasks import collect_tasks

FIXTURES = Path(__file__).parent.parent / "fixtures" / "tasks"
HEADER = "#!/bin/bash\n# Reference solution; runs in /app.\ncd /app || exit 1\nexport LC_ALL=C\n"


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(vocab_size=1024)


# -- solutions as agent commands ---------------------------------------------------------------


def test_solution_commands_drop_only_the_script_header():
    heredoc = "cat > s.sh <<'SH'\n#!/bin/bash\nexport LC_ALL=C\nsort \"$1\"\nSH"
    assert solution_commands(HEADER + "wc -l < a.txt > b.txt\n") == "wc -l < a.txt > b.txt"
    # Header-like lines inside a heredoc body are the script being written: kept verbatim.
    assert solution_commands(HEADER + heredoc + "\n") == heredoc
    assert solution_commands(HEADER + "sort a > b\n", keep_locale=True) == (
        "export LC_ALL=C\nsort a > b"
    )
    assert solution_commands("#!/bin/bash\necho hello > hello.txt\n") == "echo hello > hello.txt"


def test_action_text_refuses_a_command_the_agent_would_parse_differently():
    assert action_text("ls") == "```bash\nls\n```"
    with pytest.raises(ValueError, match="block parser"):
        action_text("cat <<'EOF'\n```\nEOF")


# -- the exact token format ----------------------------------------------------------------------


class _FakeSandbox(Sandbox):
    """Answers every command with a fixed result; nothing runs."""

    def __init__(self, result: ExecResult) -> None:
        self.result = result
        self.workdir, self.host_workdir, self.limits = "/app", Path("/nonexistent"), SandboxLimits()

    def exec(self, command, *, timeout_s=None, env=None, stdin=None) -> ExecResult:
        return self.result

    def write_file(self, relpath, data):
        raise NotImplementedError

    def read_file(self, relpath):
        raise NotImplementedError

    def copy_in(self, src, dest_rel="."):
        raise NotImplementedError

    def read_log(self, relpath):
        raise NotImplementedError

    def clear_logs(self, subdir):
        raise NotImplementedError

    def install_tests(self, src):
        raise NotImplementedError

    def begin_verification(self, *, fresh):
        raise NotImplementedError

    def close(self):
        pass


class _Task:
    task_id = "demo-0001"
    instruction = "How many lines does /app/a.txt have? Write only the number to /app/b.txt"

    def setup(self, sandbox: Sandbox) -> None:
        pass

    def grade(self, sandbox: Sandbox) -> GradeResult:
        return GradeResult(1.0, "scripted")


class _ReplayEngine:
    """Returns the given action ids turn after turn, as an engine would have sampled them."""

    policy_version = 0

    def __init__(self, actions: Sequence[Sequence[int]]) -> None:
        self.actions = [tuple(a) for a in actions]

    def generate(
        self, requests: Sequence[GenerationRequest], sampling: SamplingConfig
    ) -> list[GenerationResult]:
        out = []
        for request in requests:
            turn = int(request.request_id.rsplit("/", 1)[1])
            ids = self.actions[turn]
            out.append(GenerationResult(request.request_id, ids, (0.0,) * len(ids), "stop", 0))
        return out

    def load_weights(self, path, version):
        raise NotImplementedError

    def close(self):
        pass


@pytest.mark.parametrize("stdout", ["", "42\n", "line of output\n" * 200])
def test_episode_ids_equal_the_agent_loops_own(tokenizer, stdout):
    """The real Agent, fed the example's action ids, logs exactly the example's trajectory.

    The long output exceeds the observation budget, so truncation is covered too.
    """
    config = AgentConfig(max_turns=4, max_tokens_per_turn=64, observation_tokens=48)
    fmt = AgentFormat(tokenizer, config)
    result = ExecResult(0, stdout, "", False, None, 0.01, False, len(stdout), 0)
    task = _Task()
    solved = SolvedEpisode(
        task.task_id, "demo", task.instruction, "wc -l < a.txt > b.txt", format_observation(result)
    )
    example = fmt.episode(solved)
    actions = [s.ids for s in example.segments if s.kind == "action"]
    agent = Agent(_ReplayEngine(actions), tokenizer, lambda: _FakeSandbox(result), config=config)
    try:
        [logged] = agent.run([EpisodeSpec(task, group_id="g", trajectory_id="g/0")])
    finally:
        agent.close()
    assert logged.metadata["finish_reason"] == "submitted"
    assert logged.prompt_ids == example.prompt_ids
    assert logged.segments == example.segments


def test_loss_mask_covers_exactly_the_action_tokens(tokenizer):
    fmt = AgentFormat(tokenizer)
    solved = SolvedEpisode("t", "f", "Make the file.", "touch x.done", "exit code: 0")
    ids, scored = example_tensors(fmt.episode(solved))
    scored_text = tokenizer.decode([i for i, s in zip(ids, scored, strict=True) if s])
    assert scored_text == action_text("touch x.done") + "<|im_end|>" + SUBMIT_ACTION + "<|im_end|>"
    prompt = fmt.prompt_ids(solved.instruction)
    assert ids[: len(prompt)] == list(prompt)
    assert not any(scored[: len(prompt)])
    assert tokenizer.decode(ids[len(prompt) :]) == (
        "```bash\ntouch x.done\n```<|im_end|>\n<|im_start|>user\nexit code: 0<|im_end|>\n"
        "<|im_start|>assistant\n```bash\nsubmit\n```<|im_end|>"
    )


# -- the SFT loss and training -------------------------------------------------------------------


def _examples(tokenizer, n: int) -> list[tuple[list[int], list[bool]]]:
    fmt = AgentFormat(tokenizer)
    return [
        example_tensors(
            fmt.episode(
                SolvedEpisode(
                    f"t{i}", "f", f"Write line {i} to /app/f{i}.txt", f"echo {i} > f{i}.txt", ""
                )
            )
        )
        for i in range(n)
    ]


def test_shared_prefix_loss_equals_a_full_forward_of_every_row(tokenizer):
    """float64 with the wide norm: the prefix trick changes the order of sums only (1e-12)."""
    model = build_model("micro", seed=1, dtype=torch.float64)
    ids_BT, scored_BT = collate(_examples(tokenizer, 3), pad_id=0)
    assert shared_prefix_len(ids_BT, scored_BT) > 20  # the system prompt is shared
    loss = sft_loss(model, ids_BT, scored_BT)
    value = float(loss.detach())
    grads = torch.autograd.grad(loss, list(model.parameters()))
    logp_BTV = torch.log_softmax(model(input_ids=ids_BT).logits[:, :-1], -1)
    picked_BT = logp_BTV.gather(-1, ids_BT[:, 1:, None])[..., 0]
    reference = -picked_BT[scored_BT[:, 1:]].mean()
    ref_grads = torch.autograd.grad(reference, list(model.parameters()))
    assert value == pytest.approx(float(reference.detach()), rel=1e-12)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-9, atol=1e-12)


def test_eager_attention_gives_the_shared_prefix_loss_and_gradient_of_sdpa(tokenizer):
    """bf16 fine-tuning on CPU runs eager attention (faster there); in float64 its loss and
    gradients are SDPA's, prefix cache and right padding included, to float32 rounding
    (eager attention takes its softmax in float32)."""
    ids_BT, scored_BT = collate(_examples(tokenizer, 3), pad_id=0)
    results = {}
    for implementation in ("sdpa", "eager"):
        model = build_model("micro", seed=1, dtype=torch.float64)
        model.set_attn_implementation(implementation)
        loss = sft_loss(model, ids_BT, scored_BT)
        results[implementation] = (loss, torch.autograd.grad(loss, list(model.parameters())))
    (loss, grads), (eager_loss, eager_grads) = results["sdpa"], results["eager"]
    assert float(eager_loss) == pytest.approx(float(loss), rel=1e-6)
    for g, e in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(e, g, rtol=1e-5, atol=1e-7)


def test_bfloat16_fine_tuning_restores_the_models_attention(tokenizer):
    model = build_model("micro", seed=2)
    seen = []
    attention = model.model.layers[0].self_attn
    forward = attention.forward

    def spy(*args, **kwargs):
        seen.append(attention.config._attn_implementation)
        return forward(*args, **kwargs)

    attention.forward = spy
    config = SFTConfig(steps=2, batch_size=2, warmup_steps=1, compute_dtype="bfloat16")
    train_sft(model, _examples(tokenizer, 2), config, pad_id=0)
    assert seen
    assert set(seen) == {"eager"}
    assert model.config._attn_implementation == "sdpa"


def test_a_few_sft_steps_lower_the_loss(tokenizer):
    """The loss of a fixed batch halves: a random update would not move it that far down."""
    model = build_model("micro", seed=2)
    examples = _examples(tokenizer, 4)
    ids_BT, scored_BT = collate(examples, pad_id=0)
    with torch.no_grad():
        before = float(sft_loss(model, ids_BT, scored_BT))
    config = SFTConfig(steps=20, lr=3e-3, batch_size=4, warmup_steps=2, log_every=5)
    logged: list[str] = []
    losses = train_sft(model, examples, config, pad_id=0, log=logged.append)
    with torch.no_grad():
        after = float(sft_loss(model, ids_BT, scored_BT))
    assert len(losses) == 20
    assert len(logged) == 4
    assert losses[0] == pytest.approx(before, rel=1e-5)
    assert after < 0.5 * before


def test_bfloat16_compute_trains_float32_weights_to_the_float32_loss(tokenizer):
    """Autocast moves the products to bf16 only: weights stay float32 and the loss follows
    the float32 run's (a few percent apart after 20 steps, both far below the start)."""
    examples = _examples(tokenizer, 4)
    ids_BT, scored_BT = collate(examples, pad_id=0)
    finals = {}
    for dtype in ("float32", "bfloat16"):
        model = build_model("micro", seed=2)
        config = SFTConfig(steps=20, lr=3e-3, batch_size=4, warmup_steps=2, compute_dtype=dtype)
        losses = train_sft(model, examples, config, pad_id=0)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        with torch.no_grad():
            finals[dtype] = float(sft_loss(model, ids_BT, scored_BT))
        finals[f"{dtype}-first"] = losses[0]
    assert finals["bfloat16-first"] == pytest.approx(finals["float32-first"], rel=2e-2)
    assert finals["bfloat16"] < 0.5 * finals["bfloat16-first"]
    assert finals["bfloat16"] == pytest.approx(finals["float32"], rel=0.25)
    with pytest.raises(ValueError, match="compute_dtype"):
        SFTConfig(compute_dtype="float16")


def test_training_is_reproducible_from_the_seed(tokenizer):
    examples = _examples(tokenizer, 5)
    config = SFTConfig(steps=3, batch_size=2, warmup_steps=1)
    runs = [train_sft(build_model("micro", seed=0), examples, config, pad_id=0) for _ in "ab"]
    assert runs[0] == runs[1]


def test_a_teacher_takes_its_students_tokenizer(tmp_path):
    """OPD scores the student's token ids with the teacher: both must map text to the same ids."""
    student = tmp_path / "student"
    save_policy(build_model("micro"), build_tokenizer(vocab_size=1024), student)
    _, tokenizer = _initial_policy("micro", 5, None, student)
    assert tokenizer.get_vocab() == load_tokenizer(student).get_vocab()
    # Without a source the offline tokenizer is rebuilt, deterministically.
    _, rebuilt = _initial_policy("micro", 5, None, None)
    assert rebuilt.get_vocab() == tokenizer.get_vocab()
    wide = build_tokenizer(vocab_size=1024)
    wide.add_tokens([f"<extra{i}>" for i in range(200)])
    save_policy(build_model("micro"), wide, tmp_path / "wide")
    with pytest.raises(ValueError, match="more than the model's vocabulary"):
        _initial_policy("micro", 5, None, tmp_path / "wide")


# -- task sources and the CLI --------------------------------------------------------------------


def _linked_prep_table(tmp_path: Path) -> Path:
    """A prep ``terminal/train.parquet`` naming the fixture folders through a link."""
    prep = tmp_path / "prep"
    (prep / "terminal").mkdir(parents=True)
    (prep / "tasks").symlink_to(FIXTURES)
    table = pa.table({"path": ["tasks/write-hello", "tasks/count-lines"]})
    pq.write_table(table, prep / "terminal" / "train.parquet")
    return prep / "terminal" / "train.parquet"


def test_collect_tasks_reads_a_prep_parquet_and_filters_families(tmp_path):
    tasks = collect_tasks([_linked_prep_table(tmp_path)])
    assert [t.task_id for t in tasks] == ["count-lines", "write-hello"]
    assert [t.task_id for t in collect_tasks([FIXTURES], families=["write-hello"])] == [
        "write-hello"
    ]
    assert [t.task_id for t in collect_tasks([FIXTURES / "count-lines"])] == ["count-lines"]
    with pytest.raises(ValueError, match="--families"):
        collect_tasks([FIXTURES], families=["nope"])


def test_a_folder_counts_once_and_a_reused_id_is_another_task(tmp_path):
    # The table names the fixture folders through a link: the same two tasks.
    both = collect_tasks([_linked_prep_table(tmp_path), FIXTURES])
    assert [t.task_id for t in both] == ["count-lines", "write-hello"]
    # A warm-start pool's folder may carry a train task's id and still be another task.
    other = tmp_path / "warmstart" / "count-lines"
    shutil.copytree(FIXTURES / "count-lines", other)
    (other / "instruction.md").write_text("Count the lines of notes.txt into n.txt.\n")
    tasks = collect_tasks([FIXTURES, tmp_path / "warmstart"])
    assert [(t.task_id, t.root) for t in tasks] == [
        ("count-lines", FIXTURES / "count-lines"),
        ("count-lines", other),
        ("write-hello", FIXTURES / "write-hello"),
    ]


def test_cli_names_the_flag_of_a_bad_tasks_path(tmp_path, capsys):
    missing = tmp_path / "missing"
    assert main(["warm-start", "--tasks", str(missing), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"--tasks {missing}" in err
    assert not (tmp_path / "o").exists()


def test_cli_defaults_are_the_library_defaults():
    parser = argparse.ArgumentParser()
    warmstart_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["warm-start", "--tasks", "t", "--out", "o"])
    assert args.steps == STUDENT_STEPS
    assert args.lr == inspect.signature(warm_start).parameters["lr"].default


def test_cli_rejects_a_parquet_without_a_path_column(tmp_path, capsys):
    bad = tmp_path / "train.parquet"
    pq.write_table(pa.table({"task_id": ["x"]}), bad)
    assert main(["warm-start", "--tasks", str(bad), "--out", str(tmp_path / "o")]) == 2
    assert "'path' column" in capsys.readouterr().err
