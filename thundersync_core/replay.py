"""Replay a logged batch through a learner and write the gradient: the exactness audit.

``thundersync replay`` reads a batch file (see ``batch.py``), runs it through the sync or
the streaming learner of the objective (stream: sources in a random arrival order drawn
from ``seed``; for OPD, turns interleaved across trajectories, each trajectory's in order),
and writes ``gradient.safetensors`` (the objective's gradient per trainable parameter:
grad J for GRPO, grad L for OPD, before clipping and before any optimizer) and
``summary.json``. Two replays of one batch under different schedules
must agree to rounding; ``compare_gradients`` measures by how much.

With ``--lora`` the loaded model gets LoRA adapters (``policy/lora.py``, drawn from
``--lora-seed``, the base frozen) and the gradient file holds the adapter tensors only,
under peft's saved keys (those of ``adapter_model.safetensors``).
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from thundersync_core.batch import (
    BatchFormatError,
    Trajectory,
    Turn,
    check_token_range,
    read_batch,
    top_k_of,
    turns_of,
)
from thundersync_core.objectives.grpo import LossAgg
from thundersync_core.objectives.opd import split_by_turn
from thundersync_core.policy.io import load_model
from thundersync_core.policy.lora import LoraSettings, apply_lora, parse_lora, saved_key
from thundersync_core.streaming import (
    StreamingGRPOLearner,
    StreamingOPDLearner,
    SyncGRPOLearner,
    SyncOPDLearner,
    groups_of,
)
from thundersync_core.streaming.base import LearnerBase

Schedule = Literal["sync", "stream"]
OBJECTIVES = ("grpo", "opd")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def replay(
    *,
    model_dir: Path,
    batch_path: Path,
    out_dir: Path,
    objective: str = "grpo",
    schedule: Schedule = "sync",
    loss_agg: LossAgg = "seq-sum",
    dtype: str = "float32",
    seed: int = 0,
    max_open_groups: int = 4,
    pack_tokens: int = 0,
    order: str = "arrival",
    release: str = "trajectory",
    chunks: int = 1,
    lora: LoraSettings | str | None = None,
    lora_seed: int = 0,
    lora_init_b_std: float = 0.0,
) -> dict[str, object]:
    """Replay ``batch_path``; nothing is written unless the whole batch is valid.

    With ``pack_tokens`` (GRPO, stream) the shuffled batch arrives in chunks of seeded
    random sizes, each handed over at once and run as packs (``submit_many``); ``order``
    is the streaming learner's summation order (``fixed``: bitwise the sync update);
    ``release`` when a trajectory's backward runs (``group``: once its group's rewards are
    all known, with no per-group statistics); ``chunks`` (with packs and ``fixed``) runs
    each group as that many id-chunks, a chunk as soon as it may. ``lora`` (settings, or
    the ``--lora`` text) trains LoRA adapters drawn from ``lora_seed`` instead of every
    weight; B starts at zero (the base policy, whose gradient with respect to A is zero)
    unless ``lora_init_b_std``."""
    if objective not in OBJECTIVES:
        raise ValueError(f"--objective {objective!r}: choose one of {sorted(OBJECTIVES)}")
    if schedule not in ("sync", "stream"):
        raise ValueError(f"--schedule {schedule!r}: choose sync or stream")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: choose one of {sorted(DTYPES)}")
    if order not in ("arrival", "fixed"):
        raise ValueError(f"--order {order!r}: choose arrival or fixed")
    if release not in ("trajectory", "group"):
        raise ValueError(f"--release {release!r}: choose trajectory or group")
    if chunks < 1:
        raise ValueError(f"--chunks {chunks}: must be >= 1")
    lora_settings = parse_lora(lora) if isinstance(lora, str) else lora
    trajectories = read_batch(batch_path)
    teacher_turns: dict[str, list[tuple[float, ...]]] = {}
    top_k = 0
    if objective == "opd":
        teacher_turns = {t.trajectory_id: split_by_turn(t) for t in trajectories}
        top_k = _batch_top_k(trajectories, batch_path)
    model = load_model(model_dir, dtype=DTYPES[dtype])
    if lora_settings is not None:
        apply_lora(model, lora_settings, seed=lora_seed, init_b_std=lora_init_b_std)
    check_token_range(trajectories, int(model.config.vocab_size))

    rng = random.Random(seed)
    start_s = time.perf_counter()
    if objective == "grpo":
        learner = _feed_grpo(
            model,
            trajectories,
            schedule=schedule,
            loss_agg=loss_agg,
            max_open_groups=max_open_groups,
            rng=rng,
            pack_tokens=pack_tokens,
            order=order,
            release=release,
            chunks=chunks,
        )
    else:
        learner = _feed_opd(model, trajectories, teacher_turns, schedule, rng, top_k=top_k)
    result = learner.finish()
    wall_s = time.perf_counter() - start_s

    summary: dict[str, object] = {
        "objective_name": objective,
        "objective": result.objective,
        "gradient_of": "J (ascent)" if objective == "grpo" else "L (descent)",
        "schedule": schedule,
        "loss_agg": loss_agg if objective == "grpo" else "token-mean",
        **({"teacher_top_k": top_k} if objective == "opd" else {}),
        "dtype": dtype,
        "seed": seed,
        **(
            {"order": order, "release": release, "chunks": chunks}
            if objective == "grpo" and schedule == "stream"
            else {}
        ),
        **(
            {"lora": _lora_summary(lora_settings, lora_seed, lora_init_b_std)}
            if lora_settings
            else {}
        ),
        "n_sources": result.n_sources,
        "n_groups": result.n_groups,
        "n_trajectories": len(trajectories),
        "n_scored_tokens": result.n_scored_tokens,
        "scale": result.scale,
        "wall_s": wall_s,
        "counters": result.counters,
    }
    tensors = {name: g.detach().contiguous() for name, g in result.grad_objective.items()}
    if lora_settings is not None:  # the learner trains the adapters only
        tensors = {saved_key(name): g for name, g in tensors.items()}
    _write_outputs(out_dir, tensors, summary)
    return summary


def _lora_summary(settings: LoraSettings, seed: int, init_b_std: float) -> dict[str, object]:
    return {
        "r": settings.r,
        "alpha": settings.alpha,
        "targets": list(settings.target_modules),
        "seed": seed,
        "init_b_std": init_b_std,
    }


def _feed_grpo(
    model: PreTrainedModel,
    trajectories: list[Trajectory],
    *,
    schedule: Schedule,
    loss_agg: LossAgg,
    max_open_groups: int,
    rng: random.Random,
    pack_tokens: int = 0,
    order: str = "arrival",
    release: str = "trajectory",
    chunks: int = 1,
) -> LearnerBase:
    version = min(t.policy_version for t in trajectories)
    learner: StreamingGRPOLearner | SyncGRPOLearner
    if schedule == "stream":
        learner = StreamingGRPOLearner(
            model,
            loss_agg=loss_agg,
            max_open_groups=max_open_groups,
            policy_version=version,
            order=order,  # type: ignore[arg-type]
            release=release,  # type: ignore[arg-type]
            chunks=chunks,
        )
        trajectories = rng.sample(trajectories, len(trajectories))
    else:
        learner = SyncGRPOLearner(model, loss_agg=loss_agg, policy_version=version)
    learner.begin_batch(groups_of(trajectories, with_members=chunks > 1))
    if pack_tokens and isinstance(learner, StreamingGRPOLearner):
        pending = list(trajectories)
        while pending:
            size = rng.randint(1, len(pending))
            chunk, pending = pending[:size], pending[size:]
            learner.submit_many(chunk, pack_tokens=pack_tokens)
        return learner
    for traj in trajectories:
        learner.submit(traj)
    return learner


def _feed_opd(
    model: PreTrainedModel,
    trajectories: list[Trajectory],
    teacher_turns: dict[str, list[tuple[float, ...]]],
    schedule: Schedule,
    rng: random.Random,
    *,
    top_k: int,
) -> LearnerBase:
    version = min(t.policy_version for t in trajectories)
    if schedule == "sync":
        sync = SyncOPDLearner(model, policy_version=version, teacher_top_k=top_k)
        sync.begin_batch(groups_of(trajectories))
        for traj in trajectories:
            sync.submit(traj)
        return sync
    stream = StreamingOPDLearner(model, policy_version=version, teacher_top_k=top_k)
    stream.begin_batch(groups_of(trajectories))
    turns = {t.trajectory_id: turns_of(t, teacher_turns[t.trajectory_id]) for t in trajectories}
    for turn in interleave(turns, rng):
        stream.submit_turn(turn)
    return stream


def _batch_top_k(trajectories: list[Trajectory], source: Path) -> int:
    """The k of the batch's teacher top-k (0: none); every trajectory must have the same."""
    first: tuple[str, int] | None = None
    for traj in trajectories:
        if traj.n_scored_tokens == 0:
            continue
        k = top_k_of(traj)
        if first is None:
            first = (traj.trajectory_id, k)
        elif k != first[1]:
            raise BatchFormatError(
                f"{source}: trajectory {traj.trajectory_id!r}: teacher top-{k}, but "
                f"{first[0]!r} has top-{first[1]} (one k per batch)"
            )
    return first[1] if first is not None else 0


