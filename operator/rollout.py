"""Deploy: per pool, package the build for the pool, start this generation's revision beside the one
serving, move the pool's Service to it once it is available, then retire the pool's other revisions.

What node churn may not do: a pool whose nodes are NotReady, report no GPUs or were scaled to zero is
skipped for new revisions, but whatever it serves keeps serving. Only a pool removed from the spec loses its
revisions and Service, and only once every pool of the spec serves this generation. A revision that cannot
become available (its Deployment reports ProgressDeadlineExceeded) is deleted, freeing its GPUs, and fails
the generation; the previous revision keeps serving, and the status records the failure on the pool
(`status.pools[].failed`): no revision is made there again for this generation, only after a spec change or,
where its pods could not be scheduled, once the pool's free GPUs hold the replicas it asked for.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from tailor.compressor.buildplan import BuildPlan, PoolServing, repository_in_pod
from tailor.compressor.model.architecture import architecture_from_config
from tailor.compressor.results import PackageResult, unpack_config
from tailor.compressor.sizing.engines import Engine, reads_own_config_class, served_checkpoint
from tailor.compressor.sizing.memory import RECIPES, KvDtype
from tailor.operator import names, speedup
from tailor.operator.api import (
    CompressedModelSpec,
    DeploymentSpec,
    Endpoint,
    NodePoolTarget,
    PoolStatus,
    RevisionFailure,
)
from tailor.operator.conditions import DEPLOYED, FAILED, READY, Reason, Refused, without
from tailor.operator.decision import Decision, Pass, Patch
from tailor.operator.deployment import (
    ENGINE_ANNOTATION,
    TRITON,
    egress_policy,
    ingress_policy,
    manifests,
    pod_ports,
    pool_scheduling,
    pool_target,
    revision_labels,
    service,
    startup_seconds,
)
from tailor.operator.manifest import deployment_available
from tailor.operator.observe import stalled
from tailor.operator.pools import Built, PoolPlan, held_by_others, plan_pool
from tailor.operator.workloads import (
    claim_of,
    claim_ready,
    job_outcome,
    keep_record,
    package_result,
    recorded,
    service_account,
    start_job,
)

REVISION_KINDS = ("HorizontalPodAutoscaler", "PodDisruptionBudget", "Deployment")


def built(p: Pass) -> Built:
    """What the build produced, from the status its Jobs' results were recorded in."""
    build = p.build
    if build.child_config is None or build.recipe is None or build.kv_cache_dtype is None:
        raise Refused(Reason.INVALID_RESULT, "the build recorded no child config, recipe or KV-cache dtype to size "
                                             "deployments with")
    return read_built(build.child_config, build.recipe, build.kv_cache_dtype)


@lru_cache(maxsize=256)
def read_built(child_config: str, recipe: str, kv_cache_dtype: str) -> Built:
    """One `Built` per distinct build, read once (not on every pass; objects that built the same child share it),
    so that sizings of it are kept by its identity (`pools.SIZINGS`)."""
    arch = architecture_from_config(unpack_config(child_config), "status.build.childConfig")
    return Built(arch=arch, recipe=RECIPES[recipe], kv_dtype=KvDtype(kv_cache_dtype))


def delete_revision(p: Pass, name: str) -> None:
    for kind in REVISION_KINDS:
        p.delete(kind, name)
    p.event("RevisionDeleted", f"deleted Deployment {name}")


def revisions(p: Pass, pool: str) -> list[dict[str, Any]]:
    return [d for d in p.mine("Deployment") if d["metadata"]["labels"].get(names.POOL) == pool]


def serving_revision(service_object: dict[str, Any] | None) -> str | None:
    return ((service_object or {}).get("spec", {}).get("selector") or {}).get(names.REVISION)


