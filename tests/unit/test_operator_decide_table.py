"""`decide` as a table: each row builds an `Observed` by hand (the object, its status and what it owns, as a pass
would see them), decides once and checks the phase, the condition, the Jobs created, the objects deleted or
patched and the Events. One row per phase transition and per failure reason `decide` reaches from observed state;
no API, fake or real. The fake-API tests (test_operator_reconcile.py) run the same transitions through observe,
decide and execute."""

from __future__ import annotations

import copy
import datetime
from dataclasses import dataclass
from typing import Any

import pytest

from tailor.compressor.buildplan import PLAN_FILE, Stage
from tailor.compressor.results import CompressResult, GateResult, PackageResult, QuantizeResult, StageResult
from tailor.devcluster.simulated import RESULT_ANNOTATION, published_results
from tailor.operator import deployment, names
from tailor.operator.api import STAGE_PHASES, CompressedModelSpec, Condition, Phase, StageName
from tailor.operator.decide import decide
from tailor.operator.decision import Create, Decision, Delete, Patch
from tailor.operator.observe import Observed
from tailor.operator.resolve import fingerprint, resolve, target_batch
from tailor.operator.settings import ALLOWED_LABEL, SHARED_ANNOTATION

from compressedmodels import SETTINGS, builtin_super, manifest
from fakekube import ready_nodes

UID = "c0ffee00-0000-4000-8000-000000000001"
NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
EARLIER = "2025-12-31T00:00:00Z"
NODES = ready_nodes()
STAGES: dict[StageName, Stage] = {name: stage for stage, name in names.STAGE_NAMES.items()}  # Deploy: no Job
REVISION_OBJECTS = ("Deployment", "PodDisruptionBudget", "HorizontalPodAutoscaler")


# --- bodies ------------------------------------------------------------------------------------------------


def merged(target: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """`target` with `patch` applied as a JSON merge patch (None removes a field)."""
    out = copy.deepcopy(target)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def changed(body: dict[str, Any], **spec: Any) -> dict[str, Any]:
    """`body` with its spec merge-patched."""
    return {**copy.deepcopy(body), "spec": merged(body["spec"], spec)}


BODY = manifest()  # NVFP4 on an H100 pool and an A100-40GB pool (which cannot serve it), a private parent
BF16 = changed(BODY, quantization={"precision": "none", "kvCacheDtype": "bf16"},
               compression={"contextLength": 32768}, deployment={"contextLength": 32768})
NO_DEPLOYMENT = changed(BODY, deployment=None)
RESIZED = changed(BODY, deployment={"maxReplicas": 3})  # a deployment change: a new generation, the same build
LOWERED = changed(BODY, compression={"minQualityRetention": 0.8})  # a floor change: a new generation, the same build
RAISED = changed(BODY, compression={"minQualityRetention": 0.99})
WAITS_FOR_CLAIM = changed(BODY, storage={"size": None, "existingClaim": "shared"})


def stored(body: dict[str, Any], generation: int = 1, status: dict[str, Any] | None = None) -> dict[str, Any]:
    """`body` as the API server holds it: a uid, a generation and the status the last pass wrote."""
    model = copy.deepcopy(body)
    model["metadata"].update(uid=UID, generation=generation)
    model["status"] = status or {}
    return model


# --- results, as real Jobs write them ---------------------------------------------------------------------------

PUBLISHED = published_results()
KINDS: dict[Stage, type[StageResult]] = {"compress": CompressResult, "quantize": QuantizeResult,
                                         "evaluate": GateResult}


def result(stage: Stage, **changes: Any) -> str:
    """The published Puzzle-75B case's termination message of `stage`, as a real run writes it (not marked
    simulated), with `changes`."""
    published = KINDS[stage].model_validate_json(PUBLISHED[RESULT_ANNOTATION.format(stage=stage)])
    return published.model_copy(update={"simulated": None, **changes}).message()


CHILD = CompressResult.model_validate_json(result("compress")).config
COMPRESSED = {"childConfig": CHILD, "predictedSpeedup": 2.0}
QUANTIZED = {**COMPRESSED, "recipe": "nvfp4-mamba-moe", "weightBytes": 44_950_000_000}


# --- what the object owns ---------------------------------------------------------------------------------------


def owned(kind: str, name: str, object_labels: dict[str, str] | None = None, **fields: Any) -> dict[str, Any]:
    """An object of `kind` that the CompressedModel owns (its ownerReference), with `fields` beside metadata."""
    return {"kind": kind, "metadata": {"name": name, "namespace": "ns", "generation": 1,
                                       "labels": {**names.model_labels(BODY), **(object_labels or {})},
                                       "ownerReferences": [{"uid": UID}]}, **fields}


def job(stage: Stage, finished: str | None = None, reason: str | None = None, message: str = "",
        generation: int = 1, pool: str | None = None, name: str | None = None) -> dict[str, Any]:
    """A stage Job: running, or `finished` Complete or Failed (with the Job controller's `reason` and
    `message`)."""
    status: dict[str, Any] = {"active": 1}
    if finished is not None:
        condition = {"type": finished, "status": "True", "message": message}
        if reason is not None:
            condition["reason"] = reason
        status = {"active": 0, "conditions": [condition]}
    return owned("Job", name or names.job_name("m", generation, stage, pool),
                 {names.STAGE: stage, names.GENERATION: str(generation)}, spec={}, status=status)


def plan_map(body: dict[str, Any], generation: int = 1) -> dict[str, Any]:
    """The build plan ConfigMap, as the build's first Job was created with it (at the pools' batch)."""
    model = stored(body, generation)
    spec = CompressedModelSpec.model_validate(model["spec"])
    plan = resolve(spec, model, generation, SETTINGS.catalog, target_batch(spec, NODES, SETTINGS.catalog).value)
    return owned("ConfigMap", names.plan_name("m", generation), data={PLAN_FILE: plan.dump()})


def packaged(generation: int = 1) -> list[dict[str, Any]]:
    """The h100 pool's package plan (what its speed Job reads; its content is not read by `decide`) and the
    record of its package Job's result (the digests of the code its Triton checks)."""
    folder = f"tailor/g{generation}/package-h100/repository/m"
    code = PackageResult(code={f"{folder}/config.pbtxt": "0" * 64, f"{folder}/1/model.py": "1" * 64})
    return [owned("ConfigMap", names.package_plan_name("m", generation, "h100"), data={PLAN_FILE: ""}),
            owned("ConfigMap", names.package_record_name("m", generation, "h100"), data={"result": code.message()})]


def revision(generation: int, available: bool = True, stalled: bool = False) -> dict[str, Any]:
    """The h100 pool's Deployment of `generation`: one replica, available or past its progress deadline."""
    selector = deployment.revision_labels(BODY, "h100", generation)
    status: dict[str, Any] = {"observedGeneration": 1}
    if available:
        status.update(availableReplicas=1, updatedReplicas=1)
    if stalled:
        status["conditions"] = [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
                                 "message": f'ReplicaSet "m-h100-g{generation}-abc" has timed out progressing.'}]
    return owned("Deployment", names.revision_name("m", "h100", generation), selector,
                 spec={"replicas": 1, "selector": {"matchLabels": selector}}, status=status)


