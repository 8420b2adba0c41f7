"""vLLM worker extension: reload the policy's weights in place from a safetensors file.

``collective_rpc`` cannot carry tensors on CPU, so the learner writes the weights to a file
(under /dev/shm where it exists) and every worker reads it. The method name is prefixed so
it cannot collide with the worker's own methods (``update_weights``, ``reload_weights``).
vLLM mixes this class into its worker at start-up, so it is imported by path, not by object.
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
