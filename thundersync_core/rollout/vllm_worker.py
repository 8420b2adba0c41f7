"""vLLM worker extension: reload the policy's weights in place, from a safetensors file or
from the learner's broadcast.

``collective_rpc`` cannot carry tensors on CPU, so with file publication the learner writes
the weights to a file (under /dev/shm where it exists) and every worker reads it. With
collective publication each worker joins the learner's publication group once
(``thundersync_join_weight_group``) and receives every version there
(``rollout/weight_sync.py``). Method names are prefixed so they cannot collide with the
worker's own methods (``update_weights``, ``reload_weights``). vLLM mixes this class into
its worker at start-up, so it is imported by path, not by object.
"""

from __future__ import annotations

from typing import Any

import torch
from safetensors.torch import load_file


class WeightReloadExtension:
    model_runner: Any  # provided by the vLLM worker this class is mixed into

    def thundersync_load_weights(self, path: str) -> int:
        """Load every tensor of ``path`` into the running model; returns the tensor count."""
        state = load_file(path)
        self.model_runner.reload_weights(weights_iterator=iter(state.items()))
        self._retie_embeddings()
        return len(state)

    def thundersync_join_weight_group(
        self,
        *,
        address: dict[str, Any],
        rank_offset: int,
        layout: list[tuple[str, tuple[int, ...]]],
        dtype: str,
        bucket_bytes: int,
    ) -> int:
        """Join the publication group as rank ``rank_offset`` + this worker's rank."""
        from thundersync_core.rollout.weight_sync import GroupAddress, WeightGroup  # noqa: PLC0415

        where = GroupAddress(**address)
        rank = rank_offset + int(getattr(self, "rank", 0))
        self._publication = {
            "group": WeightGroup(where, rank),
            "layout": [(name, tuple(shape)) for name, shape in layout],
            "dtype": getattr(torch, dtype),
            "bucket_bytes": bucket_bytes,
            "device": "cuda" if where.backend == "nccl" else "cpu",
        }
        return rank

    def thundersync_receive_weights(self, verify: bool) -> dict[str, Any]:
        """Receive one publication whole, then load it; with ``verify``, a checksum of what
        arrived and the loaded parameters whose bytes differ from it."""
        from thundersync_core.rollout.weight_sync import checksum, receive_weights  # noqa: PLC0415

        pub = self._publication
        staged = receive_weights(
            pub["group"],
            pub["layout"],
            dtype=pub["dtype"],
            bucket_bytes=pub["bucket_bytes"],
            device=pub["device"],
        )
        self.model_runner.reload_weights(weights_iterator=iter(staged))
        self._retie_embeddings()
        if not verify:
            return {"tensors": len(staged)}
        differ, opaque, compared = self._compare(dict(staged))
        return {
            "tensors": len(staged),
            "checksum": checksum(staged),
            "differ": differ,
            "opaque": opaque,
            "compared": compared,
        }

    def _compare(self, sent: dict[str, torch.Tensor]) -> tuple[list[str], list[str], int]:
        """Loaded parameters against what was sent: (those whose bytes differ, those the
        engine keeps in another layout, how many were compared). A packed parameter (such
        as ``qkv_proj``) is compared with its parts concatenated as the model packs them. On
        CPU vLLM hands linear weights to its GEMM backend after loading (a prepacked copy;
        the parameter left empty or re-laid out): those are *opaque*, their values vouched
        for by the checksum of what arrived."""
        model = self.model_runner.get_model()
        packed = getattr(model, "packed_modules_mapping", {}) or {}
        embed = next((n for n in sent if n.endswith("embed_tokens.weight")), None)
        differ, opaque, compared = [], [], 0
        for name, param in model.named_parameters():
            expected = sent.get(name)
            if expected is None:
                for fused, parts in packed.items():
                    if f".{fused}." in name:
                        pieces = [sent.get(name.replace(fused, part)) for part in parts]
                        if all(p is not None for p in pieces):
                            expected = torch.cat(pieces, dim=0)  # type: ignore[arg-type]
            if expected is None and name == "lm_head.weight" and embed is not None:
                expected = sent[embed]  # a tied head
            if expected is None:
                differ.append(f"{name} (not sent)")
            elif param.shape != expected.shape or param.dtype != expected.dtype:
                opaque.append(name)
            else:
                compared += 1
                if not torch.equal(param.detach().to(expected.device), expected):
                    differ.append(name)
        return differ, opaque, compared

    def _retie_embeddings(self) -> None:
        """Refresh a tied output head after an in-place reload.

        Checkpoints of tied models carry no ``lm_head``, so the reload refreshes only the
        input embedding; on CPU the head computes through a GEMM handle prepared from the
        embedding at load time, which keeps the old values. Re-run the head's post-load
        processing (and copy the weight when the tie was broken) so it reads the new ones.
        """
        config = self.model_runner.model_config.hf_config
        if not getattr(config, "tie_word_embeddings", False):
            return
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or embed is None:
            return
        if head.weight is not embed.weight:
            if head.weight.shape != embed.weight.shape:
                raise RuntimeError(
                    f"tied head {tuple(head.weight.shape)} and embedding "
                    f"{tuple(embed.weight.shape)} differ: cannot re-tie after reload"
                )
            with torch.no_grad():
                head.weight.copy_(embed.weight)
        method = getattr(head, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(head)
