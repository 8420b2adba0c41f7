"""Grow a trained policy into a larger preset with the same function.

The larger model computes what the smaller one did, to float rounding, and trains as a
model of its own size from there: a warm start made at a cheap preset serves a policy whose
learner does the arithmetic of a larger one.

How each part keeps the function (H hidden size, I MLP width, h heads, k key-value heads,
head size d unchanged, vocabulary unchanged):

- the residual stream is the old one followed by zeros: the embedding's new columns and
  every row that writes new residual dimensions (attention output and MLP down projections)
  start at zero, so those dimensions stay zero;
- an RMSNorm over H' dims of [x, 0] divides by sqrt(H / H') times the old root mean square,
  so its old weights are scaled by sqrt(H / H') (to the norm's epsilon);
- old heads keep their key-value head: with h / k heads per key-value head before and
  h' / k after, old head j of group g becomes head g * h' / k + j; new heads and new MLP
  neurons write nothing (zero columns in the output projections);
- new layers are appended with zero output projections, so each is the identity;
- everything else new (the rows and columns that read only zeros, the new layers' other
  weights) keeps the larger preset's random initialisation, so gradients reach it.
"""

from __future__ import annotations

import math

import torch
from transformers import PreTrainedModel

__all__ = ["check_growth", "grow_into"]


def check_growth(small: str, large: str) -> None:
    """Refuse, naming the presets and the field, a growth from preset ``small`` that
    ``grow_into`` cannot make into preset ``large``."""
    from thundersync_core.policy.presets import preset_config  # noqa: PLC0415

    try:
        _check(preset_config(small), preset_config(large))
    except (KeyError, ValueError) as exc:
        raise ValueError(f"warm_start.preset {small!r} -> policy.preset {large!r}: {exc}") from exc


def grow_into(small: PreTrainedModel, large: PreTrainedModel) -> None:
    """Write ``small``'s function into ``large`` (built at the larger preset) in place."""
    a, b = small.config, large.config
    _check(a, b)
    scale = math.sqrt(a.hidden_size / b.hidden_size)
    head_map = _head_map(a.num_attention_heads, b.num_attention_heads, a.num_key_value_heads)
    src = dict(small.named_parameters())
    with torch.no_grad():
        for name, param in large.named_parameters():
            if name.endswith("embed_tokens.weight"):
                _pad(param, src[name])
            elif name.endswith("layernorm.weight") or name == "model.norm.weight":
                if name in src:
                    param.fill_(scale)
                    param[: a.hidden_size] = src[name] * scale
                # a new layer's norms keep their ones: the layer writes nothing
            elif ".layers." in name:
                _layer_part(name, param, src.get(name), (a.hidden_size, a.head_dim), head_map)
            elif name.endswith("lm_head.weight"):
                _pad(param, src[name])


def _check(a: object, b: object) -> None:
    def get(c: object, key: str) -> int:
        return int(getattr(c, key))

    same = ("vocab_size", "head_dim", "num_key_value_heads")
    for key in same:
        if get(a, key) != get(b, key):
            raise ValueError(f"grow: {key} differs ({get(a, key)} -> {get(b, key)}); it must not")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if get(b, key) < get(a, key):
            raise ValueError(f"grow: {key} would shrink ({get(a, key)} -> {get(b, key)})")
    if get(b, "num_attention_heads") % get(b, "num_key_value_heads"):
        raise ValueError("grow: the larger model's heads are not a multiple of its kv heads")
    if getattr(a, "tie_word_embeddings", True) != getattr(b, "tie_word_embeddings", True):
        raise ValueError("grow: both models must tie (or untie) their embeddings")


def _head_map(heads: int, heads_after: int, kv_heads: int) -> list[int]:
    """Old head -> new head, each keeping its key-value head."""
    per, per_after = heads // kv_heads, heads_after // kv_heads
    return [(j // per) * per_after + j % per for j in range(heads)]


def _pad(param: torch.Tensor, old: torch.Tensor) -> None:
    """Old columns in place, new columns zero (rows are the vocabulary, unchanged)."""
    param.zero_()
    param[:, : old.shape[1]] = old


def _layer_part(
    name: str,
    param: torch.Tensor,
    old: torch.Tensor | None,
    sizes: tuple[int, int],
    head_map: list[int],
) -> None:
    """One parameter of a layer; ``sizes`` the smaller model's hidden and head size."""
    leaf = name.rsplit(".", 2)[-2]
    if old is None:  # a new layer: the identity through zero output projections
        if leaf in ("o_proj", "down_proj"):
            param.zero_()
        return
    hidden, d = sizes
    if leaf == "q_proj":
        new = param.view(-1, d, param.shape[1])
        for j, k in enumerate(head_map):
            new[k, :, :hidden] = old.view(-1, d, hidden)[j]
    elif leaf in ("k_proj", "v_proj", "gate_proj", "up_proj"):
        param[: old.shape[0], :hidden] = old
    elif leaf == "o_proj":
        param.zero_()
        new = param.view(param.shape[0], -1, d)
        for j, k in enumerate(head_map):
            new[:hidden, k, :] = old.view(hidden, -1, d)[:, j, :]
    elif leaf == "down_proj":
        param.zero_()
        param[:hidden, : old.shape[1]] = old
    elif leaf in ("q_norm", "k_norm"):
        param.copy_(old)
    else:
        raise ValueError(f"grow: no rule for parameter {name}")
