"""Replay a logged batch through a learner and write the gradient: the exactness audit.

``thundersync replay`` reads a batch file (see ``batch.py``), runs it through the sync or
the streaming learner (stream: sources in a random arrival order drawn from ``seed``), and
writes ``gradient.safetensors`` (grad J per trainable parameter, before clipping and before
any optimizer) and ``summary.json``. Two replays of one batch under different schedules
must agree to rounding; ``compare_gradients`` measures by how much.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import load_file, save_file

from thundersync_core.batch import check_token_range, read_batch
from thundersync_core.objectives.grpo import LossAgg
from thundersync_core.policy.io import load_model
from thundersync_core.streaming import StreamingGRPOLearner, SyncGRPOLearner, groups_of

Schedule = Literal["sync", "stream"]
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
) -> dict[str, object]:
    if objective != "grpo":
        raise ValueError(f"--objective {objective!r}: supported objectives are: grpo")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r}: choose one of {sorted(DTYPES)}")
    trajectories = read_batch(batch_path)
    model = load_model(model_dir, dtype=DTYPES[dtype])
    check_token_range(trajectories, int(model.config.vocab_size))

    if schedule == "stream":
        learner: StreamingGRPOLearner | SyncGRPOLearner = StreamingGRPOLearner(
            model, loss_agg=loss_agg, max_open_groups=max_open_groups
        )
        order = list(trajectories)
        random.Random(seed).shuffle(order)
    elif schedule == "sync":
        learner = SyncGRPOLearner(model, loss_agg=loss_agg)
        order = list(trajectories)
    else:
        raise ValueError(f"--schedule {schedule!r}: choose sync or stream")
    versions = {t.policy_version for t in trajectories}
    learner.policy_version = min(versions)

    start_s = time.perf_counter()
    learner.begin_batch(groups_of(trajectories))
    for traj in order:
        learner.submit(traj)
    result = learner.finish()
    wall_s = time.perf_counter() - start_s

    summary: dict[str, object] = {
        "objective_name": objective,
        "objective": result.objective,
        "schedule": schedule,
        "loss_agg": loss_agg,
        "dtype": dtype,
        "seed": seed,
        "n_sources": result.n_sources,
        "n_groups": result.n_groups,
        "n_scored_tokens": result.n_scored_tokens,
        "scale": result.scale,
        "wall_s": wall_s,
        "counters": result.counters,
    }
    tensors = {name: g.detach().contiguous() for name, g in result.grad_objective.items()}
    _write_outputs(out_dir, tensors, summary)
    return summary


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
    a, b = load_file(str(a_path)), load_file(str(b_path))
    if a.keys() != b.keys():
        raise ValueError(f"parameter names differ: {sorted(a.keys() ^ b.keys())[:5]}")
    diff = max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
    ref = max(float(a[k].double().abs().max()) for k in a)
    return diff / ref if ref > 0 else diff
