"""GPU node pools and what each can serve: nodes matched by a pool's selector, their GPU from their labels (GPU Feature
Discovery's product, GKE's accelerator, an instance type or a team's own label, as the GPU profiles name them;
`node_gpu`), and the cost model's sizing of what the build produced (`Built`: the child's architecture, the quantize
Job's recipe and KV-cache dtype) on that GPU.

Only nodes that are Ready and report allocatable GPUs count: a node that is draining, NotReady or whose device
plugin restarts is not capacity. A pool with no such node, or whose nodes could not hold `minReplicas` replicas even
with every GPU free, is skipped with the reason; the operator keeps a revision it already serves there (node churn
must not take serving down). Of the nodes' allocatable GPUs, those that pods bound to the node hold (`HeldGpus`, any
namespace's unfinished pods, but not the revision being sized) are not capacity either: replicas are capped at what
the free GPUs hold, and where that limits them the status says how many GPUs other pods hold (only there: other
tenants' pods come and go, and a figure that follows them would rewrite every model's status as they do). A pool
whose GPUs have no FP8 math (Ampere) cannot serve an FP8 or NVFP4 checkpoint and is skipped; NVFP4 on Hopper runs
weight-only (W4A16) and is noted. Each pool gets its engine (`sizing/engines.py`): vLLM on GPUs; on the `cpu`
development profile vLLM's CPU build with the BF16 child where it cannot run the quantized checkpoint, or the Python
fallback engine where it cannot run the model at all (MoE hybrids). Before there is a build, what a pool asks of
each GPU (`gpu_ask`) gives the build its batch (`resolve.target_batch`).

Pure functions over Node objects (as the API returns them, in dict form), so the same code sizes a live cluster and
a test's nodes.
"""

from __future__ import annotations

import copy
import math
from typing import Any

from pydantic import BaseModel, ConfigDict

from tailor.compressor.buildplan import PoolServing
from tailor.compressor.compute import Compute, ComputeDtype, processor_from_labels, processor_of_family, resolve
from tailor.compressor.model.architecture import Architecture
from tailor.compressor.sizing import engines
from tailor.compressor.sizing.concurrency import Sizing, size, smallest_tensor_parallel
from tailor.compressor.sizing.engines import Engine, cache_bytes, choose, engine_args
from tailor.compressor.sizing.hardware import MEMORY_LABEL, PRODUCT_LABEL, GpuCatalog, GpuProfile, Precision
from tailor.compressor.sizing.hostmemory import HostNeed, serving_need
from tailor.compressor.sizing.memory import RECIPES, KvDtype, QuantRecipe, RuntimeReserve, served_kv_dtype
from tailor.operator import names
from tailor.operator.api import GPU_RESOURCE, DeploymentSpec, NodePoolTarget
from tailor.operator.manifest import container_gpus, gpu_count
from tailor.operator.memo import IdentityMemo
from tailor.operator.placement import admits_node

MIG_STRATEGY_LABEL = "nvidia.com/mig.strategy"  # GFD: single or mixed where MIG partitions the node's GPUs
MEMORY_TOLERANCE = 0.05  # a node's reported GPU memory this far from its profile's is another GPU


