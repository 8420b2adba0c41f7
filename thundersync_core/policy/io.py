"""Save and load policies in Hugging Face format.

``load_policy`` takes the same ``from_pretrained`` path a hub checkpoint takes, so any
Hugging Face causal-LM folder loads; the wide RMSNorm is installed afterwards where the
architecture is known to use the float32-upcasting norm.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.utils import logging as hf_logging

from thundersync_core.policy.norm import widen_rms_norms

# Progress bars for a few-MB local checkpoint are noise in logs and CLI output.
hf_logging.disable_progress_bar()


def save_policy(model: PreTrainedModel, tokenizer: object | None, directory: Path) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)  # type: ignore[attr-defined]
    return directory


def load_model(
    directory: Path | str, *, dtype: torch.dtype = torch.float32, attn: str = "sdpa"
) -> PreTrainedModel:
    """Load a causal LM from a local folder, in eval mode with every parameter trainable."""
    path = Path(directory)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"--model {path}: no config.json, not a Hugging Face model folder")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn)
    widen_rms_norms(model)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def checkpoint_dtype(directory: Path | str) -> torch.dtype:
    """The dtype a Hugging Face folder was saved in (``dtype``, or the older
    ``torch_dtype``, in config.json); float32 when it names none."""
    import json  # noqa: PLC0415

    config = json.loads((Path(directory) / "config.json").read_text())
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{directory}/config.json: dtype {name!r} is not a torch dtype")
    return dtype


def load_tokenizer(directory: Path | str) -> object:
    return AutoTokenizer.from_pretrained(Path(directory))
