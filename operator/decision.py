"""What a reconciliation pass decides, as data: the actions (Create, Delete, Patch), the Events and the new
status (`Decision`); and `Pass`, the decision in the making that `decide` and `rollout` work on. No I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from tailor.operator import names
from tailor.operator.api import BuildStatus, CompressedModelStatus, Phase, StageName, StageProgress
from tailor.operator.conditions import FAILED, READY, Reason, owned_elsewhere, set_condition, without
from tailor.operator.manifest import owned_by, owned_metadata
from tailor.operator.observe import Observed
from tailor.operator.settings import OperatorSettings

WAITING_REQUEUE_S = 30.0  # a safety net: Job and Deployment events wake the object sooner
PROGRESS_REQUEUE_S = 10.0  # while a build stage runs: its log's steps bring no event, so look again this soon
SETTLED_REQUEUE_S = 300.0
QUEUED_REQUEUE_S = 1.0  # after creating a Job suspended for Kueue: look soon at its Workload (which wakes nothing)


@dataclass(frozen=True)
class Create:
    manifest: dict[str, Any]


@dataclass(frozen=True)
class Delete:
    kind: str
    name: str


@dataclass(frozen=True)
class Patch:
    kind: str
    name: str
    patch: dict[str, Any]


Action = Create | Delete | Patch


@dataclass(frozen=True)
class Event:
    type: Literal["Normal", "Warning"]
    reason: str
    message: str


@dataclass
class Decision:
    status: CompressedModelStatus
    actions: list[Action]
    events: list[Event]
    phase: Phase
    requeue_s: float
    undecided: bool = False  # the object failed because deciding raised (`execute.reconcile`), not by a decision


def read_status(raw: dict[str, Any] | None) -> CompressedModelStatus:
    """The status as this operator knows it: fields it does not know (written by a newer operator) and
    fields that do not validate are left out, never fatal."""
    known: dict[str, Any] = {}
    for key, value in (raw or {}).items():
        try:
            CompressedModelStatus.model_validate({key: value})
        except ValidationError:
            continue
        known[key] = value
    return CompressedModelStatus.model_validate(known)


@dataclass
class Pass:
    """One decision in the making: the observed world, the status being written and the actions so far."""

    world: Observed
    settings: OperatorSettings
    status: CompressedModelStatus
    actions: list[Action] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)

    @property
    def model(self) -> dict[str, Any]:
        return self.world.model

    @property
    def name(self) -> str:
        return str(self.model["metadata"]["name"])

    @property
    def namespace(self) -> str:
        return str(self.model["metadata"]["namespace"])

    @property
    def generation(self) -> int:
        return int(self.model["metadata"]["generation"])

    @property
    def uid(self) -> str:
        return str(self.model["metadata"]["uid"])

    @property
    def build(self) -> BuildStatus:
        assert self.status.build is not None
        return self.status.build

    # --- status ----------------------------------------------------------------------------------

    def condition(self, kind: str, state: bool | None, reason: str, message: str = "") -> None:
        self.status.conditions = set_condition(self.status.conditions, kind, state, reason, message,
                                               self.generation, self.world.now)

    def stage(self, name: StageName) -> StageProgress:
        found = next((s for s in self.status.stages if s.name == name), None)
        if found is None:
            found = StageProgress(name=name)
            self.status.stages.append(found)
        return found

    def event(self, reason: str, message: str, warning: bool = False) -> None:
        self.events.append(Event("Warning" if warning else "Normal", reason, message))

    def outcome(self, phase: Phase) -> Decision:
        if phase != "Failed" and any(c.type == FAILED for c in self.status.conditions):
            self.recovered()
        self.status.phase = phase
        active = next((s for s in self.status.stages if s.state in ("Running", "Pending") and s.name != "Deploy"),
                      None)  # a build stage under way, for `kubectl get`: how far, or why it has not started
        self.status.progress = None if active is None else (
            f"{active.name} {active.progress:.0%}" if active.progress is not None
            else f"{active.name}: {active.reason}" if active.reason else None)
        self.status.observed_generation = self.generation
        waits_for_room = any(pool.failed is not None and pool.failed.retry == "Capacity"
                             and pool.failed.generation == self.generation for pool in self.status.pools)
        settled = phase in ("Ready", "Failed") and not waits_for_room  # free GPUs wake nothing: look again soon
        queued = any(isinstance(action, Create) and action.manifest["kind"] == "Job"
                     and action.manifest["spec"].get("suspend") for action in self.actions)
        requeue = QUEUED_REQUEUE_S if queued else SETTLED_REQUEUE_S if settled else PROGRESS_REQUEUE_S if (
            active and active.state == "Running") else WAITING_REQUEUE_S
        return Decision(self.status, self.actions, self.events, phase, requeue)

    def recovered(self) -> None:
        """What failed this generation holds no more (a pass decides again, a refused write went through): the
        Failed condition goes, and Ready says what serves, if anything."""
        self.status.conditions = without(self.status.conditions, FAILED)
        serving = self.status.serving_generation
        if serving is None:
            self.status.conditions = without(self.status.conditions, READY)
        else:
            self.condition(READY, True, Reason.SERVING, f"generation {serving} serves")

    def fail(self, reason: str, message: str, event: bool = True) -> Decision:
        """The generation ends Failed; a Warning says so once (`event` False: it was said already)."""
        if event and not (self.status.phase == "Failed" and self.status.observed_generation == self.generation):
            self.event(reason, message, warning=True)
        self.condition(FAILED, True, reason, message)
        serving = self.status.serving_generation
        self.condition(READY, serving is not None, reason, f"generation {self.generation} failed: {message}" + (
            f"; generation {serving} keeps serving" if serving is not None else ""))
        return self.outcome("Failed")

    # --- objects ---------------------------------------------------------------------------------

    def owned(self, kind: str, name: str) -> dict[str, Any] | None:
        """The object of that name if this CompressedModel owns it; refused if someone else does."""
        found = self.world.of(kind).get(name)
        if found is not None and not owned_by(found, self.uid):
            raise owned_elsewhere(kind, name, self.uid)
        return found

    def mine(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.world.of(kind).values() if owned_by(o, self.uid)]

    def create(self, manifest: dict[str, Any]) -> None:
        """Queue a create; one of an object this pass already creates (a shared one, such as the model's
        NetworkPolicy with each pool's revision) is not sent twice."""
        key = manifest["kind"], manifest["metadata"]["name"]
        if not any(isinstance(a, Create) and (a.manifest["kind"], a.manifest["metadata"]["name"]) == key
                   for a in self.actions):
            self.actions.append(Create(manifest))

    def delete(self, kind: str, name: str) -> None:
        self.actions.append(Delete(kind, name))

    def meta(self, name: str) -> dict[str, Any]:
        return owned_metadata(self.model, name, names.model_labels(self.model))