class Built(BaseModel):
    """What the build produced, as sizing needs it."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    arch: Architecture
    recipe: QuantRecipe
    kv_dtype: KvDtype


class PoolPlan(BaseModel):
    """How one pool serves the model, or why it cannot."""

    name: str
    node_selector: dict[str, str]  # the pool's, which found `nodes`: where its pods go (`deployment.pool_scheduling`)
    nodes: list[str]
    gpu_product: str | None = None
    gpu_profile: str | None = None
    gpus_per_node: int = 0
    tensor_parallel: int | None = None  # GPUs per replica
    concurrency_per_gpu: float | None = None
    concurrency_per_replica: int | None = None
    target_concurrency: int | None = None
    replicas: int | None = None  # for the target, within [minReplicas, maxReplicas] and the pool's GPUs
    capacity: int | None = None  # replicas the pool's free GPUs hold
    recipe: str | None = None
    kv_dtype: KvDtype | None = None
    compute: Compute | None = None  # what the engine computes in, and why (`pool_compute`)
    engine: Engine | None = None
    quantized: bool = True  # serves the quantized checkpoint (else the BF16 child)
    sizing: Sizing | None = None
    host: HostNeed | None = None  # what a replica holds in host memory
    skipped: str | None = None  # why the pool gets no deployment
    notes: list[str] = []

    def max_num_seqs(self) -> int:
        """Requests a replica runs at once (`engines.max_num_seqs`): what the sizing says fits, capped."""
        if self.concurrency_per_replica is None:
            raise ValueError(f"pool {self.name} is skipped: {self.skipped}")
        return engines.max_num_seqs(self.concurrency_per_replica)

    def serving(self, generation: int, context: int, catalog: GpuCatalog, checkpoint: str,
                trust_remote_code: bool) -> PoolServing:
        """What the pool's package Job writes (the build plan's `pool`), with vLLM's engine arguments for the
        checkpoint it serves from `checkpoint`: computed here only, and read by the package Job (model.json)
        and the revision (its annotation)."""
        if self.sizing is None or self.gpu_profile is None or self.concurrency_per_replica is None:
            raise ValueError(f"pool {self.name} is skipped: {self.skipped}")
        assert self.engine is not None
        batch = self.max_num_seqs()
        args = engine_args(checkpoint, catalog.get(self.gpu_profile), self.sizing, batch,
                           trust_remote_code) if self.engine is Engine.VLLM else None
        return PoolServing(name=self.name, generation=generation, gpu_profile=self.gpu_profile, context=context,
                           tensor_parallel=self.sizing.tensor_parallel, max_batch_size=batch, engine=self.engine,
                           quantized=self.quantized, sizing=self.sizing, engine_args=args)


class NodeSnapshot(list[dict[str, Any]]):
    """The cluster's Nodes as read at one moment and never changed afterwards (the operator reads them once per
    `kube.NODES_TTL_S` for every pass): what a pool makes of them is worked out once and kept with them (`memo`).
    A copy is a plain list, which keeps nothing."""

    def __init__(self, nodes: list[dict[str, Any]]) -> None:
        super().__init__(nodes)
        self.memo = IdentityMemo(64)

    def __copy__(self) -> list[dict[str, Any]]:
        return list(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> list[dict[str, Any]]:
        return copy.deepcopy(list(self), memo)


def matching_nodes(nodes: list[dict[str, Any]], selector: dict[str, str]) -> list[dict[str, Any]]:
    return [node for node in nodes if names.selects(selector, node["metadata"].get("labels"))]


def allocatable_gpus(node: dict[str, Any]) -> int:
    return gpu_count((node.get("status") or {}).get("allocatable"))


def schedulable(node: dict[str, Any]) -> bool:
    """Ready, not cordoned, with GPUs the device plugin reports."""
    conditions = (node.get("status") or {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    return ready and not (node.get("spec") or {}).get("unschedulable") and allocatable_gpus(node) > 0


class HeldGpus(BaseModel):
    """GPUs a pod bound to a node holds until it finishes, and the labels that tell a Tailor revision's pods."""

    model_config = ConfigDict(frozen=True)

    node: str
    namespace: str
    gpus: int
    labels: dict[str, str] = {}


def held_gpus(pod: dict[str, Any]) -> HeldGpus | None:
    """What a pod holds, as the scheduler counts it: its containers with all its sidecars, or an init step with
    the sidecars started before it, whichever is more; None for a pod that is not bound, has finished or holds
    no GPU."""
    spec, meta = pod.get("spec") or {}, pod["metadata"]
    if not spec.get("nodeName") or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
        return None
    sidecars, steps = 0, [0]
    for container in spec.get("initContainers") or []:
        if container.get("restartPolicy") == "Always":
            sidecars += container_gpus(container)
        else:
            steps.append(sidecars + container_gpus(container))
    gpus = max(sum(container_gpus(c) for c in spec.get("containers") or []) + sidecars, *steps)
    if gpus == 0:
        return None
    return HeldGpus(node=spec["nodeName"], namespace=meta.get("namespace", ""), gpus=gpus,
                    labels=meta.get("labels") or {})


class GpuHolders(BaseModel):
    """The pods that hold GPUs, as far as the operator may list them."""

    model_config = ConfigDict(frozen=True)

    pods: list[HeldGpus]
    namespaces: tuple[str, ...] | None = None  # None: every namespace's pods; else only these were listed


def held_by_others(pods: list[HeldGpus], namespace: str, revision: dict[str, str]) -> dict[str, int]:
    """GPUs held per node by pods other than the revision's (`revision`: its pods' labels in `namespace`)."""
    held: dict[str, int] = {}
    for pod in pods:
        if pod.namespace == namespace and names.selects(revision, pod.labels):
            continue
        held[pod.node] = held.get(pod.node, 0) + pod.gpus
    return held


