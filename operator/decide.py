"""The reconciler's decisions: from what a pass observed to the actions to take and the status to write.

Pure: no I/O, no clock (the time comes with `Observed`), so every transition is unit-tested in milliseconds
(tests/unit/test_operator_reconcile.py through a fake API; tests/unit/test_operator_decide_table.py on hand-built
`Observed` values). `execute` applies the actions and writes the status.

Per generation: Compress -> Quantize -> Evaluate (the quality gate) -> Deploy. The first three build the
artifacts and are skipped when a later generation changes only the deployment or the quality floor (same
fingerprint); a new floor gets a plan of its own and the gate is decided again from the measured scores. Deploy
(`rollout`) packages a model repository per pool, starts that generation's revision beside the one serving,
moves the pool's Service to it once it is ready, then removes the old one. A failed stage fails the
generation and leaves the serving revision alone.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import yaml
from pydantic import ValidationError

from tailor.compressor.buildplan import DATA_MOUNT, PLAN_FILE, SOURCE_MOUNT, BuildPlan, Stage
from tailor.compressor.model.architecture import ConfigError, architecture_from_config
from tailor.compressor.results import CompressResult, GateResult, QuantizeResult, StageResult, unpack_config
from tailor.compressor.sizing.memory import RECIPES
from tailor.operator import names, preflight, rollout
from tailor.operator.api import (
    STAGE_PHASES,
    ArchitectureSummary,
    BuildStatus,
    CompressedModelSpec,
    QualityReport,
    StageProgress,
)
from tailor.operator.conditions import (
    BUILD_CONDITIONS,
    COMPRESSED,
    FAILED,
    QUALITY_GATE_PASSED,
    QUANTIZED,
    READY,
    Reason,
    Refused,
    without,
)
from tailor.operator.decision import Decision, Pass, read_status
from tailor.operator.memo import Memo
from tailor.operator.observe import Observed
from tailor.operator.placement import gpu_terms, scheduling
from tailor.operator.progress import parse as parse_progress
from tailor.operator.resolve import InvalidPlan, fingerprint, mounted_claims, resolve, target_batch
from tailor.operator.settings import OperatorSettings
from tailor.operator.tenancy import check_claim, check_secret
from tailor.operator.workloads import (
    claim_capacity,
    claim_of,
    claim_ready,
    job_outcome,
    keep_record,
    plan_config_map,
    read_plan,
    recorded,
    start_job,
)

CLAIM_FIELDS = {SOURCE_MOUNT: "spec.source.uri", DATA_MOUNT: "spec.compression.data.claimName"}  # by mount path
NO_POD_YET = "waiting for a pod"  # a stage Job's message until its pods run (as created: no status write after)


# --- the pass ------------------------------------------------------------------------------------------


def decide(world: Observed, settings: OperatorSettings) -> Decision:
    """The next actions and the status for the object `world` observed."""
    p = Pass(world, settings, read_status(world.model.get("status")))
    try:
        spec = CompressedModelSpec.model_validate(world.model["spec"])
    except ValidationError as error:
        return p.fail(Reason.INVALID_SPEC, f"the spec does not validate: {error}")
    try:
        admit(p, spec)
        start_build(p, spec)
        plan = build_plan(p, spec)
        delete_superseded_jobs(p)
        for stage in plan.stages:
            if not advance(p, spec, plan, stage):  # Pending: no Job yet (waiting for the claim)
                waiting = p.stage(names.STAGE_NAMES[stage]).state == "Pending"
                return p.outcome("Pending" if waiting else STAGE_PHASES[names.STAGE_NAMES[stage]])
        if spec.deployment is None:
            rollout.remove_serving(p, keep=set())
            p.condition(READY, True, Reason.BUILT, "the model is built; the spec asks for no deployment")
            return p.outcome("Ready")
        return rollout.deploy(p, spec, plan)
    except Refused as refused:
        return p.fail(refused.reason, refused.message)


def admit(p: Pass, spec: CompressedModelSpec) -> None:
    """What a tenant may not ask for, whatever the API server let through: images, pod annotations and labels,
    tolerations, priority classes and resources outside the chart's allowlists (`allowlists`), and claims and
    Secrets it was not given (`tenancy`)."""
    limits = p.settings.tenancy
    listed = limits.model_dump(by_alias=True)  # as the chart's values name them
    for mount, name in mounted_claims(spec, data=True).items():
        check_claim(p.world.named_claims.get(name), name, CLAIM_FIELDS[mount], p.model)
    if spec.source.credentials_secret is not None:
        check_secret(spec.source.credentials_secret.name, p.name, tuple(limits.shared_secrets))
    images = {"spec.jobs.image": spec.jobs.image,
              "spec.deployment.tritonImage": spec.deployment.triton_image if spec.deployment else None}
    for where, image in images.items():
        if image is not None and not p.settings.image_allowed(image):
            raise Refused(Reason.IMAGE_NOT_ALLOWED, f"{where} {image!r} is not an allowed image (the operator "
                                                    f"allows {p.settings.job_image} and images under "
                                                    f"{', '.join(limits.allowed_image_prefixes) or 'no prefix'})")
    placements = {"spec.jobs": spec.jobs, **{f"spec.deployment.pools[{pool.name}]": pool
                                             for pool in (spec.deployment.pools if spec.deployment else [])}}
    for where, placement in placements.items():
        resources = placement.resources
        asked = (("podAnnotations", placement.pod_annotations, limits.annotation_allowed,
                  Reason.ANNOTATION_NOT_ALLOWED, "allowedAnnotationPrefixes"),
                 ("podLabels", placement.pod_labels, limits.pod_label_allowed, Reason.POD_LABEL_NOT_ALLOWED,
                  "allowedPodLabelPrefixes"),
                 ("tolerations", [t.key for t in placement.tolerations], limits.toleration_allowed,
                  Reason.TOLERATION_NOT_ALLOWED, "allowedTolerationKeys"),
                 ("priorityClassName", [placement.priority_class_name] if placement.priority_class_name else [],
                  limits.priority_class_allowed, Reason.PRIORITY_CLASS_NOT_ALLOWED, "allowedPriorityClasses"),
                 ("resources", [*resources.requests, *resources.limits] if resources else [],
                  limits.resource_allowed, Reason.RESOURCE_NOT_ALLOWED, "allowedExtendedResources"))
        for field_name, keys, allowed, reason, value in asked:
            if refused := sorted({key for key in keys if not allowed(key)}):
                said = ", ".join(repr(key) for key in refused) + (" is" if len(refused) == 1 else " are")
                raise Refused(reason, f"{where}.{field_name} {said} not allowed (the chart's tenancy.{value}: "
                                      f"{', '.join(listed[value]) or 'none'})")


def start_build(p: Pass, spec: CompressedModelSpec) -> None:
    """A new build when the artifacts' inputs changed, or when a new generation follows a build whose Job
    failed (a retry); otherwise this generation reuses the last build. A failed quality gate is not retried:
    the same inputs give the same child (a new floor decides it again, `floor_plan`)."""
    digest = fingerprint(spec)
    hold_fingerprint(p, spec)
    build, new_generation = p.status.build, p.status.observed_generation != p.generation
    if build is not None and build.fingerprint == fingerprint(spec, floor=True):  # recorded with the floor in it
        build = p.status.build = build.model_copy(update={"fingerprint": digest})
    job_failed = any(s.state == "Failed" and s.name != "Deploy" and s.reason != Reason.QUALITY_GATE_FAILED
                     for s in p.status.stages)
    if build is not None and build.fingerprint == digest and not (job_failed and new_generation):
        if new_generation:
            p.status.conditions = without(p.status.conditions, FAILED)
            p.status.stages = [s for s in p.status.stages if s.name != "Deploy"]
        return
    if p.generation >= 10**names.MAX_GENERATION_DIGITS:
        raise Refused(Reason.INVALID_SPEC, f"generation {p.generation} is past the {names.MAX_GENERATION_DIGITS} "
                                           "digits derived names allow; create a new CompressedModel")
    gated = any(c.type == QUALITY_GATE_PASSED and c.status == "True" for c in p.status.conditions)
    last_good = build.generation if build is not None and gated else build.last_good if build is not None else None
    p.status.build = BuildStatus(generation=p.generation, fingerprint=digest, last_good=last_good)
    p.status.stages, p.status.architecture, p.status.quality = [], None, None
    p.status.conditions = without(p.status.conditions, FAILED, *BUILD_CONDITIONS)
    p.event("BuildStarted", f"generation {p.generation} builds new artifacts (fingerprint {digest})")


def hold_fingerprint(p: Pass, spec: CompressedModelSpec) -> None:
    """The build's fingerprint is the one its plan ConfigMap (the operator's, which its Jobs read) records, once
    that exists: a status that says otherwise, written by anyone else to pass a changed spec off as the built one,
    is put back, with a Warning, and the spec is built afresh. A plan that recorded the floor in its fingerprint
    (before the floor left it) stands for the spec's inputs when the spec, at that plan's floor, gives it."""
    build = p.status.build
    written = None if build is None else p.owned("ConfigMap", names.plan_name(p.name, build.generation))
    if build is None or written is None:
        return
    plan = plan_in(written)
    at_floor = spec.model_copy(update={"compression": spec.compression.model_copy(
        update={"min_quality_retention": plan.evaluate.min_retention})})
    inputs = {fingerprint(spec), fingerprint(at_floor, floor=True)}  # the spec's, also as recorded with the floor
    if build.fingerprint != plan.fingerprint and not {build.fingerprint, plan.fingerprint} <= inputs:
        p.status.build = build.model_copy(update={"fingerprint": plan.fingerprint})
        p.event("StatusRestored", f"status.build.fingerprint {build.fingerprint!r} is not the one generation "
                                  f"{build.generation}'s plan records (ConfigMap {written['metadata']['name']}): put "
                                  f"back as {plan.fingerprint!r}", warning=True)


def kept(p: Pass) -> list[int]:
    """Generations whose folders a new build must not prune: every one a revision of the object reads (the
    serving one, and an older one a pool kept through node churn), and the last build that passed its gate, until
    this one passes its own."""
    live = {int(label[1:]) for deployment in p.mine("Deployment")
            if (label := (deployment["metadata"].get("labels") or {}).get(names.REVISION, "")).startswith("g")
            and label[1:].isdigit()}
    also = {p.status.serving_generation, p.build.last_good}
    return sorted(live | {generation for generation in also if generation is not None} - {p.build.generation})


def build_plan(p: Pass, spec: CompressedModelSpec) -> BuildPlan:
    """The plan in force: as written in its ConfigMap once that exists (the build's, which the Jobs read, or
    a later generation's `floor_plan`), else resolved now, at the batch the spec or the pools' nodes give (an
    Event when that changes). Its resolved values go into the status."""
    source = p.build.batch_source  # recorded when the plan was resolved
    if (written := written_plan(p)) is not None:
        planned, plan = written
        quality = p.status.quality
        if quality is not None and quality.passed is not None and quality.min_quality_retention is None:
            quality.min_quality_retention = plan.evaluate.min_retention  # decided before the floor was recorded
        floor = spec.compression.min_quality_retention
        if planned != p.generation and plan.evaluate.min_retention != floor:
            plan = floor_plan(p, plan, floor)
    else:
        try:
            batch = target_batch(spec, p.world.nodes, p.settings.catalog)
            plan = resolve(spec, p.model, p.build.generation, p.settings.catalog, batch.value, kept(p))
        except (InvalidPlan, ValueError) as error:
            raise Refused(Reason.INVALID_PLAN, str(error)) from error
        if batch.source != source:
            p.event("BatchChosen", batch.message(), warning=bool(batch.left_out))
        source = batch.source
    p.status.build = p.build.model_copy(update={"batch": plan.puzzle.target.batch, "batch_source": source,
                                                "precision": plan.precision.value,
                                                "kv_cache_dtype": plan.kv_cache_dtype.value,
                                                "target_product": plan.target_product})
    return plan


def written_plan(p: Pass) -> tuple[int, BuildPlan] | None:
    """The plan in force as its ConfigMap holds it, and the generation it is named after: the last
    `floor_plan`'s, else the build's; None before the build's first Job wrote it."""
    for generation in dict.fromkeys(g for g in (p.build.plan_generation, p.build.generation) if g is not None):
        config_map = p.owned("ConfigMap", names.plan_name(p.name, generation))
        if config_map is None:
            continue
        return generation, plan_in(config_map)
    return None


def plan_in(config_map: dict[str, Any]) -> BuildPlan:
    """The plan a plan ConfigMap holds; one that holds none fails the build, naming it."""
    try:
        return read_plan((config_map.get("data") or {})[PLAN_FILE])
    except (KeyError, yaml.YAMLError, ValidationError) as error:
        raise Refused(Reason.INVALID_PLAN, f"ConfigMap {config_map['metadata']['name']} does not hold a build "
                                           f"plan: {error}") from error


def floor_plan(p: Pass, plan: BuildPlan, floor: float) -> BuildPlan:
    """The plan of a generation that changes only the quality floor: `plan` with the new floor, written once as
    this generation's ConfigMap. The build, its artifacts and its measured scores are reused: the gate is
    decided at the new floor (`regate`), no Job runs again."""
    name = names.plan_name(p.name, p.generation)
    new = plan.model_copy(update={"evaluate": plan.evaluate.model_copy(update={"min_retention": floor})})
    plan_config_map(p, name, new)
    p.status.build = p.build.model_copy(update={"plan_generation": p.generation})
    p.event("QualityFloorChanged", f"generation {p.generation} changes minQualityRetention from "
                                   f"{plan.evaluate.min_retention} to {floor}: generation {p.build.generation}'s "
                                   f"build is reused and gated at the new floor (ConfigMap {name})")
    return new


def delete_superseded_jobs(p: Pass) -> None:
    """Jobs of a generation that is neither the build's nor the current one: they hold GPUs for nothing."""
    keep = {str(p.build.generation), str(p.generation)}
    for job in p.mine("Job"):
        if job["metadata"]["labels"].get(names.GENERATION) not in keep and not job["metadata"].get(
                "deletionTimestamp"):
            p.delete("Job", job["metadata"]["name"])


# --- storage -------------------------------------------------------------------------------------------


def advance(p: Pass, spec: CompressedModelSpec, plan: BuildPlan, stage: Stage) -> bool:
    """Advance one build stage; True once it has succeeded."""
    progress = p.stage(names.STAGE_NAMES[stage])
    name = names.job_name(p.name, p.build.generation, stage)
    if progress.state == "Succeeded":
        check_recorded(p, spec, plan, stage, name, progress)
    if stage == "evaluate":
        regate(p, plan, progress)
    if progress.state == "Succeeded":
        return True
    if progress.state == "Failed":
        raise Refused(progress.reason or Reason.JOB_FAILED, progress.message or f"{progress.name} failed")
    try:
        job = p.owned("Job", name)
        if job is None:
            fits = preflight.check_fits(spec, plan) if stage == "compress" else None  # before the claim and Job
            capacity = claim_capacity(p, spec) if stage == "compress" else None  # checked before a claim is made
            room = preflight.check_claim(spec, claim_of(p, spec), capacity, p.world.claim is None, fits) \
                if capacity else None
            if (waiting := claim_ready(p, spec)) is not None:
                progress.message = waiting
                return False
            start_job(p, spec, plan, stage, p.build.generation, names.plan_name(p.name, p.build.generation),
                      scheduling(spec.jobs, gpu_terms(plan.catalog().get(plan.target_gpu))),
                      host=preflight.host_need(fits))
            if fits is not None:
                p.event("FitChecked", preflight.summary(fits))
            if room is not None:
                p.event("ClaimChecked", f"the build writes up to {room.total / 1e9:,.0f} GB ({room.describe()}) on "
                                        f"{claim_of(p, spec)} of {capacity}")
            progress.job_name, progress.state, progress.message = name, "Running", NO_POD_YET
            progress.reason = progress.progress = None  # an earlier Job's (deleted by hand) do not hold for this one
            progress.started_at = progress.started_at or p.world.now
            return False
        progress.job_name, progress.state = name, "Running"
        progress.started_at = progress.started_at or p.world.now
        message = job_outcome(p, job)
        if message is None:
            counts = job.get("status") or {}
            active, ran = counts.get("active", 0), counts.get("succeeded", 0) + counts.get("failed", 0)
            why = p.world.waiting.get(name)
            step = None if why else parse_progress(p.world.logs.get(name, ""))
            if ran and not (why or step or active):
                return False  # its pods ran and none runs now: the last word stands until the Job controller says
                #              how the Job ended (or starts its next try), moments later
            progress.state, progress.reason = ("Pending", "Queued" if (job.get("spec") or {}).get("suspend")
                                               else "Unschedulable") if why else ("Running", None)
            progress.progress = None if step is None else round(step.share, 3)
            progress.message = why or (step.describe(spec.compression.rounds if stage == "compress" else None)
                                       if step else f"{active} pod(s) running" if active else NO_POD_YET)
            return False
        if not message and name not in p.world.with_pods:
            message = read_back(p, spec, plan, stage, name)
            if message is None:
                progress.message = "the stage's pod is gone: reading its result from the claim"
                return False
        if not message:
            raise Refused(Reason.NO_RESULT, f"Job {name} succeeded without a result in its termination message")
        keep_record(p, name, message)  # what `check_recorded` holds the status to, pass or fail
        result = record(p, spec, plan, stage, message)
    except Refused as refused:
        progress.reason, progress.message = refused.reason, refused.message
        if refused.reason is not Reason.OWNED_ELSEWHERE:  # another owner's object is theirs to remove: the stage
            progress.state = "Failed"                     # waits (Pending) and starts on the pass after it goes
        raise
    progress.state, progress.progress, progress.reason = "Succeeded", 1.0, succeeded(result.simulated)
    progress.completed_at, progress.message = p.world.now, simulated_note(result.simulated)
    if result.simulated:
        p.event("SimulatedResult", f"{progress.name}: {simulated_note(result.simulated)}", warning=True)
    return True


def succeeded(simulated: str | None) -> Reason:
    return Reason.SIMULATED if simulated else Reason.JOB_SUCCEEDED


def simulated_note(simulated: str | None) -> str | None:
    """What a user must know of a canned result (`simulated`: why it is), in the stage's and the condition's
    message."""
    return None if simulated is None else f"SIMULATED, not computed: {simulated}"


# --- results -------------------------------------------------------------------------------------------


def read_back(p: Pass, spec: CompressedModelSpec, plan: BuildPlan, stage: Stage, job: str) -> str | None:
    """A finished stage whose pod is gone (its node scaled away) costs no rebuild: a reader Job hands back
    the result the stage wrote on the claim. The message once it has; None while it runs."""
    reader = p.owned("Job", names.reader_name(job))
    if reader is None:
        start_job(p, spec, plan, stage, p.build.generation, names.plan_name(p.name, p.build.generation),
                  scheduling(spec.jobs, gpu_terms(plan.catalog().get(plan.target_gpu))), reader=True)  # as its stage
        return None
    try:
        return job_outcome(p, reader)
    except Refused as refused:
        raise Refused(Reason.NO_RESULT, f"Job {job} succeeded and its pod is gone; reading its result from the "
                                        f"claim failed: {refused.message}") from refused


CHECKED: Memo[bool] = Memo(4096)  # digests of (record, status fields) already found to agree


def check_recorded(p: Pass, spec: CompressedModelSpec, plan: BuildPlan, stage: Stage, name: str,
                   progress: StageProgress) -> None:
    """A stage the status says succeeded is held to its record: the immutable ConfigMap of the stage's name the
    operator made from the Job's result. Re-applied, it must give the status fields it gave (the build's, the
    quality report, the architecture); a status written by anyone else is put back as recorded, with a Warning,
    and a quality verdict the record does not support fails as it would have. A stage without a record is read
    again from its Job (its pod's message, or the claim's through a reader), as is one whose build has no plan
    ConfigMap, unless its build is older than records (its plan ConfigMap says so): then its status is taken as
    it is."""
    message = recorded(p, name)
    if message is None:
        built = p.owned("ConfigMap", names.plan_name(p.name, p.build.generation))
        if built is None or names.RECORDS in (built.get("metadata", {}).get("annotations") or {}):
            progress.state, progress.reason, progress.message = "Running", None, "no record of its result: read again"
        return
    fields = (p.status.build, p.status.quality, p.status.architecture)
    key = hashlib.sha256(json.dumps([name, message, *(f and f.model_dump(mode="json") for f in fields)],
                                    sort_keys=True).encode()).hexdigest()  # kept small: a fleet's worth fit
    if CHECKED.find(key):
        return
    floor = p.status.quality.min_quality_retention if p.status.quality else None
    if stage == "evaluate" and floor is not None:  # the verdict at the floor it was decided at: another is `regate`'s
        plan = plan.model_copy(update={"evaluate": plan.evaluate.model_copy(update={"min_retention": floor})})
    scratch = Pass(p.world, p.settings, p.status.model_copy(deep=True))
    refused = None
    try:
        record(scratch, spec, plan, stage, message)
    except Refused as error:
        refused = error
    restored = (scratch.status.build, scratch.status.quality, scratch.status.architecture)
    if restored != fields:
        p.status.build, p.status.quality, p.status.architecture = restored
        p.event("StatusRestored", f"the status of the {stage} result differed from the operator's record "
                                  f"(ConfigMap {name}): put back as recorded", warning=True)
    if refused is not None:
        progress.state, progress.reason, progress.message = "Failed", refused.reason, refused.message
        raise refused
    if restored == fields:
        CHECKED.put(key, True)


def record(p: Pass, spec: CompressedModelSpec, plan: BuildPlan, stage: Stage, message: str) -> StageResult:
    """Check a stage's result (untrusted: it comes from a pod) and copy it into the status."""
    try:
        return {"compress": record_compress, "quantize": record_quantize, "evaluate": record_gate}[stage](
            p, spec, plan, message)
    except (ValidationError, ValueError, ConfigError) as error:
        raise Refused(Reason.INVALID_RESULT, f"the {stage} Job's result is not what tailor writes: "
                                             f"{str(error)[:1024]}") from error


def record_compress(p: Pass, spec: CompressedModelSpec, plan: BuildPlan, message: str) -> StageResult:
    result = CompressResult.model_validate_json(message)
    config = unpack_config(result.config)
    arch = architecture_from_config(config, f"the compress Job's child config of {p.name}")  # MAX_BLOCKS at most
    p.status.build = p.build.model_copy(update={"child_config": result.config, "compute": result.compute,
                                                "predicted_speedup": round(result.predicted_speedup, 4)})
    if plan.quantize is None:
        p.status.build = p.build.model_copy(update={"recipe": "bf16"})
    measured = "not measured" if result.measured_speedup is None else f"measured {result.measured_speedup:.3f}x"
    p.status.architecture = ArchitectureSummary(
        total_params_billions=round(result.params / 1e9, 4),
        active_params_billions=round(result.active_params / 1e9, 4), blocks=len(arch.blocks), precision=p.build.recipe,
        summary=f"{result.pattern}; predicted {result.predicted_speedup:.3f}x decode, {measured}, KL to parent "
                f"{result.kl_to_parent:.4f}" + (" (SIMULATED)" if result.simulated else ""))
    p.condition(COMPRESSED, True, succeeded(result.simulated), f"{result.params / 1e9:.3f}B parameters "
                f"({result.active_params / 1e9:.3f}B active) from {result.parent_params / 1e9:.3f}B"
                + (f"; {simulated_note(result.simulated)}" if result.simulated else ""))
    cap = spec.compression.max_active_params_billions
    if cap is not None and result.active_params > cap * 1e9:
        raise Refused(Reason.ACTIVE_PARAMS_ABOVE_CAP, f"the child has {result.active_params / 1e9:.3f}B active "
                                                      f"parameters, above maxActiveParamsBillions {cap}")
    return result


def record_quantize(p: Pass, spec: CompressedModelSpec, plan: BuildPlan, message: str) -> StageResult:
    result = QuantizeResult.model_validate_json(message)
    recipe = RECIPES.get(result.recipe)
    if recipe is None or recipe.precision is not plan.precision:
        raise ValueError(f"recipe {result.recipe!r} is not a {plan.precision.value} recipe of tailor's")
    kv = "fp8" if result.kv_cache_quant_algo == "FP8" else "bf16"
    if kv != plan.kv_cache_dtype.value:
        raise ValueError(f"the KV cache was quantized as {kv}, the plan asked for {plan.kv_cache_dtype.value}")
    p.status.build = p.build.model_copy(update={"recipe": recipe.name, "weight_bytes": result.weight_bytes})
    if p.status.architecture is not None:
        p.status.architecture.precision = recipe.name
    p.condition(QUANTIZED, True, succeeded(result.simulated), f"{recipe.name}: {result.weight_bytes / 1e9:.3f} GB "
                "of weights" + (f"; {simulated_note(result.simulated)}" if result.simulated else ""))
    return result


def record_gate(p: Pass, spec: CompressedModelSpec, plan: BuildPlan, message: str) -> StageResult:
    """The operator's own verdict from the measured scores and the plan's floor (the pod's `passed` is not
    trusted)."""
    gate = GateResult.model_validate_json(message)
    if gate.parent_score <= 0:
        raise ValueError(f"parent score {gate.parent_score}: the parent must score above 0 to compare with")
    p.status.quality = QualityReport(metric=gate.metric, parent_score=gate.parent_score, child_score=gate.child_score,
                                     simulated=gate.simulated)
    p.event("QualityGatePassed", judge(p, plan.evaluate.min_retention))
    return gate


def regate(p: Pass, plan: BuildPlan, progress: StageProgress) -> None:
    """A gate decided at another floor than the plan's (a `floor_plan` is in force) is decided again from the
    scores in status.quality; no Job runs again."""
    quality, floor = p.status.quality, plan.evaluate.min_retention
    gated = progress.state == "Succeeded" or progress.reason == Reason.QUALITY_GATE_FAILED
    if not gated or quality is None or quality.min_quality_retention == floor:
        return
    try:
        verdict = judge(p, floor, f"re-decided from the measured scores (the floor was "
                                  f"{quality.min_quality_retention}): ")
    except Refused as refused:
        progress.reason, progress.message = refused.reason, refused.message
        if refused.reason is not Reason.OWNED_ELSEWHERE:  # another owner's object is theirs to remove: the stage
            progress.state = "Failed"                     # waits (Pending) and starts on the pass after it goes
        raise
    progress.state, progress.reason, progress.message = "Succeeded", succeeded(quality.simulated), verdict
    p.event("QualityGateRedecided", verdict)


def judge(p: Pass, floor: float, how: str = "") -> str:
    """The gate at `floor` on the scores in status.quality: its retention and the QualityGatePassed condition;
    the verdict (beginning with `how`), refused with QualityGateFailed below the floor."""
    quality = p.status.quality
    parent, child = (None, None) if quality is None else (quality.parent_score, quality.child_score)
    if quality is None or parent is None or child is None or parent <= 0:
        raise Refused(Reason.NO_RESULT, "status.quality holds no scores to decide the quality gate on")
    retention = child / parent
    passed = retention >= floor and math.isfinite(retention)
    quality.retention, quality.min_quality_retention, quality.passed = round(retention, 6), floor, passed
    verdict = (f"{how}retention {retention:.4f} against a floor of {floor} ({quality.metric}: child {child:.4f}, "
               f"parent {parent:.4f})" + (f"; {simulated_note(quality.simulated)}" if quality.simulated else ""))
    p.condition(QUALITY_GATE_PASSED, passed, Reason.QUALITY_GATE_PASSED if passed else Reason.QUALITY_GATE_FAILED,
                verdict)
    if not passed:
        raise Refused(Reason.QUALITY_GATE_FAILED, verdict)
    return verdict
