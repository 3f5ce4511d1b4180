"""What a `tailor quantize` format means: the precision recipe (tensor groups, modelopt preset) for a
model on a target GPU, and the tensor group of each linear layer of the project's modeling."""

from __future__ import annotations

from enum import StrEnum

from tailor.compressor.model.architecture import Architecture, TensorGroup
from tailor.compressor.sizing.hardware import GpuProfile, Precision, resolve_precision
from tailor.compressor.sizing.memory import RECIPES, QuantRecipe, recipe_for


class QuantFormat(StrEnum):
    AUTO = "auto"  # NVFP4 where the GPU computes in it (Blackwell), FP8 on Hopper and Ada
    NVFP4 = "nvfp4"  # W4A4: weights and activations in NVFP4
    NVFP4_W4A16 = "nvfp4-w4a16"  # weights in NVFP4, activations in BF16
    FP8 = "fp8"  # W8A8 per tensor


def choose_recipe(fmt: QuantFormat, arch: Architecture, gpu: GpuProfile | None) -> tuple[QuantRecipe, str]:
    """The recipe and a sentence saying why it was chosen (and what the GPU will make of it)."""
    if fmt is QuantFormat.AUTO:
        if gpu is None:
            raise ValueError("--format auto needs a target GPU (--gpu) to choose between nvfp4 and fp8")
        precision = resolve_precision("auto", gpu)
        if precision is Precision.BF16:
            raise ValueError(f"--format auto: {gpu.name} ({gpu.family}) computes in neither NVFP4 nor FP8; "
                             "pick --format fp8 or nvfp4 explicitly")
        recipe = recipe_for(precision, arch)
        return recipe, (f"auto: {gpu.name} ({gpu.family}) computes natively in {precision.value}, so "
                        f"{recipe.name} ({recipe.modelopt_config})")
    recipe = RECIPES["nvfp4-w4a16"] if fmt is QuantFormat.NVFP4_W4A16 else recipe_for(Precision(fmt.value), arch)
    reason = f"{fmt.value} as asked: {recipe.name} ({recipe.modelopt_config})"
    note = gpu.fallback_note(recipe.precision) if gpu is not None else None
    return recipe, f"{reason}; {note}" if note else reason


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
