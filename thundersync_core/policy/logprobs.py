"""Log-probabilities of scored tokens, projecting only scored positions onto the vocabulary.

Shape legend: B batch rows, T tokens per row, H hidden size, N scored tokens in the batch,
V vocabulary. Token t of a row is *scored* when the loss uses log pi(y_t | y_<t); its
log-prob is read from the hidden state at t - 1, so only those N hidden states go through
the output projection (the V-wide logits are the largest activation of a small model).

Works with any Hugging Face causal LM whose decoder is ``model.base_model`` and whose
head is ``model.get_output_embeddings()`` with no logit scaling.

A sampler divides the model's logits by the temperature, then cuts them to the top k and
to the top-p nucleus (``SamplingFilter``); ``sampling_log_softmax`` gives the log-probs of
that distribution, which the engines report as behaviour log-probs. A learner's model
carries the filter its log-probs are taken under (``set_policy_sampling``; the training
stage sets the run's temperature alone, so the learner's policy keeps the whole vocabulary
as support); without one it is the plain log-softmax.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel


@dataclass(frozen=True)
class SamplingFilter:
    """The sampler a policy's tokens come from: temperature, then top-k, then top-p."""

    temperature: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError("temperature must be > 0 (greedy decoding is not an RL sampler)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def plain(self) -> bool:
        return self.temperature == 1.0 and self.top_k == 0 and self.top_p == 1.0


_SAMPLING_ATTRIBUTE = "thundersync_sampling"


def set_policy_sampling(model: torch.nn.Module, sampling: SamplingFilter) -> None:
    """Make every log-prob this module computes for ``model`` one of ``sampling``'s
    distribution (the learner's policy is the distribution its engines sample)."""
    setattr(model, _SAMPLING_ATTRIBUTE, sampling)


def policy_sampling(model: torch.nn.Module) -> SamplingFilter:
    found = getattr(model, _SAMPLING_ATTRIBUTE, None)
    return found if isinstance(found, SamplingFilter) else SamplingFilter()


def sampling_log_softmax(logits_NV: torch.Tensor, sampling: SamplingFilter) -> torch.Tensor:
    """Log-probs of the sampling distribution over the last axis: logits / temperature;
    tokens below the k-th largest dropped; then, in ascending order of probability, the
    tokens whose cumulative probability is at most 1 - top_p dropped (the most likely one
    always kept); log-softmax over the rest (dropped tokens get -inf). The filters' masks
    carry no gradient."""
    if sampling.plain:
        return F.log_softmax(logits_NV, dim=-1)
    scaled = logits_NV / sampling.temperature if sampling.temperature != 1.0 else logits_NV
    with torch.no_grad():
        drop = torch.zeros_like(scaled, dtype=torch.bool)
        vocab = scaled.shape[-1]
        if 0 < sampling.top_k < vocab:
            kth = torch.topk(scaled, sampling.top_k, dim=-1).values[..., -1:]
            drop |= scaled < kth
        if sampling.top_p < 1.0:
            kept = scaled.masked_fill(drop, float("-inf"))
            ascending, order = torch.sort(kept, dim=-1)
            cumulative = torch.softmax(ascending, dim=-1).cumsum(dim=-1)
            tail = cumulative <= 1.0 - sampling.top_p
            tail[..., -1] = False
            drop |= torch.zeros_like(tail).scatter(-1, order, tail)
    return F.log_softmax(scaled.masked_fill(drop, float("-inf")), dim=-1)


def _head_dtype(dtype: torch.dtype) -> torch.dtype:
    # log_softmax over the vocabulary in at least float32 so bf16 logits do not saturate.
    return torch.promote_types(dtype, torch.float32)


def scored_logprobs(
    model: PreTrainedModel,
    ids_BT: torch.Tensor,
    scored_BT: torch.Tensor,
    *,
    attention_mask_BT: torch.Tensor | None = None,
    past_key_values: DynamicCache | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (logprobs_N, row_N): each scored token's log-prob and its batch row.

    ``scored_BT[:, 0]`` must be False: the first token of a row has no predictor in the row.
    With ``past_key_values`` the row continues that cache (positions follow on).
    """
    if bool(scored_BT[:, 0].any()):
        raise ValueError("the first token of a row cannot be scored: it has no predecessor")
    decoder = model.base_model
    out = decoder(
        input_ids=ids_BT,
        attention_mask=attention_mask_BT,
        past_key_values=past_key_values,
        use_cache=past_key_values is not None,
    )
    hidden_BTH = out.last_hidden_state
    predicts_BT = scored_BT[:, 1:]
    hidden_NH = hidden_BTH[:, :-1][predicts_BT]
    targets_N = ids_BT[:, 1:][predicts_BT]
    row_N = predicts_BT.nonzero()[:, 0]
    return _project(model, hidden_NH, targets_N), row_N


def _project(
    model: PreTrainedModel, hidden_NH: torch.Tensor, targets_N: torch.Tensor
) -> torch.Tensor:
    """log pi(target) for each of N hidden states: the only vocabulary-wide work."""
    logits_NV = model.get_output_embeddings()(hidden_NH)
    logp_NV = sampling_log_softmax(
        logits_NV.to(_head_dtype(logits_NV.dtype)), policy_sampling(model)
    )
    return logp_NV.gather(-1, targets_N[:, None])[:, 0]


def prefix_key_values(
    model: PreTrainedModel, prefix_ids_T: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Forward a prefix once and return each layer's (keys, values), graph attached."""
    cache = DynamicCache()
    model.base_model(input_ids=prefix_ids_T[None], past_key_values=cache, use_cache=True)
    return _cache_key_values(cache)


def _cache_key_values(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    pairs = []
    for index, layer in enumerate(cache.layers):
        keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
        if keys is None or values is None:
            raise TypeError(
                f"layer {index}: cache layer {type(layer).__name__} holds no keys/values; "
                "shared-prefix streaming needs standard attention"
            )
        pairs.append((keys, values))
    return pairs


def cache_from_flat(kv_flat: Sequence[torch.Tensor]) -> DynamicCache:
    """A fresh cache over [k0, v0, k1, v1, ...]; later tokens append to it, not to these."""
    if not kv_flat:
        return DynamicCache()
    pairs = [(kv_flat[i], kv_flat[i + 1]) for i in range(0, len(kv_flat), 2)]
    return DynamicCache(ddp_cache_data=pairs)


def chunk_forward(
    model: PreTrainedModel,
    input_ids_T: torch.Tensor,
    targets_T: torch.Tensor,
    scored_T: torch.Tensor,
    cache: DynamicCache,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Forward one chunk after ``cache``; return (logprobs_N, new_kv_flat).

    Hidden state i predicts ``targets_T[i]``; only scored targets are projected onto the
    vocabulary. ``new_kv_flat`` holds this chunk's keys and values per layer
    ([k0, v0, k1, v1, ...]), graph attached when grad is enabled. ``cache`` is consumed.
    """
    past_len = cache.get_seq_length()
    out = model.base_model(input_ids=input_ids_T[None], past_key_values=cache, use_cache=True)
    new_kv = [t[:, :, past_len:] for kv in _cache_key_values(out.past_key_values) for t in kv]
    if not bool(scored_T.any()):
        return torch.zeros(0, device=input_ids_T.device), new_kv
    hidden_NH = out.last_hidden_state[0][scored_T]
    return _project(model, hidden_NH, targets_T[scored_T]), new_kv