def service(generation: int) -> dict[str, Any]:
    """The h100 pool's Service, sending traffic to `generation`'s revision."""
    return owned("Service", names.service_name("m", "h100"), deployment.labels(BODY, "h100"),
                 spec={"selector": deployment.revision_labels(BODY, "h100", generation)})


ARTIFACTS = {"metadata": {"name": "m-artifacts", "namespace": "ns",
                          "labels": {names.MODEL: "m", names.MODEL_UID: UID}},
             "spec": {"resources": {"requests": {"storage": "8Ti"}}}}  # Tailor's claim, made for this object


def given(name: str) -> dict[str, Any]:
    """A claim allowed for Tailor and shared with the object, as its owner gives it."""
    return {"metadata": {"name": name, "namespace": "ns", "labels": {ALLOWED_LABEL: "true"},
                         "annotations": {SHARED_ANNOTATION: "m"}}}


# --- statuses -----------------------------------------------------------------------------------------------


def build(body: dict[str, Any], generation: int = 1, **fields: Any) -> dict[str, Any]:
    """status.build of `body`'s build at `generation`, as resolved (its batch's source recorded), with `fields`."""
    spec = CompressedModelSpec.model_validate(body["spec"])
    return {"generation": generation, "fingerprint": fingerprint(spec),
            "batchSource": target_batch(spec, NODES, SETTINGS.catalog).source, **fields}


def building(body: dict[str, Any], done: tuple[StageName, ...], running: StageName | None,
             generation: int = 1, **fields: Any) -> dict[str, Any]:
    """The status a pass wrote with the stages `done` succeeded and `running` under way (its Job created, Deploy:
    its first pool's package Job); `fields` go into status.build."""
    stages: list[dict[str, Any]] = [{"name": name, "state": "Succeeded", "reason": "JobSucceeded", "progress": 1.0,
                                     "jobName": stage_job(name)} for name in done]
    if running is not None:
        stages.append({"name": running, "state": "Running", "jobName": stage_job(running), "startedAt": EARLIER})
    return {"phase": STAGE_PHASES[running] if running else "Evaluating", "observedGeneration": generation,
            "stages": stages, "build": build(body, **fields)}


