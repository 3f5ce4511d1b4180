"""The thin, effectful side of a pass: observe, `decide`, apply the actions through `Kube`, then write the
status (only when it changed) and queue the Events (only once the status is written; `Kube.event` posts them
in the background).

A pass that raises while deciding (a bug, or an object's data no check caught: `decide` is pure, so the same
data fails the same way) is tried `MAX_DECIDE_TRIES` times running, then the object is failed with reason
Undecidable and the error, instead of being retried forever behind a log line.

A create or patch that finds another's object of its name fails the generation with reason OwnedElsewhere
(`Kube` checks every write's target; the next pass tries again, so removing that object lets the model go on).
A write the API server refuses with a 4xx (other than 404 on a delete and 409 on a create of the object's own,
which mean the work is already done) ends the generation in `Failed` with reason ApiRejected, naming the object
and the server's message; the operator never retries a refusal in a silent loop. 5xx and throttling are
retried by `Kube` and then by the daemon's backoff.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

from kubernetes.client.exceptions import ApiException

from tailor.operator.conditions import Reason, Refused
from tailor.operator.decide import decide
from tailor.operator.decision import Create, Decision, Delete, Pass, Patch, read_status
from tailor.operator.kube import Kube
from tailor.operator.memo import Memo
from tailor.operator.observe import Observed, observe
from tailor.operator.settings import OperatorSettings


def server_message(error: ApiException) -> str:
    try:
        return str(json.loads(error.body or "{}").get("message") or error.reason)
    except (ValueError, AttributeError):
        return str(error.body or error.reason)[:512]


REFUSED: Memo[str] = Memo(4096)  # (object uid, generation, a write's digest) -> what the API server said


def refusal_key(world: Observed, write: Any) -> tuple[str, int, str]:
    """A write of this object's generation, as the API server was (or will be) asked it."""
    meta = world.model["metadata"]
    text = json.dumps(write, sort_keys=True, default=str)
    return str(meta["uid"]), int(meta["generation"]), hashlib.sha256(text.encode()).hexdigest()


def apply(kube: Kube, world: Observed, decision: Decision, settings: OperatorSettings) -> Decision:
    """Carry out the actions in order; a refused write fails the generation instead, and is not sent again for
    this generation (the same write would be refused the same way: a spec change sends it again)."""
    meta = world.model["metadata"]
    owner, namespace = f"{meta['namespace']}/{meta['name']}", meta["namespace"]
    for action in decision.actions:
        key = refusal_key(world, dataclasses.asdict(action) | {"verb": type(action).__name__})
        if (said := REFUSED.find(key)) is None:
            try:
                if isinstance(action, Create):
                    kube.create(owner, action.manifest)
                elif isinstance(action, Delete):
                    kube.delete(owner, action.kind, namespace, action.name, meta["uid"])
                elif isinstance(action, Patch):
                    kube.merge_patch(owner, action.kind, namespace, action.name, action.patch, meta["uid"])
                continue
            except Refused as refused:  # a name taken by another's object: not memoized, it may be removed
                return Pass(world, settings, decision.status, events=decision.events).fail(refused.reason,
                                                                                            refused.message)
            except ApiException as error:
                if error.status is None or not 400 <= error.status < 500:
                    raise
                kind, name = ((action.manifest["kind"], action.manifest["metadata"]["name"])
                              if isinstance(action, Create) else (action.kind, action.name))
                said = (f"the API server refused to {type(action).__name__.lower()} {kind} {name}: {error.status} "
                        f"{server_message(error)}")
                REFUSED.put(key, said)
                return Pass(world, settings, decision.status, events=decision.events).fail(Reason.API_REJECTED, said)
        return Pass(world, settings, decision.status).fail(Reason.API_REJECTED, said, event=False)  # said before
    return decision


MAX_DECIDE_TRIES = 3
ERROR_CHARS = 1024  # of an exception's message in the status


class DecideFailed(Exception):
    """Deciding a pass raised; `tries` times running so far."""

    def __init__(self, tries: int, error: Exception) -> None:
        super().__init__(f"deciding failed ({tries} of {MAX_DECIDE_TRIES} tries): {type(error).__name__}: {error}")
        self.tries = tries


def reconcile(kube: Kube, namespace: str, name: str, settings: OperatorSettings, tries: int = 0
              ) -> Decision | None:
    """One pass on the object as the API server has it now (None once it is gone); `tries`: how many passes
    before this one failed to decide, running."""
    world = observe(kube, namespace, name)
    if world is None:
        return None
    try:
        decided = decide(world, settings)
    except Exception as error:  # a bug or unchecked data: a Failed object says so, a crash loop would not
        if tries + 1 < MAX_DECIDE_TRIES:
            raise DecideFailed(tries + 1, error) from error
        decided = Pass(world, settings, read_status(world.model.get("status"))).fail(
            Reason.UNDECIDABLE, f"the operator failed to decide what to do with this object {MAX_DECIDE_TRIES} "
                                f"times running ({type(error).__name__}: {str(error)[:ERROR_CHARS]}); it tries again "
                                "when the object changes")
        decided.undecided = True
    decision = apply(kube, world, decided, settings)
    before = _dump(read_status(world.model.get("status")))
    after = _dump(decision.status)
    if after != before:
        key = refusal_key(world, "status")  # its times move each pass: once refused, only the report this generation
        try:
            if (said := REFUSED.find(key)) is None:
                kube.patch_status(f"{namespace}/{name}", namespace, name, merge_patch(before, after))
        except ApiException as error:
            if error.status is None or not 400 <= error.status < 500:
                raise
            said = (f"the API server refused the status of CompressedModel {name}: "
                    f"{error.status} {server_message(error)[:1024]}")
            REFUSED.put(key, said)
        if said is not None:  # the status itself was refused: say so in one the server takes (it took the old one)
            refused = Pass(world, settings, read_status(world.model.get("status"))).fail(Reason.API_REJECTED, said)
            if (report := merge_patch(before, _dump(refused.status))):
                kube.patch_status(f"{namespace}/{name}", namespace, name, report)
            decision = refused
    for event in decision.events:
        kube.event(f"{namespace}/{name}", world.model, event.type, event.reason, event.message)
    return decision


def _dump(status: Any) -> dict[str, Any]:
    dumped: dict[str, Any] = json.loads(status.model_dump_json(by_alias=True, exclude_none=True))
    return dumped


def merge_patch(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """An RFC 7386 merge patch from `before` to `after` (keys that went away become null). `before` holds
    only the fields this operator knows, so a newer operator's fields are left alone."""
    patch: dict[str, Any] = {key: None for key in before if key not in after}
    for key, value in after.items():
        old = before.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            inner = merge_patch(old, value)
            if inner:
                patch[key] = inner
        elif value != old:
            patch[key] = value
    return patch
