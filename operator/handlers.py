"""The kopf wiring: one daemon per CompressedModel runs reconciliation passes; watch events on the object and on
the Jobs and Deployments it owns wake it; deletion is a finalizer that removes Jobs and revisions first.

The passes themselves (`execute.reconcile`) are synchronous Kubernetes calls, run on a pool of worker threads
(`PASS_WORKERS` at once) so the event loop keeps serving watches. A failing pass (API down, a conflict that outlived
its retries) is logged, counted and retried with exponential backoff; the operator never dies of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import kopf
from kubernetes import client

from tailor.operator import login, metrics, names
from tailor.operator.api import GROUP, PLURAL, VERSION
from tailor.operator.decision import owned_by
from tailor.operator.execute import reconcile
from tailor.operator.kube import Kube
from tailor.operator.rollout import REVISION_KINDS
from tailor.operator.settings import OperatorSettings

MAX_BACKOFF_S = 60.0
DEBOUNCE_S = 0.2
PASS_WORKERS = 8  # passes in flight at once: more only adds contention where the API server is the bottleneck


class Runtime:
    """What the handlers share: the API client, settings, and a wake-up event per object."""

    def __init__(self) -> None:
        self.kube: Kube | None = None
        self.settings = OperatorSettings()
        self.wakeups: dict[str, asyncio.Event] = {}
        self.passes = ThreadPoolExecutor(max_workers=PASS_WORKERS, thread_name_prefix="pass")

    def wake(self, uid: str | None) -> None:
        if uid is not None and (event := self.wakeups.get(uid)) is not None:
            event.set()


RUNTIME = Runtime()


def configure(settings: OperatorSettings) -> None:
    RUNTIME.settings = settings


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = names.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP)
    settings.posting.level = logging.WARNING  # the reconciler posts its own Events
    settings.watching.server_timeout = 300  # watches are restarted at least this often
    settings.watching.client_timeout = 330
    settings.execution.max_workers = 16
    settings.scanning.disabled = True  # the resources are known: no need to read or watch CRDs (RBAC)
    api = client.ApiClient(login.load_config())
    api.user_agent = names.USER_AGENT  # tells the operator's own requests apart in audit logs (kopf's say kopf/...)
    api.rest_client.pool_manager.connection_pool_kw["maxsize"] = 32
    RUNTIME.kube = Kube(api)


def _owner_uid(body: kopf.Body) -> str | None:
    return next((ref.get("uid") for ref in body.get("metadata", {}).get("ownerReferences", [])
                 if ref.get("kind") == "CompressedModel"), None)


@kopf.on.event(GROUP, VERSION, PLURAL)
def on_model_event(uid: str, **_: Any) -> None:
    RUNTIME.wake(uid)


@kopf.on.event("batch", "v1", "jobs", labels=names.MANAGED)
def on_job_event(event: kopf.RawEvent, body: kopf.Body, **_: Any) -> None:
    """A Job that finished or went away moves its owner on; its other updates (pods starting) do not."""
    finished = any(c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
                   for c in (body.get("status") or {}).get("conditions") or [])
    if finished or event["type"] == "DELETED":
        RUNTIME.wake(_owner_uid(body))


@kopf.on.event("apps", "v1", "deployments", labels=names.MANAGED)
def on_deployment_event(event: kopf.RawEvent, body: kopf.Body, **_: Any) -> None:
    """A revision that became available (or went away) moves its owner on."""
    status, spec = body.get("status") or {}, body.get("spec") or {}
    available = (status.get("observedGeneration", 0) >= body.get("metadata", {}).get("generation", 1)
                 and status.get("availableReplicas", 0) >= spec.get("replicas", 1))
    if available or event["type"] == "DELETED":
        RUNTIME.wake(_owner_uid(body))


@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=30.0)
async def run(*, stopped: kopf.DaemonStopped, name: str, namespace: str | None, uid: str, logger: kopf.Logger,
              **_: Any) -> None:
    """Reconcile until the object goes: after each pass, sleep until woken or until the pass's requeue time."""
    assert namespace is not None  # CompressedModels are namespaced
    wakeup = RUNTIME.wakeups.setdefault(uid, asyncio.Event())
    backoff = 1.0
    try:
        while not stopped:
            wakeup.clear()
            started = time.monotonic()
            assert RUNTIME.kube is not None
            try:
                outcome = await asyncio.get_running_loop().run_in_executor(
                    RUNTIME.passes, reconcile, RUNTIME.kube, namespace, name, RUNTIME.settings)
            except Exception as error:  # the operator outlives any one failure; the next pass retries
                metrics.RECONCILES.labels(result="error").inc()
                logger.exception(f"reconcile failed, retrying in {backoff:.0f}s: {error}")
                delay, backoff = backoff, min(MAX_BACKOFF_S, backoff * 2)
            else:
                if outcome is None:  # deleted: the finalizer handler takes over
                    return
                metrics.RECONCILES.labels(result="ok").inc()
                metrics.observe(uid, outcome.phase, time.monotonic() - started)
                delay, backoff = outcome.requeue_s, 1.0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wakeup.wait(), timeout=delay)
                await asyncio.sleep(DEBOUNCE_S)  # let a burst of events (a Job and its pods) settle into one pass
    finally:
        RUNTIME.wakeups.pop(uid, None)
        metrics.forget(uid)


@kopf.on.delete(GROUP, VERSION, PLURAL)
def on_delete(*, body: kopf.Body, name: str, namespace: str | None, uid: str, logger: kopf.Logger, **_: Any) -> None:
    """Stop the work before the object goes: its Jobs (their pods with them) and serving revisions; the claim
    Tailor created for this very object goes too when storage.deletionPolicy is Delete. Only objects this
    object owns (by uid) are touched: never another's, nor an earlier object's of the same name."""
    assert namespace is not None
    kube = RUNTIME.kube
    assert kube is not None
    owner = f"{namespace}/{name}"
    selector = {**names.MANAGED, names.MODEL: name}
    for kind in ("Job", "Deployment", "Service"):
        for item in kube.select(owner, kind, namespace, selector):
            if owned_by(item, uid):  # a revision's PDB and HPA share its name
                for doomed in REVISION_KINDS if kind == "Deployment" else (kind,):
                    kube.delete(owner, doomed, namespace, item["metadata"]["name"])
    storage = (body.get("spec") or {}).get("storage") or {}
    claim = names.claim_name(name)
    if storage.get("deletionPolicy") == "Delete" and not storage.get("existingClaim"):
        found = kube.get(owner, "PersistentVolumeClaim", namespace, claim)
        if found is not None and owned_by(found, uid) and kube.delete(owner, "PersistentVolumeClaim", namespace,
                                                                      claim):
            logger.info(f"deleted PersistentVolumeClaim {claim} (deletionPolicy Delete)")
    kube.requests.pop(owner, None)