def stage_job(name: StageName) -> str | None:
    """The Job of a build stage of generation 1 (the Deploy stage has one per pool)."""
    return names.job_name("m", 1, STAGES[name]) if name in STAGES else None


BUILT: tuple[StageName, ...] = ("Compress", "Quantize", "Evaluate")


def serving(body: dict[str, Any]) -> dict[str, Any]:
    """The status once generation 1 serves on the h100 pool."""
    status = building(body, (*BUILT, "Deploy"), None, **QUANTIZED)
    return {**status, "phase": "Ready", "servingGeneration": 1, "pools": [{"name": "h100", "revision": "g1"}],
            "conditions": [condition_of("Ready", "True", "Serving")]}


def condition_of(kind: str, state: str, reason: str) -> dict[str, Any]:
    return {"type": kind, "status": state, "reason": reason, "message": "", "lastTransitionTime": EARLIER,
            "observedGeneration": 1}


def world(body: dict[str, Any], status: dict[str, Any] | None = None, *objects: dict[str, Any],
          generation: int = 1, claim: dict[str, Any] | None = ARTIFACTS, **fields: Any) -> Observed:
    """What a pass observes: `body` at `generation` with `status`, the `objects` it owns, its artifacts `claim`
    and the devcluster's nodes; `fields` are the rest of `Observed` (results, waiting, evidence, ...)."""
    kinds: dict[str, dict[str, dict[str, Any]]] = {}
    for obj in objects:
        kinds.setdefault(obj["kind"], {})[obj["metadata"]["name"]] = obj
    return Observed(model=stored(body, generation, status), objects=kinds, claim=claim,
                    nodes=fields.pop("nodes", NODES), now=NOW, **fields)


# --- what a decision did ----------------------------------------------------------------------------------------


def created(decision: Decision, kind: str | None = None) -> set[tuple[str, str]]:
    return {(a.manifest["kind"], a.manifest["metadata"]["name"]) for a in decision.actions
            if isinstance(a, Create) and kind in (None, a.manifest["kind"])}


def deleted(decision: Decision) -> set[tuple[str, str]]:
    return {(a.kind, a.name) for a in decision.actions if isinstance(a, Delete)}


def patched(decision: Decision) -> set[tuple[str, str]]:
    return {(a.kind, a.name) for a in decision.actions if isinstance(a, Patch)}


def condition(decision: Decision, kind: str) -> Condition | None:
    return next((c for c in decision.status.conditions if c.type == kind), None)


def revision_gone(generation: int) -> tuple[tuple[str, str], ...]:
    """What deleting the h100 pool's revision of `generation` deletes."""
    return tuple((kind, names.revision_name("m", "h100", generation)) for kind in REVISION_OBJECTS)


