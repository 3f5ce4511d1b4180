"""The kopf wiring: one daemon per CompressedModel runs reconciliation passes; deletion is a finalizer that removes
Jobs and revisions first. The operator's watch cache (`watchcache`, one list and watch per kind and watched
namespace) serves the passes' reads, and its events wake a daemon: a change to the object's spec or its deletion,
a Job of it that finished or went away, a revision that became available or went away (its own status writes and
pods starting do not).

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
from tailor.operator.api import API_VERSION, GROUP, PLURAL
from tailor.operator.decision import PROGRESS_REQUEUE_S
from tailor.operator.execute import DecideFailed, reconcile
from tailor.operator.kopf_input import TenantProgress, read_bounded
from tailor.operator.kube import Kube
from tailor.operator.manifest import deployment_available, job_finished, owned_by, owner_uid
from tailor.operator.rollout import REVISION_KINDS
from tailor.operator.settings import OperatorSettings
from tailor.operator.watchcache import CACHED, Reflector, Store

MAX_BACKOFF_S = 60.0
DEBOUNCE_S = 0.2
PASS_WORKERS = 8  # passes in flight at once: more only adds contention where the API server is the bottleneck
PROGRESS_PASSES_PER_S = 5.0  # the running builds' progress passes, all together: the rest of the time is for events


class Runtime:
    """What the handlers share: the API client, settings, and a wake-up event per object."""

    def __init__(self) -> None:
        self.kube: Kube | None = None
        self.settings = OperatorSettings()
        self.namespaces: tuple[str, ...] = ()  # watched; none: every namespace
        self.wakeups: dict[str, asyncio.Event] = {}
        self.progressing: set[str] = set()  # objects whose build runs: their passes look at its log
        self.passes = ThreadPoolExecutor(max_workers=PASS_WORKERS, thread_name_prefix="pass")
        self.loop: asyncio.AbstractEventLoop | None = None

    def wake(self, uid: str | None) -> None:
        """Wake the object's daemon (from any thread)."""
        if uid is not None and (event := self.wakeups.get(uid)) is not None and self.loop is not None:
            self.loop.call_soon_threadsafe(event.set)


RUNTIME = Runtime()


class NoDiffBase(kopf.DiffBaseStorage):
    """kopf's record of the spec it last handled, kept nowhere: the operator has no create or update handlers (its
    daemon reconciles from the spec itself), so the record would only cost each object a patch and a copy of its
    spec in an annotation. Read back as the object is now, so that kopf takes every event as "nothing changed"
    (deletion and the finalizer kopf sees apart from this)."""

    def fetch(self, *, body: kopf.Body) -> kopf.BodyEssence | None:
        return self.build(body=body)

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: kopf.BodyEssence) -> None:
        return None


def configure(settings: OperatorSettings, namespaces: tuple[str, ...] = ()) -> None:
    RUNTIME.settings, RUNTIME.namespaces = settings, namespaces


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    read_bounded()  # before kopf lists anything: no object it reads can stop it
    settings.persistence.finalizer = names.FINALIZER
    settings.persistence.progress_storage = TenantProgress(prefix=GROUP)
    settings.persistence.diffbase_storage = NoDiffBase()
    settings.posting.level = logging.WARNING  # the reconciler posts its own Events
    settings.watching.server_timeout = 300  # watches are restarted at least this often
    settings.watching.client_timeout = 330
    settings.execution.max_workers = 16
    settings.scanning.disabled = True  # the resources are known: no need to read or watch CRDs (RBAC)
    api = client.ApiClient(login.load_config())
    api.user_agent = names.USER_AGENT  # tells the operator's own requests apart in audit logs (kopf's say kopf/...)
    api.rest_client.pool_manager.connection_pool_kw["maxsize"] = 32
    RUNTIME.kube = Kube(api, Store(), RUNTIME.namespaces, RUNTIME.settings.gpu_namespaces)
    RUNTIME.loop = asyncio.get_running_loop()
    for kind in CACHED:
        for namespace in RUNTIME.namespaces or (None,):
            Reflector(RUNTIME.kube, kind, namespace, on_change).start()


