"""The served speed-up: once a generation serves, a Job measures the child's tokens/s over the parent's through
the first pool's engine, and the status shows it beside the compression's prediction.

The pool's package Job packaged the BF16 child and the parent side by side (`PoolServing.measure_speedup`); the
speed Job runs the pool's Triton image on them as a native sidecar, on one of the pool's nodes with the pool's
GPUs per replica, and `tailor speed` beside it measures both interleaved (`compressor/serving/speedup.py`). It
is informational: it never blocks or fails the rollout, and a measurement that fails says why in the status.
Only vLLM pools are measured (the fallback engine is not what GPU pools serve).
"""

from __future__ import annotations

from pydantic import ValidationError

from tailor.compressor.buildplan import BuildPlan, repository_in_pod
from tailor.compressor.results import PackageResult, SpeedResult
from tailor.compressor.sizing.engines import Engine
from tailor.operator import names
from tailor.operator.api import CompressedModelSpec, PoolStatus, ServedSpeedup, SpeedRatioStatus
from tailor.operator.conditions import Reason, Refused
from tailor.operator.decision import Pass
from tailor.operator.deployment import pool_scheduling, pool_target, speed_sidecar
from tailor.operator.workloads import job_outcome, package_result, recorded, start_job


def measured_pool(spec: CompressedModelSpec) -> str | None:
    """The pool the speed-up is measured on: the spec's first, where the spec asks for the measurement."""
    deployment = spec.deployment
    return deployment.pools[0].name if deployment is not None and deployment.measure_speedup else None


def advance(p: Pass, spec: CompressedModelSpec, plan: BuildPlan) -> None:
    """Start, follow or record the current generation's speed Job; a no-op once its figures are recorded."""
    pool_name = measured_pool(spec)
    current = p.status.served_speedup
    if pool_name is None:
        p.status.served_speedup = None
        return
    if current is not None and current.generation == p.generation and current.state != "Running":
        return
    pool = next(s for s in p.status.pools if s.name == pool_name)
    found = ServedSpeedup(generation=p.generation, pool=pool_name, state="Running",
                          predicted=p.build.predicted_speedup)
    p.status.served_speedup = found
    if pool.engine != Engine.VLLM.value or pool.revision != names.revision_of(p.generation):
        found.state = "NotMeasured"
        found.message = (f"pool {pool_name} serves with {pool.engine}: the speed-up is measured through vLLM"
                         if pool.engine != Engine.VLLM.value else f"pool {pool_name} does not serve this generation")
        return
    name = names.job_name(p.name, p.generation, "speed", pool_name)
    found.job_name = name
    job = p.owned("Job", name)
    try:
        if job is None:
            config_map = names.package_plan_name(p.name, p.generation, pool.name)
            if p.owned("ConfigMap", config_map) is None:  # the pool's plan, which asked its package Job for the pair
                raise Refused("NoPackagePlan", f"ConfigMap {config_map} (the pool's package plan) is gone")
            kept = names.package_record_name(p.name, p.generation, pool.name)
            if (packaged := recorded(p, kept)) is None:
                raise Refused(Reason.NO_RESULT, f"ConfigMap {kept} (the digests of the code the pair runs) is gone")
            start(p, spec, plan, pool, package_result(f"ConfigMap {kept}", packaged))
            found.message = "waiting for a pod"
            return
        message = job_outcome(p, job)
    except Refused as refused:
        fail(p, found, refused.message)
        return
    if message is None:
        found.message = "measuring" if (job.get("status") or {}).get("active") else "waiting for a pod"
    elif not message:
        fail(p, found, f"Job {name} succeeded without a result in its termination message")
    else:
        record(p, found, message)


def start(p: Pass, spec: CompressedModelSpec, plan: BuildPlan, pool: PoolStatus, packaged: PackageResult) -> None:
    """The speed Job on one of the pool's nodes, reading the pool's package plan (its ConfigMap is there); its
    Triton checks the pair's code against what the package Job wrote (`packaged`)."""
    deployment = spec.deployment
    assert deployment is not None
    folder = plan.layout.speed(p.generation, pool.name)
    repository = repository_in_pod(folder)
    config_map = names.package_plan_name(p.name, p.generation, pool.name)
    target = pool_target(deployment, pool.name)  # started from the status: no `PoolPlan` here, the spec's selector
    start_job(p, spec, plan, "speed", p.generation, config_map, pool_scheduling(target, target.node_selector),
              pool=pool.name, sidecar=speed_sidecar(deployment.triton_image, repository, pool.gpus_per_replica or 1,
                                                    target, packaged.under(folder)))


def record(p: Pass, found: ServedSpeedup, message: str) -> None:
    """The Job's result (untrusted: it comes from a pod) into the status."""
    try:
        result = SpeedResult.model_validate_json(message)
    except ValidationError as error:
        fail(p, found, f"the speed Job's result is not what tailor writes: {str(error)[:1024]}")
        return
    if result.simulated is not None and result.skipped is None:
        fail(p, found, f"the speed Job's result is simulated ({result.simulated}): no figure is shown")
        return
    if result.skipped is not None:
        found.state = "NotMeasured"
        found.message = result.skipped + (f" ({result.simulated})" if result.simulated else "")
        p.event("SpeedupNotMeasured", result.skipped, warning=True)
        return
    found.state = "Measured"
    found.ratios = [SpeedRatioStatus(concurrency=r.concurrency, ratio=r.ratio, per_round=r.per_round,
                                     contended=r.contended) for r in result.ratios]
    figures = ", ".join(f"{r.ratio:.2f}x at concurrency {r.concurrency}" for r in result.ratios)
    predicted = f" (predicted {found.predicted:.2f}x)" if found.predicted else ""
    found.message = (f"child over parent, unquantized, in {result.dtype}, through Triton + vLLM on {result.gpu} "
                     f"(max_num_seqs {result.max_num_seqs}, context {result.context}), interleaved over "
                     f"{result.rounds} rounds: "
                     f"{figures}{predicted}")
    p.event("SpeedupMeasured", found.message)


def fail(p: Pass, found: ServedSpeedup, message: str) -> None:
    found.state, found.message = "Failed", message
    p.event("SpeedupFailed", message, warning=True)
