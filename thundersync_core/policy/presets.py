"""Tiny Qwen3-style model presets built from config.

head_dim is 64 in every preset because vLLM's CPU attention backend needs head_dim >= 32
and the GPU kernels prefer powers of two. Embeddings are tied, as in small Qwen3 models.

Add a preset by adding an entry to ``PRESETS``; ``build_model`` turns it into a
``Qwen3ForCausalLM`` with the wide RMSNorm (see ``norm.py``) installed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from thundersync_core.policy.norm import widen_rms_norms


@dataclass(frozen=True)
class ModelPreset:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int = 64
    max_position_embeddings: int = 4096


PRESETS: dict[str, ModelPreset] = {
    # ~0.5 M parameters: unit tests, property tests over many arrival orders.
    "micro": ModelPreset(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=256,
        vocab_size=1024,
    ),
    # ~4 M parameters: the embedded default policy, demo and benchmarks.
    "tiny": ModelPreset(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=768,
        vocab_size=2048,
    ),
    # ~13 M parameters: tiny's four layers at twice the width, the embedded demo's policy
    # (warm-started at tiny and grown, policy/grow.py). On the two-core box its learner
    # takes 2.5x tiny's time per step while the vLLM rollout stage grows ~10%: vLLM CPU's
    # per-step costs, not its matrix products, dominate a small model's decode.
    "wide": ModelPreset(
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=1536,
        vocab_size=2048,
    ),
    # ~11 M and ~25 M parameters: the learner's arithmetic per token grows with the
    # parameters, a rollout stage of few episodes in flight grows less (vLLM's per-step
    # costs and the sandboxes do not scale with the model); the bench picks the size that
    # brings the learner level with the rollout stage.
    "small": ModelPreset(
        hidden_size=384,
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=1152,
        vocab_size=2048,
    ),
    "medium": ModelPreset(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=1536,
        vocab_size=2048,
    ),
    # ~48 M parameters: the learner of the two-core bench (configs/bench_embedded.yaml).
    "large": ModelPreset(
        hidden_size=640,
        num_hidden_layers=10,
        num_attention_heads=10,
        num_key_value_heads=2,
        intermediate_size=1920,
        vocab_size=2048,
    ),
}


def preset_config(name: str, **overrides: object) -> Qwen3Config:
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    fields = asdict(PRESETS[name]) | overrides
    return Qwen3Config(
        **fields,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        attention_dropout=0.0,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def build_model(
    name: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: object
) -> Qwen3ForCausalLM:
    """A freshly initialised preset model, deterministic in ``seed``, in eval mode."""
    config = preset_config(name, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    widen_rms_norms(model)
    # transformers wraps .to() in a decorator that mypy cannot see through.
    model.to(dtype)  # type: ignore[arg-type]
    model.eval()
    return model


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
