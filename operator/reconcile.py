"""One reconciliation pass over a CompressedModel: read what exists, take the next step, write the status.

Level-triggered and idempotent: every object has a deterministic name, is created or adopted (a restarted
operator finds the Job it started), and every decision is made from what the API server holds, so a pass
can be repeated, interrupted or run after a crash with the same outcome.

Per generation: Compress -> Quantize -> Evaluate (the quality gate) -> Deploy. The first three build the
artifacts and are skipped when a later generation changes only the deployment (same `fingerprint`). Deploy
packages a model repository per pool, starts that generation's revision beside the one serving, moves the
pool's Service to it once it is ready, then removes the old one. A failed stage fails the generation and
leaves the serving revision alone.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, field
from typing import Any

import yaml
from pydantic import ValidationError

from tailor.compressor.architecture import architecture_from_config
from tailor.compressor.hardware import GpuCatalog
from tailor.compressor.results import CompressResult, GateResult, QuantizeResult, unpack_config
from tailor.operator.api import (
    RUNTIME_IMAGE,
    STAGE_PHASES,
    ArchitectureSummary,
    BuildStatus,
    CompressedModelSpec,
    CompressedModelStatus,
    Condition,
    Endpoint,
    Phase,
    PoolStatus,
    QualityReport,
    StageName,
    StageProgress,
)
from tailor.operator.deployment import (
    PORTS,
    REVISION_LABEL,
    SERVING_SERVICE_ACCOUNT,
    labels,
    manifests,
    owner_reference,
    revision_name,
    service,
    service_name,
)
from tailor.operator.jobs import JOB_SERVICE_ACCOUNT, JobSettings, Stage, job_name, stage_job
from tailor.operator.kube import Kube
from tailor.operator.pools import PoolPlan, plan_pools
from tailor.operator.stages import (
    PLAN_FILE,
    InvalidPlan,
    artifacts_folder,
    compress_args,
    compression_plan,
    evaluate_args,
    fingerprint,
    job_env,
    package_args,
    parent_location,
    quantize_args,
    quantizes,
    repository,
)

WAITING_REQUEUE_S = 30.0  # a safety net: Job and Deployment events wake the object sooner
SETTLED_REQUEUE_S = 300.0
STAGE_COMMANDS: dict[StageName, Stage] = {"Compress": "compress", "Quantize": "quantize", "Evaluate": "evaluate"}


@dataclass(frozen=True)
class OperatorSettings:
    """Cluster-wide defaults the spec can leave out."""

    job_image: str = RUNTIME_IMAGE
    claim_size: str = "1Ti"
    catalog: GpuCatalog = field(default_factory=GpuCatalog.load)
    job_service_account: str = JOB_SERVICE_ACCOUNT
    serving_service_account: str = SERVING_SERVICE_ACCOUNT
    image_pull_secrets: tuple[str, ...] = ()


@dataclass
class Outcome:
    phase: Phase | None
    requeue_s: float
    events: list[tuple[str, str, str]]  # (type, reason, message)


class StageFailed(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0)


class Pass:
    """One pass; `run` returns the phase and when to look again."""

    def __init__(self, kube: Kube, body: dict[str, Any], settings: OperatorSettings) -> None:
        self.kube, self.body, self.settings = kube, body, settings
        meta = body["metadata"]
        self.name, self.namespace, self.generation = meta["name"], meta["namespace"], int(meta["generation"])
        self.owner = f"{self.namespace}/{self.name}"
        self.status = CompressedModelStatus.model_validate(body.get("status") or {})
        self.events: list[tuple[str, str, str]] = []

    # --- status helpers ---------------------------------------------------------------------------

    def condition(self, kind: str, state: bool | None, reason: str, message: str = "") -> None:
        value = "Unknown" if state is None else "True" if state else "False"
        old = next((c for c in self.status.conditions if c.type == kind), None)
        since = old.last_transition_time if old is not None and old.status == value else _now()
        new = Condition(type=kind, status=value, reason=reason, message=message[:32768],
                        last_transition_time=since, observed_generation=self.generation)
        self.status.conditions = [c for c in self.status.conditions if c.type != kind] + [new]

    def stage(self, name: StageName) -> StageProgress:
        found = next((s for s in self.status.stages if s.name == name), None)
        if found is None:
            found = StageProgress(name=name)
            self.status.stages.append(found)
        return found

    def event(self, reason: str, message: str, warning: bool = False) -> None:
        self.events.append(("Warning" if warning else "Normal", reason, message))

    # --- the pass ---------------------------------------------------------------------------------

    def run(self) -> Outcome:
        try:
            spec = CompressedModelSpec.model_validate(self.body["spec"])
        except ValidationError as error:
            return self.fail("InvalidSpec", f"the spec does not validate: {error}")
        try:
            self.start_build(spec)
            claim = spec.storage.existing_claim or f"{self.name}-artifacts"
            for stage in self.build_stages(spec, self.settings.catalog):
                if not self.run_stage(spec, stage, claim):
                    return self.outcome(STAGE_PHASES[stage])
            if spec.deployment is None:
                self.condition("Ready", True, "Compressed", "the model is built; the spec asks for no deployment")
                return self.outcome("Ready")
            return self.deploy(spec, claim)
        except StageFailed as failure:
            return self.fail(failure.reason, failure.message)
        except InvalidPlan as error:
            return self.fail("InvalidPlan", str(error))

    def outcome(self, phase: Phase) -> Outcome:
        self.status.phase = phase
        self.status.observed_generation = self.generation
        settled = phase in ("Ready", "Failed")
        return Outcome(phase, SETTLED_REQUEUE_S if settled else WAITING_REQUEUE_S, self.events)

    def fail(self, reason: str, message: str) -> Outcome:
        if self.status.phase != "Failed" or self.status.observed_generation != self.generation:
            self.event(reason, message, warning=True)
        self.condition("Failed", True, reason, message)
        serving = self.status.serving_generation
        self.condition("Ready", serving is not None, reason,
                       f"generation {self.generation} failed: {message}" + (
                           f"; generation {serving} keeps serving" if serving is not None else ""))
        return self.outcome("Failed")

    def start_build(self, spec: CompressedModelSpec) -> None:
        """A new build when the artifacts' inputs changed, or when a new generation follows a build whose Job
        failed (a retry); otherwise this generation reuses the last build. A failed quality gate is not retried:
        the same inputs give the same child."""
        digest = fingerprint(spec)
        build, new_generation = self.status.build, self.status.observed_generation != self.generation
        job_failed = any(s.state == "Failed" and s.name != "Deploy" and not (s.message or "").startswith(
            "QualityGateFailed") for s in self.status.stages)
        if build is not None and build.fingerprint == digest and not (job_failed and new_generation):
            if new_generation:
                self.status.conditions = [c for c in self.status.conditions if c.type != "Failed"]
                self.status.stages = [s for s in self.status.stages if s.name != "Deploy"]
            return
        self.status.build = BuildStatus(generation=self.generation, fingerprint=digest)
        self.status.stages, self.status.architecture, self.status.quality = [], None, None
        self.status.conditions = [c for c in self.status.conditions if c.type in ("Ready",)]
        self.event("BuildStarted", f"generation {self.generation} builds new artifacts (fingerprint {digest})")

    @staticmethod
    def build_stages(spec: CompressedModelSpec, catalog: GpuCatalog) -> list[StageName]:
        stages: list[StageName] = ["Compress", "Quantize", "Evaluate"]
        return [s for s in stages if s != "Quantize" or quantizes(spec, catalog)]

    @property
    def build(self) -> int:
        assert self.status.build is not None
        return self.status.build.generation

    def ensure_claim(self, spec: CompressedModelSpec) -> str | None:
        """The artifacts claim, created before the first Job that needs it (unless it is an existingClaim); why
        to wait instead, while a claim of that name from a deleted object is still going away."""
        if spec.storage.existing_claim is not None:
            return None
        name = f"{self.name}-artifacts"
        claim: dict[str, Any] = {
            "apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": name, "namespace": self.namespace,
                         "labels": {"app.kubernetes.io/managed-by": "tailor", "tailor.dev/model": self.name}},
            "spec": {"accessModes": ["ReadWriteMany"],
                     "resources": {"requests": {"storage": spec.storage.size or self.settings.claim_size}}}}
        if spec.storage.storage_class_name is not None:
            claim["spec"]["storageClassName"] = spec.storage.storage_class_name
        if self.kube.create(self.owner, claim) is not None:
            self.event("ClaimCreated", f"created PersistentVolumeClaim {name} for the artifacts")
            return None
        existing = self.kube.get(self.owner, "PersistentVolumeClaim", self.namespace, name)
        if existing is None or existing["metadata"].get("deletionTimestamp"):
            return f"waiting for PersistentVolumeClaim {name}, being deleted, to go before creating it anew"
        return None

    def ensure_service_account(self, name: str) -> None:
        """A ServiceAccount for the stage or Triton pods of this namespace: no API token is mounted and no role
        is bound to it; it carries the image pull secrets. Shared by the namespace's models, so not owned."""
        self.kube.create(self.owner, {
            "apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": name, "namespace": self.namespace,
                         "labels": {"app.kubernetes.io/managed-by": "tailor"}},
            "automountServiceAccountToken": False,
            "imagePullSecrets": [{"name": secret} for secret in self.settings.image_pull_secrets]})

    def job_settings(self, spec: CompressedModelSpec, stage: Stage) -> JobSettings:
        jobs = spec.jobs
        return JobSettings(image=jobs.image or self.settings.job_image,
                           service_account=self.settings.job_service_account,
                           gpus_per_node=0 if stage == "package" else 1 if stage == "evaluate" else jobs.gpus_per_node,
                           nodes=jobs.nodes if stage == "compress" else 1, backoff_limit=jobs.backoff_limit,
                           active_deadline_seconds=jobs.active_deadline_seconds)

    def plan_config_map(self, spec: CompressedModelSpec) -> str:
        name = f"{self.name}-g{self.build}-plan"

        plan = compression_plan(spec, self.settings.catalog)
        self.kube.create(self.owner, {  # one plan per build: an existing one is this one
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": self.namespace, "ownerReferences": [owner_reference(self.body)],
                         "labels": {"app.kubernetes.io/managed-by": "tailor", "tailor.dev/model": self.name}},
            "data": {PLAN_FILE: yaml.safe_dump(plan, sort_keys=False)}})
        return name

    # --- stage Jobs -------------------------------------------------------------------------------

    def run_stage(self, spec: CompressedModelSpec, name: StageName, claim: str) -> bool:
        """Advance one build stage; True once it has succeeded."""
        progress = self.stage(name)
        if progress.state == "Succeeded":
            return True
        if progress.state == "Failed":
            raise StageFailed(progress.message.split(":", 1)[0] if progress.message else "StageFailed",
                              progress.message or f"{name} failed")
        command = STAGE_COMMANDS[name]
        folder = artifacts_folder(self.body)
        args = {"compress": lambda: compress_args(folder, self.build),
                "quantize": lambda: quantize_args(spec, folder, self.build, self.settings.catalog),
                "evaluate": lambda: evaluate_args(spec, folder, self.build, self.settings.catalog)}[command]()
        message = self.job(spec, command, self.build, args, claim, progress)
        if message is None:
            return False
        self.record(spec, name, message)
        progress.state, progress.completed_at, progress.progress = "Succeeded", _now(), 1.0
        return True

    def job(self, spec: CompressedModelSpec, stage: Stage, generation: int, args: list[str], claim: str,
            progress: StageProgress, suffix: str = "") -> str | None:
        """Create or adopt the stage's Job; its result message once it succeeded, None while it runs."""
        name = job_name(self.body, generation, stage, suffix)
        job = self.kube.get(self.owner, "Job", self.namespace, name)
        if job is None:
            if waiting := self.ensure_claim(spec):
                progress.message = waiting
                return None
            self.ensure_service_account(self.settings.job_service_account)
            plan_map = self.plan_config_map(spec)
            _, source_claim = parent_location(spec)
            for manifest in stage_job(self.body, stage, generation, args, self.job_settings(spec, stage),
                                      self.target_product(spec), claim, plan_map, spec.jobs.pod_annotations,
                                      source_claim, suffix, job_env(spec)):
                job, created = self.kube.ensure(self.owner, manifest)
                if created and manifest["kind"] == "Job":
                    self.event("JobCreated", f"created Job {name}: tailor {' '.join(args)}")
        assert job is not None
        progress.job_name, progress.state = name, "Running"
        progress.started_at = progress.started_at or _now()
        conditions = {c["type"]: c for c in (job.get("status") or {}).get("conditions", [])
                      if c.get("status") == "True"}
        if "Failed" in conditions:
            failure = conditions["Failed"]
            detail = self.pod_message(name, "Failed")
            reason = failure.get("reason") or "JobFailed"
            text = f"{reason}: Job {name} failed: {failure.get('message', '')}" + (f"; {detail}" if detail else "")
            progress.state, progress.message = "Failed", text
            raise StageFailed(reason, text)
        if "Complete" not in conditions:
            active = (job.get("status") or {}).get("active", 0)
            progress.message = f"{active} pod(s) running" if active else "waiting for a pod"
            return None
        if stage == "package":  # the repository on the claim is the result
            return ""
        message = self.pod_message(name, "Succeeded")
        if not message:
            progress.state = "Failed"
            progress.message = f"NoResult: Job {name} succeeded without a result in its termination message"
            raise StageFailed("NoResult", progress.message)
        return message

    def pod_message(self, job: str, phase: str) -> str | None:
        """The termination message of the Job's pod in `phase` (rank 0 of an Indexed Job), newest first."""
        pods = [p for p in self.kube.select(self.owner, "Pod", self.namespace, {"batch.kubernetes.io/job-name": job})
                if (p.get("status") or {}).get("phase") == phase and (p["metadata"].get("annotations") or {}).get(
                    "batch.kubernetes.io/job-completion-index", "0") == "0"]
        pods.sort(key=lambda p: p["metadata"].get("creationTimestamp", ""), reverse=True)
        for pod in pods:
            for container in (pod.get("status") or {}).get("containerStatuses", []):
                terminated = (container.get("state") or {}).get("terminated") or {}
                if terminated.get("message"):
                    return str(terminated["message"]).strip()
        return None

    def target_product(self, spec: CompressedModelSpec) -> str:
        gpu = self.settings.catalog.get(spec.compression.target_gpu.value)
        if not gpu.gfd_products:
            raise StageFailed("NoNodeLabel", f"GPU profile {gpu.name} names no nvidia.com/gpu.product to select "
                                             "nodes by (gfdProducts in the GPU catalog)")
        return gpu.gfd_products[0]

    def record(self, spec: CompressedModelSpec, stage: StageName, message: str) -> None:
        """Copy a stage's result into the status."""
        try:
            if stage == "Compress":
                result = CompressResult.model_validate_json(message)
                assert self.status.build is not None
                self.status.build.child_config = result.config
                self.status.architecture = ArchitectureSummary(
                    total_params_billions=round(result.params / 1e9, 4),
                    active_params_billions=round(result.active_params / 1e9, 4),
                    blocks=len(result.pattern), summary=f"{result.pattern}; predicted {result.predicted_speedup:.3f}x "
                    f"decode, KL to parent {result.kl_to_parent:.4f}")
                self.condition("Compressed", True, "JobSucceeded", f"{result.params / 1e9:.3f}B parameters "
                               f"({result.active_params / 1e9:.3f}B active) from {result.parent_params / 1e9:.3f}B")
                cap = spec.compression.max_active_params_billions
                if cap is not None and result.active_params > cap * 1e9:
                    raise StageFailed("ActiveParamsAboveCap", f"the child has {result.active_params / 1e9:.3f}B "
                                      f"active parameters, above maxActiveParamsBillions {cap}")
            elif stage == "Quantize":
                quantized = QuantizeResult.model_validate_json(message)
                if self.status.architecture is not None:
                    self.status.architecture.precision = quantized.recipe
                self.condition("Quantized", True, "JobSucceeded",
                               f"{quantized.recipe}: {quantized.weight_bytes / 1e9:.3f} GB of weights")
            else:
                gate = GateResult.model_validate_json(message)
                self.status.quality = QualityReport(metric=gate.metric, parent_score=gate.parent_score,
                                                    child_score=gate.child_score, retention=gate.retention,
                                                    passed=gate.passed)
                verdict = (f"retention {gate.retention:.4f} against a floor of {gate.min_retention} "
                           f"({gate.metric}: child {gate.child_score:.4f}, parent {gate.parent_score:.4f})")
                self.condition("QualityGatePassed", gate.passed, "Passed" if gate.passed else "QualityGateFailed",
                               verdict)
                if not gate.passed:
                    self.stage("Evaluate").state = "Failed"
                    self.stage("Evaluate").message = f"QualityGateFailed: {verdict}"
                    raise StageFailed("QualityGateFailed", verdict)
                self.event("QualityGatePassed", verdict)
        except (ValidationError, ValueError) as error:
            raise StageFailed("InvalidResult", f"the {stage} Job's result is not what tailor writes: "
                                               f"{error}") from error
        if stage == "Compress" and self.status.architecture is not None and not quantizes(spec, self.settings.catalog):
            self.status.architecture.precision = "bf16"

    # --- deployment -------------------------------------------------------------------------------

    def deploy(self, spec: CompressedModelSpec, claim: str) -> Outcome:
        assert spec.deployment is not None and self.status.build is not None
        progress = self.stage("Deploy")
        progress.state, progress.started_at = "Running", progress.started_at or _now()
        config = self.status.build.child_config
        if config is None:
            raise StageFailed("NoArchitecture", "the build has no child config to size deployments with")
        arch = architecture_from_config(unpack_config(config), f"status.build.childConfig of {self.owner}")
        plans = plan_pools(spec, self.kube.nodes(self.owner), arch, self.settings.catalog)
        serving = [p for p in plans if p.skipped is None]
        pools: list[PoolStatus] = []
        ready = True
        for plan in plans:
            if plan.skipped is not None:
                pools.append(PoolStatus(name=plan.name, gpu_product=plan.gpu_product, skipped=plan.skipped))
                continue
            status, pool_ready = self.deploy_pool(spec, plan, claim)
            pools.append(status)
            ready = ready and pool_ready
        self.remove_pools({p.name for p in serving})
        self.status.pools = pools
        self.status.ready_replicas = sum(p.ready_replicas or 0 for p in pools)
        self.status.endpoints = [
            Endpoint(pool=p.name, url=f"{service_name(self.body, p.name)}.{self.namespace}.svc:{PORTS[protocol]}",
                     protocol=protocol)
            for p in pools if p.revision is not None for protocol in ("http", "grpc")]
        skipped = "; ".join(f"{p.name}: {p.skipped}" for p in pools if p.skipped)
        if not serving:
            progress.state, progress.message = "Failed", f"NoPoolFits: {skipped}"
            raise StageFailed("NoPoolFits", f"no pool can serve the model: {skipped}")
        if not ready:
            progress.message = "waiting for " + ", ".join(
                p.name for p in pools if not p.skipped and (p.revision != f"g{self.generation}"
                                                             or (p.ready_replicas or 0) < (p.replicas or 1)))
            self.condition("Deployed", False, "RevisionNotReady", progress.message)
            return self.outcome("Deploying")
        if self.status.serving_generation != self.generation:
            self.event("Ready", f"generation {self.generation} serves on {', '.join(p.name for p in serving)}")
        self.status.serving_generation = self.generation
        progress.state, progress.completed_at, progress.progress = "Succeeded", _now(), 1.0
        progress.message = f"skipped pools: {skipped}" if skipped else None
        self.condition("Deployed", True, "RevisionReady",
                       f"generation {self.generation} on {len(serving)} pool(s)" + (f"; skipped {skipped}"
                                                                                    if skipped else ""))
        self.condition("Ready", True, "Serving", f"{self.status.ready_replicas} ready replica(s)")
        self.status.conditions = [c for c in self.status.conditions if c.type != "Failed"]
        return self.outcome("Ready")

    def deploy_pool(self, spec: CompressedModelSpec, plan: PoolPlan, claim: str) -> tuple[PoolStatus, bool]:
        """Package, start this generation's revision, switch the Service once it is ready, retire the old."""
        assert spec.deployment is not None and plan.replicas is not None
        status = PoolStatus(name=plan.name, gpu_product=plan.gpu_product, gpus_per_replica=plan.tensor_parallel,
                            concurrency_per_gpu=int(plan.concurrency_per_gpu or 0),
                            concurrency_per_replica=plan.concurrency_per_replica, replicas=plan.replicas)
        current = self.kube.get(self.owner, "Service", self.namespace, service_name(self.body, plan.name))
        serving = ((current or {}).get("spec", {}).get("selector") or {}).get(REVISION_LABEL)
        status.revision = serving
        revision = f"g{self.generation}"
        if serving == revision:
            ready, replicas = self.revision_ready(plan.name)
            status.ready_replicas = replicas
            if ready:
                self.retire(plan.name, keep=revision)
            return status, ready
        package = self.job(spec, "package", self.generation,
                           package_args(spec, self.name, artifacts_folder(self.body), self.build, self.generation,
                                        plan, self.settings.catalog),
                           claim, self.stage("Deploy"), suffix=plan.name)
        if package is None:
            return status, False
        ready, replicas = self.revision_ready(plan.name)
        if replicas is None:  # no Deployment yet: create the revision
            self.ensure_service_account(self.settings.serving_service_account)
            served = f"{repository(artifacts_folder(self.body), self.generation, plan.name)}/repository"
            for manifest in manifests(self.body, plan, spec.deployment, claim, served, self.generation,
                                      self.settings.serving_service_account):
                _, created = self.kube.ensure(self.owner, manifest)
                if created and manifest["kind"] == "Deployment":
                    self.event("RevisionCreated", f"created Deployment {manifest['metadata']['name']}: "
                               f"{plan.replicas} replica(s) x {plan.tensor_parallel} GPU(s), "
                               f"{plan.concurrency_per_replica} concurrent requests each")
            replicas = 0
        if current is None:  # the first revision: the Service can point at it from the start
            self.kube.ensure(self.owner, service(self.body, plan.name, self.generation))
            status.revision = revision
        elif ready:  # never send traffic to a revision that is not ready
            self.kube.merge_patch(self.owner, "Service", self.namespace, service_name(self.body, plan.name),
                                  {"spec": {"selector": {REVISION_LABEL: revision}}})
            self.event("TrafficSwitched", f"Service {service_name(self.body, plan.name)} moved from {serving} to "
                                          f"{revision}")
            status.revision = revision
        if ready and status.revision == revision:
            self.retire(plan.name, keep=revision)
            status.ready_replicas = replicas
        else:
            status.ready_replicas = self.revision_ready(plan.name, serving)[1] if serving else replicas
        return status, ready and status.revision == revision

    def revision_ready(self, pool: str, revision: str | None = None) -> tuple[bool, int | None]:
        """Whether the revision (this generation's by default) is available; its available replicas, None when
        it has no Deployment."""
        name = revision_name(self.body, pool, self.generation) if revision is None else \
            f"{service_name(self.body, pool)}-{revision}"
        deployment = self.kube.get(self.owner, "Deployment", self.namespace, name)
        if deployment is None:
            return False, None
        status, wanted = deployment.get("status") or {}, deployment["spec"].get("replicas", 1)
        available = status.get("availableReplicas", 0)
        current = status.get("observedGeneration", 0) >= deployment["metadata"]["generation"]
        return current and available >= wanted and status.get("updatedReplicas", 0) >= wanted, available

    def retire(self, pool: str, keep: str) -> None:
        """Delete the pool's other revisions (Deployment, PDB, HPA)."""
        for deployment in self.kube.select(self.owner, "Deployment", self.namespace, labels(self.body, pool)):
            if deployment["metadata"]["labels"].get(REVISION_LABEL) != keep:
                self.delete_revision(deployment["metadata"]["name"])

    def delete_revision(self, name: str) -> None:
        for kind in ("HorizontalPodAutoscaler", "PodDisruptionBudget", "Deployment"):
            if self.kube.delete(self.owner, kind, self.namespace, name) and kind == "Deployment":
                self.event("RevisionDeleted", f"deleted Deployment {name}")

    def remove_pools(self, keep: set[str]) -> None:
        """Pools gone from the spec (or skipped now): their revisions and Service go."""
        selector = {"app.kubernetes.io/managed-by": "tailor", "tailor.dev/model": self.name,
                    "app.kubernetes.io/name": "triton"}
        for deployment in self.kube.select(self.owner, "Deployment", self.namespace, selector):
            pool = deployment["metadata"]["labels"].get("tailor.dev/pool")
            if pool not in keep:
                self.delete_revision(deployment["metadata"]["name"])
                self.kube.delete(self.owner, "Service", self.namespace, service_name(self.body, str(pool)))


def reconcile(kube: Kube, namespace: str, name: str, settings: OperatorSettings) -> Outcome | None:
    """One pass on the object as the API server has it now (None once it is gone): act, then write the status
    if it changed, and post the Events the pass collected."""
    body = kube.get(f"{namespace}/{name}", "CompressedModel", namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return None
    step = Pass(kube, body, settings)
    outcome = step.run()
    before = body.get("status") or {}
    after = json.loads(step.status.model_dump_json(by_alias=True, exclude_none=True))
    if after != before:
        kube.patch_status(step.owner, step.namespace, step.name, _merge_patch(before, after))
    for kind, reason, message in outcome.events:
        kube.event(step.owner, body, kind, reason, message)
    return outcome


def _merge_patch(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """An RFC 7386 merge patch from `before` to `after` (keys that went away become null)."""
    patch: dict[str, Any] = {key: None for key in before if key not in after}
    for key, value in after.items():
        old = before.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            inner = _merge_patch(old, value)
            if inner:
                patch[key] = inner
        elif value != old:
            patch[key] = value
    return patch

