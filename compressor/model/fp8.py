"""FP8 (E4M3) as modelopt exports it: `weight` in float8_e4m3fn with one float32 `weight_scale`, and a
static `input_scale` for the activations (W8A8, per tensor). `Fp8Linear` computes from exactly those
tensors, rounding its inputs to FP8 as an FP8 GEMM sees them. `Fp8Round` rounds keys or values to an FP8
KV cache with the exported `k_scale` / `v_scale`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8_MAX = 448.0  # the largest finite float8_e4m3fn


def round_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x as FP8 with `scale` (x / scale saturated to the E4M3 range, then cast), back in x's dtype."""
    scaled = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (scaled.float() * scale).to(x.dtype)


class Fp8Linear(nn.Module):
    """A bias-free linear layer stored as an FP8 export stores it."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    input_scale: torch.Tensor
    values: torch.Tensor

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_scale", torch.ones(()))
        self.register_buffer("input_scale", torch.ones(()))
        self.register_buffer("values", torch.zeros(out_features, in_features, dtype=dtype), persistent=False)

    def refresh(self) -> Fp8Linear:
        """Recompute the dequantized weights after the stored tensors changed (e.g. a state-dict load)."""
        self.values = (self.weight.float() * self.weight_scale.float()).to(self.values.dtype)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(round_fp8(x, self.input_scale), self.values)


class Fp8Round(nn.Module):
    """Rounds a tensor to FP8 with a fixed scale: an attention layer's keys or values in an FP8 KV cache."""

    scale: torch.Tensor

    def __init__(self, scale: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("scale", scale.detach().float().clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return round_fp8(x, self.scale)