# --- phase transitions ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """What one pass must decide: the phase; the Jobs it creates (exactly); other objects it creates (at least);
    what it deletes and patches (exactly); Events it says and must not say; one condition (type, status,
    reason) and one stage (name, state, reason)."""

    phase: Phase
    jobs: tuple[str, ...] = ()
    creates: tuple[tuple[str, str], ...] = ()
    deletes: tuple[tuple[str, str], ...] = ()
    patches: tuple[tuple[str, str], ...] = ()
    said: tuple[str, ...] = ()
    unsaid: tuple[str, ...] = ()
    condition: tuple[str, str, str] | None = None
    stage: tuple[StageName, str, str | None] | None = None


COMPRESSING = building(BODY, (), "Compress")
QUANTIZING = building(BODY, ("Compress",), "Quantize", **COMPRESSED)
EVALUATING = building(BODY, ("Compress", "Quantize"), "Evaluate", **QUANTIZED)
DEPLOYING = building(BODY, BUILT, "Deploy", **QUANTIZED)
POD_GONE: dict[str, Any] = {"results": {}, "with_pods": frozenset()}  # a finished Job whose pod went with its node
WEAK = result("evaluate", child_score=0.50)  # retention 0.8333: below BODY's floor (0.97), above LOWERED's (0.8)
GATE_FAILED = {  # BODY's build, its gate failed at 0.97 on WEAK's scores
    **EVALUATING, "phase": "Failed",
    "stages": [*EVALUATING["stages"][:-1], {"name": "Evaluate", "state": "Failed", "reason": "QualityGateFailed",
                                            "jobName": "m-g1-evaluate"}],
    "quality": {"metric": "next_token_accuracy", "parentScore": 0.6, "childScore": 0.5, "retention": 0.833333,
                "minQualityRetention": 0.97, "passed": False},
    "conditions": [condition_of("QualityGatePassed", "False", "QualityGateFailed"),
                   condition_of("Failed", "True", "QualityGateFailed"),
                   condition_of("Ready", "False", "QualityGateFailed")]}


def finished(stage: Stage, message: str) -> dict[str, Any]:
    """`results` and `with_pods` of a pass that finds `stage`'s Job done with its pod's `message`."""
    name = names.job_name("m", 1, stage)
    return {"results": {name: message}, "with_pods": frozenset({name})}


TRANSITIONS = [
    pytest.param(world(BODY, None, claim=None), Step(
        "Compressing", jobs=("m-g1-compress",), creates=(("PersistentVolumeClaim", "m-artifacts"),
                                                         ("ConfigMap", "m-g1-plan")),
        said=("BuildStarted", "BatchChosen", "ClaimCreated", "JobCreated"), stage=("Compress", "Running", None)),
        id="new-Compressing"),
    pytest.param(world(WAITS_FOR_CLAIM, None, claim=None), Step(
        "Pending", said=("BuildStarted",), unsaid=("ClaimCreated", "JobCreated"),
        stage=("Compress", "Pending", None)), id="new-Pending-existingClaim-not-there"),
    pytest.param(world(WAITS_FOR_CLAIM, {
        "phase": "Pending", "observedGeneration": 1, "build": build(WAITS_FOR_CLAIM),
        "stages": [{"name": "Compress", "state": "Pending", "message": "waiting for PersistentVolumeClaim shared"}]},
        claim=given("shared")), Step(
        "Compressing", jobs=("m-g1-compress",), creates=(("ConfigMap", "m-g1-plan"),), said=("JobCreated",),
        unsaid=("BuildStarted", "BatchChosen", "ClaimCreated"), stage=("Compress", "Running", None)),
        id="Pending-Compressing-claim-there"),
    pytest.param(world(BODY, COMPRESSING, plan_map(BODY), {**job("compress"), "spec": {"suspend": True},
                                                           "status": {}},
                       waiting={"m-g1-compress": "waiting in Kueue LocalQueue team-a: quota exhausted"}),
                 Step("Pending", stage=("Compress", "Pending", "Queued")), id="Compressing-Pending-queued-in-Kueue"),
    pytest.param(world(BODY, COMPRESSING, plan_map(BODY), job("compress", "Complete"), **finished(
        "compress", result("compress"))), Step(
        "Quantizing", jobs=("m-g1-quantize",), said=("JobCreated",), condition=("Compressed", "True", "JobSucceeded"),
        stage=("Compress", "Succeeded", "JobSucceeded")), id="Compressing-Quantizing"),
    pytest.param(world(BODY, COMPRESSING, plan_map(BODY), job("compress", "Complete"), **POD_GONE), Step(
        "Compressing", jobs=("m-g1-compress-r",), said=("JobCreated",), stage=("Compress", "Running", None)),
        id="Compressing-Compressing-pod-gone-result-read-back"),
    pytest.param(world(BF16, building(BF16, (), "Compress"), plan_map(BF16), job("compress", "Complete"),
                       **finished("compress", result("compress"))), Step(
        "Evaluating", jobs=("m-g1-evaluate",), said=("JobCreated",), condition=("Compressed", "True", "JobSucceeded"),
        stage=("Compress", "Succeeded", "JobSucceeded")), id="Compressing-Evaluating-BF16-skips-Quantizing"),
    pytest.param(world(BODY, QUANTIZING, plan_map(BODY), job("compress", "Complete"), job("quantize", "Complete"),
                       **finished("quantize", result("quantize"))), Step(
        "Evaluating", jobs=("m-g1-evaluate",), said=("JobCreated",), condition=("Quantized", "True", "JobSucceeded"),
        stage=("Quantize", "Succeeded", "JobSucceeded")), id="Quantizing-Evaluating"),
    pytest.param(world(BODY, EVALUATING, plan_map(BODY), job("evaluate", "Complete"),
                       **finished("evaluate", result("evaluate"))), Step(
        "Deploying", jobs=("m-g1-package-h100",), creates=(("ConfigMap", "m-g1-package-h100"),),
        said=("QualityGatePassed", "JobCreated"), condition=("QualityGatePassed", "True", "Passed"),
        stage=("Evaluate", "Succeeded", "JobSucceeded")), id="Evaluating-Deploying-package-job"),
    pytest.param(world(NO_DEPLOYMENT, building(NO_DEPLOYMENT, ("Compress", "Quantize"), "Evaluate", **QUANTIZED),
                       plan_map(NO_DEPLOYMENT), job("evaluate", "Complete"),
                       **finished("evaluate", result("evaluate"))), Step(
        "Ready", said=("QualityGatePassed",), unsaid=("JobCreated",), condition=("Ready", "True", "Built"),
        stage=("Evaluate", "Succeeded", "JobSucceeded")), id="Evaluating-Ready-no-deployment"),
    pytest.param(world(LOWERED, EVALUATING, plan_map(BODY), job("evaluate", "Complete"), generation=2,
                       **finished("evaluate", WEAK)), Step(
        "Deploying", jobs=("m-g2-package-h100",), creates=(("ConfigMap", "m-g2-plan"),),
        said=("QualityFloorChanged", "QualityGatePassed", "JobCreated"),
        unsaid=("BuildStarted", "QualityGateRedecided"),
        condition=("QualityGatePassed", "True", "Passed"), stage=("Evaluate", "Succeeded", "JobSucceeded")),
        id="Evaluating-Deploying-a-floor-changed-mid-build-gates-at-its-own-plan"),
    pytest.param(world(LOWERED, GATE_FAILED, plan_map(BODY), generation=2), Step(
        "Deploying", jobs=("m-g2-package-h100",), creates=(("ConfigMap", "m-g2-plan"),),
        said=("QualityFloorChanged", "QualityGateRedecided", "JobCreated"),
        unsaid=("BuildStarted", "QualityGatePassed"),
        condition=("QualityGatePassed", "True", "Passed"), stage=("Evaluate", "Succeeded", "JobSucceeded")),
        id="Failed-Deploying-a-lowered-floor-passes-the-gate-without-a-build-job"),
    pytest.param(world(BODY, DEPLOYING, plan_map(BODY), *packaged(), job("package", "Complete", pool="h100")),
                 Step("Deploying", creates=(("Deployment", "m-h100-g1"), ("Service", "m-h100")),
                      said=("RevisionCreated",), unsaid=("Ready",),
                      condition=("Deployed", "False", "RevisionNotReady"), stage=("Deploy", "Running", None)),
                 id="Deploying-Deploying-packaged-revision-created"),
    pytest.param(world(BODY, DEPLOYING, plan_map(BODY), *packaged(), revision(1), service(1)), Step(
        "Ready", jobs=("m-g1-speed-h100",), said=("Ready",), condition=("Ready", "True", "Serving"),
        stage=("Deploy", "Succeeded", "RevisionReady")), id="Deploying-Ready"),
    pytest.param(world(RESIZED, {**building(RESIZED, BUILT, "Deploy", 2, **QUANTIZED), "servingGeneration": 1},
                       plan_map(RESIZED), *packaged(2), revision(1), revision(2), service(1), generation=2), Step(
        "Ready", jobs=("m-g2-speed-h100",), deletes=revision_gone(1), patches=(("Service", "m-h100"),),
        said=("TrafficSwitched", "RevisionDeleted", "Ready"), unsaid=("BuildStarted",),
        condition=("Deployed", "True", "RevisionReady"), stage=("Deploy", "Succeeded", "RevisionReady")),
        id="Deploying-Ready-traffic-switched-old-revision-deleted"),
    pytest.param(world(NO_DEPLOYMENT, serving(BODY), plan_map(BODY), revision(1), service(1), generation=2), Step(
        "Ready", deletes=(*revision_gone(1), ("Service", "m-h100"), ("NetworkPolicy", "m-no-egress"),
                          ("NetworkPolicy", "m-ingress")),
        said=("RevisionDeleted",), unsaid=("BuildStarted",), condition=("Ready", "True", "Built")),
        id="Ready-Ready-deployment-removed-serving-objects-deleted"),
    pytest.param(world(BODY, {
        "phase": "Failed", "observedGeneration": 1, "build": build(BODY),
        "stages": [{"name": "Compress", "state": "Failed", "reason": "BackoffLimitExceeded",
                    "jobName": "m-g1-compress"}],
        "conditions": [condition_of("Failed", "True", "BackoffLimitExceeded"),
                       condition_of("Ready", "False", "BackoffLimitExceeded")]},
        plan_map(BODY), job("compress", "Failed", "BackoffLimitExceeded"), generation=2), Step(
        "Compressing", jobs=("m-g2-compress",), creates=(("ConfigMap", "m-g2-plan"),),
        deletes=(("Job", "m-g1-compress"),), said=("BuildStarted", "JobCreated"), stage=("Compress", "Running", None)),
        id="Failed-Compressing-new-generation-retries-the-build"),
]


@pytest.mark.parametrize(("observed", "expected"), TRANSITIONS)
def test_a_pass_moves_the_phase_and_acts(observed: Observed, expected: Step) -> None:
    """One pass from a hand-built `Observed`: the phase it moves to and what it does on the way."""
    decision = decide(observed, SETTINGS)
    assert decision.phase == expected.phase, decision.status.conditions
    assert condition(decision, "Failed") is None
    assert {name for _, name in created(decision, "Job")} == set(expected.jobs)
    assert set(expected.creates) <= created(decision), created(decision)
    assert deleted(decision) == set(expected.deletes)
    assert patched(decision) == set(expected.patches)
    said = {event.reason for event in decision.events}
    assert set(expected.said) <= said and not said & set(expected.unsaid), said
    if expected.condition is not None:
        kind, state, reason = expected.condition
        found = condition(decision, kind)
        assert found is not None and (found.status, found.reason) == (state, reason), found
    if expected.stage is not None:
        name, state, reason = expected.stage
        stage = next(s for s in decision.status.stages if s.name == name)
        assert (stage.state, stage.reason) == (state, reason), stage


PASSED = {"metric": "next_token_accuracy", "parentScore": 0.6, "childScore": 0.59, "retention": 0.983333,
          "minQualityRetention": 0.97, "passed": True}  # status.quality of the published scores, at BODY's floor


def test_a_raised_floor_fails_the_gate_and_what_serves_keeps_serving() -> None:
    """Generation 2 raises the floor above generation 1's measured retention (0.9833): the gate is decided again
    at the floor of generation 2's plan and fails; no Job starts, nothing is deleted, generation 1 keeps serving."""
    decision = decide(world(RAISED, {**serving(BODY), "quality": PASSED}, plan_map(BODY), *packaged(), revision(1),
                            service(1), generation=2), SETTINGS)
    assert decision.phase == "Failed"
    failed, ready = condition(decision, "Failed"), condition(decision, "Ready")
    assert failed is not None and failed.reason == "QualityGateFailed"
    assert failed.message.startswith("re-decided from the measured scores (the floor was 0.97): retention 0.9833 "
                                     "against a floor of 0.99")
    assert ready is not None and ready.status == "True" and ready.message.endswith("generation 1 keeps serving")
    assert created(decision) == {("ConfigMap", "m-g2-plan")} and not deleted(decision) and not patched(decision)
    assert {event.reason for event in decision.events} == {"QualityFloorChanged", "QualityGateFailed"}
    evaluate = next(s for s in decision.status.stages if s.name == "Evaluate")
    assert (evaluate.state, evaluate.reason) == ("Failed", "QualityGateFailed")
    assert decision.status.build is not None and decision.status.build.plan_generation == 2