class PoolNodes(BaseModel):
    """A pool's Ready, schedulable nodes, their one GPU (the label value that named it, and its profile), the
    fewest GPUs any of them has; or why the pool is skipped."""

    model_config = ConfigDict(frozen=True, arbitrary_types_allowed=True)

    members: list[dict[str, Any]] = []
    product: str | None = None
    gpus_per_node: int = 0
    gpu: GpuProfile | None = None
    skipped: str | None = None


def node_gpu(node: dict[str, Any], catalog: GpuCatalog) -> tuple[GpuProfile | None, str]:
    """The GPU profile a node's labels name and the label value that named it; or None and why not (MIG slices,
    no profile knowing its labels, a memory label that contradicts the profile)."""
    labels, name = node["metadata"].get("labels") or {}, node["metadata"]["name"]
    product = labels.get(PRODUCT_LABEL, "")
    if "-MIG-" in product or labels.get(MIG_STRATEGY_LABEL) in ("single", "mixed"):
        return None, (f"node {name} partitions its GPUs with MIG ({PRODUCT_LABEL}={product or '?'}, "
                      f"{MIG_STRATEGY_LABEL}={labels.get(MIG_STRATEGY_LABEL, '?')}): Tailor sizes whole GPUs")
    found = catalog.for_node(labels)
    if found is None:
        keys = {key for profile in catalog.profiles.values() for key in profile.identifying_labels()}
        shown = ", ".join(f"{key}={labels[key]}" for key in sorted(labels) if key in keys) or "none"
        return None, (f"no GPU profile knows node {name}'s GPU labels ({shown}): add its label to a profile's "
                      "gfdProducts or nodeLabels (the chart's gpuProfiles)")
    gpu, label = found
    reported = labels.get(MEMORY_LABEL, "")
    if reported.isdigit() and abs(int(reported) - gpu.memory_mib) > MEMORY_TOLERANCE * gpu.memory_mib:
        return None, (f"node {name} reports {MEMORY_LABEL}={reported} MiB, but {label} names {gpu.name} "
                      f"({gpu.memory_mib} MiB): a different GPU needs a profile of its own")
    return gpu, label.split("=", 1)[1]


def pool_nodes(pool: NodePoolTarget, nodes: list[dict[str, Any]], catalog: GpuCatalog) -> PoolNodes:
    """What of `nodes` the pool can serve on: the rules sizing and the build's batch both follow (worked out once
    per snapshot of the nodes and pool)."""
    if isinstance(nodes, NodeSnapshot):
        return nodes.memo.get((catalog,), (pool.model_dump_json(),), lambda: _pool_nodes(pool, nodes, catalog))
    return _pool_nodes(pool, nodes, catalog)


def _pool_nodes(pool: NodePoolTarget, nodes: list[dict[str, Any]], catalog: GpuCatalog) -> PoolNodes:
    matched = matching_nodes(nodes, pool.node_selector)
    ready = [node for node in matched if schedulable(node)]
    if not matched:
        return PoolNodes(skipped=f"no node matches nodeSelector {pool.node_selector}")
    if not ready:
        return PoolNodes(skipped=f"none of the {len(matched)} matching node(s) is Ready and schedulable with "
                                 f"allocatable {GPU_RESOURCE}")
    refusals = {node["metadata"]["name"]: admits_node(pool, node) for node in ready}
    members = [node for node in ready if refusals[node["metadata"]["name"]] is None]
    if not members:
        return PoolNodes(skipped=f"the pool's pods fit none of its {len(ready)} Ready node(s): "
                                 + "; ".join(why for why in refusals.values() if why))
    found = {node["metadata"]["name"]: node_gpu(node, catalog) for node in members}
    problem = next((why for gpu, why in found.values() if gpu is None), None)
    if problem is not None:
        return PoolNodes(members=members, skipped=problem)
    profiles = {gpu.name for gpu, _ in found.values() if gpu is not None}
    if len(profiles) != 1:
        return PoolNodes(members=members, skipped="the pool's nodes must have one GPU, found " + ", ".join(
            f"{name}: {gpu.name if gpu else '?'}" for name, (gpu, _) in sorted(found.items())))
    gpu, product = next(iter(found.values()))
    return PoolNodes(members=members, product=product, gpus_per_node=min(map(allocatable_gpus, members)), gpu=gpu)


