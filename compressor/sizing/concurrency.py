"""How many concurrent requests of a given context length a GPU, a tensor-parallel group and a node hold.

A replica is one tensor-parallel group of `tp` GPUs serving one copy of the model. Weights are split
evenly across the group; the KV cache splits over at most as many GPUs as there are KV heads and the
Mamba state over at most as many as there are SSM groups (beyond that they are replicated). Each GPU
holds back the runtime reserve. Concurrency is what fits in the rest, request by request.
"""

from __future__ import annotations

import math
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field

from tailor.compressor.compute import ComputeDtype
from tailor.compressor.model.architecture import Architecture
from tailor.compressor.sizing.hardware import GpuProfile, Precision
from tailor.compressor.sizing.memory import (
    KvDtype,
    QuantRecipe,
    RuntimeReserve,
    kv_bytes_per_token,
    state_bytes_per_request,
    usable_bytes,
    weight_bytes,
)


class Binding(StrEnum):
    """The resource that stops one more request from fitting."""

    WEIGHTS = "weights"  # the weights alone do not fit: no request can be served
    KV_CACHE = "kv-cache"  # per-request memory is mostly KV cache
    SSM_STATE = "ssm-state"  # per-request memory is mostly Mamba state


class Footprint(BaseModel):
    """Bytes one replica needs, per GPU of its tensor-parallel group."""

    model_config = ConfigDict(frozen=True)

    weights: int = Field(description="Weight bytes per GPU.")
    kv_per_request: int = Field(description="KV-cache bytes per request per GPU at the context length.")
    state_per_request: int = Field(description="Mamba SSM and conv state bytes per request per GPU.")
    reserve: int = Field(description="Runtime reserve per GPU.")
    usable: int = Field(description="Device memory less the reserve, per GPU.")
    attention_layers: int = Field(0, description="Layers with a KV cache (engines page each layer's cache).")
    mamba_layers: int = Field(0, description="Layers with a Mamba state (one engine page each per request).")

    @property
    def per_request(self) -> int:
        return self.kv_per_request + self.state_per_request


class Sizing(BaseModel):
    """The answer `tailor size` prints and the operator uses to shape deployments."""

    model_config = ConfigDict(frozen=True)  # the operator keeps one per build and GPU (`pools.SIZINGS`)

    model: str
    gpu: str
    context: int
    recipe: str
    kv_dtype: KvDtype
    ssm_dtype: str
    dtype: ComputeDtype = Field(ComputeDtype.BFLOAT16, description="What the engine computes in and keeps "
                                "unquantized weights in (float32 on a CPU without BF16 math).")
    tensor_parallel: int
    gpus_per_node: int
    total_params: int
    active_params: int
    footprint: Footprint
    concurrency_per_replica: int = Field(description="Requests one tensor-parallel group holds.")
    concurrency_per_gpu: float = Field(description="concurrency_per_replica / tensor_parallel.")
    replicas_per_node: int
    concurrency_per_node: int
    binding: Binding
    target_concurrency: int | None = None
    replicas_for_target: int | None = Field(default=None, description="Replicas needed for the target.")
    warnings: list[str] = Field(default_factory=list)


def footprint(arch: Architecture, gpu: GpuProfile, context: int, recipe: QuantRecipe, kv_dtype: KvDtype,
              reserve: RuntimeReserve, tp: int = 1, ssm_dtype: str | None = None,
              dtype: ComputeDtype = ComputeDtype.BFLOAT16) -> Footprint:
    """Per-GPU bytes of one replica spread over `tp` GPUs, in an engine computing in `dtype`."""
    if context <= 0:
        raise ValueError(f"context must be a positive number of tokens, got {context}")
    if tp <= 0:
        raise ValueError(f"tensor parallelism must be at least 1, got {tp}")
    kv_heads = min((layer.num_kv_heads for layer in arch.attention_layers()), default=tp)
    ssm_groups = min((layer.n_groups for layer in arch.mamba_layers()), default=tp)
    kv = kv_bytes_per_token(arch, kv_dtype) * context
    state = state_bytes_per_request(arch, ssm_dtype, dtype).total
    return Footprint(
        weights=math.ceil(weight_bytes(arch, recipe, dtype) / tp),
        kv_per_request=math.ceil(kv / min(tp, kv_heads)),
        state_per_request=math.ceil(state / min(tp, ssm_groups)),
        reserve=reserve.bytes,
        usable=usable_bytes(gpu, reserve),
        attention_layers=len(arch.attention_layers()),
        mamba_layers=len(arch.mamba_layers()),
    )


def max_requests(fp: Footprint) -> int:
    """Requests that fit beside the weights; a model without request state is capped by nothing here."""
    free = fp.usable - fp.weights
    if free < 0:
        return 0
    if fp.per_request == 0:
        raise ValueError("the model keeps no per-request state (no attention or Mamba layers); "
                         "memory does not bound its concurrency")
    return free // fp.per_request


