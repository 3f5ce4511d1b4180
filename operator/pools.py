"""GPU node pools and what each can serve: nodes matched by a pool's selector, their GPU from the GPU Feature
Discovery label, and the cost model's sizing of the compressed, quantized model on that GPU.

The checkpoint is quantized once, for the spec's target GPU (`spec_recipe`); every pool serves that
checkpoint. A pool whose GPUs have no FP8 math (Ampere) cannot serve an FP8 or NVFP4 checkpoint with
TensorRT-LLM and is skipped; NVFP4 on Hopper runs weight-only (W4A16) and is noted. The `cpu` development
profile serves them through the Python backend, which dequantizes them.

Pure functions over Node objects (as the API returns them, in dict form), so the same code sizes a live
cluster and a test's nodes. A pool that cannot serve the model is kept with the reason it was skipped.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel

from tailor.compressor.architecture import Architecture
from tailor.compressor.hardware import GpuCatalog, Precision
from tailor.compressor.memory import KvDtype, QuantRecipe, RuntimeReserve, preferred_kv_dtype, recipe_for
from tailor.compressor.sizing import Sizing, size, smallest_tensor_parallel
from tailor.operator.api import CompressedModelSpec, DeploymentSpec, KvCacheDtype, NodePoolTarget

PRODUCT_LABEL = "nvidia.com/gpu.product"
GPU_RESOURCE = "nvidia.com/gpu"


class PoolPlan(BaseModel):
    """How one pool serves the model, or why it cannot."""

    name: str
    nodes: list[str]
    gpu_product: str | None = None
    gpu_profile: str | None = None
    gpus_per_node: int = 0
    tensor_parallel: int | None = None  # GPUs per replica
    concurrency_per_gpu: float | None = None
    concurrency_per_replica: int | None = None
    target_concurrency: int | None = None
    replicas: int | None = None  # for the target, within [minReplicas, maxReplicas] and the pool's GPUs
    recipe: str | None = None
    kv_dtype: KvDtype | None = None
    sizing: Sizing | None = None
    skipped: str | None = None  # why the pool gets no deployment
    notes: list[str] = []


def matching_nodes(nodes: list[dict[str, Any]], selector: dict[str, str]) -> list[dict[str, Any]]:
    return [node for node in nodes
            if all((node["metadata"].get("labels") or {}).get(k) == v for k, v in selector.items())]


def _allocatable_gpus(node: dict[str, Any]) -> int:
    value = ((node.get("status") or {}).get("allocatable") or {}).get(GPU_RESOURCE, "0")
    return int(value) if str(value).isdigit() else 0


def spec_recipe(spec: CompressedModelSpec, arch: Architecture, catalog: GpuCatalog) -> QuantRecipe:
    """The recipe the quantization Job applies: the spec's precision, `auto` resolved for the target GPU."""
    precision = spec.quantization.precision
    if precision == "auto":
        return recipe_for(catalog.get(spec.compression.target_gpu.value).preferred_precision(), arch)
    return recipe_for(Precision.BF16 if precision == "none" else Precision(precision), arch)


def plan_pool(pool: NodePoolTarget, nodes: list[dict[str, Any]], arch: Architecture, recipe: QuantRecipe,
              kv_cache_dtype: KvCacheDtype, deployment: DeploymentSpec, catalog: GpuCatalog) -> PoolPlan:
    """Size `arch` for the pool: GPUs per replica, requests per replica and replicas for the concurrency."""
    members = matching_nodes(nodes, pool.node_selector)
    plan = PoolPlan(name=pool.name, nodes=sorted(n["metadata"]["name"] for n in members))
    if not members:
        return plan.model_copy(update={"skipped": f"no node matches nodeSelector {pool.node_selector}"})
    products = {(n["metadata"].get("labels") or {}).get(PRODUCT_LABEL) for n in members}
    if len(products) != 1 or None in products:
        return plan.model_copy(update={"skipped": f"the pool's nodes must share one {PRODUCT_LABEL} label, "
                                                  f"found {sorted(map(str, products))}"})
    product = str(products.pop())
    gpu = catalog.for_product(product)
    plan = plan.model_copy(update={"gpu_product": product, "gpus_per_node": min(map(_allocatable_gpus, members))})
    if gpu is None:
        return plan.model_copy(update={"skipped": f"no GPU profile knows {PRODUCT_LABEL}={product}"})
    if plan.gpus_per_node == 0:
        return plan.model_copy(update={"skipped": f"the nodes have no allocatable {GPU_RESOURCE}"})
    if recipe.precision is not Precision.BF16 and not gpu.serves_quantized:
        return plan.model_copy(update={"skipped": f"{gpu.name} ({gpu.family}) has no FP8 math: TensorRT-LLM cannot "
                                                  f"serve the {recipe.precision.value} checkpoint there"})
    kv = preferred_kv_dtype(gpu) if kv_cache_dtype == "auto" else (
        KvDtype.FP8 if kv_cache_dtype == "fp8" else KvDtype.BF16)
    plan = plan.model_copy(update={"gpu_profile": gpu.name, "recipe": recipe.name, "kv_dtype": kv})
    context = deployment.context_length
    try:
        tp = smallest_tensor_parallel(arch, gpu, context, recipe, kv, RuntimeReserve(), plan.gpus_per_node)
    except ValueError as error:
        return plan.model_copy(update={"skipped": f"{error} ({recipe.name} weights, {kv.value} KV cache)"})
    sizing = size(arch, gpu, context, recipe, kv, tp=tp, gpus_per_node=plan.gpus_per_node)
    target = (pool.concurrency.per_node * len(members) if pool.concurrency.per_node is not None
              else pool.concurrency.total)
    assert target is not None  # the API guarantees exactly one of perNode and total
    needed = math.ceil(target / sizing.concurrency_per_replica)
    capacity = sizing.replicas_per_node * len(members)
    replicas = max(deployment.min_replicas, min(needed, deployment.max_replicas, capacity))
    notes = list(sizing.warnings)
    if needed > min(deployment.max_replicas, capacity):
        limit = "maxReplicas" if deployment.max_replicas < capacity else "the pool's GPUs"
        notes.append(f"{target} concurrent requests need {needed} replicas of {sizing.concurrency_per_replica}; "
                     f"{limit} allow {replicas}")
    return plan.model_copy(update={
        "tensor_parallel": tp, "concurrency_per_gpu": sizing.concurrency_per_gpu,
        "concurrency_per_replica": sizing.concurrency_per_replica, "target_concurrency": target,
        "replicas": replicas, "sizing": sizing, "notes": notes})


def plan_pools(spec: CompressedModelSpec, nodes: list[dict[str, Any]], arch: Architecture,
               catalog: GpuCatalog | None = None) -> list[PoolPlan]:
    """One plan per pool of the spec's deployment, for the child `arch` as the spec quantizes it."""
    if spec.deployment is None:
        return []
    catalog = catalog or GpuCatalog.load()
    recipe = spec_recipe(spec, arch, catalog)
    return [plan_pool(pool, nodes, arch, recipe, spec.quantization.kv_cache_dtype, spec.deployment, catalog)
            for pool in spec.deployment.pools]
