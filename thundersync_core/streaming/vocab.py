"""Forwards that return the whole next-token distribution at each scored position.

``policy.logprobs`` projects a scored hidden state onto its target token only. OPD with the
teacher's top-k needs the full log-distribution of both models there: the teacher to pick
its top k, the student for the per-token KL over the vocabulary. The vocabulary-wide
log-softmax is the same one ``policy.logprobs`` takes (at least float32), so a target's
log-prob gathered from it is the log-prob ``policy.logprobs`` returns.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from thundersync_core.policy.logprobs import (
    _cache_key_values,
    policy_sampling,
    sampling_log_softmax,
)


def _vocab_logprobs(model: PreTrainedModel, hidden_NH: torch.Tensor) -> torch.Tensor:
    logits_NV = model.get_output_embeddings()(hidden_NH)
    return sampling_log_softmax(
        logits_NV.to(torch.promote_types(logits_NV.dtype, torch.float32)),
        policy_sampling(model),
    )


def scored_vocab_logprobs(
    model: PreTrainedModel,
    ids_BT: torch.Tensor,
    scored_BT: torch.Tensor,
    *,
    attention_mask_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp_NV, targets_N, row_N): at each scored token, the log-distribution that predicts
    it, the token, and its batch row; tokens row by row in position order."""
    if bool(scored_BT[:, 0].any()):
        raise ValueError("the first token of a row cannot be scored: it has no predecessor")
    hidden_BTH = model.base_model(input_ids=ids_BT, attention_mask=attention_mask_BT)
    predicts_BT = scored_BT[:, 1:]
    hidden_NH = hidden_BTH.last_hidden_state[:, :-1][predicts_BT]
    targets_N = ids_BT[:, 1:][predicts_BT]
    return _vocab_logprobs(model, hidden_NH), targets_N, predicts_BT.nonzero()[:, 0]


def chunk_vocab_forward(
    model: PreTrainedModel,
    input_ids_T: torch.Tensor,
    scored_T: torch.Tensor,
    cache: DynamicCache,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Forward one chunk after ``cache``; return (logp_NV at the scored hidden states, this
    chunk's keys/values per layer as [k0, v0, k1, v1, ...], graph attached when grad is
    enabled). ``cache`` is consumed."""
    past_len = cache.get_seq_length()
    out = model.base_model(input_ids=input_ids_T[None], past_key_values=cache, use_cache=True)
    new_kv = [t[:, :, past_len:] for kv in _cache_key_values(out.past_key_values) for t in kv]
    hidden_NH = out.last_hidden_state[0][scored_T]
    vocab = model.get_output_embeddings().weight.shape[0]
    if not bool(scored_T.any()):
        return hidden_NH.new_zeros((0, vocab)), new_kv
    return _vocab_logprobs(model, hidden_NH), new_kv