def test_a_build_recorded_before_the_floor_left_the_fingerprint_is_kept() -> None:
    """A status an earlier operator wrote: its build's fingerprint holds the floor, and status.quality does not
    say at which floor the gate was decided. The build is kept (no rebuild on upgrade) under its new fingerprint,
    and the verdict is known as its plan's floor's (not decided again)."""
    spec = CompressedModelSpec.model_validate(BODY["spec"])
    earlier = {**serving(BODY), "build": build(BODY, fingerprint=fingerprint(spec, floor=True), **QUANTIZED),
               "quality": {key: value for key, value in PASSED.items() if key != "minQualityRetention"}}
    decision = decide(world(BODY, earlier, plan_map(BODY), *packaged(), revision(1), service(1)), SETTINGS)
    assert decision.phase == "Ready"
    assert not {"BuildStarted", "QualityGateRedecided", "StatusRestored"} & {event.reason for event in decision.events}
    assert decision.status.build is not None and decision.status.build.fingerprint == fingerprint(spec)
    assert decision.status.quality is not None and decision.status.quality.min_quality_retention == 0.97


def test_the_bf16_build_records_its_recipe_and_the_nvfp4_build_leaves_it_to_quantization() -> None:
    """The BF16 row's build is sized as bf16 from the compression on; the NVFP4 one waits for its recipe."""
    bf16, nvfp4 = (decide(world(body, building(body, (), "Compress"), plan_map(body), job("compress", "Complete"),
                                **finished("compress", result("compress"))), SETTINGS) for body in (BF16, BODY))
    assert bf16.status.build is not None and bf16.status.build.recipe == "bf16"
    assert nvfp4.status.build is not None and nvfp4.status.build.recipe is None