def deploy_pool(p: Pass, spec: CompressedModelSpec, plan: BuildPlan, pool: NodePoolTarget, found: Built
                ) -> tuple[PoolStatus, bool | None]:
    """One pool's step; its status and whether this generation serves there (None: skipped, not waited for)."""
    deployment = spec.deployment
    assert deployment is not None
    revision = names.revision_of(p.generation)
    service_name = names.service_name(p.name, pool.name)
    current = p.owned("Service", service_name)
    serving = serving_revision(current)
    mine = p.owned("Deployment", names.revision_name(p.name, pool.name, p.generation))
    holders = p.world.gpu_pods
    held = None if holders is None else held_by_others(holders.pods, p.namespace, revision_labels(
        p.model, pool.name, p.generation))
    sized = plan_pool(pool, p.world.nodes, found, deployment, p.settings.catalog, held,
                      None if holders is None else holders.namespaces)
    status = PoolStatus(name=pool.name, gpu_product=sized.gpu_product, engine=sized.engine, notes=sized.notes,
                        gpus_per_replica=sized.tensor_parallel,
                        concurrency_per_gpu=int(sized.concurrency_per_gpu or 0) if sized.sizing else None,
                        concurrency_per_replica=sized.concurrency_per_replica, replicas=sized.replicas,
                        revision=serving, skipped=sized.skipped,
                        startup_seconds=None if sized.skipped else startup_seconds(sized, pool))
    if serving is not None:
        old = p.world.of("Deployment").get(f"{service_name}-{serving}")
        status.ready_replicas = deployment_available(old)[1] if old is not None else 0
    if mine is None:
        if sized.skipped is not None:
            return status, None
        if (packaged := package(p, spec, plan, sized)) is None:
            return status, False
        if (failure := earlier_failure(p, pool.name)) is not None:
            if failure.retry == "SpecChange" or (sized.capacity or 0) < failure.replicas:
                raise Refused(Reason.REVISION_FAILED, failed_message(failure))  # it stays failed
            p.event("RevisionRetried", f"pool {pool.name} has free GPUs for the {failure.replicas} replica(s) "
                                       f"{failure.deployment} asked for: a new one is made")
        create_revision(p, spec, plan, sized, packaged, first=current is None)
        if current is None:
            status.revision = revision
        return status, False
    status.skipped = None  # this generation's revision exists: it is rolled out whatever the nodes say now
    if (problem := stalled(mine)) is not None:  # what its pods say goes into the status and an Event first
        name = mine["metadata"]["name"]
        evidence = p.world.evidence.get(name, "its pods were not read")
        failure = RevisionFailure(generation=p.generation, deployment=name,
                                  replicas=(mine.get("spec") or {}).get("replicas", 1),
                                  retry="Capacity" if name in p.world.unscheduled else "SpecChange",
                                  message=f"Deployment {name} cannot become available: {problem}\n{evidence}"[:8192])
        delete_revision(p, name)  # the Warning that fails the generation says what its pods said
        status.failed = failure
        p.status.pools = [s for s in p.status.pools if s.name != pool.name] + [status]  # kept: the pass fails here
        raise Refused(Reason.REVISION_FAILED, failed_message(failure))
    ready, count = deployment_available(mine, deployment.min_replicas if serving == revision else None)
    if current is None:  # the revision's engine, as it was created (the nodes may say otherwise now)
        engine = Engine(mine["metadata"].get("annotations", {}).get(ENGINE_ANNOTATION, Engine.VLLM))
        p.create(service(p.model, pool.name, p.generation, engine))
        status.revision = revision
    elif ready and serving != revision:  # never send traffic to a revision that is not ready
        p.actions.append(Patch("Service", service_name, {"spec": {"selector": {names.REVISION: revision}}}))
        p.event("TrafficSwitched", f"Service {service_name} moved from {serving} to {revision}")
        status.revision = revision
    if status.revision == revision:
        status.ready_replicas = count
        if ready:
            for other in revisions(p, pool.name):
                if other["metadata"]["labels"].get(names.REVISION) != revision:
                    delete_revision(p, other["metadata"]["name"])
    return status, ready and status.revision == revision


def earlier_failure(p: Pass, pool: str) -> RevisionFailure | None:
    """This generation's revision that failed on the pool, as the status recorded it."""
    found = next((s.failed for s in p.status.pools if s.name == pool and s.failed is not None), None)
    return found if found is not None and found.generation == p.generation else None


def failed_message(failure: RevisionFailure) -> str:
    """The failure and what retries it."""
    retry = (f"the pool is tried again once its free GPUs hold the {failure.replicas} replica(s) it asked for, or "
             "when the spec changes" if failure.retry == "Capacity" else "the pool is tried again when the spec "
             "changes")
    return f"{failure.message}\n{retry}"


