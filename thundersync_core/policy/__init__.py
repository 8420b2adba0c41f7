"""Policy models: tiny Qwen3-style presets, an offline tokenizer, HF-format I/O, log-probs."""

from thundersync_core.policy.io import load_model, load_tokenizer, save_policy
from thundersync_core.policy.logprobs import scored_logprobs
from thundersync_core.policy.presets import PRESETS, build_model, parameter_count
from thundersync_core.policy.tokenizer import build_tokenizer

__all__ = [
    "PRESETS",
    "build_model",
    "build_tokenizer",
    "load_model",
    "load_tokenizer",
    "parameter_count",
    "save_policy",
    "scored_logprobs",
]
