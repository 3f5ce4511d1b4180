"""The operator's read cache, as client-go's informers keep one: per kind a pass reads, one list and then one watch
(per watched namespace, or cluster-wide) keep a copy of every CompressedModel and of every object carrying the
`tailor.dev/model` label, so a pass reads memory instead of listing each kind per pass.

- The operator's own writes go in as the API server answers them (`Store.put`, `Store.forget`), so the next pass
  sees what the last one did even when the watch has not brought it yet; an event older than what the store holds
  (by resourceVersion, etcd's revision) is dropped, and an object the operator deleted stays out until the watch
  says it is gone.
- A watch the server ends (or whose connection drops) is reopened from the last resourceVersion seen (bookmarks
  keep it current); one that is too old (410 Gone) or fails otherwise is listed again, with backoff.
- Until a kind's first list is in, or while it cannot be listed (RBAC), `Store.synced` is False and the reader
  asks the API server instead.
- Each watch's resourceVersion (etcd's revision, shared by every kind) is kept as its events and bookmarks come
  (`Store.reached`): a store that has reached an object's resourceVersion holds every change of its kind made before
  that object's (a finished Job's pods, as they were when the Job controller saw them finish).
- `on_change` is called from the watch thread for every event that changed the store (not for an event of the
  operator's own write that came after the server's answer): it is how passes are woken (`handlers`).
"""

from __future__ import annotations

import copy
import logging
import random
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import ProtocolError

from tailor.operator import names, wire

if TYPE_CHECKING:
    from tailor.operator.kube import Kube

LOG = logging.getLogger(__name__)
WATCH_TIMEOUT_S = 300  # the server ends each watch after this long; it is reopened where it ended
OWNER = "watch-cache"  # what the cache's requests are counted under (`Kube.requests`)
MAX_BACKOFF_S = 30.0
# Kind -> the label selector of what is cached (None: every object of the kind).
CACHED = {"CompressedModel": None, "Job": names.MODEL, "ConfigMap": names.MODEL, "Deployment": names.MODEL,
          "Service": names.MODEL, "Pod": names.MODEL, "PersistentVolumeClaim": names.MODEL}

Key = tuple[str, str, str]  # kind, namespace, name
Change = Callable[[str, str, dict[str, Any] | None, dict[str, Any]], None]  # kind, event type, before, after


def resource_version(obj: dict[str, Any]) -> int:
    """An object's resourceVersion as a number (etcd's revision; 0 where it is not one)."""
    found = str(obj["metadata"].get("resourceVersion") or "")
    return int(found) if found.isdigit() else 0


def _key(kind: str, obj: dict[str, Any]) -> Key:
    meta = obj["metadata"]
    return kind, meta.get("namespace", ""), meta["name"]


class Store:
    """The cached objects by kind, namespace and name, indexed by the model label; thread-safe. Reads return
    copies."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._objects: dict[Key, dict[str, Any]] = {}
        self._of_model: dict[Key, set[str]] = {}  # (kind, namespace, tailor.dev/model) -> names
        self._deleted: set[str] = set()  # uids the operator deleted whose DELETED event has not come yet
        self._synced: set[tuple[str, str | None]] = set()  # (kind, namespace or None for all) listed
        self._reached: dict[tuple[str, str | None], int] = {}  # (kind, scope) -> the resourceVersion its watch reached

    def synced(self, kind: str, namespace: str) -> bool:
        return (kind, None) in self._synced or (kind, namespace) in self._synced

    def reached(self, kind: str, namespace: str, version: int) -> bool:
        """Whether the cache of `kind` in `namespace` is listed and holds every change up to `version`."""
        return self.synced(kind, namespace) and max(self._reached.get((kind, None), 0),
                                                    self._reached.get((kind, namespace), 0)) >= version

    def advance(self, kind: str, namespace: str | None, version: int) -> None:
        """The watch of `kind` in `namespace` (None: everywhere) has brought every change up to `version`."""
        self._reached[kind, namespace] = max(self._reached.get((kind, namespace), 0), version)

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            found = self._objects.get((kind, namespace, name))
            return copy.deepcopy(found) if found is not None else None

    def select(self, kind: str, namespace: str, labels: dict[str, str]) -> list[dict[str, Any]]:
        """The objects with `labels`, which name a model."""
        with self._lock:
            found = (self._objects[kind, namespace, name]
                     for name in self._of_model.get((kind, namespace, labels[names.MODEL]), ()))
            return [copy.deepcopy(obj) for obj in found if names.selects(labels, obj["metadata"].get("labels"))]

    def _set(self, key: Key, obj: dict[str, Any]) -> None:
        if key in self._objects:
            self._drop(key)
        obj["metadata"].pop("managedFields", None)  # what no pass reads is not kept: a third of an object
        if key[0] == "Pod":
            obj.pop("spec", None)  # a pass reads a pod's metadata and status only
        self._objects[key] = obj
        if (model := (obj["metadata"].get("labels") or {}).get(names.MODEL)) is not None:
            self._of_model.setdefault((key[0], key[1], model), set()).add(key[2])

    def _drop(self, key: Key) -> dict[str, Any]:
        obj = self._objects.pop(key)
        if (model := (obj["metadata"].get("labels") or {}).get(names.MODEL)) is not None:
            members = self._of_model[key[0], key[1], model]
            members.discard(key[2])
            if not members:
                del self._of_model[key[0], key[1], model]
        return obj

    def put(self, kind: str, obj: dict[str, Any]) -> None:
        """What the API server answered to the operator's own create or patch."""
        self.apply(kind, "MODIFIED", obj)

    def forget(self, kind: str, namespace: str, name: str) -> None:
        """An object the operator deleted: out now, and kept out until its DELETED event."""
        with self._lock:
            if (kind, namespace, name) in self._objects:
                self._deleted.add(self._drop((kind, namespace, name))["metadata"]["uid"])

    def apply(self, kind: str, event: str, obj: dict[str, Any]) -> dict[str, Any] | None:
        """A watch event (ADDED, MODIFIED, DELETED) or a write's answer. Returns what the store held before when
        the event changed it (an empty dict for a new object), None when it was stale or already known."""
        key, uid = _key(kind, obj), obj["metadata"].get("uid")
        with self._lock:
            held = self._objects.get(key)
            same = held is not None and held["metadata"].get("uid") == uid
            if event == "DELETED":
                self._deleted.discard(uid)
                return self._drop(key) if same else None
            if uid in self._deleted or (
                    same and resource_version(held) >= resource_version(obj)):  # type: ignore[arg-type]
                return None
            self._set(key, obj)
            return held if held is not None else {}

    def replace(self, kind: str, namespace: str | None, items: list[dict[str, Any]], version: int) -> None:
        """A fresh list of the kind (in `namespace`, or everywhere): it replaces what was held, except the
        operator's writes newer than the list."""
        with self._lock:
            listed = {_key(kind, obj): obj for obj in items}
            for key in [k for k in self._objects if k[0] == kind and namespace in (None, k[1])]:
                if key not in listed and resource_version(self._objects[key]) <= version:
                    self._drop(key)
            for key, obj in listed.items():
                held = self._objects.get(key)
                if held is None or resource_version(held) < resource_version(obj) or held["metadata"].get("uid") != obj[
                        "metadata"].get("uid"):
                    self._set(key, obj)
            self._deleted.intersection_update(obj["metadata"]["uid"] for obj in items)
            self._synced.add((kind, namespace))
            self._reached[kind, namespace] = version

    def unsync(self, kind: str, namespace: str | None) -> None:
        self._synced.discard((kind, namespace))


