"""Distributed checkpoints of a learner group, loadable at another world size.

A checkpoint folder ``step-NNNNNN`` (the layout of ``checkpoint.py``) holds:

    dcp/         torch.distributed.checkpoint of the master model and the AdamW state,
                 keyed by parameter name (``get_state_dict``), so a save at W ranks loads at
                 W' ranks (DCP reads each rank's slice) and into a plain one-process model
    model/       Hugging Face weights and config (rank 0, streamed per tensor) for evaluation
                 and the rollout engines, in ``export_dtype`` (the master is in dcp/); a LoRA
                 learner's adapters merged into them
    adapter/     a LoRA learner's adapters in peft's format (dcp/ holds them with the frozen
                 base, by the learner's parameter names)
    rng.pt       rank 0's random-number states (the streaming learners draw none; kept for
                 the schedules and data cursor, as in a one-process checkpoint)
    state.json   step, policy version, world size and sharding it was written with

Every rank calls ``save_group_checkpoint`` (DCP and the weight gather are collectives); the
folder is written under a temporary name and renamed by rank 0 after the last barrier, so a
crash never leaves a checkpoint ``latest_checkpoint`` would pick up. On a cluster ``root``
must be storage every learner node sees (the run folder on the shared mount).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from thundersync_core.checkpoint import (
    ADAPTER_DIR,
    STATE_FILE,
    checkpoint_dir,
    dtype_name,
    refuse_weights_only,
    save_model_config,
)
from thundersync_core.parallel.fsdp import TrainState

DCP_DIR = "dcp"


def is_group_checkpoint(path: Path) -> bool:
    return (Path(path) / DCP_DIR).is_dir()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def save_group_checkpoint(
    root: Path,
    *,
    step: int,
    state: TrainState,
    policy_version: int,
    sharding: str,
    model_config: Any,
    extra: dict[str, Any] | None = None,
    export_dtype: torch.dtype = torch.float32,
) -> Path:
    """Write the checkpoint of ``step`` (every rank calls); returns its folder."""
    target = checkpoint_dir(root, step)
    staging = target.with_name(f".{target.name}.partial")
    if _rank() == 0:
        if target.exists():
            raise FileExistsError(f"checkpoint {target} exists; a step is saved once")
        shutil.rmtree(staging, ignore_errors=True)
        (staging / "model").mkdir(parents=True)
    _barrier()
    model_sd, optim_sd = get_state_dict(state.checkpoint_module(), state.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(staging / DCP_DIR))
    state.write_weights(staging / "model" / "model.safetensors", dtype=export_dtype)
    if _rank() == 0:
        save_model_config(model_config, staging / "model", export_dtype)
        _save_adapter_if_any(state.model, staging / ADAPTER_DIR)
        rng = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
        }
        torch.save(rng, staging / "rng.pt")
        world = dist.get_world_size() if dist.is_initialized() else 1
        record = {
            "step": step,
            "policy_version": policy_version,
            "world_size": world,
            "sharding": sharding,
            "export_dtype": dtype_name(export_dtype),
            "extra": extra or {},
        }
        (staging / STATE_FILE).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    _barrier()
    if _rank() == 0:
        staging.rename(target)
    _barrier()
    return target


def _save_adapter_if_any(model: torch.nn.Module, directory: Path) -> None:
    """A LoRA learner's adapters in peft's format (its compute replica holds them whole and
    in float32, equal to the master)."""
    from thundersync_core.policy.lora import adapter_settings, save_adapter  # noqa: PLC0415

    settings = adapter_settings(model)
    if settings is not None:
        save_adapter(model, settings, directory)


def load_group_checkpoint(
    path: Path, *, module: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Load model and optimizer state into ``module`` (sharded or plain) at any world size.

    Every rank calls; without a process group it loads in one process. Returns state.json.
    The caller refreshes a compute replica from a sharded ``module`` afterwards.
    """
    path = Path(path)
    refuse_weights_only(path)
    if not is_group_checkpoint(path):
        raise FileNotFoundError(
            f"checkpoint {path}: no {DCP_DIR}/ folder (written by a one-process learner: "
            "resume it with resources.learner.ranks: 1)"
        )
    model_sd, optim_sd = get_state_dict(module, optimizer)
    loaded: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    dcp.load(loaded, checkpoint_id=str(path / DCP_DIR))
    set_state_dict(
        module, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"]
    )
    rng = torch.load(path / "rng.pt", weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    return json.loads((path / STATE_FILE).read_text())


__all__ = ["is_group_checkpoint", "load_group_checkpoint", "save_group_checkpoint"]