def interleave(queues: dict[str, list[Turn]], rng: random.Random) -> list[Turn]:
    """A random arrival order of turns across trajectories, each trajectory's turns in order.

    Drawing the next trajectory with probability proportional to its remaining turns makes
    every interleaving equally likely.
    """
    pending = {tid: list(turns) for tid, turns in queues.items() if turns}
    order = []
    while pending:
        ids = sorted(pending)
        tid = rng.choices(ids, weights=[len(pending[t]) for t in ids])[0]
        order.append(pending[tid].pop(0))
        if not pending[tid]:
            del pending[tid]
    return order


def _write_outputs(out_dir: Path, tensors: dict[str, torch.Tensor], summary: dict) -> None:
    """Write both files via temporaries and rename, so a failure leaves no half output."""
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp_grad = tempfile.mkstemp(dir=out_dir, suffix=".safetensors.tmp")
    os.close(fd)
    save_file(tensors, tmp_grad, metadata={"objective": "grad J (ascent direction)"})
    tmp_summary = out_dir / "summary.json.tmp"
    tmp_summary.write_text(json.dumps(summary, indent=2) + "\n")
    os.replace(tmp_grad, out_dir / "gradient.safetensors")
    os.replace(tmp_summary, out_dir / "summary.json")


def compare_gradients(a_path: Path, b_path: Path) -> float:
    """max |a - b| / max |a| over all parameters of two gradient files."""
    return relative_difference(load_file(str(a_path)), load_file(str(b_path)))


def relative_difference(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """max |a - b| / max |a| over all parameters (absolute when a is all zeros)."""
    if a.keys() != b.keys():
        raise ValueError(f"parameter names differ: {sorted(a.keys() ^ b.keys())[:5]}")
    diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    ref = max(float(a[k].double().abs().max()) for k in a)
    return diff / ref if ref > 0 else diff
