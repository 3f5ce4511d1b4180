"""Condition types and reasons of a CompressedModel's status, and the pure helpers that set them.

Types are short PascalCase nouns (Ready, Compressed, ...); a reason is a PascalCase constant kept in its own
field, never packed into a message and parsed back. `set_condition` keeps lastTransitionTime while the
status (True/False/Unknown) stays the same, as metav1.Condition asks.
"""

from __future__ import annotations

import datetime
from enum import StrEnum

from tailor.operator.api import Condition

READY = "Ready"
COMPRESSED = "Compressed"
QUANTIZED = "Quantized"
QUALITY_GATE_PASSED = "QualityGatePassed"
DEPLOYED = "Deployed"
FAILED = "Failed"
BUILD_CONDITIONS = (COMPRESSED, QUANTIZED, QUALITY_GATE_PASSED)


class Reason(StrEnum):
    """Why a condition or a stage is what it is."""

    JOB_SUCCEEDED = "JobSucceeded"
    SIMULATED = "Simulated"  # a stage's result is canned (the devcluster's simulated GPU pools), not computed
    JOB_FAILED = "JobFailed"  # a Job failed without a reason of its own (else its reason is used)
    NO_RESULT = "NoResult"  # a Job succeeded without handing back a result
    INVALID_RESULT = "InvalidResult"  # a Job's result is not what tailor writes, or out of bounds
    INVALID_SPEC = "InvalidSpec"
    INVALID_PLAN = "InvalidPlan"
    IMAGE_NOT_ALLOWED = "ImageNotAllowed"
    ANNOTATION_NOT_ALLOWED = "AnnotationNotAllowed"
    PRIORITY_CLASS_NOT_ALLOWED = "PriorityClassNotAllowed"
    POD_LABEL_NOT_ALLOWED = "PodLabelNotAllowed"
    TOLERATION_NOT_ALLOWED = "TolerationNotAllowed"
    RESOURCE_NOT_ALLOWED = "ResourceNotAllowed"  # an extended resource outside the chart's allowlist
    CLAIM_NOT_ALLOWED = "ClaimNotAllowed"  # a claim the spec names is not allowed for Tailor or not given to it
    SECRET_NOT_ALLOWED = "SecretNotAllowed"  # a Secret the spec names is neither the object's nor shared
    OWNED_ELSEWHERE = "OwnedElsewhere"  # an object with a name the operator derives belongs to someone else
    API_REJECTED = "ApiRejected"  # the API server refused one of the operator's writes (4xx)
    UNDECIDABLE = "Undecidable"  # deciding raised MAX_DECIDE_TRIES passes running (a bug, data no check caught)
    ACTIVE_PARAMS_ABOVE_CAP = "ActiveParamsAboveCap"
    DOES_NOT_FIT = "DoesNotFit"  # a compression stage needs more memory per rank than spec.jobs' GPUs have
    CLAIM_TOO_SMALL = "ClaimTooSmall"  # the artifacts claim cannot hold what the build writes
    QUALITY_GATE_PASSED = "Passed"
    QUALITY_GATE_FAILED = "QualityGateFailed"
    NO_POOL_FITS = "NoPoolFits"
    REVISION_NOT_READY = "RevisionNotReady"
    REVISION_READY = "RevisionReady"
    REVISION_FAILED = "RevisionFailed"  # a revision that cannot become available (ProgressDeadlineExceeded)
    SERVING = "Serving"
    BUILT = "Built"  # built, and the spec asks for no deployment


def set_condition(conditions: list[Condition], kind: str, state: bool | None, reason: str, message: str,
                  generation: int, now: datetime.datetime) -> list[Condition]:
    """`conditions` with `kind` set; its lastTransitionTime moves only when its status changes."""
    value = "Unknown" if state is None else "True" if state else "False"
    old = next((c for c in conditions if c.type == kind), None)
    since = old.last_transition_time if old is not None and old.status == value else now
    new = Condition(type=kind, status=value, reason=reason, message=message[:32768], last_transition_time=since,
                    observed_generation=generation)
    return [c for c in conditions if c.type != kind] + [new]


def without(conditions: list[Condition], *kinds: str) -> list[Condition]:
    return [c for c in conditions if c.type not in kinds]


class Refused(Exception):
    """The generation cannot go on: a reason (a condition reason) and a message naming what and why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


def owned_elsewhere(kind: str, name: str, uid: str) -> Refused:
    """A name the operator derives for CompressedModel `uid` is taken by an object that is not its own."""
    return Refused(Reason.OWNED_ELSEWHERE, f"{kind} {name} exists and is not this CompressedModel's (uid {uid}); "
                                           "delete or rename it")