def create_revision(p: Pass, spec: CompressedModelSpec, plan: BuildPlan, sized: PoolPlan, packaged: PackageResult,
                    first: bool) -> None:
    """This generation's revision of a packaged pool: the serving ServiceAccount, the model's NetworkPolicy (one
    that is there already is left as it is), the Deployment with its PodDisruptionBudget and autoscaler (its
    Triton checks the code its package Job wrote, `packaged`), and for the pool's `first` revision its Service,
    which can point at it from the start."""
    deployment = spec.deployment
    assert deployment is not None and sized.engine is not None  # `manifests` refuses a pool no engine serves
    service_account(p, p.settings.serving_service_account)
    package_folder = plan.layout.package(p.generation, sized.name)
    image, engine_config = p.settings.job_image, None
    if sized.engine is Engine.VLLM:
        image = deployment.triton_image
        engine_config = pool_serving(p, plan, sized, deployment.context_length).engine_args
    p.create(egress_policy(p.model))
    if p.settings.serving_ingress is not None:
        p.create(ingress_policy(p.model, p.settings.serving_ingress))
    made = manifests(p.model, sized, deployment, claim_of(p, spec), package_folder, p.generation, image,
                     packaged.under(package_folder), engine_config, p.settings.serving_service_account,
                     p.settings.job_image)
    # the Deployment last: while a name of its PodDisruptionBudget or HPA is another's (refused, OwnedElsewhere) no
    # revision exists, so every pass sends them again and the model stays failed until that object goes
    for manifest in sorted(made, key=lambda made_one: made_one["kind"] == "Deployment"):
        p.create(manifest)
    p.event("RevisionCreated", f"created Deployment {names.revision_name(p.name, sized.name, p.generation)}: "
                               f"{sized.replicas} replica(s) x {sized.tensor_parallel} GPU(s), "
                               f"{sized.concurrency_per_replica} concurrent requests each, engine {sized.engine}")
    if first:
        p.create(service(p.model, sized.name, p.generation, sized.engine))


def pool_serving(p: Pass, plan: BuildPlan, sized: PoolPlan, context: int) -> PoolServing:
    """What the pool's package Job writes, its vLLM engine arguments among it (`PoolPlan.serving`): for the
    checkpoint in the pool's package folder, read through tailor's config class where the child's config says
    so. The package Job writes them into model.json from its plan; the revision shows them as its annotation."""
    checkpoint = served_checkpoint(repository_in_pod(plan.layout.package(p.generation, sized.name)), p.name)
    return sized.serving(p.generation, context, p.settings.catalog, checkpoint,
                         reads_own_config_class(unpack_config(p.build.child_config or "")))


def package(p: Pass, spec: CompressedModelSpec, plan: BuildPlan, sized: PoolPlan) -> PackageResult | None:
    """The pool's `tailor package` Job, reading the build plan with the pool's sizing; its result (kept as a
    record) once done. One that ended without a result (its pod went before it was read, or an earlier operator
    made it) is made again: packaging twice writes the same repository."""
    deployment = spec.deployment
    assert deployment is not None
    name = names.job_name(p.name, p.generation, "package", sized.name)
    record = names.package_record_name(p.name, p.generation, sized.name)
    if (message := recorded(p, record)) is not None:
        return package_result(f"ConfigMap {record}", message)
    job = p.owned("Job", name)
    progress = p.stage("Deploy")
    if job is not None and (message := job_outcome(p, job)) is not None:
        if message:
            keep_record(p, record, message)
            return package_result(f"Job {name}", message)
        if not job["metadata"].get("deletionTimestamp"):
            p.delete("Job", name)
            p.event("PackageRerun", f"Job {name} ended without the digests of the code it wrote: packaged again")
        return None
    if job is None:
        if (waiting := claim_ready(p, spec)) is not None:
            progress.message = waiting
            return None
        serving = pool_serving(p, plan, sized, deployment.context_length)
        measure = sized.name == speedup.measured_pool(spec) and sized.engine is Engine.VLLM
        pool_plan = plan.model_copy(update={"pool": serving.model_copy(update={"measure_speedup": measure})})
        start_job(p, spec, pool_plan, "package", p.generation, names.package_plan_name(p.name, p.generation,
                                                                                        sized.name),
                  pool_scheduling(pool_target(deployment, sized.name), sized.node_selector,
                                  plan.catalog().get(sized.gpu_profile) if sized.gpu_profile else None),
                  pool=sized.name)
    return None



