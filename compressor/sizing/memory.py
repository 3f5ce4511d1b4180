"""What a model occupies on a GPU: weights per quantization recipe, KV cache, Mamba state, runtime reserve.

Recipes mirror nvidia-modelopt's presets (`modelopt.torch.quantization`): which tensor groups a preset
quantizes, and at how many bits. NVFP4 stores 4 bits a weight plus one FP8 scale per 16 weights
(4.5 bits); FP8 stores 8 bits plus a per-tensor scale. Everything a preset leaves alone stays BF16, or is
widened to float32 by an engine that computes in float32 (a CPU without BF16 math, `compute.resolve`): its
weights, its KV cache (vLLM's `auto`: the model dtype) and its Mamba convolution window. No torch here.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from tailor.compressor.compute import ComputeDtype
from tailor.compressor.model.architecture import Architecture, Block, Mamba, TensorGroup
from tailor.compressor.sizing.hardware import GpuProfile, Precision

GIB = 1024**3
GB = 10**9
BF16_BITS = 16.0


class KvDtype(StrEnum):
    BF16 = "bf16"
    FP8 = "fp8"
    FP32 = "fp32"  # an unquantized KV cache kept by an engine computing in float32 (`served_kv_dtype`)


KV_BYTES = {KvDtype.BF16: 2, KvDtype.FP8: 1, KvDtype.FP32: 4}
STATE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

_LINEAR_LAYERS = frozenset({
    TensorGroup.ATTENTION, TensorGroup.LINEAR, TensorGroup.MAMBA_PROJ, TensorGroup.MLP,
    TensorGroup.LATENT, TensorGroup.EXPERTS, TensorGroup.SHARED_EXPERTS,
})


class QuantRecipe(BaseModel):
    """A precision recipe: the tensor groups it quantizes and the bits a quantized weight costs."""

    model_config = ConfigDict(frozen=True)

    name: str
    precision: Precision
    bits: float = Field(gt=0, le=BF16_BITS)
    quantized: frozenset[TensorGroup]
    modelopt_config: str | None = Field(description="The modelopt preset this recipe follows.")
    weight_only: bool = Field(default=False, description="Activations stay BF16 (e.g. W4A16).")

    def bits_for(self, group: TensorGroup, dtype: ComputeDtype = ComputeDtype.BFLOAT16) -> float:
        """Bits a weight of `group` costs in an engine computing in `dtype` (which widens what stays BF16)."""
        return self.bits if group in self.quantized else 8.0 * dtype.bytes


# modelopt's defaults quantize every nn.Linear but the LM head and MoE routers; its Mamba-MoE presets
# also keep attention and the latent MoE projections in BF16 ("aggressive"), and the conservative
# ones keep the Mamba in/out projections too.
_MAMBA_MOE = _LINEAR_LAYERS - {TensorGroup.ATTENTION, TensorGroup.LATENT}
RECIPES = {recipe.name: recipe for recipe in (
    QuantRecipe(name="bf16", precision=Precision.BF16, bits=16, quantized=frozenset(), modelopt_config=None),
    QuantRecipe(name="fp8", precision=Precision.FP8, bits=8, quantized=_LINEAR_LAYERS,
                modelopt_config="FP8_DEFAULT_CFG"),
    QuantRecipe(name="fp8-mamba-moe", precision=Precision.FP8, bits=8, quantized=_MAMBA_MOE,
                modelopt_config="MAMBA_MOE_FP8_AGGRESSIVE_CFG"),
    QuantRecipe(name="nvfp4", precision=Precision.NVFP4, bits=4.5, quantized=_LINEAR_LAYERS,
                modelopt_config="NVFP4_DEFAULT_CFG"),
    QuantRecipe(name="nvfp4-w4a16", precision=Precision.NVFP4, bits=4.5, quantized=_LINEAR_LAYERS,
                modelopt_config="W4A16_NVFP4_CFG", weight_only=True),
    QuantRecipe(name="nvfp4-mamba-moe", precision=Precision.NVFP4, bits=4.5, quantized=_MAMBA_MOE,
                modelopt_config="MAMBA_MOE_NVFP4_AGGRESSIVE_CFG"),
    QuantRecipe(name="nvfp4-mamba-moe-conservative", precision=Precision.NVFP4, bits=4.5,
                quantized=_MAMBA_MOE - {TensorGroup.MAMBA_PROJ}, modelopt_config="MAMBA_MOE_NVFP4_CONSERVATIVE_CFG"),
)}


def recipe_for(precision: Precision, arch: Architecture) -> QuantRecipe:
    """The default recipe for a precision: modelopt's Mamba-MoE preset for hybrids, its default otherwise."""
    if precision is Precision.BF16:
        return RECIPES["bf16"]
    return RECIPES[f"{precision.value}-mamba-moe" if arch.is_hybrid else precision.value]


