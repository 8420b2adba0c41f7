"""A transformers engine with the rollout protocol, used where vLLM is absent.

Each request decodes on its own (batch of one, own key/value cache, own ``torch.Generator``
seeded from the request), so its tokens are identical whatever else is in the call: the
guarantee is exact, at the price of throughput. The engine holds its own copy of the
policy; ``load_weights`` copies new weights into it in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import DynamicCache, PreTrainedModel

from thundersync_core.policy.io import load_model
from thundersync_core.policy.logprobs import SamplingFilter, sampling_log_softmax
from thundersync_core.rollout.engine import (
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SamplingConfig,
)


class HFEngine:
    def __init__(self, model_dir: Path, *, dtype: torch.dtype = torch.float32) -> None:
        self.model: PreTrainedModel = load_model(model_dir, dtype=dtype)
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.policy_version = 0

    def generate(
        self, requests: Sequence[GenerationRequest], sampling: SamplingConfig
    ) -> list[GenerationResult]:
        return [self._generate_one(r, sampling) for r in requests]

    @torch.no_grad()
    def _generate_one(
        self, request: GenerationRequest, sampling: SamplingConfig
    ) -> GenerationResult:
        generator = torch.Generator().manual_seed(request.seed)
        cache = DynamicCache()
        inputs = torch.tensor([request.prompt_ids])
        tokens: list[int] = []
        logprobs: list[float] = []
        finish: FinishReason = "length"
        for _ in range(request.max_tokens):
            logits = self.model(input_ids=inputs, past_key_values=cache, use_cache=True).logits
            logp_V = _sampling_logprobs(logits[0, -1].double(), sampling)
            token = int(torch.multinomial(logp_V.exp(), 1, generator=generator))
            tokens.append(token)
            logprobs.append(float(logp_V[token]))
            if token in sampling.stop_token_ids:
                finish = "stop"
                break
            inputs = torch.tensor([[token]])
        return GenerationResult(
            request.request_id, tuple(tokens), tuple(logprobs), finish, self.policy_version
        )

    @torch.no_grad()
    def load_weights(self, path: Path, version: int) -> None:
        state = load_file(str(path))
        params = dict(self.model.named_parameters())
        missing = sorted(set(params) - set(state))
        if missing:
            raise KeyError(f"{path}: weights missing for {missing[:3]}")
        for name, tensor in state.items():
            params[name].copy_(tensor)
        self.policy_version = version

    def close(self) -> None:
        pass


def _sampling_logprobs(logits_V: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
    """Log-probs of the sampling distribution (the learner's own function)."""
    return sampling_log_softmax(
        logits_V, SamplingFilter(sampling.temperature, sampling.top_k, sampling.top_p)
    )
