"""Cluster tests run against the devcluster: a real kube-apiserver, controllers, scheduler and kwok.

The devcluster starts once per test session (its binaries are built by `tailor devcluster build`
beforehand, which `make test` and .ci/run do); a devcluster that was already up is reused and left up.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
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


@pytest.fixture(scope="session")
def helm(devcluster: cluster.Layout) -> Callable[..., subprocess.CompletedProcess[str]]:
    binary = build.ensure_binaries() / "helm"

    def run(*args: str, check: bool = True, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([str(binary), f"--kubeconfig={devcluster.kubeconfig}", *args], capture_output=True,
                              text=True, timeout=timeout_s)
        if check and done.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed:\n{done.stderr}")
        return done

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
CHART = REPO / "charts" / "tailor"


KUBE_VERSION = build.kubernetes_version()


@pytest.fixture(scope="session")
def crd(api: client.ApiClient, kubectl: Callable[..., Any]) -> None:
    kubectl("apply", "--server-side", "-f", str(REPO / "crds" / "compressedmodel.yaml"))
    kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{model.PLURAL}.{model.GROUP}")
    # Discovery of a new CRD settles just after Established; wait until creates are served.
    wait_for("the CRD to be served", lambda: _served(api))


def _served(api: client.ApiClient) -> bool:
    try:
        client.CustomObjectsApi(api).list_cluster_custom_object(model.GROUP, model.API_VERSION, model.PLURAL)
    except ApiException:
        return False
    return True


SIMULATED_RESULTS = "devcluster.tailor.dev/"  # the pod annotations kwok finishes stage Jobs with
# The devcluster chart values' tenancy block (which allows them), given to an operator run from this checkout as the
# chart gives it to its own
TENANCY = json.dumps(yaml.safe_load((REPO / "devcluster" / "chart-values.yaml").read_text())["tenancy"])


class OperatorProcess:
    """`tailor operator` as a subprocess watching one namespace, as it runs in a cluster; killable."""

    def __init__(self, namespace: str, log: Path, kubeconfig: Path) -> None:
        import socket

        self.namespace, self.log, self.kubeconfig = namespace, log, kubeconfig
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

        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tailor.cli.main", "operator", "--namespace", self.namespace,
                 "--metrics-port", str(self.metrics_port), "--liveness-port", str(self.liveness_port),
                 "--bind", "127.0.0.1", "--tenancy", TENANCY],
                env=env, stdout=out, stderr=subprocess.STDOUT)
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


def service_account_kubeconfig(api: client.ApiClient, layout: cluster.Layout, namespace: str, account: str,
                               path: Path) -> Path:
    """A kubeconfig that authenticates as a ServiceAccount (a token from the TokenRequest API)."""
    import yaml

    token = client.CoreV1Api(api).create_namespaced_service_account_token(
        account, namespace, {"spec": {"expirationSeconds": 3600}}).status.token
    admin = yaml.safe_load(layout.kubeconfig.read_text())
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "clusters": admin["clusters"],
        "users": [{"name": account, "user": {"token": token}}],
        "contexts": [{"name": account, "context": {"cluster": admin["clusters"][0]["name"], "user": account,
                                                   "namespace": namespace}}],
        "current-context": account}))
    return path


@pytest.fixture
def chart_rbac(api: client.ApiClient, helm: Callable[..., Any], kubectl: Callable[..., Any],
               namespace: str) -> Iterator[str]:
    """The chart's ServiceAccount and RBAC for an operator watching the test's namespace (release = namespace,
    so cluster-scoped names do not collide); the ServiceAccount's name."""
    rendered = helm("template", namespace, str(CHART), "-n", namespace, "--kube-version", KUBE_VERSION,
                    "--show-only", "templates/serviceaccount.yaml", "--show-only", "templates/rbac.yaml").stdout
    kubectl("apply", "-f", "-", stdin=rendered)
    yield f"{namespace}-tailor"
    kubectl("delete", "--ignore-not-found", "-f", "-", stdin=rendered)


@pytest.fixture
def operator(devcluster: cluster.Layout, crd: None, api: client.ApiClient, namespace: str, chart_rbac: str,
             tmp_path: Path) -> Iterator[OperatorProcess]:
    """The operator for the test's namespace, authenticated as the chart's ServiceAccount (so with exactly the
    chart's permissions); afterwards its CompressedModels are deleted through it (their finalizers need it),
    so the namespace can go."""
    kubeconfig = service_account_kubeconfig(api, devcluster, namespace, chart_rbac, tmp_path / "kubeconfig")
    running = OperatorProcess(namespace, tmp_path / "operator.log", kubeconfig).start()
    yield running
    if running.process is None or running.process.poll() is not None:
        running.start()
    delete_models(api, namespace)
    running.stop()


class InstalledOperator:
    """The chart's operator Deployment on the executor node (`local-0`), which runs it as a process of this
    checkout under the chart's ServiceAccount token."""

    def __init__(self, layout: cluster.Layout, namespace: str, release: str) -> None:
        self.layout, self.namespace, self.release = layout, namespace, release

    def log_tail(self, lines: int = 40) -> str:
        pods = self.layout.root / "executor" / "pods"
        logs = sorted(pods.glob(f"{self.namespace}_{self.release}-tailor-*/operator/output.log"),
                      key=lambda p: p.stat().st_mtime)
        return "\n".join(logs[-1].read_text(errors="replace").splitlines()[-lines:]) if logs else "(no log)"


def delete_models(api: client.ApiClient, namespace: str) -> None:
    """Delete a namespace's CompressedModels and wait until their finalizers have run."""
    objects = client.CustomObjectsApi(api)
    for item in objects.list_namespaced_custom_object(model.GROUP, model.API_VERSION, namespace, model.PLURAL)["items"]:
        objects.delete_namespaced_custom_object(model.GROUP, model.API_VERSION, namespace, model.PLURAL,
                                                item["metadata"]["name"])
    wait_for("the CompressedModels to be deleted", lambda: not objects.list_namespaced_custom_object(
        model.GROUP, model.API_VERSION, namespace, model.PLURAL)["items"], timeout_s=60)


DEVCLUSTER_VALUES = REPO / "devcluster" / "chart-values.yaml"


@pytest.fixture
def installed_operator(devcluster: cluster.Layout, crd: None, api: client.ApiClient, helm: Callable[..., Any],
                       namespace: str) -> Iterator[InstalledOperator]:
    """The chart installed into the test's namespace (watching it), its operator pod Ready on local-0."""
    helm("install", namespace, str(CHART), "-n", namespace, "-f", str(DEVCLUSTER_VALUES), "--wait",
         "--timeout", "120s")
    yield InstalledOperator(devcluster, namespace, namespace)
    delete_models(api, namespace)
    helm("uninstall", namespace, "-n", namespace, "--wait")
