"""The operator's API calls against a small HTTP server that answers like an API server under stress: transient
errors (conflicts, throttling, 5xx) are retried with backoff, a create of an existing object adopts it, a missing
object reads as None."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tailor.operator import kube as kube_module
from tailor.operator.conditions import Refused
from tailor.operator.kube import Kube


class Script:
    """Answers per (method, path): a list of (status, body) consumed in order; the last one repeats."""

    def __init__(self) -> None:
        self.answers: dict[tuple[str, str], list[tuple[int, dict[str, Any]]]] = {}
        self.seen: list[tuple[str, str]] = []
        self.bodies: list[Any] = []  # each request's JSON body (None without one)


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Kube, Script]]:
    script = Script()
    monkeypatch.setattr(kube_module.time, "sleep", lambda _: None)  # no real backoff waits in a unit test

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            key = (self.command, self.path.split("?")[0])
            script.seen.append(key)
            length = int(self.headers.get("Content-Length") or 0)
            script.bodies.append(json.loads(self.rfile.read(length)) if length else None)
            queue = script.answers.get(key, [(404, {"kind": "Status", "code": 404})])
            status, body = queue.pop(0) if len(queue) > 1 else queue[0]
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PATCH = do_DELETE = _answer

        def log_message(self, *_: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    api = client.ApiClient(client.Configuration(host=f"http://127.0.0.1:{httpd.server_address[1]}"))
    yield Kube(api), script
    api.close()
    httpd.shutdown()
    httpd.server_close()


JOB = "/apis/batch/v1/namespaces/ns/jobs"


def test_transient_errors_are_retried_and_counted(server: tuple[Kube, Script]) -> None:
    kube, script = server
    script.answers[("GET", f"{JOB}/j")] = [(503, {}), (429, {}), (200, {"metadata": {"name": "j"}})]
    assert kube.get("ns/m", "Job", "ns", "j") == {"metadata": {"name": "j"}}
    assert kube.requests["ns/m"] == 3


def test_a_persistent_error_is_raised_after_the_last_attempt(server: tuple[Kube, Script]) -> None:
    kube, script = server
    script.answers[("GET", f"{JOB}/j")] = [(500, {})]
    with pytest.raises(ApiException) as error:
        kube.get("ns/m", "Job", "ns", "j")
    assert error.value.status == 500 and kube.requests["ns/m"] == kube_module.ATTEMPTS


def owned(uid: str | None, object_uid: str = "o1") -> dict[str, Any]:
    """Job j as the API server has it, owned by CompressedModel `uid` (None: by no CompressedModel)."""
    refs = [] if uid is None else [{"kind": "CompressedModel", "uid": uid}]
    return {"metadata": {"name": "j", "namespace": "ns", "uid": object_uid, "ownerReferences": refs}}


def test_a_create_that_finds_its_own_object_takes_it_and_another_s_is_refused(server: tuple[Kube, Script]) -> None:
    kube, script = server
    manifest = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {
        "name": "j", "namespace": "ns", "ownerReferences": [{"kind": "CompressedModel", "uid": "u1"}]}}
    script.answers[("POST", JOB)] = [(409, {"reason": "AlreadyExists"})]
    script.answers[("GET", f"{JOB}/j")] = [(200, owned("u1")), (200, owned(None))]
    assert kube.create("ns/m", manifest) is None
    assert script.seen == [("POST", JOB), ("GET", f"{JOB}/j")]  # a 409 on create is an answer, not retried
    with pytest.raises(Refused) as refused:
        kube.create("ns/m", manifest)  # a namespace admin's Job of that name
    assert refused.value.reason == "OwnedElsewhere" and "Job j exists and is not this" in refused.value.message
    assert kube.get("ns/m", "Job", "ns", "other") is None
    assert kube.delete("ns/m", "Job", "ns", "other", "u1") is False


def test_deletes_and_patches_touch_only_the_models_own_object(server: tuple[Kube, Script]) -> None:
    """Another's object is left alone (no DELETE or PATCH is sent); the model's own is deleted or patched with its
    uid as a precondition, and a delete whose precondition fails (the name now another object's) is an answer."""
    kube, script = server
    script.answers[("GET", f"{JOB}/j")] = [(200, owned("u2"))]
    assert kube.delete("ns/m", "Job", "ns", "j", "u1") is False
    with pytest.raises(Refused, match="Job j exists and is not this CompressedModel's"):
        kube.merge_patch("ns/m", "Job", "ns", "j", {"spec": {"suspend": False}}, "u1")
    assert {method for method, _ in script.seen} == {"GET"}

    script.answers[("GET", f"{JOB}/j")] = [(200, owned("u1", "o7"))]
    script.answers[("DELETE", f"{JOB}/j")] = [(409, {"reason": "Conflict"})]
    script.answers[("PATCH", f"{JOB}/j")] = [(200, owned("u1", "o7"))]
    assert kube.delete("ns/m", "Job", "ns", "j", "u1") is False
    assert script.seen.count(("DELETE", f"{JOB}/j")) == 1  # not retried
    assert script.bodies[script.seen.index(("DELETE", f"{JOB}/j"))]["preconditions"] == {"uid": "o7"}
    kube.merge_patch("ns/m", "Job", "ns", "j", {"spec": {"suspend": False}}, "u1")
    assert script.bodies[script.seen.index(("PATCH", f"{JOB}/j"))] == {"spec": {"suspend": False},
                                                                       "metadata": {"uid": "o7"}}


def test_a_namespace_service_account_is_created_once_per_while(server: tuple[Kube, Script],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Job start asks for the namespace's ServiceAccount; one seen there (created or found) is not asked
    for again until SHARED_TTL_S has passed. Other kinds are always sent."""
    kube, script = server
    path = "/api/v1/namespaces/ns/serviceaccounts"
    script.answers[("POST", path)] = [(409, {"reason": "AlreadyExists"})]
    script.answers[("POST", "/api/v1/namespaces/other/serviceaccounts")] = [(201, {})]
    account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "tailor-job", "namespace": "ns"}}
    now = [1000.0]
    monkeypatch.setattr(kube_module.time, "monotonic", lambda: now[0])
    for _ in range(3):
        kube.create("ns/m", account)
    assert script.seen.count(("POST", path)) == 1
    now[0] += kube_module.SHARED_TTL_S + 1
    kube.create("ns/m", account)
    kube.create("ns/m", {**account, "metadata": {"name": "tailor-job", "namespace": "other"}})
    assert script.seen.count(("POST", path)) == 2
    assert ("POST", "/api/v1/namespaces/other/serviceaccounts") in script.seen


def test_events_are_posted_in_the_background_and_retried(server: tuple[Kube, Script]) -> None:
    kube, script = server
    path = "/api/v1/namespaces/ns/events"
    script.answers[("POST", path)] = [(500, {}), (201, {})]  # the first is retried, then posted
    model = {"metadata": {"name": "m", "namespace": "ns", "uid": "u1"}}
    for reason in ("JobCreated", "Ready"):
        kube.event("ns/m", model, "Normal", reason, "...")
    done = threading.Event()
    for _ in range(100):  # up to 5 s
        if script.seen.count(("POST", path)) == 3 or done.wait(0.05):
            break
    assert script.seen.count(("POST", path)) == 3 and kube.requests["ns/m"] == 3


def test_pods_holding_gpus_are_read_a_page_at_a_time_or_are_unknown(server: tuple[Kube, Script]) -> None:
    """Only bound, unfinished pods with GPUs are kept; a 403 (no cluster-wide pod list) reads as None."""
    kube, script = server

    def pod(name: str, gpus: str) -> dict[str, Any]:
        return {"metadata": {"name": name, "namespace": "a"}, "status": {"phase": "Running"},
                "spec": {"nodeName": "n1", "containers": [{"resources": {"limits": {"nvidia.com/gpu": gpus}}}]}}

    script.answers[("GET", "/api/v1/pods")] = [
        (200, {"items": [pod("p1", "2"), pod("cpu", "0")], "metadata": {"continue": "next"}}),
        (200, {"items": [pod("p2", "1")], "metadata": {}})]
    held = kube.gpu_pods("ns/m")
    assert held is not None and [(h.node, h.gpus) for h in held.pods] == [("n1", 2), ("n1", 1)]
    assert held.namespaces is None  # every namespace's
    assert script.seen.count(("GET", "/api/v1/pods")) == 2
    assert kube.gpu_pods("ns/m") == held and script.seen.count(("GET", "/api/v1/pods")) == 2  # cached
    other = Kube(kube.api)
    script.answers[("GET", "/api/v1/pods")] = [(403, {"reason": "Forbidden"})]
    assert other.gpu_pods("ns/m") is None


def test_pods_holding_gpus_are_listed_only_where_named_or_in_the_watched_namespaces(
        server: tuple[Kube, Script]) -> None:
    """Named namespaces (the chart's serving.heldGpuNamespaces): pods are listed there and nowhere else. None named
    and no cluster-wide list allowed: the watched namespaces' pods, which the operator's Roles let it list; a
    namespace it may not list is left out, and the result names those that were counted."""
    kube, script = server

    def pods(*gpus: str) -> list[tuple[int, dict[str, Any]]]:
        return [(200, {"items": [{"metadata": {"name": f"p{i}", "namespace": "x"}, "status": {"phase": "Running"},
                                  "spec": {"nodeName": "n1", "containers": [{"resources": {"limits": {
                                      "nvidia.com/gpu": count}}}]}} for i, count in enumerate(gpus)],
                       "metadata": {}})]

    named = Kube(kube.api, gpu_namespaces=("gpu-a",))
    script.answers[("GET", "/api/v1/namespaces/gpu-a/pods")] = pods("4")
    held = named.gpu_pods("ns/m")
    assert held is not None and held.namespaces == ("gpu-a",) and [h.gpus for h in held.pods] == [4]
    assert ("GET", "/api/v1/pods") not in script.seen, "pods were listed cluster-wide"

    watching = Kube(kube.api, watched=("team-a", "team-b"))
    script.answers[("GET", "/api/v1/pods")] = [(403, {"reason": "Forbidden"})]
    script.answers[("GET", "/api/v1/namespaces/team-a/pods")] = pods("1", "2")
    script.answers[("GET", "/api/v1/namespaces/team-b/pods")] = [(403, {"reason": "Forbidden"})]
    held = watching.gpu_pods("ns/m")
    assert held is not None and held.namespaces == ("team-a",) and sum(h.gpus for h in held.pods) == 3