def moves_on(kind: str, event: str, before: dict[str, Any] | None, after: dict[str, Any]) -> bool:
    """Whether a change the watch cache saw is one the object's next pass must act on."""
    if event == "DELETED":
        return kind in ("CompressedModel", "Job", "Deployment")
    if kind == "CompressedModel":  # its spec, or its deletion; not the status its passes write
        return before is None or before.get("spec") != after.get("spec") or bool(
            after["metadata"].get("deletionTimestamp"))
    if kind == "Job":  # finished; not its pods starting
        return job_finished(after) is not None
    if kind == "Deployment":  # a revision available
        return deployment_available(after)[0]
    return False


def on_change(kind: str, event: str, before: dict[str, Any] | None, after: dict[str, Any]) -> None:
    """Called by the watch cache's threads: wake the owner's daemon when a change moves it on."""
    if moves_on(kind, event, before, after):
        RUNTIME.wake(after["metadata"].get("uid") if kind == "CompressedModel" else owner_uid(after))


def progress_spaced(uid: str, requeue_s: float) -> float:
    """The pass's requeue time; for a running build's look at its log, spaced so that all running builds
    together take at most PROGRESS_PASSES_PER_S passes a second (200 builds: one look each 40 s)."""
    if requeue_s != PROGRESS_REQUEUE_S:
        RUNTIME.progressing.discard(uid)
        return requeue_s
    RUNTIME.progressing.add(uid)
    return max(requeue_s, len(RUNTIME.progressing) / PROGRESS_PASSES_PER_S)


@kopf.daemon(GROUP, API_VERSION, PLURAL, cancellation_timeout=30.0)
async def run(*, stopped: kopf.DaemonStopped, name: str, namespace: str | None, uid: str, logger: kopf.Logger,
              **_: Any) -> None:
    """Reconcile until the object goes: after each pass, sleep until woken or until the pass's requeue time."""
    assert namespace is not None  # CompressedModels are namespaced
    wakeup = RUNTIME.wakeups.setdefault(uid, asyncio.Event())
    backoff, tries = 1.0, 0  # tries: passes that failed to decide, running (`execute.MAX_DECIDE_TRIES`)
    try:
        while not stopped:
            wakeup.clear()
            started = time.monotonic()
            assert RUNTIME.kube is not None
            try:
                outcome = await asyncio.get_running_loop().run_in_executor(
                    RUNTIME.passes, reconcile, RUNTIME.kube, namespace, name, RUNTIME.settings, tries)
            except DecideFailed as error:
                metrics.RECONCILES.labels(result="error").inc()
                logger.exception(f"{error}; trying again in {backoff:.0f}s")
                tries, delay, backoff = error.tries, backoff, min(MAX_BACKOFF_S, backoff * 2)
            except Exception as error:  # the operator outlives any one failure; the next pass retries
                metrics.RECONCILES.labels(result="error").inc()
                logger.exception(f"reconcile failed, retrying in {backoff:.0f}s: {error}")
                delay, backoff = backoff, min(MAX_BACKOFF_S, backoff * 2)
            else:
                if outcome is None:  # deleted: the finalizer handler takes over
                    return
                metrics.RECONCILES.labels(result="ok").inc()
                metrics.observe(uid, outcome.phase, time.monotonic() - started)
                delay, backoff = progress_spaced(uid, outcome.requeue_s), 1.0
                tries = tries if outcome.undecided else 0  # failed undecided: one try per pass from now on
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wakeup.wait(), timeout=delay)
                await asyncio.sleep(DEBOUNCE_S)  # let a burst of events (a Job and its pods) settle into one pass
    finally:
        RUNTIME.wakeups.pop(uid, None)
        RUNTIME.progressing.discard(uid)
        metrics.forget(uid)


@kopf.on.delete(GROUP, API_VERSION, PLURAL)
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
                    kube.delete(owner, doomed, namespace, item["metadata"]["name"], uid)
    storage = (body.get("spec") or {}).get("storage") or {}
    claim = names.claim_name(name)
    if (storage.get("deletionPolicy") == "Delete" and not storage.get("existingClaim")
            and kube.delete(owner, "PersistentVolumeClaim", namespace, claim, uid)):
        logger.info(f"deleted PersistentVolumeClaim {claim} (deletionPolicy Delete)")
    kube.requests.pop(owner, None)
