"""A dict-backed stand-in for the Kubernetes API, for the operator's unit tests: a FAKE, said so. It keeps
objects by kind, namespace and name, answers the requests the reconciler makes (`tailor.operator.kube.Kube`,
whose ownership checks run unchanged on top) with the API server's semantics that matter to it (409 on a
second create, 404 as None, label selection, merge patches, uid preconditions and generation), and lets a test
play the controllers: finish a Job with a result, make a revision available, stall it, take nodes away, refuse
a write. The devcluster tests are the real thing.
"""

from __future__ import annotations

import copy
import datetime
import json
import re
import uuid
from collections import Counter
from typing import Any

from kubernetes.client.exceptions import ApiException

from tailor.devcluster import nodes as devcluster_nodes
from tailor.devcluster.simulated import RESULT_ANNOTATION
from tailor.operator.kube import Kube
from tailor.operator.pools import GpuHolders, held_gpus

Key = tuple[str, str, str]  # kind, namespace, name


def _field(message: str) -> str:
    """The status field a validation message names first: `status.stages[0].message: Too long` -> stages."""
    return re.split(r"[.\[:]", message.removeprefix("status."), maxsplit=1)[0]


def _apply(target: dict[str, Any], patch: dict[str, Any]) -> None:
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _apply(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


def ready_nodes(pools_file: Any = devcluster_nodes.DEFAULT_POOLS_FILE) -> list[dict[str, Any]]:
    """The devcluster's simulated pools as Ready nodes (kwok marks them Ready on a real devcluster)."""
    found = devcluster_nodes.node_manifests(devcluster_nodes.load_pools(pools_file))
    for node in found:
        node["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    return found


class FakeKube(Kube):
    """The operator's API calls against dicts; every write is recorded in `writes`."""

    def __init__(self, nodes: list[dict[str, Any]] | None = None) -> None:
        self.store: dict[Key, dict[str, Any]] = {}
        self.requests: Counter[str] = Counter()
        self.writes: list[tuple[str, str, str]] = []  # (verb, kind, name)
        self.refused: list[tuple[str, str, str]] = []  # writes sent and refused (`refusals`), not in `writes`
        self.events: list[tuple[str, str, str]] = []  # (type, reason, message)
        self.logs: dict[tuple[str, str, str], str] = {}  # (namespace, pod, container) -> its log
        self.refusals: dict[tuple[str, str], tuple[int, str]] = {}  # (verb, kind) -> (status, message)
        self.node_list = nodes if nodes is not None else ready_nodes()

    # --- the Kube interface ------------------------------------------------------------------------

    def _refuse(self, verb: str, kind: str, name: str) -> None:
        if (verb, kind) in self.refusals:
            self.refused.append((verb, kind, name))
            status, message = self.refusals[(verb, kind)]
            raise ApiException(status=status, reason="Refused", body=json.dumps({"message": message}))

    def get(self, owner: str, kind: str, namespace: str, name: str, fresh: bool = False) -> dict[str, Any] | None:
        self.requests[owner] += 1
        found = self.store.get((kind, namespace, name))
        return copy.deepcopy(found) if found is not None else None

    def select(self, owner: str, kind: str, namespace: str, labels: dict[str, str],
               not_older_than: int | None = None) -> list[dict[str, Any]]:
        self.requests[owner] += 1
        return [copy.deepcopy(o) for (k, ns, _), o in sorted(self.store.items())
                if k == kind and ns == namespace
                and all((o["metadata"].get("labels") or {}).get(key) == value for key, value in labels.items())]

    def _post(self, owner: str, manifest: dict[str, Any]) -> dict[str, Any] | None:
        self.requests[owner] += 1
        meta = manifest["metadata"]
        self._refuse("create", manifest["kind"], meta["name"])
        key = (manifest["kind"], meta["namespace"], meta["name"])
        if key in self.store:
            return None
        self.writes.append(("create", manifest["kind"], meta["name"]))
        stored = copy.deepcopy(manifest)
        stored["metadata"].update(uid=str(uuid.uuid4()), generation=1,
                                  creationTimestamp=datetime.datetime.now(datetime.UTC).isoformat())
        self.store[key] = stored
        return copy.deepcopy(stored)

    def _patch(self, owner: str, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> None:
        self.requests[owner] += 1
        self._refuse("patch", kind, name)
        target = self.store[(kind, namespace, name)]
        if patch.get("metadata", {}).get("uid", target["metadata"]["uid"]) != target["metadata"]["uid"]:
            raise ApiException(status=422, reason="Invalid", body=json.dumps({"message": "metadata.uid: Invalid "
                                                                              "value: field is immutable"}))
        self.writes.append(("patch", kind, name))
        _apply(target, patch)
        if "spec" in patch:
            target["metadata"]["generation"] += 1

    def _delete(self, owner: str, kind: str, namespace: str, name: str, uid: str) -> bool:
        self.requests[owner] += 1
        self._refuse("delete", kind, name)
        if (self.store.get((kind, namespace, name)) or {"metadata": {}})["metadata"].get("uid", "") != uid:
            return False  # gone, or another object of that name (the precondition failed)
        gone = self.store.pop((kind, namespace, name))
        self.writes.append(("delete", kind, name))
        uid = gone["metadata"]["uid"]  # the garbage collector: what it owned goes with it
        for key, obj in list(self.store.items()):
            if any(ref.get("uid") == uid for ref in obj["metadata"].get("ownerReferences") or []):
                del self.store[key]
        return True

    def patch_status(self, owner: str, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.requests[owner] += 1
        refusal = self.refusals.get(("status", "CompressedModel"))
        if refusal is not None and _field(refusal[1]) in status:  # as validation would: a patch writing that field
            self._refuse("status", "CompressedModel", name)
        self.writes.append(("status", "CompressedModel", name))
        target = self.store[("CompressedModel", namespace, name)]
        target.setdefault("status", {})
        _apply(target["status"], status)

    def nodes(self, owner: str) -> list[dict[str, Any]]:
        self.requests[owner] += 1
        return copy.deepcopy(self.node_list)

    def gpu_pods(self, owner: str) -> GpuHolders | None:
        """None where a test refuses ("list", "Pod"), as Kube says a 403."""
        self.requests[owner] += 1
        if ("list", "Pod") in self.refusals:
            return None
        return GpuHolders(pods=[held for (kind, _, _), pod in self.store.items()
                                if kind == "Pod" and (held := held_gpus(pod)) is not None])

    def event(self, owner: str, model: dict[str, Any], kind: str, reason: str, message: str) -> None:
        self.events.append((kind, reason, message))

    def pod_log(self, owner: str, namespace: str, pod: str, container: str, tail_lines: int) -> str:
        """`logs[(namespace, pod, container)]`, as a kubelet holds it; a 404 for a pod without one."""
        self.requests[owner] += 1
        if (namespace, pod, container) not in self.logs:
            raise ApiException(status=404, reason=f"no log of {pod}/{container}")
        return "".join(self.logs[(namespace, pod, container)].splitlines(keepends=True)[-tail_lines:])

    # --- what a test does as a user ----------------------------------------------------------------

    def apply(self, body: dict[str, Any]) -> dict[str, Any]:
        body = copy.deepcopy(body)
        body["metadata"].setdefault("namespace", "ns")
        created = self.create("test", body)
        assert created is not None
        return created

    def update_spec(self, name: str, patch: dict[str, Any], namespace: str = "ns") -> None:
        self.patch("test", "CompressedModel", namespace, name, {"spec": patch})

    def patch(self, actor: str, kind: str, namespace: str, name: str, patch: dict[str, Any]) -> None:
        """A merge patch as a user or a controller sends it: no ownership check (the operator's own go through
        `merge_patch`)."""
        self._patch(actor, kind, namespace, name, patch)

    def remove(self, actor: str, kind: str, namespace: str, name: str) -> bool:
        """A delete as a user or a controller sends it, whoever owns the object (the operator's go through
        `delete`)."""
        found = self.store.get((kind, namespace, name))
        return found is not None and self._delete(actor, kind, namespace, name, found["metadata"].get("uid", ""))

    def model(self, name: str, namespace: str = "ns") -> dict[str, Any]:
        return self.store[("CompressedModel", namespace, name)]

    def status(self, name: str) -> dict[str, Any]:
        return dict(self.model(name).get("status") or {})

    def condition(self, name: str, kind: str) -> dict[str, Any]:
        return next(c for c in self.status(name).get("conditions", []) if c["type"] == kind)

    def names(self, kind: str) -> list[str]:
        return sorted(name for (k, _, name) in self.store if k == kind)

    def obj(self, kind: str, name: str, namespace: str = "ns") -> dict[str, Any]:
        return self.store[(kind, namespace, name)]

    # --- what a test does as the controllers -------------------------------------------------------

    def finish_job(self, name: str, message: str | None = None, failed: str | None = None,
                   namespace: str = "ns", pod: bool = True) -> None:
        """The Job controller's verdict, and its pod with the termination message (`pod` False: the pod is
        gone, as when its node was scaled away)."""
        job = self.store[("Job", namespace, name)]
        condition = {"type": "Failed", "status": "True", "reason": failed, "message": "Job has reached the "
                     "specified backoff limit"} if failed else {"type": "Complete", "status": "True"}
        job["status"] = {"conditions": [condition], "active": 0}
        if not pod:
            return
        pod_labels = {**job["spec"]["template"]["metadata"]["labels"], "batch.kubernetes.io/job-name": name}
        text = message if message is not None else (failed or "")
        self.store[("Pod", namespace, f"{name}-pod")] = {
            "metadata": {"name": f"{name}-pod", "namespace": namespace, "labels": pod_labels,
                         "creationTimestamp": "2026-11-30T00:00:00Z"},
            "status": {"phase": "Failed" if failed else "Succeeded",
                       "containerStatuses": [{"state": {"terminated": {"message": text}}}]}}

    def finish_stage(self, job: str, results: dict[str, str]) -> None:
        """Finish a stage Job with the result its pod annotations carry (as kwok does on the devcluster)."""
        stage = self.store[("Job", "ns", job)]["metadata"]["labels"]["tailor.dev/stage"]
        self.finish_job(job, results.get(RESULT_ANNOTATION.format(stage=stage), ""))

    def make_available(self, name: str, namespace: str = "ns") -> None:
        deployment = self.store[("Deployment", namespace, name)]
        replicas = deployment["spec"]["replicas"]
        deployment["status"] = {"observedGeneration": deployment["metadata"]["generation"],
                                "availableReplicas": replicas, "updatedReplicas": replicas,
                                "conditions": [{"type": "Available", "status": "True"}]}

    def stall(self, name: str, namespace: str = "ns") -> None:
        deployment = self.store[("Deployment", namespace, name)]
        deployment["status"] = {"observedGeneration": deployment["metadata"]["generation"], "conditions": [
            {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
             "message": f'ReplicaSet "{name}-abc" has timed out progressing.'}]}

