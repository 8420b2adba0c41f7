"""The rollout engine protocol: token ids in, token ids and sampled log-probs out.

Engines never re-tokenise: a request carries the exact context token ids, a result carries
the exact sampled ids and, for each, its log-prob under the distribution that sampled it
(the logits divided by the temperature, cut by top-k and top-p, log-softmaxed:
``policy.logprobs.sampling_log_softmax``; at temperature 1 without filters the plain
log-softmax). Every result reports the policy version
of the weights that produced it. Sampling is seeded per request from (base seed, group,
trajectory, turn), so a trajectory's tokens do not depend on how requests were batched or
scheduled (see each engine for what it guarantees).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

FinishReason = Literal["stop", "length"]


class EngineFailed(RuntimeError):
    """The engine cannot serve any more requests (its process died); the rollout role must
    be restarted. The training stage does so from the latest checkpoint."""


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    stop_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    seed: int
    #: The episode's group: several engines keep a group on one (its shared prompt's cache).
    group_id: str = ""


@dataclass(frozen=True)
class GenerationResult:
    request_id: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: FinishReason
    policy_version: int


class RolloutEngine(Protocol):
    """What the agent loop needs from an inference engine."""

    policy_version: int

    def generate(
        self, requests: Sequence[GenerationRequest], sampling: SamplingConfig
    ) -> list[GenerationResult]: ...

    def load_weights(self, path: Path, version: int) -> None:
        """Load a safetensors file of full weights in place; report ``version`` afterwards."""
        ...

    def close(self) -> None: ...


def request_seed(base_seed: int, group: str, trajectory: str, turn: int) -> int:
    """A 63-bit seed that depends only on the request's identity, never on batching."""
    key = f"{base_seed}/{group}/{trajectory}/{turn}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") >> 1


def gone_processes(pids: Sequence[int]) -> list[int]:
    """Those of ``pids`` that have exited (a zombie counts: its parent has not reaped it)."""
    import psutil  # noqa: PLC0415

    gone = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                gone.append(pid)
        except psutil.NoSuchProcess:
            gone.append(pid)
    return gone