def size(arch: Architecture, gpu: GpuProfile, context: int, recipe: QuantRecipe, kv_dtype: KvDtype,
         *, reserve: RuntimeReserve | None = None, tp: int = 1, gpus_per_node: int = 8,
         target_concurrency: int | None = None, ssm_dtype: str | None = None,
         dtype: ComputeDtype = ComputeDtype.BFLOAT16) -> Sizing:
    """Concurrency per GPU, per replica and per node, and replicas for a total target, in an engine computing in
    `dtype` (its KV cache is `kv_dtype`: `memory.served_kv_dtype`)."""
    if gpus_per_node < tp:
        raise ValueError(f"tensor parallelism {tp} needs more GPUs than a node has ({gpus_per_node})")
    if target_concurrency is not None and target_concurrency <= 0:
        raise ValueError(f"target concurrency must be positive, got {target_concurrency}")
    fp = footprint(arch, gpu, context, recipe, kv_dtype, reserve or RuntimeReserve(), tp, ssm_dtype, dtype)
    per_replica = max_requests(fp)
    binding = (Binding.WEIGHTS if fp.weights > fp.usable
               else Binding.KV_CACHE if fp.kv_per_request >= fp.state_per_request else Binding.SSM_STATE)
    replicas_per_node = gpus_per_node // tp
    warnings = []
    if note := gpu.fallback_note(recipe.precision):
        warnings.append(note)
    if kv_dtype is KvDtype.FP8 and not gpu.runs_natively(Precision.FP8):
        warnings.append(f"{gpu.name} has no native FP8: an FP8 KV cache is stored in FP8 and converted to "
                        "BF16 for attention, which costs speed but not memory")
    if arch.max_position_embeddings and context > arch.max_position_embeddings:
        warnings.append(f"context {context} is beyond the model's max_position_embeddings "
                        f"({arch.max_position_embeddings})")
    if binding is Binding.WEIGHTS:
        warnings.append(f"weights need {fp.weights / 1e9:.1f} GB per GPU but only {fp.usable / 1e9:.1f} GB is "
                        f"usable after the reserve: use a larger tensor-parallel group or a smaller precision")
    replicas_for_target = None
    if target_concurrency is not None and per_replica > 0:
        replicas_for_target = math.ceil(target_concurrency / per_replica)
    return Sizing(
        model=arch.name, gpu=gpu.name, context=context, recipe=recipe.name, kv_dtype=kv_dtype,
        ssm_dtype=ssm_dtype or arch.ssm_cache_dtype, dtype=dtype, tensor_parallel=tp, gpus_per_node=gpus_per_node,
        total_params=arch.total_params, active_params=arch.active_param_count, footprint=fp,
        concurrency_per_replica=per_replica, concurrency_per_gpu=per_replica / tp,
        replicas_per_node=replicas_per_node, concurrency_per_node=per_replica * replicas_per_node,
        binding=binding, target_concurrency=target_concurrency, replicas_for_target=replicas_for_target,
        warnings=warnings,
    )


def smallest_tensor_parallel(arch: Architecture, gpu: GpuProfile, context: int, recipe: QuantRecipe,
                             kv_dtype: KvDtype, reserve: RuntimeReserve, gpus_per_node: int,
                             ssm_dtype: str | None = None, dtype: ComputeDtype = ComputeDtype.BFLOAT16) -> int:
    """The smallest power-of-two group within a node that holds at least one request."""
    tp = 1
    while tp <= gpus_per_node:
        if max_requests(footprint(arch, gpu, context, recipe, kv_dtype, reserve, tp, ssm_dtype, dtype)) >= 1:
            return tp
        tp *= 2
    raise ValueError(f"{arch.name} does not fit one request of {context} tokens on {gpus_per_node} x {gpu.name}")


class Published(BaseModel):
    """A concurrency someone measured: `count` requests of `context` tokens on one GPU."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    arch: Architecture
    gpu: GpuProfile
    context: int
    recipe: QuantRecipe
    kv_dtype: KvDtype
    count: int = Field(ge=0)


def reserve_window(cases: list[Published]) -> tuple[float, float]:
    """Reserves (bytes, low exclusive, high inclusive) for which every case gives exactly its count.

    The window is empty (low >= high) when no single reserve reproduces all of them.
    """
    low, high = 0.0, float("inf")
    for case in cases:
        fp = footprint(case.arch, case.gpu, case.context, case.recipe, case.kv_dtype, RuntimeReserve(gib=0))
        free = case.gpu.memory_bytes - fp.weights
        low = max(low, free - (case.count + 1) * fp.per_request)  # one more request must not fit
        high = min(high, free - case.count * fp.per_request)  # the published count must
    return low, high