def preferred_kv_dtype(gpu: GpuProfile) -> KvDtype:
    """The `auto` KV-cache dtype: FP8 where the GPU has FP8 math, else BF16."""
    return KvDtype.FP8 if gpu.runs_natively(Precision.FP8) else KvDtype.BF16


def served_kv_dtype(kv: KvDtype, dtype: ComputeDtype) -> KvDtype:
    """The KV cache an engine computing in `dtype` keeps for a checkpoint built with `kv`: an FP8 cache as
    exported, an unquantized one in the compute dtype (vLLM's `auto`)."""
    if kv is KvDtype.FP8:
        return kv
    return KvDtype.FP32 if dtype is ComputeDtype.FLOAT32 else KvDtype.BF16


def resolve_kv_dtype(requested: str, gpu: GpuProfile) -> KvDtype:
    """The one place an `auto` KV-cache dtype is decided (for the GPU the model is built for); fp16 is stored
    like bf16 (two bytes)."""
    if requested == "auto":
        return preferred_kv_dtype(gpu)
    return {"fp8": KvDtype.FP8, "fp32": KvDtype.FP32}.get(requested, KvDtype.BF16)


def block_weight_bytes(block: Block, hidden: int, recipe: QuantRecipe) -> float:
    return float(sum(count * recipe.bits_for(group) / 8 for group, count in block.params(hidden).items()))


def weight_bytes(arch: Architecture, recipe: QuantRecipe, dtype: ComputeDtype = ComputeDtype.BFLOAT16) -> int:
    """Bytes of all weights under a recipe (embeddings, norms and LM head included), in an engine computing in
    `dtype`."""
    return round(sum(count * recipe.bits_for(group, dtype) / 8 for group, count in arch.params().items()))


def kv_bytes_per_token(arch: Architecture, kv_dtype: KvDtype) -> int:
    """K and V of every attention layer for one token."""
    return int(sum(layer.kv_elements_per_token() for layer in arch.attention_layers())) * KV_BYTES[kv_dtype]


class StateBytes(BaseModel):
    """Mamba state a request holds whatever its length: the SSM state and the convolution window."""

    ssm: int
    conv: int

    @property
    def total(self) -> int:
        return self.ssm + self.conv


def state_bytes_per_request(arch: Architecture, ssm_dtype: str | None = None,
                            dtype: ComputeDtype = ComputeDtype.BFLOAT16) -> StateBytes:
    """SSM state in the model's `mamba_ssm_cache_dtype` (float32 unless the config says otherwise), the
    convolution window in the engine's compute dtype."""
    return mamba_state_bytes(arch.mamba_layers(), ssm_dtype or arch.ssm_cache_dtype, dtype)


def mamba_state_bytes(layers: list[Mamba], ssm_dtype: str,
                      dtype: ComputeDtype = ComputeDtype.BFLOAT16) -> StateBytes:
    """The state one request holds in these Mamba layers."""
    if ssm_dtype not in STATE_BYTES:
        raise ValueError(f"SSM state dtype {ssm_dtype!r} is not one of {', '.join(STATE_BYTES)}")
    return StateBytes(ssm=int(sum(layer.ssm_elements() for layer in layers)) * STATE_BYTES[ssm_dtype],
                      conv=int(sum(layer.conv_elements() for layer in layers)) * dtype.bytes)


class RuntimeReserve(BaseModel):
    """Memory held back on every GPU before weights and request state are placed.

    It covers what a serving engine needs beside weights and cache: the CUDA context and library
    workspaces (cuBLAS, NCCL: about 1 GiB), activations of the largest prefill chunk and the sampler's
    logits (a few GiB for a 131K vocabulary), CUDA graphs, and allocator fragmentation.

    The default, 6.25 GiB per GPU whatever the GPU, is calibrated, not derived: it was chosen against
    the one published pair we can check (Nemotron-3-Super 1 vs Puzzle-75B-A9B 8 concurrent requests of
    10^6 tokens on one H100, NVFP4 weights, FP8 KV cache, FP32 SSM state). Both hold only for a reserve
    in (6.55, 6.78] GB = (6.10, 6.32] GiB, and 6.25 GiB is the quarter-GiB step inside it;
    `bench/sizing.py` recomputes the window. vLLM's default gpu_memory_utilization=0.90 would hold back
    8.6 GB on an H100 and give 1 vs 7.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    gib: float = Field(default=6.25, ge=0, description="GiB held back per GPU.")

    @property
    def bytes(self) -> int:
        return round(self.gib * GIB)


def usable_bytes(gpu: GpuProfile, reserve: RuntimeReserve) -> int:
    return gpu.memory_bytes - reserve.bytes