def pool_compute(gpu: GpuProfile, members: list[dict[str, Any]]) -> Compute:
    """What the pool's engine computes in (`compute.resolve`): a GPU pool's family decides; a CPU pool's nodes
    decide by Node Feature Discovery's CPUID labels, BF16 only where every node has BF16 math."""
    if gpu.family != "cpu":
        return resolve(ComputeDtype.AUTO, processor_of_family(gpu.family))
    found = [resolve(ComputeDtype.AUTO, processor_from_labels(node["metadata"].get("labels") or {},
                                                              f"CPU of node {node['metadata']['name']}"))
             for node in members]
    return min(found, key=lambda compute: compute.dtype is ComputeDtype.BFLOAT16)  # float32 where any node needs it


def no_quantized_math(gpu: GpuProfile, precision: Precision) -> str | None:
    """Why `gpu` cannot serve a `precision` checkpoint (Ampere has no FP8 math), or None."""
    if precision is Precision.BF16 or gpu.serves_quantized:
        return None
    return f"{gpu.name} ({gpu.family}) has no FP8 math: it cannot serve the {precision.value} checkpoint"


class GpuAsk(BaseModel):
    """What a pool's concurrency asks of each GPU of its schedulable nodes."""

    pool: str
    per_gpu: int
    why: str  # e.g. "perNode 64 over 8 GPUs"


def gpu_ask(pool: NodePoolTarget, nodes: list[dict[str, Any]], catalog: GpuCatalog,
            precision: Precision) -> GpuAsk | str:
    """The pool's concurrency over its schedulable nodes and their GPUs (as `plan_pool` counts them), rounded
    up; or why the pool will not serve a `precision` build (as `plan_pool` skips it)."""
    found = pool_nodes(pool, nodes, catalog)
    if found.gpu is None or found.skipped is not None:
        return found.skipped or "no GPU profile"
    if (why_not := no_quantized_math(found.gpu, precision)) is not None:
        return why_not
    members, gpus = len(found.members), found.gpus_per_node
    per_node = pool.concurrency.per_node
    why = (f"perNode {per_node} over {gpus} GPUs" if per_node is not None
           else f"total {pool.concurrency.total} over {members} node(s) x {gpus} GPUs")
    return GpuAsk(pool=pool.name, per_gpu=math.ceil(target_concurrency(pool, members) / (members * gpus)), why=why)


def target_concurrency(pool: NodePoolTarget, nodes: int) -> int:
    """The concurrent requests the pool asks for over its `nodes` schedulable nodes."""
    per_node, total = pool.concurrency.per_node, pool.concurrency.total
    if per_node is not None:
        return per_node * nodes
    assert total is not None  # the API guarantees exactly one of perNode and total
    return total


SIZINGS = IdentityMemo(256)  # by the build (one `Built` per build: `rollout.built`), GPU and recipe


def _sizing(arch: Architecture, gpu: GpuProfile, context: int, recipe: QuantRecipe, kv: KvDtype,
            gpus_per_node: int, dtype: ComputeDtype) -> Sizing | str:
    """The smallest tensor-parallel group that holds a request, sized; or why none within a node does."""
    try:
        tp = smallest_tensor_parallel(arch, gpu, context, recipe, kv, RuntimeReserve(), gpus_per_node, dtype=dtype)
    except ValueError as error:
        return f"{error} ({recipe.name} weights, {kv.value} KV cache)"
    return size(arch, gpu, context, recipe, kv, tp=tp, gpus_per_node=gpus_per_node, dtype=dtype)