# --- failure reasons --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Failure:
    """How a pass fails: the reason, words of its message, the build stage failed with it (None: refused outside a
    stage's Job: admission, the plan, the deployment), the stage left Pending with the reason (another owner's
    object in the way: the stage starts once it is gone), and what it deletes (exactly)."""

    reason: str
    says: str
    stage: StageName | None = None
    deletes: tuple[tuple[str, str], ...] = ()
    waits: StageName | None = None


STALLED = (plan_map(BODY), revision(1, available=False, stalled=True), service(1))
EVIDENCE = "pod m-h100-g1-abc-1: Running; triton waiting (CrashLoopBackOff)"
BUILTIN = {"models": given("models")}  # the built-in parent's claim, given to the object

FAILURES = [
    pytest.param(world(changed(BODY, jobs={"gpusPerNodes": 8}), None), Failure(
        "InvalidSpec", "the spec does not validate"), id="InvalidSpec-schema"),
    pytest.param(world(changed(BODY, jobs={"resources": {"limits": {"memory": "1Gi"}}}), None), Failure(
        "InvalidSpec", "the memory limit 1Gi is below its request 2Gi", "Compress"),
        id="InvalidSpec-limit-below-request"),
    pytest.param(world(BODY, None, generation=10**6), Failure(
        "InvalidSpec", "generation 1000000 is past the 6 digits"), id="InvalidSpec-generation-past-the-name-digits"),
    pytest.param(world(changed(BODY, jobs={"image": "docker.io/attacker/miner:latest"}), None), Failure(
        "ImageNotAllowed", "spec.jobs.image 'docker.io/attacker/miner:latest' is not an allowed image"),
        id="ImageNotAllowed"),
    pytest.param(world(changed(BODY, jobs={"podAnnotations": {"sidecar.istio.io/inject": "true"}}), None), Failure(
        "AnnotationNotAllowed", "spec.jobs.podAnnotations 'sidecar.istio.io/inject' is not allowed"),
        id="AnnotationNotAllowed"),
    pytest.param(world(changed(BODY, jobs={"priorityClassName": "system-node-critical"}), None), Failure(
        "PriorityClassNotAllowed", "spec.jobs.priorityClassName 'system-node-critical' is not allowed"),
        id="PriorityClassNotAllowed"),
    pytest.param(world(changed(BODY, compression={"data": {"claimName": "corpora", "path": "x"}}), None,
                       named_claims={"corpora": None}), Failure(
        "ClaimNotAllowed", "spec.compression.data.claimName: PersistentVolumeClaim corpora does not exist"),
        id="ClaimNotAllowed"),
    pytest.param(world(changed(BODY, source={"credentialsSecret": {"name": "team-b-hf-token"}}), None), Failure(
        "SecretNotAllowed", "spec.source.credentialsSecret 'team-b-hf-token' is not this object's"),
        id="SecretNotAllowed"),
    pytest.param(world(BODY, None, {**job("compress"), "metadata": {
        "name": "m-g1-compress", "namespace": "ns", "labels": {names.MODEL: "m"},
        "ownerReferences": [{"uid": "someone-else"}]}}), Failure(
        "OwnedElsewhere", "Job m-g1-compress exists and is not this CompressedModel's", waits="Compress"),
        id="OwnedElsewhere-Job"),
    pytest.param(world(BODY, None, claim={**given("m-artifacts"), "metadata": {
        "name": "m-artifacts", "namespace": "ns", "labels": {names.MODEL: "m", names.MODEL_UID: "an-earlier-m"}}}),
        Failure("OwnedElsewhere", "PersistentVolumeClaim m-artifacts exists and was not created for this",
                waits="Compress"), id="OwnedElsewhere-claim"),
    pytest.param(world(BODY, COMPRESSING, owned("ConfigMap", "m-g1-plan", data={}), job("compress")), Failure(
        "InvalidPlan", "ConfigMap m-g1-plan does not hold a build plan"), id="InvalidPlan"),
    pytest.param(world(changed(builtin_super({"gpusPerNode": 8, "nodes": 2}, 100_000), storage={"size": "1Ti"}),
                       None, claim=None, named_claims=BUILTIN), Failure(
        "DoesNotFit", "the compression does not fit 2 node(s) x 8 H100-80GB", "Compress"), id="DoesNotFit"),
    pytest.param(world(changed(builtin_super({"gpusPerNode": 8, "nodes": 3}, 100_000), storage={"size": "1Ti"}),
                       None, claim=None, named_claims=BUILTIN), Failure(
        "ClaimTooSmall", "PersistentVolumeClaim m-artifacts would hold 1Ti", "Compress"), id="ClaimTooSmall"),
    pytest.param(world(BODY, COMPRESSING, plan_map(BODY), job(
        "compress", "Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit"),
        results={"m-g1-compress": "CUDA out of memory"}), Failure(
        "BackoffLimitExceeded", "Job m-g1-compress failed: Job has reached the specified backoff limit; CUDA out of "
        "memory", "Compress"), id="BackoffLimitExceeded"),
    pytest.param(world(BODY, QUANTIZING, plan_map(BODY), job(
        "quantize", "Failed", "DeadlineExceeded", "Job was active longer than specified deadline")), Failure(
        "DeadlineExceeded", "Job m-g1-quantize failed: Job was active longer than specified deadline", "Quantize"),
        id="DeadlineExceeded"),
    pytest.param(world(BODY, EVALUATING, plan_map(BODY), job("evaluate", "Failed")), Failure(
        "JobFailed", "Job m-g1-evaluate failed", "Evaluate"), id="JobFailed-no-reason-of-its-own"),
    pytest.param(world(BODY, COMPRESSING, plan_map(BODY), job("compress", "Complete"), **finished("compress", "")),
                 Failure("NoResult", "Job m-g1-compress succeeded without a result in its termination message",
                         "Compress"), id="NoResult"),
    pytest.param(world(BODY, COMPRESSING, plan_map(BODY), job("compress", "Complete"), job(
        "compress", "Failed", "BackoffLimitExceeded", name="m-g1-compress-r"),
        results={"m-g1-compress-r": "no compress result on the claim"}), Failure(
        "NoResult", "reading its result from the claim failed: Job m-g1-compress-r failed", "Compress"),
        id="NoResult-pod-gone-and-read-back-failed"),
    pytest.param(world(BODY, COMPRESSING, plan_map(BODY), job("compress", "Complete"),
                       **finished("compress", "Segmentation fault (core dumped)")), Failure(
        "InvalidResult", "the compress Job's result is not what tailor writes", "Compress"), id="InvalidResult"),
    pytest.param(world(BODY, building(BODY, BUILT, None, recipe="nvfp4-mamba-moe"), plan_map(BODY)), Failure(
        "InvalidResult", "the build recorded no child config"), id="InvalidResult-no-child-config-to-size-with"),
    pytest.param(world(BODY, COMPRESSING, plan_map(BODY), job("compress", "Complete"),
                       **finished("compress", result("compress", active_params=9_600_000_000))), Failure(
        "ActiveParamsAboveCap", "9.600B active parameters, above maxActiveParamsBillions 9.5", "Compress"),
        id="ActiveParamsAboveCap"),
    pytest.param(world(BODY, EVALUATING, plan_map(BODY), job("evaluate", "Complete"),
                       **finished("evaluate", result("evaluate", child_score=0.50))), Failure(
        "QualityGateFailed", "retention 0.8333 against a floor of 0.97", "Evaluate"), id="QualityGateFailed"),
    pytest.param(world(LOWERED, EVALUATING, plan_map(BODY), job("evaluate", "Complete"), **finished("evaluate", WEAK)),
                 Failure("QualityGateFailed", "retention 0.8333 against a floor of 0.97", "Evaluate"),
                 id="QualityGateFailed-at-the-floor-of-its-plan-not-of-the-spec"),  # generation 1's plan says 0.97
    pytest.param(world(BODY, building(BODY, BUILT, None, **QUANTIZED), plan_map(BODY), nodes=[]), Failure(
        "NoPoolFits", "no pool can serve the model: h100: no node matches nodeSelector"), id="NoPoolFits"),
    pytest.param(world(BODY, DEPLOYING, *STALLED, evidence={"m-h100-g1": EVIDENCE}), Failure(
        "RevisionFailed", f"cannot become available: ReplicaSet \"m-h100-g1-abc\" has timed out progressing.\n"
        f"{EVIDENCE}\nthe pool is tried again when the spec changes", deletes=revision_gone(1)),
        id="RevisionFailed-past-its-progress-deadline"),
    pytest.param(world(BODY, DEPLOYING, *STALLED, unscheduled=frozenset({"m-h100-g1"})), Failure(
        "RevisionFailed", "tried again once its free GPUs hold the 1 replica(s) it asked for",
        deletes=revision_gone(1)), id="RevisionFailed-unschedulable-retried-on-capacity"),
]


