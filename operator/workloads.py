"""The workloads a pass creates for a stage: the artifacts claim (or the check of an existingClaim), the
namespace's ServiceAccount, the plan ConfigMap and the stage's Job; and what a Job's state means for it.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from tailor.compressor.buildplan import BUILD_STAGES, DISTRIBUTED_STAGES, ONE_GPU_STAGES, PLAN_FILE, BuildPlan, Stage
from tailor.compressor.results import PackageResult
from tailor.compressor.sizing.hostmemory import HostNeed
from tailor.operator import names
from tailor.operator.api import CompressedModelSpec
from tailor.operator.conditions import Reason, Refused
from tailor.operator.decision import Pass
from tailor.operator.deployment import egress_policy
from tailor.operator.jobs import JobSettings, downloads, stage_job
from tailor.operator.manifest import finishing_condition, owned_by, owned_metadata
from tailor.operator.memo import Memo
from tailor.operator.resolve import mounted_claims
from tailor.operator.settings import ALLOWED_LABEL, SHARED_ANNOTATION
from tailor.operator.tenancy import check_claim

SPEED_DEADLINE_S = 2 * 3600  # loading both models and measuring them; a speed Job never holds GPUs longer
RESULT_KEY = "result"  # of a Job's record (`keep_record`)
PLANS: Memo[BuildPlan] = Memo(1024)  # a plan ConfigMap's text -> its plan (frozen): parsed once, not every pass


def claim_ready(p: Pass, spec: CompressedModelSpec) -> str | None:
    """Make sure the artifacts claim is there to write to (creating Tailor's own); None when it is, else
    what the object waits for. An existingClaim must be labelled for Tailor; a claim of Tailor's name
    that another object (or an earlier object of the same name) created is never adopted."""
    claim = p.world.claim
    if spec.storage.existing_claim is not None:
        name = spec.storage.existing_claim
        if claim is None:
            return f"waiting for PersistentVolumeClaim {name} (spec.storage.existingClaim) to exist"
        check_claim(claim, name, "spec.storage.existingClaim", p.model)
        return None
    name = names.claim_name(p.name)
    if claim is None:
        manifest: dict[str, Any] = {
            "apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": owned_metadata(p.model, name, names.model_labels(p.model), by_label=True),
            "spec": {"accessModes": ["ReadWriteMany"],
                     "resources": {"requests": {"storage": spec.storage.size or p.settings.claim_size}}}}
        if spec.storage.storage_class_name is not None:
            manifest["spec"]["storageClassName"] = spec.storage.storage_class_name
        p.create(manifest)
        p.event("ClaimCreated", f"created PersistentVolumeClaim {name} for the artifacts")
        return None
    if claim["metadata"].get("deletionTimestamp"):
        return f"waiting for PersistentVolumeClaim {name}, being deleted, to go before creating it anew"
    if not owned_by(claim, p.uid):
        raise Refused(Reason.OWNED_ELSEWHERE, f"PersistentVolumeClaim {name} exists and was not created for this "
                                              f"CompressedModel (uid {p.uid}); delete it, or label it "
                                              f"{ALLOWED_LABEL}=true, annotate it {SHARED_ANNOTATION}={p.name} "
                                              "and name it in spec.storage.existingClaim")
    return None


def claim_capacity(p: Pass, spec: CompressedModelSpec) -> str | None:
    """The artifacts claim's size: what a bound claim reports, else what it asks for, or what Tailor's claim will
    ask for; None for an existingClaim not there yet."""
    claim = p.world.claim
    if claim is None:
        return None if spec.storage.existing_claim else spec.storage.size or p.settings.claim_size
    reported = ((claim.get("status") or {}).get("capacity") or {}).get("storage")
    requested = (((claim.get("spec") or {}).get("resources") or {}).get("requests") or {}).get("storage")
    return str(reported or requested or spec.storage.size or p.settings.claim_size)


def claim_of(p: Pass, spec: CompressedModelSpec) -> str:
    return spec.storage.existing_claim or names.claim_name(p.name)


def service_account(p: Pass, name: str) -> None:
    """A ServiceAccount for the stage or Triton pods of this namespace: no API token is mounted and no role
    is bound to it; it carries the image pull secrets. Shared by the namespace's models, so not owned; a
    create that finds it there is fine."""
    p.create({"apiVersion": "v1", "kind": "ServiceAccount",
              "metadata": {"name": name, "namespace": p.namespace, "labels": dict(names.MANAGED)},
              "automountServiceAccountToken": False,
              "imagePullSecrets": [{"name": secret} for secret in p.settings.image_pull_secrets]})


def plan_config_map(p: Pass, name: str, plan: BuildPlan) -> None:
    """A plan ConfigMap (what a Job reads, or a generation's new floor), unless it is already there; immutable,
    as the Jobs that read it."""
    if p.owned("ConfigMap", name) is None:
        text = plan.dump()
        PLANS.put(text, plan)  # it reads back equal (tests/unit/test_operator_resolve.py)
        meta = p.meta(name)
        meta["annotations"] = {names.RECORDS: "results"}
        p.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "immutable": True,
                  "data": {PLAN_FILE: text}})


def keep_record(p: Pass, name: str, message: str) -> None:
    """A Job's result, as the operator read it from the Job's pod, in an immutable ConfigMap `name` (a stage's
    Job's, `names.package_record_name` for a package Job): what the status is held to (`decide.check_recorded`)
    and what a pool's Triton checks its code against (`package_result`)."""
    p.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": p.meta(name), "immutable": True,
              "data": {RESULT_KEY: message}})


def recorded(p: Pass, name: str) -> str | None:
    """The result kept for the Job `name`, or None without a record."""
    found = p.owned("ConfigMap", name)
    return None if found is None else str((found.get("data") or {}).get(RESULT_KEY, ""))


def package_result(source: str, message: str) -> PackageResult:
    """A package Job's result (untrusted: it comes from a pod) from `source` (the Job, or its record): the digests
    of the code its repositories run."""
    try:
        return PackageResult.model_validate_json(message)
    except ValidationError as error:
        raise Refused(Reason.INVALID_RESULT, f"{source}'s result is not what tailor package writes: "
                                             f"{str(error)[:1024]}") from error


def read_plan(text: str) -> BuildPlan:
    """A plan ConfigMap's plan; one this operator wrote or read before is not parsed again."""
    return PLANS.get(text, lambda: BuildPlan.parse(text))


def start_job(p: Pass, spec: CompressedModelSpec, plan: BuildPlan, stage: Stage, generation: int,
              config_map: str, scheduling: dict[str, Any], pool: str | None = None, reader: bool = False,
              host: HostNeed | None = None, sidecar: dict[str, Any] | None = None) -> None:
    """Create a stage's Job and what it needs (or its result reader's, without GPUs), placed by `scheduling`
    (`placement.scheduling`) and queued in the spec's (or the operator's) Kueue queue, if any; `host` is what
    the pod holds in host memory, where its footprint is known; a `sidecar` runs beside it (the speed Job's
    Triton, which holds its GPUs). Only the stage that downloads (`jobs.downloads`) gets the credentials Secret's
    HF_TOKEN and egress; the others run with the Hugging Face Hub offline, under the model's no-egress policy."""
    jobs = spec.jobs
    distributed = stage in DISTRIBUTED_STAGES and not reader
    gpus = jobs.gpus_per_node if distributed else 1 if stage in ONE_GPU_STAGES and not reader else 0
    settings = JobSettings(image=jobs.image or p.settings.job_image, service_account=p.settings.job_service_account,
                           gpus_per_node=gpus, nodes=jobs.nodes if distributed else 1,
                           backoff_limit=0 if stage == "speed" else jobs.backoff_limit,
                           active_deadline_seconds=min(jobs.active_deadline_seconds, SPEED_DEADLINE_S)
                           if stage == "speed" else jobs.active_deadline_seconds,
                           host=host, queue_name=jobs.queue_name or p.settings.queue_name)
    service_account(p, p.settings.job_service_account)
    plan_config_map(p, config_map, plan)
    env: list[dict[str, Any]] = [{"name": "TAILOR_CACHE_DIR", "value": plan.layout.cache}]
    if not downloads(stage, reader):  # the parent is in the cache by now: read there, never from the hub
        env.append({"name": "HF_HUB_OFFLINE", "value": "1"})
        p.create(egress_policy(p.model))  # and none of its pods reaches out (they carry NO_EGRESS)
    elif spec.source.credentials_secret is not None:  # an hf:// token; nothing else of the Secret is read
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": spec.source.credentials_secret.name, "key": "HF_TOKEN", "optional": True}}})
    for manifest in stage_job(p.model, stage, generation, settings, scheduling, claim_of(p, spec), config_map,
                              jobs, mounted_claims(spec, stage in BUILD_STAGES and not reader), pool,
                              env, reader, sidecar):
        p.create(manifest)
    name = names.job_name(p.name, generation, stage, pool)
    p.event("JobCreated", f"created Job {names.reader_name(name)}: tailor result --stage {stage}" if reader
            else f"created Job {name}: tailor {stage}")


def job_outcome(p: Pass, job: dict[str, Any]) -> str | None:
    """The Job's result message once it succeeded; None while it runs; refused when it failed."""
    name = job["metadata"]["name"]
    finished = finishing_condition(job)
    if finished is not None and finished["type"] == "Failed":
        detail = p.world.results.get(name)
        reason = str(finished.get("reason") or Reason.JOB_FAILED)
        raise Refused(reason, f"Job {name} failed: {finished.get('message', '')}" + (f"; {detail}" if detail else ""))
    if finished is None:
        return None
    return p.world.results.get(name, "")