def remove_serving(p: Pass, keep: set[str]) -> None:
    """Revisions and Services of pools not in `keep` (gone from the spec, or no deployment at all)."""
    for deployment in p.mine("Deployment"):
        pool = deployment["metadata"]["labels"].get(names.POOL)
        if pool not in keep and deployment["metadata"]["labels"].get(names.APP_NAME) == TRITON[names.APP_NAME]:
            delete_revision(p, deployment["metadata"]["name"])
    for svc in p.mine("Service"):
        pool = svc["metadata"]["labels"].get(names.POOL)
        if pool is not None and pool not in keep:
            p.delete("Service", svc["metadata"]["name"])
    if not keep:
        if p.status.pools or p.status.serving_generation is not None:  # it was deploying or serving
            p.delete("NetworkPolicy", names.egress_policy_name(p.name))
            p.delete("NetworkPolicy", names.ingress_policy_name(p.name))
        p.status.pools, p.status.endpoints, p.status.ready_replicas = [], [], None
        p.status.serving_generation = None
        p.status.conditions = without(p.status.conditions, DEPLOYED)


def deploy(p: Pass, spec: CompressedModelSpec, plan: BuildPlan) -> Decision:
    deployment: DeploymentSpec | None = spec.deployment
    assert deployment is not None
    progress = p.stage("Deploy")
    if progress.state == "Pending":
        progress.state, progress.started_at = "Running", p.world.now
    found = built(p)
    pools: list[PoolStatus] = []
    ready = True
    for pool in deployment.pools:
        status, serves = deploy_pool(p, spec, plan, pool, found)
        pools.append(status)
        ready = ready and serves is not False
    p.status.pools = pools
    p.status.ready_replicas = sum(s.ready_replicas or 0 for s in pools)
    p.status.endpoints = [
        Endpoint(pool=s.name, url=f"{names.service_name(p.name, s.name)}.{p.namespace}.svc:{port}", protocol=protocol)
        for s in pools if s.revision is not None and s.engine is not None
        for protocol, port in pod_ports(Engine(s.engine)).items() if protocol != "metrics"]
    skipped = "; ".join(f"{s.name}: {s.skipped}" for s in pools if s.skipped)
    if all(s.skipped and s.revision is None for s in pools):
        raise Refused(Reason.NO_POOL_FITS, f"no pool can serve the model: {skipped}")
    revision = names.revision_of(p.generation)
    if not ready or not any(s.revision == revision for s in pools):
        waiting = [s.name for s in pools if s.revision != revision or (s.ready_replicas or 0) < (s.replicas or 1)]
        progress.state, progress.message = "Running", "waiting for " + ", ".join(waiting)
        if skipped:
            progress.message += f" (skipped now: {skipped})"
        p.condition(DEPLOYED, False, Reason.REVISION_NOT_READY, progress.message)
        return p.outcome("Deploying")
    remove_serving(p, keep={pool.name for pool in deployment.pools})
    if p.status.serving_generation != p.generation:
        p.event("Ready", f"generation {p.generation} serves on {', '.join(s.name for s in pools if not s.skipped)}")
    p.status.serving_generation = p.generation
    if progress.state != "Succeeded":
        progress.state, progress.completed_at, progress.progress = "Succeeded", p.world.now, 1.0
        progress.reason = Reason.REVISION_READY
    progress.message = f"skipped pools: {skipped}" if skipped else None
    p.condition(DEPLOYED, True, Reason.REVISION_READY, f"generation {p.generation} on "
                f"{sum(1 for s in pools if not s.skipped)} pool(s)" + (f"; skipped {skipped}" if skipped else ""))
    p.condition(READY, True, Reason.SERVING, f"{p.status.ready_replicas} ready replica(s)")
    p.status.conditions = without(p.status.conditions, FAILED)
    speedup.advance(p, spec, plan)
    return p.outcome("Ready")