class Gone(Exception):
    """The watch's resourceVersion is too old (410): list again."""


class Reflector:
    """One kind in one scope: list, then watch from the list's resourceVersion, forever, on a daemon thread,
    through `kube` into its cache."""

    def __init__(self, kube: Kube, kind: str, namespace: str | None, on_change: Change) -> None:
        assert kube.cache is not None
        self.kube, self.store, self.kind, self.namespace = kube, kube.cache, kind, namespace
        self.path, self.on_change = kube.path(kind, namespace), on_change
        selector = CACHED[kind]
        self.query: list[tuple[str, Any]] = [("labelSelector", selector)] if selector else []
        self.thread = threading.Thread(target=self._run, name=f"watch-{kind}-{namespace or 'all'}", daemon=True)
        self.stopped = threading.Event()

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Stop once the open watch ends (the operator's never stop; a test's do)."""
        self.stopped.set()

    def _run(self) -> None:
        backoff = 1.0
        while not self.stopped.is_set():
            try:
                version = self._list()
                backoff = 1.0
                while not self.stopped.is_set():
                    version = self._watch(version)
            except Gone:
                LOG.info(f"watch of {self.kind} in {self.namespace or 'all namespaces'} expired: listing again")
            except Exception as error:  # the cache outlives any one failure: the readers ask the server meanwhile
                self.store.unsync(self.kind, self.namespace)
                LOG.warning(f"watch of {self.kind} in {self.namespace or 'all namespaces'} failed, listing again "
                            f"in {backoff:.0f}s: {error}")
                self.stopped.wait(backoff * (0.5 + random.random()))
                backoff = min(MAX_BACKOFF_S, backoff * 2)

    def _list(self) -> int:
        items: list[dict[str, Any]] = []
        for page in self.kube.pages(OWNER, self.path, self.query):
            items += page.get("items", [])
        version = int(page["metadata"]["resourceVersion"])
        for obj in items:  # a list's items carry no kind
            obj.setdefault("kind", self.kind)
        self.store.replace(self.kind, self.namespace, items, version)
        return version

    def _events(self, version: int) -> Iterator[dict[str, Any]]:
        stream = self.kube.watch(OWNER, self.path, [
            *self.query, ("watch", "true"), ("resourceVersion", str(version)), ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", WATCH_TIMEOUT_S)], WATCH_TIMEOUT_S + 30)
        try:
            buffer = b""
            for chunk in stream.stream(65536, decode_content=True):
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield wire.loads(line)
        except ProtocolError:  # the connection ended without the stream's last chunk: reopen where it was
            return
        finally:
            stream.release_conn()

    def _watch(self, version: int) -> int:
        """Apply events until the server ends the watch; the resourceVersion to reopen it from."""
        for event in self._events(version):
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                if obj.get("code") == 410:
                    raise Gone()
                raise ApiException(status=obj.get("code"), reason=obj.get("message"))
            version = max(version, resource_version(obj))
            if kind != "BOOKMARK" and (before := self.store.apply(self.kind, str(kind), obj)) is not None:
                self.on_change(self.kind, str(kind), before or None, obj)
            self.store.advance(self.kind, self.namespace, version)  # after the event is in
        return version
