"""An RMSNorm that computes in the wider of float32 and the input dtype.

Hugging Face's Llama/Qwen RMSNorm casts to float32 inside, even for float64 inputs, and
its backward then rounds gradients to float32. That is harmless for training but makes
float64 exactness checks meaningless (a split backward differs from a joint one by ~1e-7).
For float32 and bfloat16 inputs this norm is the same computation as the stock one; for
float64 it stays in float64. Parameter names and shapes are unchanged, so checkpoints load
and save exactly as before.
"""

from __future__ import annotations

import torch
from torch import nn

# Classes whose forward is exactly weight * (x / rms(x)) with the float32 upcast.
_REPLACEABLE = {"Qwen3RMSNorm", "Qwen2RMSNorm", "LlamaRMSNorm", "MistralRMSNorm"}


class WideRMSNorm(nn.Module):
    """weight * x / sqrt(mean(x^2) + eps), computed in max(float32, x.dtype)."""

    def __init__(self, weight: nn.Parameter, eps: float) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        compute_dtype = torch.promote_types(input_dtype, torch.float32)
        x = hidden_states.to(compute_dtype)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def widen_rms_norms(model: nn.Module) -> int:
    """Swap known float32-upcasting RMSNorm modules for WideRMSNorm in place.

    Returns the number of modules replaced. Unknown norm classes are left alone.
    """
    replaced = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child).__name__ in _REPLACEABLE:
                weight = child.weight
                assert isinstance(weight, nn.Parameter)
                eps = float(child.variance_epsilon)  # type: ignore[arg-type]
                setattr(parent, child_name, WideRMSNorm(weight, eps))
                replaced += 1
    return replaced
