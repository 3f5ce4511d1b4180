"""Cluster tests run against the devcluster: a real kube-apiserver, controllers, scheduler and kwok.

The devcluster starts once per test session (its binaries are built by `tailor devcluster build`
beforehand, which `make test` and .ci/run do); a devcluster that was already up is reused and left up.
"""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from tailor.devcluster import build, cluster
from tailor.operator import api as model


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test in this folder `cluster`, so `pytest -m "not cluster"` runs without one."""
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.cluster)


@pytest.fixture(scope="session")
def devcluster() -> Iterator[cluster.Layout]:
    layout = cluster.Layout(cluster.state_dir())
    was_running = cluster.running_pid(layout, "kube-apiserver") is not None
    if not was_running:
        cluster.down(purge=True)  # a fresh cluster: no state left by a session that was stopped
    cluster.up()
    yield layout
    if not was_running:
        cluster.down(purge=True)


@pytest.fixture(scope="session")
def api(devcluster: cluster.Layout) -> client.ApiClient:
    return config.new_client_from_config(config_file=str(devcluster.kubeconfig))


@pytest.fixture(scope="session")
def kubectl(devcluster: cluster.Layout) -> Callable[..., subprocess.CompletedProcess[str]]:
    binary = build.ensure_binaries() / "kubectl"

    def run(*args: str, stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(binary), f"--kubeconfig={devcluster.kubeconfig}", *args], input=stdin,
                              capture_output=True, text=True, check=check, timeout=120)

    return run


@pytest.fixture
def namespace(api: client.ApiClient) -> Iterator[str]:
    name = f"test-{uuid.uuid4().hex[:8]}"
    core = client.CoreV1Api(api)
    core.create_namespace({"metadata": {"name": name}})
    yield name
    core.delete_namespace(name)


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float = 60, interval_s: float = 0.5) -> Any:
    """Poll `probe` until it returns something truthy; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)


REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def crd(api: client.ApiClient, kubectl: Callable[..., Any]) -> None:
    kubectl("apply", "--server-side", "-f", str(REPO / "crds" / "compressedmodel.yaml"))
    kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{model.PLURAL}.{model.GROUP}")
    # Discovery of a new CRD settles just after Established; wait until creates are served.
    wait_for("the CRD to be served", lambda: _served(api))


def _served(api: client.ApiClient) -> bool:
    try:
        client.CustomObjectsApi(api).list_cluster_custom_object(model.GROUP, model.VERSION, model.PLURAL)
    except ApiException:
        return False
    return True


class OperatorProcess:
    """`tailor operator` as a subprocess watching one namespace, as it runs in a cluster; killable."""

    def __init__(self, layout: cluster.Layout, namespace: str, log: Path) -> None:
        import socket

        self.layout, self.namespace, self.log = layout, namespace, log
        self.process: subprocess.Popen[bytes] | None = None
        sockets = [socket.socket() for _ in range(2)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        self.metrics_port, self.liveness_port = (s.getsockname()[1] for s in sockets)
        for s in sockets:
            s.close()

    def start(self) -> OperatorProcess:
        import os
        import sys

        env = {**os.environ, "KUBECONFIG": str(self.layout.kubeconfig)}
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tailor.cli.main", "operator", "--namespace", self.namespace,
                 "--metrics-port", str(self.metrics_port), "--liveness-port", str(self.liveness_port),
                 "--bind", "127.0.0.1"], env=env, stdout=out, stderr=subprocess.STDOUT)
        return self

    def kill(self) -> None:
        """SIGKILL: no graceful shutdown, as when a node dies."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def get(self, port: int, path: str) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return str(reply.read().decode())

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


@pytest.fixture
def operator(devcluster: cluster.Layout, crd: None, api: client.ApiClient, namespace: str,
             tmp_path: Path) -> Iterator[OperatorProcess]:
    """The operator for the test's namespace; afterwards its CompressedModels are deleted through it (their
    finalizers need it), so the namespace can go."""
    running = OperatorProcess(devcluster, namespace, tmp_path / "operator.log").start()
    yield running
    if running.process is None or running.process.poll() is not None:
        running.start()
    objects = client.CustomObjectsApi(api)
    for item in objects.list_namespaced_custom_object(model.GROUP, model.VERSION, namespace, model.PLURAL)["items"]:
        objects.delete_namespaced_custom_object(model.GROUP, model.VERSION, namespace, model.PLURAL,
                                                item["metadata"]["name"])
    wait_for("the CompressedModels to be deleted", lambda: not objects.list_namespaced_custom_object(
        model.GROUP, model.VERSION, namespace, model.PLURAL)["items"], timeout_s=60)
    running.stop()
