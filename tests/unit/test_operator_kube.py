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
from tailor.operator.kube import Kube


class Script:
    """Answers per (method, path): a list of (status, body) consumed in order; the last one repeats."""

    def __init__(self) -> None:
        self.answers: dict[tuple[str, str], list[tuple[int, dict[str, Any]]]] = {}
        self.seen: list[tuple[str, str]] = []


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Kube, Script]]:
    script = Script()
    monkeypatch.setattr(kube_module.time, "sleep", lambda _: None)  # no real backoff waits in a unit test

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            key = (self.command, self.path.split("?")[0])
            script.seen.append(key)
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


def test_a_create_that_finds_the_object_there_and_missing_reads_are_none(server: tuple[Kube, Script]) -> None:
    kube, script = server
    manifest = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "j", "namespace": "ns"}}
    script.answers[("POST", JOB)] = [(409, {"reason": "AlreadyExists"})]
    assert kube.create("ns/m", manifest) is None  # the next pass observes it (and checks its owner)
    assert script.seen == [("POST", JOB)]  # a 409 on create is an answer, not retried
    assert kube.get("ns/m", "Job", "ns", "other") is None
    assert kube.delete("ns/m", "Job", "ns", "other") is False
