"""Checkpoints on a cadence, and exact resume.

A checkpoint is a folder ``step-NNNNNN`` holding everything that decides the next update:
the weights in Hugging Face format (so evaluation and engines load them like any model;
in float32, or in bfloat16 with the float32 master beside them in ``master.safetensors``;
a LoRA learner's adapters merged into them, the adapter itself in peft's format under
``adapter/`` and the base and adapters by name in ``master.safetensors``),
the optimizer state, the random-number states (Python, NumPy, torch) and a ``state.json``
with the step and policy version. It is written to a temporary sibling and renamed, so a
crash never leaves a half-written checkpoint that ``latest_checkpoint`` would pick up; a
write that fails (a full disk) removes what it wrote and raises ``CheckpointWriteError``
naming the latest complete checkpoint, which stays loadable. Resuming from step k and
training on gives bitwise the parameters of an uninterrupted run.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel

STATE_FILE = "state.json"
#: The float32 master of a checkpoint whose ``model/`` holds a lower-precision export, or
#: the merged weights of a LoRA learner (then its base and adapters, by their own names).
MASTER_FILE = "master.safetensors"
#: A LoRA learner's adapter in peft's format (``model/`` holds it merged).
ADAPTER_DIR = "adapter"


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (the disk is full, say); earlier ones are intact."""


def checkpoint_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def save_checkpoint(
    root: Path,
    *,
    step: int,
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    policy_version: int,
    extra: dict[str, Any] | None = None,
    export_dtype: torch.dtype = torch.float32,
) -> Path:
    """Write the checkpoint of ``step`` under ``root``; refuses to overwrite one.
    ``export_dtype`` is the dtype of ``model/``."""
    target = checkpoint_dir(root, step)
    if target.exists():
        raise FileExistsError(f"checkpoint {target} exists; a step is saved once")
    staging = target.with_name(f".{target.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        _write_checkpoint(
            staging,
            step=step,
            model=model,
            optimizer=optimizer,
            version=policy_version,
            extra=extra,
            export_dtype=export_dtype,
        )
    except BaseException as exc:
        # A full disk, say: what was written of this one goes, the earlier ones stay.
        shutil.rmtree(staging, ignore_errors=True)
        if not isinstance(exc, Exception):
            raise
        raise CheckpointWriteError(
            f"writing checkpoint {target} failed ({exc}); "
            f"the latest complete checkpoint is {latest_checkpoint(root)}"
        ) from exc
    staging.rename(target)
    return target


def _write_checkpoint(
    staging: Path,
    *,
    step: int,
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    version: int,
    extra: dict[str, Any] | None,
    export_dtype: torch.dtype,
) -> None:
    from thundersync_core.policy.lora import (  # noqa: PLC0415
        adapter_settings,
        published_weights,
        save_adapter,
    )

    lora = adapter_settings(model)
    if lora is None and all(p.dtype == export_dtype for p in model.parameters()):
        model.save_pretrained(staging / "model", safe_serialization=True)
    else:
        from thundersync_core.parallel.fsdp import (  # noqa: PLC0415
            cast_named,
            named_detached,
            write_safetensors_streamed,
        )

        # The learner's own parameters (with LoRA: the frozen base and the adapters) are
        # what a resume restores; model/ holds what engines and evaluation load.
        write_safetensors_streamed(staging / MASTER_FILE, named_detached(model))
        (staging / "model").mkdir()
        write_safetensors_streamed(
            staging / "model" / "model.safetensors",
            cast_named(published_weights(model), export_dtype),
        )
        if lora is not None:
            save_adapter(model, lora, staging / ADAPTER_DIR)
        save_model_config(model.config, staging / "model", export_dtype)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(staging / "model")
    torch.save(optimizer.state_dict(), staging / "optimizer.pt")
    rng = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    torch.save(rng, staging / "rng.pt")
    state = {
        "step": step,
        "policy_version": version,
        "export_dtype": dtype_name(export_dtype),
        "extra": extra or {},
    }
    (staging / STATE_FILE).write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")


def dtype_name(dtype: torch.dtype) -> str:
    """``bfloat16`` for ``torch.bfloat16`` (as config.json and state.json spell it)."""
    return str(dtype).removeprefix("torch.")