@pytest.mark.parametrize(("observed", "expected"), FAILURES)
def test_a_pass_fails_the_generation_with_the_reason(observed: Observed, expected: Failure) -> None:
    """One pass from a hand-built `Observed` that fails the generation: the reason in the Failed condition, the
    stage and a Warning; no Job is started, nothing serves (Ready False)."""
    decision = decide(observed, SETTINGS)
    assert decision.phase == "Failed"
    failed, ready = condition(decision, "Failed"), condition(decision, "Ready")
    assert failed is not None and (failed.status, failed.reason) == ("True", expected.reason), failed
    assert expected.says in failed.message, failed.message
    assert ready is not None and (ready.status, ready.reason) == ("False", expected.reason)
    assert ("Warning", expected.reason) in {(event.type, event.reason) for event in decision.events}
    assert not created(decision, "Job")
    assert deleted(decision) == set(expected.deletes)
    stages = {s.name: s for s in decision.status.stages if s.state == "Failed"}
    if expected.stage is None:
        assert not stages, stages
    else:
        assert list(stages) == [expected.stage] and stages[expected.stage].reason == expected.reason
    waiting = {s.name: s for s in decision.status.stages if s.state == "Pending" and s.reason}
    assert list(waiting) == ([expected.waits] if expected.waits else []), waiting
    if expected.waits:
        assert waiting[expected.waits].reason == expected.reason and expected.says in waiting[expected.waits].message
