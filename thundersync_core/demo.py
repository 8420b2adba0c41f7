"""The embedded demo: real GRPO steps of the tiny policy with the streaming learner.

What runs, all on CPU and offline:
1. A tiny Qwen3-style policy and its byte-level BPE tokenizer are created and saved in
   Hugging Face format.
2. Each step samples a group of completions per task prompt from the policy
   (transformers generation), grades each against the task's reference command with a
   character-similarity reward in [0, 1], submits the trajectories to the streaming GRPO
   learner in a shuffled arrival order, and takes one exact optimizer step.
3. The first batch is logged and replayed through the sync and the streaming learner in
   float64 (the ``thundersync replay`` audit); their gradients must agree.
4. On-policy distillation audit: the trained policy becomes a frozen teacher that scores
   the first batch (the initial policy's own samples) turn by turn on its worker thread;
   the OPD batch is replayed through the sync and the streaming OPD learners.

Simplification: the reward compares text instead of executing the command in a sandbox,
which keeps the demo to seconds on two cores; the grader is a plain function of the output.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import random
import time
from pathlib import Path

import torch

from thundersync_core.batch import Segment, Trajectory, trajectory_to_json, turns_of
from thundersync_core.policy import build_model, build_tokenizer, parameter_count, save_policy
from thundersync_core.replay import Schedule, compare_gradients, replay
from thundersync_core.streaming import StreamingGRPOLearner, groups_of
from thundersync_core.teacher import Teacher, TeacherWorker

TASKS = [
    ("Print the word hello.", "echo hello"),
    ("List all files, including hidden ones.", "ls -la"),
    ("Count the lines of data.csv.", "wc -l data.csv"),
    ("Run the test suite quietly.", "python -m pytest -q"),
    ("Show the first 20 lines of main.py.", "head -n 20 main.py"),
    ("Find every Python file below this directory.", "find . -name '*.py'"),
]


def similarity_reward(completion: str, reference: str) -> float:
    """Character-level similarity of the first line of the answer to the reference."""
    answer = completion.strip().strip("`").removeprefix("bash").strip().split("\n")[0]
    return difflib.SequenceMatcher(None, answer, reference).ratio()


def sample_batch(
    model, tokenizer, step: int, *, groups: int, group_size: int, max_new: int
) -> list[Trajectory]:
    rng = random.Random(step)
    batch = []
    for g, (instruction, reference) in enumerate(rng.sample(TASKS, groups)):
        prompt_ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": instruction}], add_generation_prompt=True
        )
        prompt_ids = list(prompt_ids["input_ids"] if hasattr(prompt_ids, "keys") else prompt_ids)
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt_ids]),
                do_sample=True,
                top_k=0,
                max_new_tokens=max_new,
                num_return_sequences=group_size,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        for i, sampled in enumerate(out[:, len(prompt_ids) :].tolist()):
            end = (
                sampled.index(tokenizer.eos_token_id) + 1
                if tokenizer.eos_token_id in sampled
                else None
            )
            row = sampled[:end]
            reward = similarity_reward(tokenizer.decode(row, skip_special_tokens=True), reference)
            batch.append(
                Trajectory(
                    group_id=f"s{step}-g{g}",
                    trajectory_id=f"s{step}-g{g}-{i}",
                    prompt_ids=tuple(prompt_ids),
                    segments=(Segment.action(row),),
                    reward=reward,
                    policy_version=step,
                )
            )
    return batch


def run_demo(out: Path, *, steps: int = 4, groups: int = 4, group_size: int = 6) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = build_model("tiny", seed=0)
    tokenizer = build_tokenizer(vocab_size=model.config.vocab_size)
    save_policy(model, tokenizer, out / "policy")
    print(
        f"[policy] tiny Qwen3-style, {parameter_count(model) / 1e6:.2f} M parameters, "
        f"tokenizer {len(tokenizer)} tokens -> {out / 'policy'}"
    )

    learner = StreamingGRPOLearner(model, max_open_groups=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    history = []
    for step in range(steps):
        t0 = time.perf_counter()
        batch = sample_batch(
            model, tokenizer, step, groups=groups, group_size=group_size, max_new=24
        )
        rollout_s = time.perf_counter() - t0
        if step == 0:
            batch0 = batch
            (out / "batch-0000.jsonl").write_text(
                "".join(trajectory_to_json(t) + "\n" for t in batch)
            )
        t0 = time.perf_counter()
        learner.begin_batch(groups_of(batch))
        for traj in random.Random(step).sample(batch, len(batch)):
            learner.submit(traj)
        result = learner.step(optimizer)
        learn_s = time.perf_counter() - t0
        mean_reward = sum(t.reward for t in batch) / len(batch)
        history.append({"step": step, "mean_reward": mean_reward, "objective": result.objective})
        print(
            f"[step {step}] {len(batch)} trajectories in {groups} groups, mean reward "
            f"{mean_reward:.3f}, J {result.objective:+.4f}, rollout {rollout_s:.1f}s, "
            f"learner {learn_s:.2f}s, prompt replays {result.counters['prefix_replays']}"
        )

    grpo_rel = _audit(out, "grpo", out / "batch-0000.jsonl")
    _score_with_teacher(model, batch0, out / "batch-opd-0000.jsonl")
    opd_rel = _audit(out, "opd", out / "batch-opd-0000.jsonl")
    report = {
        "steps": history,
        "audit_rel_diff_fp64": {"grpo": grpo_rel, "opd": opd_rel},
        "out": str(out),
    }
    (out / "demo.json").write_text(json.dumps(report, indent=2) + "\n")
    for name, rel in [("GRPO", grpo_rel), ("OPD", opd_rel)]:
        if rel > 1e-10:
            raise RuntimeError(f"{name}: streamed and sync gradients differ by {rel:.2e}")
    return report


def _audit(out: Path, objective: str, batch_path: Path) -> float:
    """Replay one logged batch under sync and stream in float64; return their difference."""
    objectives = {}
    schedules: list[tuple[Schedule, int]] = [("sync", 0), ("stream", 1)]
    for schedule, seed in schedules:
        summary = replay(
            model_dir=out / "policy",
            batch_path=batch_path,
            out_dir=out / f"replay-{objective}-{schedule}",
            objective=objective,
            schedule=schedule,
            dtype="float64",
            seed=seed,
        )
        objectives[schedule] = summary["objective"]
    rel = compare_gradients(
        out / f"replay-{objective}-sync" / "gradient.safetensors",
        out / f"replay-{objective}-stream" / "gradient.safetensors",
    )
    print(
        f"[audit {objective}] replay of {batch_path.name} in float64: sync objective "
        f"{objectives['sync']:+.6f}, stream {objectives['stream']:+.6f}, "
        f"max|grad diff|/max|grad| = {rel:.2e}"
    )
    return rel


def _score_with_teacher(teacher_model, batch: list[Trajectory], path: Path) -> None:
    """Teacher log-probs for every action turn, scored on the teacher's worker thread."""
    with TeacherWorker(Teacher(teacher_model)) as worker:
        futures = {
            t.trajectory_id: [worker.submit(turn) for turn in turns_of(t, [()] * len(t.segments))]
            for t in batch
        }
        scored = [
            dataclasses.replace(
                t, teacher_logprobs=tuple(q for f in futures[t.trajectory_id] for q in f.result())
            )
            for t in batch
        ]
    path.write_text("".join(trajectory_to_json(t) + "\n" for t in scored))
    print(
        f"[teacher] scored {sum(t.n_scored_tokens for t in scored)} tokens of "
        f"{len(scored)} trajectories -> {path.name}"
    )