def save_model_config(config: Any, folder: Path, dtype: torch.dtype) -> None:
    """A Hugging Face config.json that names ``dtype`` as the weights' dtype."""
    config.save_pretrained(folder)
    path = Path(folder) / "config.json"
    record = json.loads(path.read_text())
    key = "torch_dtype" if "torch_dtype" in record and "dtype" not in record else "dtype"
    record[key] = dtype_name(dtype)
    path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def load_checkpoint(
    path: Path, *, model: PreTrainedModel, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Restore weights (in place, by name), optimizer and RNG states; return state.json."""
    path = Path(path)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"checkpoint {path}: no {STATE_FILE} (not a checkpoint)")
    refuse_weights_only(path)
    from safetensors.torch import load_file  # noqa: PLC0415 - only on resume

    weights: dict[str, torch.Tensor] = {}
    master = path / MASTER_FILE  # the float32 master beside a lower-precision export
    for shard in [master] if master.is_file() else sorted((path / "model").glob("*.safetensors")):
        weights.update(load_file(str(shard)))
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(weights))
    if missing:
        raise KeyError(f"checkpoint {path}: no weights for {missing[:3]}")
    with torch.no_grad():
        for name, param in params.items():
            if weights[name].dtype != param.dtype:
                raise ValueError(
                    f"checkpoint {path}: {name!r} is {weights[name].dtype}, the learner's "
                    f"parameter {param.dtype} (its float32 master is missing)"
                )
            param.copy_(weights[name])
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
    rng = torch.load(path / "rng.pt", weights_only=False)
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    return json.loads((path / STATE_FILE).read_text())


#: What a weights-only checkpoint keeps (evaluation loads ``model/``).
_WEIGHTS_ONLY_KEEP = {"model", ADAPTER_DIR, STATE_FILE}


def prune_checkpoints(root: Path, *, keep_last: int, keep_every: int = 0) -> dict[str, list[int]]:
    """Keep the last ``keep_last`` complete checkpoints whole (0: keep everything); of the
    older ones, those whose step is a multiple of ``keep_every`` keep only their weights
    and state.json (marked ``weights_only``), the rest are removed. Returns the steps
    slimmed and removed. The latest checkpoint, the one a resume takes, is always whole."""
    done: dict[str, list[int]] = {"weights_only": [], "removed": []}
    if keep_last < 1:
        return done
    complete = sorted(
        (p for p in Path(root).glob("step-*") if (p / STATE_FILE).is_file()),
        key=lambda p: int(p.name.split("-")[1]),
    )
    for path in complete[:-keep_last]:
        step = int(path.name.split("-")[1])
        if keep_every and step % keep_every == 0:
            state = json.loads((path / STATE_FILE).read_text())
            if state.get("weights_only"):
                continue
            state["weights_only"] = True
            tmp = path / (STATE_FILE + ".partial")
            tmp.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
            tmp.replace(path / STATE_FILE)
            for item in path.iterdir():
                if item.name in _WEIGHTS_ONLY_KEEP:
                    continue
                if item.is_dir():
                    shutil.rmtree(item)
                else:
                    item.unlink()
            done["weights_only"].append(step)
        else:
            shutil.rmtree(path)
            done["removed"].append(step)
    return done


def refuse_weights_only(path: Path) -> None:
    """A resume from a checkpoint whose optimizer and RNG states were pruned is refused."""
    state = json.loads((Path(path) / STATE_FILE).read_text())
    if state.get("weights_only"):
        raise ValueError(
            f"checkpoint {path} holds weights only (its optimizer and RNG states were removed "
            "by checkpoint_keep_last); resume from a later checkpoint, or load its model/ "
            "folder as policy.path for a new run"
        )


def latest_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint with the highest step under ``root``, if any."""
    done = [p for p in Path(root).glob("step-*") if (p / STATE_FILE).is_file()]
    return max(done, key=lambda p: int(p.name.split("-")[1]), default=None)


def due(step: int, every: int) -> bool:
    """Whether ``step`` (1-based count of optimizer steps) falls on the cadence."""
    if every < 1:
        raise ValueError(f"checkpoint cadence must be >= 1 step, got {every}")
    return step % every == 0
