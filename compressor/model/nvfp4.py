"""NVFP4 in pure torch, as modelopt exports it and serving engines read it, so a quantized model runs on a CPU.

modelopt's NVFP4 fake-quantization needs CUDA ("amax must be a CUDA tensor for dynamic block
quantization"), but its `NVFP4QTensor` packs and unpacks in plain torch. A weight becomes E2M1 values
two to a byte (`weight`, uint8), one FP8-E4M3 scale per block of 16 along the input dimension
(`weight_scale`) and one float32 scale per tensor (`weight_scale_2`): 4.5 bits per weight.
`Nvfp4Linear` holds exactly those tensors, under those names, and computes from them. With an
`input_scale` (W4A4) its inputs are quantized the way NVFP4 kernels do: block scales computed per
call, the global scale fixed by calibration. Without one, weight-only (W4A16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

BLOCK = 16


@dataclass
class PackedNvfp4:
    """A tensor in NVFP4: what an exported checkpoint holds for it."""

    data: torch.Tensor  # uint8 [..., n / 2]: two E2M1 codes per byte
    scale: torch.Tensor  # float8_e4m3fn [..., n / 16]: one per block
    global_scale: torch.Tensor  # float32 scalar
    shape: torch.Size

    @property
    def nbytes(self) -> int:
        return self.data.numel() + self.scale.numel() + 4


def pack(tensor: torch.Tensor, global_scale: torch.Tensor | None = None) -> PackedNvfp4:
    """Quantize along the last dimension, which must be a multiple of 16. The global scale defaults to
    modelopt's, amax / (6 * 448)."""
    if tensor.shape[-1] % BLOCK:
        raise ValueError(f"NVFP4 needs the last dimension to be a multiple of {BLOCK}, got {tuple(tensor.shape)}")
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor  # seconds to import: NVFP4 only

    quantized, scale, global_scale = NVFP4QTensor.quantize(
        tensor.float(), BLOCK, weights_scaling_factor_2=None if global_scale is None else global_scale.float())
    return PackedNvfp4(quantized._quantized_data, scale, global_scale.float(), tensor.shape)


def unpack(packed: PackedNvfp4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values the packed tensor stands for."""
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor  # seconds to import: NVFP4 only

    holder = NVFP4QTensor(packed.shape, torch.float32, packed.data)
    values: torch.Tensor = holder.dequantize(dtype=torch.float32, scale=packed.scale.to(torch.float8_e4m3fn),
                                             double_scale=packed.global_scale.float(), block_sizes={-1: BLOCK})
    return values.to(dtype)


class Nvfp4Linear(nn.Module):
    """A bias-free linear layer stored as an NVFP4 export stores it, computed exactly from those tensors."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    weight_scale_2: torch.Tensor
    input_scale: torch.Tensor | None
    values: torch.Tensor

    def __init__(self, in_features: int, out_features: int, quantize_inputs: bool,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if in_features % BLOCK:
            raise ValueError(f"NVFP4 needs in_features to be a multiple of {BLOCK}, got {in_features}")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.zeros(out_features, in_features // BLOCK,
                                                         dtype=torch.float8_e4m3fn))
        self.register_buffer("weight_scale_2", torch.ones(()))
        self.register_buffer("input_scale", torch.ones(()) if quantize_inputs else None)
        self.register_buffer("values", torch.zeros(out_features, in_features, dtype=dtype), persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear, input_scale: torch.Tensor | None = None) -> Nvfp4Linear:
        """Pack a linear layer's weights; with an `input_scale`, its inputs are quantized too (W4A4)."""
        if linear.bias is not None:
            raise ValueError("NVFP4 covers bias-free linear layers")
        layer = cls(linear.in_features, linear.out_features, quantize_inputs=input_scale is not None)
        packed = pack(linear.weight.detach())
        layer.weight, layer.weight_scale, layer.weight_scale_2 = packed.data, packed.scale, packed.global_scale
        layer.input_scale = input_scale
        return layer.refresh()

    def packed(self) -> PackedNvfp4:
        return PackedNvfp4(self.weight, self.weight_scale, self.weight_scale_2,
                           torch.Size((self.out_features, self.in_features)))

    def refresh(self) -> Nvfp4Linear:
        """Recompute the dequantized weights after the packed tensors changed (e.g. a state-dict load)."""
        self.values = unpack(self.packed(), self.values.dtype)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale is not None:
            x = unpack(pack(x, self.input_scale), x.dtype)
        return F.linear(x, self.values)
