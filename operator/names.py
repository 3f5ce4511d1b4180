"""The operator's vocabulary, in one place: its user agent, label keys, the names it derives for the objects it
owns, and the stages. Every derived name must stay a DNS label (63 characters, starting with a letter): the
CRD refuses object and pool names that would break one (`api.NAME_BUDGET`)."""

from __future__ import annotations

from typing import Any

from tailor.compressor.buildplan import Stage
from tailor.operator.api import GROUP, NAME_BUDGET, VERSION_OF_TAILOR, StageName

USER_AGENT = f"tailor-operator/{VERSION_OF_TAILOR}"
FINALIZER = f"{GROUP}/finalizer"

MANAGED_BY = "app.kubernetes.io/managed-by"
APP_NAME = "app.kubernetes.io/name"
MODEL = f"{GROUP}/model"
MODEL_UID = f"{GROUP}/model-uid"  # on objects not owned through ownerReferences (the claim)
STAGE = f"{GROUP}/stage"
GENERATION = f"{GROUP}/generation"
RECORDS = f"{GROUP}/records"  # on a plan ConfigMap: its build's stage results are recorded (`decide.check_recorded`)
POOL = f"{GROUP}/pool"
REVISION = f"{GROUP}/revision"
MANAGED = {MANAGED_BY: "tailor"}

# The build stages as the status names them (StageName) and as the Jobs run them (Stage).
STAGE_NAMES: dict[Stage, StageName] = {"compress": "Compress", "quantize": "Quantize", "evaluate": "Evaluate"}
MAX_GENERATION_DIGITS = 6  # names carry g<generation>; the CRD's NAME_BUDGET leaves room for six digits
assert 63 - len("-g") - MAX_GENERATION_DIGITS - len("-package-") == NAME_BUDGET


def selects(selector: dict[str, str], labels: dict[str, str] | None) -> bool:
    """Whether an equality `selector` (matchLabels, a nodeSelector) selects an object with `labels`."""
    return all((labels or {}).get(key) == value for key, value in selector.items())


def model_labels(model: dict[str, Any]) -> dict[str, str]:
    return {**MANAGED, MODEL: model["metadata"]["name"]}


def claim_name(name: str) -> str:
    return f"{name}-artifacts"


def credentials_secret(name: str) -> str:
    """The Secret an object may name as its own (`tenancy.check_secret`)."""
    return f"{name}-credentials"


def job_name(name: str, generation: int, stage: Stage, pool: str | None = None) -> str:
    return f"{name}-g{generation}-{stage}" + (f"-{pool}" if pool else "")


def reader_name(job: str) -> str:
    """The Job that reads a stage's result back from the claim when the stage's pod is gone."""
    return f"{job}-r"


def plan_name(name: str, generation: int) -> str:
    """The build plan ConfigMap the build's stage Jobs read."""
    return f"{name}-g{generation}-plan"


def package_plan_name(name: str, generation: int, pool: str) -> str:
    """A package Job's plan (the build plan with its pool's sizing): named like the Job."""
    return job_name(name, generation, "package", pool)


def package_record_name(name: str, generation: int, pool: str) -> str:
    """A package Job's record (the digests of the code it wrote): named after the Job, whose name its plan has."""
    return code_record_of(job_name(name, generation, "package", pool))


def code_record_of(package_job: str) -> str:
    return f"{package_job}-code"


def service_name(name: str, pool: str) -> str:
    return f"{name}-{pool}"


def revision_name(name: str, pool: str, generation: int) -> str:
    return f"{service_name(name, pool)}-g{generation}"


def ingress_policy_name(name: str) -> str:
    """The NetworkPolicy that lets only the namespace, the monitoring stack and named clients reach the model's
    serving pods."""
    return f"{name}-ingress"


def egress_policy_name(name: str) -> str:
    """The NetworkPolicy that cuts the model's serving pods off from everything outside them."""
    return f"{name}-no-egress"


def revision_of(generation: int) -> str:
    return f"g{generation}"


def folder(model: dict[str, Any]) -> str:
    """The object's folder on the artifacts claim: its name and uid, so that a claim kept (deletionPolicy
    Retain) for a deleted object is never mistaken for a new object's of the same name."""
    meta = model["metadata"]
    return f"{meta['name']}-{meta['uid'][:8]}"