def too_few_gpus(min_replicas: int, tp: int, members: list[dict[str, Any]]) -> str | None:
    """Why the pool's nodes can never hold `min_replicas` replicas of `tp` GPUs, even with every GPU free (a
    revision would wait forever, holding what it got); None when they can. Fewer free GPUs than that is not a
    refusal: other pods end, and the revision waits for them (`rollout`)."""
    room = sum(allocatable_gpus(node) // tp for node in members)
    if min_replicas <= room:
        return None
    return (f"spec.deployment.minReplicas {min_replicas} needs {min_replicas} replicas of {tp} GPU(s), but the "
            f"pool's {len(members)} schedulable node(s) hold at most {room} with every GPU free "
            f"({sum(map(allocatable_gpus, members))} allocatable): lower minReplicas or add nodes to the pool")


def plan_pool(pool: NodePoolTarget, nodes: list[dict[str, Any]], built: Built, deployment: DeploymentSpec,
              catalog: GpuCatalog, held: dict[str, int] | None = None,
              counted_in: tuple[str, ...] | None = None) -> PoolPlan:
    """Size what was built for the pool: GPUs per replica, requests per replica and replicas for the
    concurrency, on the pool's schedulable nodes and the GPUs other pods leave free there (`held`, per node;
    None where they are not known: all allocatable GPUs count, and a note says so; `counted_in`: the only
    namespaces whose pods were counted, which a note names)."""
    found = pool_nodes(pool, nodes, catalog)
    members = found.members
    plan = PoolPlan(name=pool.name, node_selector=pool.node_selector,
                    nodes=sorted(n["metadata"]["name"] for n in members), gpu_product=found.product,
                    gpus_per_node=found.gpus_per_node)
    if found.gpu is None or found.skipped is not None:
        return plan.model_copy(update={"skipped": found.skipped})
    gpu = found.gpu
    recipe, kv = built.recipe, built.kv_dtype
    engine = choose(gpu, built.arch, recipe.precision)
    if engine.engine is None:
        return plan.model_copy(update={"skipped": engine.note})
    if not engine.quantized:
        recipe, kv = RECIPES["bf16"], KvDtype.BF16
    compute = pool_compute(gpu, members)
    kv = served_kv_dtype(kv, compute.dtype)
    notes = [engine.note] if engine.note else []
    if gpu.family == "cpu":
        notes.append(f"the engine computes in {compute.describe()}")
    plan = plan.model_copy(update={"engine": engine.engine, "quantized": engine.quantized, "notes": notes})
    if (why_not := no_quantized_math(gpu, recipe.precision)) is not None:
        return plan.model_copy(update={"skipped": why_not})
    plan = plan.model_copy(update={"gpu_profile": gpu.name, "recipe": recipe.name, "kv_dtype": kv, "compute": compute})
    sizing = SIZINGS.get((built, gpu, recipe), (deployment.context_length, kv, plan.gpus_per_node, compute.dtype),
                         lambda: _sizing(built.arch, gpu, deployment.context_length, recipe, kv, plan.gpus_per_node,
                                         compute.dtype))
    if isinstance(sizing, str):
        return plan.model_copy(update={"skipped": sizing})
    tp = sizing.tensor_parallel
    if (why_not := too_few_gpus(deployment.min_replicas, tp, members)) is not None:
        return plan.model_copy(update={"skipped": why_not})
    target = target_concurrency(pool, len(members))
    needed = math.ceil(target / sizing.concurrency_per_replica)
    taken = {name: min(held.get(name, 0), allocatable_gpus(node))
             for node in members if held is not None and (name := node["metadata"]["name"]) in held}
    capacity = sum((allocatable_gpus(node) - taken.get(node["metadata"]["name"], 0)) // tp for node in members)
    replicas = max(deployment.min_replicas, min(needed, deployment.max_replicas, capacity))
    notes = [*plan.notes, *sizing.warnings]
    allocatable = sum(map(allocatable_gpus, members))
    if held is None:
        notes.append("GPUs other pods hold are not known (the operator may not list pods cluster-wide): all "
                     f"{allocatable} allocatable GPUs counted as free")
    elif counted_in is not None:
        notes.append(f"GPUs held by pods outside {', '.join(counted_in)} are not counted (the operator lists pods "
                     "only there: the chart's serving.heldGpuNamespaces, or its Roles where it may not list them "
                     "cluster-wide)")
    if needed > min(deployment.max_replicas, capacity):
        limit = "maxReplicas" if deployment.max_replicas < capacity else "the pool's free GPUs"
        notes.append(f"{target} concurrent requests need {needed} replicas of {sizing.concurrency_per_replica}; "
                     f"{limit} allow {replicas}")
        if taken and limit != "maxReplicas":  # only where they limit it: other tenants' pods come and go
            notes.append(f"other pods hold {sum(taken.values())} of the pool's {allocatable} GPUs (on "
                         f"{len(taken)} node(s)): room for {capacity} replica(s) of {tp} GPU(s)")
    plan = plan.model_copy(update={
        "tensor_parallel": tp, "concurrency_per_gpu": sizing.concurrency_per_gpu,
        "concurrency_per_replica": sizing.concurrency_per_replica, "target_concurrency": target,
        "replicas": replicas, "capacity": capacity, "sizing": sizing, "notes": notes})
    batch = plan.max_num_seqs()
    cache = cache_bytes(gpu, sizing, batch) if engine.engine is Engine.VLLM else batch * sizing.footprint.per_request
    return plan.model_copy(update={"host": serving_need(gpu.family == "cpu", tp, sizing.footprint.weights, cache)})

