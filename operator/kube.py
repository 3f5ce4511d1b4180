"""The few Kubernetes calls the reconciler makes, on the official client, with the semantics it needs:
reads that return None for a missing object, lists by label, and transient errors retried with backoff.
Every write is to an object the CompressedModel owns (by owner reference or uid label): a create that finds its
own object there takes it as done, and one that finds another's raises Refused (OwnedElsewhere); a delete leaves
another's object alone; a patch of another's is refused. Deletes and patches carry the uid of the object they
checked, so one replaced in between is not touched either. Given a watch cache (`watchcache.Store`), reads of
the kinds it holds are served from it once it has listed them, and the operator's writes go into it as the
server answers them. Every request is counted per CompressedModel for the operator's metrics and the benchmark.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tailor.operator import metrics, names, wire
from tailor.operator.api import API_VERSION, GROUP, PLURAL
from tailor.operator.conditions import owned_elsewhere
from tailor.operator.manifest import object_reference, owned_by, owner_uid
from tailor.operator.pools import GpuHolders, HeldGpus, NodeSnapshot, held_gpus
from tailor.operator.watchcache import CACHED, Store

RETRIED_STATUS = {409, 429, 500, 502, 503, 504}
ATTEMPTS = 5
NODES_TTL_S = 10.0  # and the pods holding GPUs
SHARED_TTL_S = 300.0  # a namespace's ServiceAccount seen this recently is not created again
LOG = logging.getLogger(__name__)
PAGE = 500  # objects per list request: a large cluster's pods are read a page at a time
HELD_PODS = "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"  # the pods that may hold GPUs

# Kind -> (api group/version, plural) for the objects the operator owns.
KINDS = {
    "Job": ("batch/v1", "jobs"), "Service": ("v1", "services"), "ConfigMap": ("v1", "configmaps"),
    "PersistentVolumeClaim": ("v1", "persistentvolumeclaims"), "Deployment": ("apps/v1", "deployments"),
    "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets"),
    "HorizontalPodAutoscaler": ("autoscaling/v2", "horizontalpodautoscalers"), "Pod": ("v1", "pods"),
    "ServiceAccount": ("v1", "serviceaccounts"), "NetworkPolicy": ("networking.k8s.io/v1", "networkpolicies"),
    "CompressedModel": (f"{GROUP}/{API_VERSION}", PLURAL),
    "Workload": ("kueue.x-k8s.io/v1beta2", "workloads"),  # Kueue's, read only: why a queued Job waits
}


class Kube:
    """Namespaced reads and writes through the generic dynamic paths of the API server."""

    def __init__(self, api: client.ApiClient, cache: Store | None = None, watched: tuple[str, ...] = (),
                 gpu_namespaces: tuple[str, ...] = ()) -> None:
        self.api = api
        self.cache = cache
        self.watched = watched  # the namespaces the operator watches (none named: all)
        self.gpu_namespaces = gpu_namespaces  # the only ones whose pods hold the pools' GPUs (none named: any)
        self.requests: Counter[str] = Counter()  # by "namespace/name" of the CompressedModel it served
        self._cache: dict[str, tuple[float, Any]] = {}  # cluster-wide lists shared by all objects
        self._cache_lock = threading.Lock()
        self._shared: dict[tuple[str, str], float] = {}  # (namespace, ServiceAccount) -> when last seen there
        self._events: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        threading.Thread(target=self._post_events, name="events", daemon=True).start()

    def _call(self, owner: str, method: str, path: str, body: Any = None, query: list[tuple[str, Any]] | None = None,
              content_type: str = "application/json") -> Any:
        """One request, retried with jittered backoff on conflicts, throttling and server errors. A conflict is an
        answer to a create (the name is taken) and to a delete (its uid precondition failed), not retried."""
        for attempt in range(ATTEMPTS):
            self.requests[owner] += 1
            metrics.API_REQUESTS.inc()
            try:
                return self._request(method, path, body, query or [], content_type)
            except ApiException as error:
                if error.status not in RETRIED_STATUS or attempt == ATTEMPTS - 1 or (
                        error.status == 409 and method in ("POST", "DELETE")):
                    raise
                time.sleep(min(8.0, 0.2 * 2**attempt) * (0.5 + random.random()))
        raise AssertionError("unreachable")

    def _open(self, method: str, path: str, body: Any, query: list[tuple[str, Any]], content_type: str,
              timeout: float = 60) -> Any:
        """One request: the urllib3 response, its body not read yet (a watch streams it); ApiException unless 2xx."""
        method, url, headers, payload, _ = self.api.param_serialize(
            method, path, query_params=query, body=body, auth_settings=["BearerToken"],
            header_params={"Accept": "application/json", "Content-Type": content_type})
        response = self.api.call_api(method, url, header_params=headers, body=payload, _request_timeout=timeout)
        if not 200 <= response.status <= 299:
            response.read()  # type: ignore[no-untyped-call]
            raise ApiException(status=response.status, reason=response.reason,
                               body=response.data.decode(errors="replace") if response.data else None)
        return response.response

    def _request(self, method: str, path: str, body: Any, query: list[tuple[str, Any]], content_type: str,
                 text: bool = False) -> Any:
        data = self._open(method, path, body, query, content_type).data
        if text:
            return data.decode(errors="replace") if data else ""
        return wire.loads(data) if data else None

    def pages(self, owner: str, path: str, query: list[tuple[str, Any]]) -> Iterator[dict[str, Any]]:
        """A list read a page (PAGE items) at a time."""
        token: str | None = None
        while True:
            page: dict[str, Any] = self._call(owner, "GET", path, query=[
                *query, ("limit", PAGE), *([("continue", token)] if token else [])])
            yield page
            if not (token := (page.get("metadata") or {}).get("continue")):
                return

    def watch(self, owner: str, path: str, query: list[tuple[str, Any]], timeout: float) -> Any:
        """A watch request's open response, to stream its events from (not retried: the caller lists again)."""
        self.requests[owner] += 1
        metrics.API_REQUESTS.inc()
        return self._open("GET", path, None, query, "application/json", timeout)

    @staticmethod
    def path(kind: str, namespace: str | None, name: str | None = None, subresource: str | None = None) -> str:
        """The kind's objects in `namespace` (None: in every namespace), or one of them."""
        version, plural = KINDS[kind]
        root = "/api/v1" if version == "v1" else f"/apis/{version}"
        path = f"{root}/namespaces/{namespace}/{plural}" if namespace is not None else f"{root}/{plural}"
        if name is not None:
            path += f"/{name}"
        if subresource is not None:
            path += f"/{subresource}"
        return path

    def _cached_kind(self, kind: str, namespace: str) -> Store | None:
        return self.cache if self.cache is not None and self.cache.synced(kind, namespace) else None

    def get(self, owner: str, kind: str, namespace: str, name: str, fresh: bool = False) -> dict[str, Any] | None:
        """The object, from the cache where it holds it (one it does not hold yet, such as a CompressedModel
        kopf saw first, is read from the server); `fresh`: from the server."""
        if (not fresh and (cache := self._cached_kind(kind, namespace)) is not None
                and (held := cache.get(kind, namespace, name))):
            return held
        try:
            found: dict[str, Any] = self._call(owner, "GET", self.path(kind, namespace, name))
        except ApiException as error:
            if error.status == 404:
                return None
            raise
        self._remember(kind, found)
        return found

    def _remember(self, kind: str, answer: Any) -> None:
        if self.cache is not None and kind in CACHED and isinstance(answer, dict) and answer.get("metadata"):
            self.cache.put(kind, answer)

    def select(self, owner: str, kind: str, namespace: str, labels: dict[str, str],
               not_older_than: int | None = None) -> list[dict[str, Any]]:
        """The objects with `labels`; `not_older_than`: as they were at that resourceVersion or later (the cache's
        watches of different kinds are not in step with each other: one that has not reached it is passed by, and
        the API server answers from its own watch cache once that has)."""
        if (names.MODEL in labels and (cache := self._cached_kind(kind, namespace)) is not None
                and (not_older_than is None or cache.reached(kind, namespace, not_older_than))):
            return cache.select(kind, namespace, labels)
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        since = [] if not_older_than is None else [("resourceVersion", str(not_older_than)),
                                                   ("resourceVersionMatch", "NotOlderThan")]
        found = self._call(owner, "GET", self.path(kind, namespace), query=[("labelSelector", selector), *since])
        items: list[dict[str, Any]] = found.get("items", [])
        return items

    def pod_log(self, owner: str, namespace: str, pod: str, container: str, tail_lines: int) -> str:
        """The last `tail_lines` lines of a container's log (at most 64 KiB), through the API server from the
        node's kubelet. Not retried: the next pass reads it again."""
        self.requests[owner] += 1
        metrics.API_REQUESTS.inc()
        found: str = self._request("GET", f"/api/v1/namespaces/{namespace}/pods/{pod}/log", None,
                                   [("container", container), ("tailLines", tail_lines), ("limitBytes", 65536)],
                                   "application/json", text=True)
        return found

    def create(self, owner: str, manifest: dict[str, Any]) -> dict[str, Any] | None:
        """Create `manifest`; None when its CompressedModel's object of that name is there already. One there that
        the manifest's CompressedModel does not own raises Refused (OwnedElsewhere); a manifest owned by none (the
        namespace's shared ServiceAccount) is taken as there whoever made it."""
        created = self._post(owner, manifest)
        meta = manifest["metadata"]
        if created is None and (uid := owner_uid(manifest)) is not None:
            found = self.get(owner, manifest["kind"], meta["namespace"], meta["name"])
            if found is not None and not owned_by(found, uid):
                raise owned_elsewhere(manifest["kind"], meta["name"], uid)
        return created

    def merge_patch(self, owner: str, kind: str, namespace: str, name: str, patch: dict[str, Any], uid: str
                    ) -> None:
        """Merge `patch` into CompressedModel `uid`'s object of that name (read from the server, not the cache);
        another's raises Refused (OwnedElsewhere). The patch carries the object's uid, which the API server
        refuses to change: an object replaced in between is not patched."""
        found = self.get(owner, kind, namespace, name, fresh=True)
        if found is not None and not owned_by(found, uid):
            raise owned_elsewhere(kind, name, uid)
        if found is not None:
            patch = {**patch, "metadata": {**patch.get("metadata", {}), "uid": found["metadata"]["uid"]}}
        self._patch(owner, kind, namespace, name, patch)

    def delete(self, owner: str, kind: str, namespace: str, name: str, uid: str) -> bool:
        """Delete CompressedModel `uid`'s object of that name (children in the background); False when there is
        none: gone already, or another's, which is left alone. The delete's precondition is the uid of the object
        checked, so one replaced in between is left alone too."""
        found = self.get(owner, kind, namespace, name)
        if found is None:
            return False
        if not owned_by(found, uid):
            LOG.info("left %s %s/%s alone: it is not CompressedModel %s's", kind, namespace, name, uid)
            return False
        return self._delete(owner, kind, namespace, name, found["metadata"]["uid"])

    # --- the requests behind create, merge_patch and delete (a test's fake answers these) -------------

    def _post(self, owner: str, manifest: dict[str, Any]) -> dict[str, Any] | None:
        """POST `manifest`; None when its name is taken. A ServiceAccount (shared by the namespace's models,
        created with each of their Jobs) seen in the last SHARED_TTL_S is taken as there without asking."""
        meta = manifest["metadata"]
        shared = (meta["namespace"], meta["name"]) if manifest["kind"] == "ServiceAccount" else None
        if shared is not None and time.monotonic() - self._shared.get(shared, -SHARED_TTL_S) < SHARED_TTL_S:
            return None
        created: dict[str, Any] | None = None
        try:
            created = self._call(owner, "POST", self.path(manifest["kind"], meta["namespace"]), manifest)
        except ApiException as error:
            if error.status != 409:
                raise
        self._remember(manifest["kind"], created)
        if shared is not None:
            self._shared[shared] = time.monotonic()
        return created

    def _patch(self, owner: str, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self._remember(kind, self._call(owner, "PATCH", self.path(kind, namespace, name), patch,
                                        content_type="application/merge-patch+json"))

    def _delete(self, owner: str, kind: str, namespace: str, name: str, uid: str) -> bool:
        """DELETE the object of that name if its uid is `uid`; False when it is gone or another has the name."""
        try:
            self._call(owner, "DELETE", self.path(kind, namespace, name),
                       {"propagationPolicy": "Background", "preconditions": {"uid": uid}})
            deleted = True
        except ApiException as error:
            if error.status not in (404, 409):
                raise
            deleted = False
        if self.cache is not None:
            self.cache.forget(kind, namespace, name)
        return deleted

    def patch_status(self, owner: str, namespace: str, name: str, status: dict[str, Any]) -> None:
        self._remember("CompressedModel", self._call(
            owner, "PATCH", f"/apis/{GROUP}/{API_VERSION}/namespaces/{namespace}/{PLURAL}/{name}/status",
            {"status": status}, content_type="application/merge-patch+json"))

    def _cached(self, key: str, read: Any) -> Any:
        """`read()`, at most once per NODES_TTL_S for all objects."""
        with self._cache_lock:
            at, value = self._cache.get(key, (-NODES_TTL_S, None))
            if time.monotonic() - at > NODES_TTL_S:
                value = read()
                self._cache[key] = (time.monotonic(), value)
            return value

    def nodes(self, owner: str) -> NodeSnapshot:
        """The cluster's Nodes (300 nodes are a large response; pools change on the scale of minutes)."""
        found: NodeSnapshot = self._cached(
            "nodes", lambda: NodeSnapshot(self._call(owner, "GET", "/api/v1/nodes").get("items", [])))
        return found

    def gpu_pods(self, owner: str) -> GpuHolders | None:
        """What every unfinished pod bound to a node holds of its GPUs, read a page at a time and kept only for pods
        that hold GPUs: in every namespace, or only in `gpu_namespaces` where the chart names them. Where the
        operator may not list pods cluster-wide, those of the namespaces it watches (its Roles grant that); None
        where it may list none."""
        def listed(path: str) -> list[HeldGpus]:
            return [h for page in self.pages(owner, path, [("fieldSelector", HELD_PODS)])
                    for pod in page.get("items", []) if (h := held_gpus(pod)) is not None]

        def read() -> GpuHolders | None:
            if not self.gpu_namespaces:
                try:
                    return GpuHolders(pods=listed("/api/v1/pods"))
                except ApiException as error:
                    if error.status != 403:
                        raise
            held: list[HeldGpus] = []
            counted: list[str] = []
            for namespace in self.gpu_namespaces or self.watched:
                try:
                    held += listed(f"/api/v1/namespaces/{namespace}/pods")
                    counted.append(namespace)
                except ApiException as error:
                    if error.status != 403:
                        raise
            return GpuHolders(pods=held, namespaces=tuple(counted)) if counted else None

        found: GpuHolders | None = self._cached("gpu-pods", read)
        return found

    def event(self, owner: str, model: dict[str, Any], kind: str, reason: str, message: str) -> None:
        """A core/v1 Event on the CompressedModel (kubectl describe shows it), posted in the background in the
        order given, as client-go's event recorder does: a pass does not wait on it, and one the API server
        refuses is logged and dropped."""
        meta = model["metadata"]
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        body = {"metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
                "involvedObject": {**object_reference(model), "namespace": meta["namespace"],
                                   "resourceVersion": meta.get("resourceVersion")},
                "type": kind, "reason": reason, "message": message[:1024], "count": 1,
                "firstTimestamp": now, "lastTimestamp": now, "source": {"component": "tailor-operator"},
                "reportingComponent": "tailor.dev/operator", "reportingInstance": "tailor-operator"}
        self._events.put((owner, body))

    def _post_events(self) -> None:
        while True:
            owner, body = self._events.get()
            try:
                self._call(owner, "POST", f"/api/v1/namespaces/{body['metadata']['namespace']}/events", body)
            except Exception as error:  # an Event is worth a log line, never a failed pass
                LOG.warning(f"event {body['reason']} on {owner} not posted: {error}")

