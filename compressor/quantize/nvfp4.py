"""NVFP4 in pure torch, as serving engines store it, so a quantized model can be evaluated on a CPU.

modelopt's NVFP4 fake-quantization needs CUDA ("amax must be a CUDA tensor for dynamic block
quantization"), but its `NVFP4QTensor` packs and unpacks in plain torch. A weight becomes E2M1 values
two to a byte, one FP8-E4M3 scale per block of 16 along the input dimension, and one float32 scale per
tensor: 4.5 bits per weight. `Nvfp4Linear` runs a linear layer from exactly those packed tensors, and can
quantize its inputs the same way (W4A4, as NVFP4 kernels do) or not (W4A16). `emulate` applies a
precision recipe of `tailor.compressor.memory` (which tensor groups are quantized) to a whole model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor
from torch import nn

from tailor.compressor.architecture import TensorGroup
from tailor.compressor.hardware import Precision
from tailor.compressor.memory import QuantRecipe

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


def pack(tensor: torch.Tensor) -> PackedNvfp4:
    """Quantize along the last dimension, which must be a multiple of 16."""
    if tensor.shape[-1] % BLOCK:
        raise ValueError(f"NVFP4 needs the last dimension to be a multiple of {BLOCK}, got {tuple(tensor.shape)}")
    quantized, scale, global_scale = NVFP4QTensor.quantize(tensor.float(), BLOCK)
    return PackedNvfp4(quantized._quantized_data, scale, global_scale.float(), tensor.shape)


def unpack(packed: PackedNvfp4, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values the packed tensor stands for."""
    holder = NVFP4QTensor(packed.shape, torch.float32, packed.data)
    values: torch.Tensor = holder.dequantize(dtype=torch.float32, scale=packed.scale,
                                             double_scale=packed.global_scale, block_sizes={-1: BLOCK})
    return values.to(dtype)


class Nvfp4Linear(nn.Module):
    """A bias-free linear layer computed from NVFP4-packed weights, optionally on NVFP4-quantized inputs."""

    weight: torch.Tensor
    packed: PackedNvfp4

    def __init__(self, linear: nn.Linear, quantize_inputs: bool) -> None:
        super().__init__()
        if linear.bias is not None:
            raise ValueError("NVFP4 emulation covers bias-free linear layers")
        self.packed = pack(linear.weight.detach())
        self.quantize_inputs: bool = quantize_inputs
        self.register_buffer("weight", unpack(self.packed), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantize_inputs:
            x = unpack(pack(x), x.dtype)
        return F.linear(x, self.weight.to(x.dtype))


def tensor_group(name: str) -> TensorGroup:
    """The tensor group of a linear layer of the project's modeling, from its checkpoint name."""
    leaf = name.rsplit(".", 1)[-1]
    if name == "lm_head":
        return TensorGroup.LM_HEAD
    if leaf in ("linear_attn", "linear_mlp"):
        return TensorGroup.LINEAR
    if leaf in ("q_proj", "k_proj", "v_proj", "o_proj"):
        return TensorGroup.ATTENTION
    if leaf in ("in_proj", "out_proj"):
        return TensorGroup.MAMBA_PROJ
    if leaf in ("fc1_latent_proj", "fc2_latent_proj"):
        return TensorGroup.LATENT
    if ".shared_experts." in f"{name}.":
        return TensorGroup.SHARED_EXPERTS
    if ".experts." in name:
        return TensorGroup.EXPERTS
    if leaf in ("gate_proj", "up_proj", "down_proj"):
        return TensorGroup.MLP
    raise ValueError(f"{name}: no tensor group for this linear layer")


def emulate(model: nn.Module, recipe: QuantRecipe, quantize_inputs: bool = True) -> dict[str, PackedNvfp4]:
    """Replace, in place, every linear layer the recipe quantizes by its `Nvfp4Linear`; the packed weights
    by layer name (what an export writes)."""
    if recipe.precision is not Precision.NVFP4:
        raise ValueError(f"recipe {recipe.name} is {recipe.precision.value}, not nvfp4")
    packed: dict[str, PackedNvfp4] = {}
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and tensor_group(name) in recipe.quantized:
            parent_name, _, leaf = name.rpartition(".")
            replacement = Nvfp4Linear(module, quantize_inputs)
            setattr(model.get_submodule(parent_name), leaf, replacement)
            packed[name] = replacement.packed
    return packed
