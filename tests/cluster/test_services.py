"""Services on the devcluster's loopback (`devcluster/services.py`): a client of a Service reaches every ready
replica the executor runs, and stops reaching one that is being deleted, without a failed request."""

from __future__ import annotations

import http.client
import threading
import time
from typing import Any

import pytest
from kubernetes import client

from tailor.devcluster import cluster
from tailor.devcluster.executor import announced_ports
from tailor.devcluster.nodes import EXECUTOR_LABEL, GPU_TAINT

from conftest import wait_for

# answers every GET with its pod's name; `/slow` says so on its output, then waits 3 s for a worker process (as
# Triton waits for vLLM's engine process). On SIGTERM it stops listening and finishes the requests it holds, as
# Triton does: only the main process is signalled, so a worker ended by it answers so. The executor rewrites
# --http-port.
SERVER = ("import os, signal, subprocess, sys, threading, http.server\n"
          "class Handler(http.server.BaseHTTPRequestHandler):\n"
          "    def do_GET(self):\n"
          "        if self.path == '/slow':\n"
          "            print('slow request received', flush=True)\n"
          "        code = subprocess.run(['sleep', '3']).returncode if self.path == '/slow' else 0\n"
          "        body = (os.environ['HOSTNAME'] if code == 0 else f'worker ended: {code}').encode()\n"
          "        self.send_response(200)\n"
          "        self.send_header('Content-Length', str(len(body)))\n"
          "        self.end_headers()\n"
          "        self.wfile.write(body)\n"
          "    def log_message(self, *args):\n"
          "        pass\n"
          "class Server(http.server.ThreadingHTTPServer):\n"
          "    daemon_threads = False\n"
          "server = Server(('127.0.0.1', int(sys.argv[1].split('=')[1])), Handler)\n"
          "signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())\n"
          "server.serve_forever()\n"
          "server.server_close()\n")


def _pod(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"app": "web"}}, "spec": {
        "nodeSelector": {EXECUTOR_LABEL: "true"},
        "tolerations": [{"key": GPU_TAINT["key"], "operator": "Exists", "effect": "NoSchedule"}],
        "terminationGracePeriodSeconds": 10,
        "containers": [{"name": "web", "image": "python", "command": ["python", "-c", SERVER, "--http-port=8080"],
                        "ports": [{"name": "http", "containerPort": 8080}],
                        "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
                        # as the operator gives Triton: a connection the Service routed just before the pod left
                        # it reaches the server before it stops listening
                        "lifecycle": {"preStop": {"exec": {"command": ["sleep", "1"]}}}}]}}


def _answer(port: int, path: str = "/") -> str:
    """One GET through the Service; its connection closed whatever happens (urllib leaves the socket of a
    connection the server closed unanswered to the garbage collector, whose warning would fail a later test)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=15)
    try:
        connection.request("GET", path)
        return connection.getresponse().read().decode()
    finally:
        connection.close()


def _answers(port: int, count: int) -> set[str]:
    """Who answers `count` requests; none while the Service has no ready replica (it refuses the connection)."""
    try:
        return {_answer(port) for _ in range(count)}
    except OSError:
        return set()


def _web_service(core: client.CoreV1Api, namespace: str) -> int:
    """A Service `web` over the pods labelled app=web; its loopback port, once the executor announces it."""
    core.create_namespaced_service(namespace, {"metadata": {"name": "web"}, "spec": {
        "selector": {"app": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}})
    return int(wait_for("the Service's loopback port", lambda: announced_ports(
        core.read_namespaced_service("web", namespace)).get("http"), 60))


@pytest.mark.timeout(180)
def test_a_service_spreads_over_ready_replicas_and_drops_one_being_deleted(api: client.ApiClient,
                                                                          namespace: str) -> None:
    core = client.CoreV1Api(api)
    for name in ("web-a", "web-b"):
        core.create_namespaced_pod(namespace, _pod(name))
    port = _web_service(core, namespace)
    wait_for("both replicas to answer", lambda: _answers(port, 8) == {"web-a", "web-b"}, 60)

    core.delete_namespaced_pod("web-a", namespace)
    answers, deadline = [], time.monotonic() + 60
    while time.monotonic() < deadline and answers[-10:] != ["web-b"] * 10:
        answers.append(_answer(port))  # raises on a failed request
    assert answers[-10:] == ["web-b"] * 10, f"web-a still answers after its deletion: {answers[-10:]}"
    wait_for("web-a to be gone", lambda: not core.list_namespaced_pod(
        namespace, field_selector="metadata.name=web-a").items, 30)
    assert {_answer(port) for _ in range(6)} == {"web-b"}


@pytest.mark.timeout(120)
def test_a_request_in_flight_when_its_pod_is_deleted_finishes(api: client.ApiClient, devcluster: cluster.Layout,
                                                               namespace: str) -> None:
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(namespace, _pod("web-a"))
    port = _web_service(core, namespace)
    wait_for("the replica to answer", lambda: _answers(port, 1) == {"web-a"}, 60)
    answer: list[str] = []
    slow = threading.Thread(target=lambda: answer.append(_answer(port, "/slow")))
    slow.start()
    log = devcluster.root / "executor" / "pods"
    wait_for("the replica to hold the request", lambda: any(
        "slow request received" in path.read_text() for path in log.glob(f"{namespace}_web-a_*/web/output.log")), 30)
    core.delete_namespaced_pod("web-a", namespace)
    slow.join(timeout=30)
    assert answer == ["web-a"], "the request in flight was cut when its pod was deleted"
    wait_for("web-a to be gone", lambda: not core.list_namespaced_pod(
        namespace, field_selector="metadata.name=web-a").items, 30)
    with pytest.raises(OSError):  # no ready replica: the Service refuses the connection
        _answer(port)
    said = devcluster.log_file("executor").read_text(errors="replace")  # the Service's account of the drain
    assert f"service {namespace}/web:http: pod web-a left with 1 connection(s) open" in said
    assert f"service {namespace}/web:http: the last connection to pod web-a ended" in said
