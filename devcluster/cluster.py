"""Start, stop and inspect the devcluster: etcd, kube-apiserver, controller manager, scheduler, kwok, the
development executor (`executor.py`), unless turned off, the metrics pipeline (`metrics.py`: Prometheus and
prometheus-adapter) and, when asked for, Kueue (`kueue.py`).

Each component runs as its own process in its own session, with its pid and log under the state
folder, so `down` (or a later session) finds and stops exactly what `up` started.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tailor.devcluster import kueue, metrics
from tailor.devcluster.build import ensure_binaries, ensure_kueue_binaries, ensure_metrics_binaries
from tailor.devcluster.log import log
from tailor.devcluster.nodes import DEFAULT_POOLS_FILE, KWOK_ANNOTATION, load_pools, node_manifests
from tailor.devcluster.pki import CLIENTS, FRONT_PROXY_CLIENT, Pki, ensure_pki

KWOK_STAGES_FILE = Path(__file__).parent / "kwok-stages.yaml"
SERVICE_CIDR = "10.96.0.0/16"
POD_CIDR = "10.244.0.0/16"
START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Ports:
    """Loopback ports, away from the usual ones so a real local cluster can run beside it."""

    etcd_client: int = 23790
    etcd_peer: int = 23800
    apiserver: int = 16443
    kwok: int = 10347
    prometheus: int = 19090
    prometheus_adapter: int = 16445
    kueue_health: int = 18081
    kueue_webhook: int = 19443


def state_dir() -> Path:
    """$TAILOR_DEVCLUSTER_DIR, else ~/.local/state/tailor/devcluster."""
    default = Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local" / "state")) / "tailor" / "devcluster"
    return Path(os.environ.get("TAILOR_DEVCLUSTER_DIR", default))


@dataclass(frozen=True)
class Layout:
    """Every path the devcluster reads or writes."""

    root: Path

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def etcd_data(self) -> Path:
        return self.root / "etcd"

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig handed to users and tests."""
        return self.root / "kubeconfig"

    def component_kubeconfig(self, stem: str) -> Path:
        return self.root / f"{stem}.kubeconfig"

    def pid_file(self, component: str) -> Path:
        return self.run / f"{component}.pid"

    def log_file(self, component: str) -> Path:
        return self.logs / f"{component}.log"

    @property
    def audit_log(self) -> Path:
        """Every API request, one JSON line each, when `up(audit=True)` started the API server."""
        return self.logs / "audit.log"


# Start order; `down` stops in reverse. The metrics components come last, and only with `up(metrics=True)`;
# Kueue only with `up(queueing=True)`.
METRICS_COMPONENTS = ("prometheus", "prometheus-adapter")
OPTIONAL_COMPONENTS = (*METRICS_COMPONENTS, "kueue")
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "executor",
              *METRICS_COMPONENTS, "kueue")


AUDIT_POLICY = {"apiVersion": "audit.k8s.io/v1", "kind": "Policy",
                "omitStages": ["RequestReceived", "ResponseStarted"],  # one entry per request
                "rules": [{"level": "Metadata"}]}


def _component_argv(name: str, bin_dir: Path, layout: Layout, pki: Pki, ports: Ports,
                    audit: bool = False) -> list[str]:
    binary = str(bin_dir / name)
    if name == "prometheus":
        return metrics.prometheus_argv(bin_dir / name, layout.root, ports.prometheus)
    if name == "prometheus-adapter":
        return metrics.adapter_argv(bin_dir / name, layout.root, pki, layout.component_kubeconfig(name),
                                    ports.prometheus_adapter, ports.prometheus)
    if name == "kueue":  # as the cluster's admin: Kueue's release binds it a ClusterRole of the same reach
        return kueue.argv(bin_dir / name, kueue.write_config(layout.root, ports.kueue_health, ports.kueue_webhook),
                          layout.kubeconfig)
    if name == "etcd":
        return [binary, f"--data-dir={layout.etcd_data}",
                f"--listen-client-url=http://127.0.0.1:{ports.etcd_client}",
                f"--listen-peer-url=http://127.0.0.1:{ports.etcd_peer}"]
    if name == "kube-apiserver":
        return [binary,
                f"--etcd-servers=http://127.0.0.1:{ports.etcd_client}",
                "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={ports.apiserver}",
                f"--tls-cert-file={pki.serving_cert}", f"--tls-private-key-file={pki.serving_key}",
                f"--client-ca-file={pki.ca_cert}",
                "--authorization-mode=Node,RBAC",
                # `kubectl logs` reaches a node at its InternalIP (loopback on every devcluster node: the executor's
                # kubelet endpoint, nothing on kwok's), verifying the executor's certificate
                "--kubelet-preferred-address-types=InternalIP", f"--kubelet-certificate-authority={pki.ca_cert}",
                # The defaults (NamespaceLifecycle, LimitRanger, ServiceAccount, DefaultStorageClass,
                # ResourceQuota, validating/mutating webhooks and policies, ...) plus what kubeadm adds.
                "--enable-admission-plugins=NodeRestriction",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki.service_account_pub}",
                f"--service-account-signing-key-file={pki.service_account_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                # The only address is loopback, which may not back the `kubernetes` Service's endpoints.
                "--endpoint-reconciler-type=none",
                "--allow-privileged=true", "--profiling=false",
                # the aggregation layer (kubeadm's flags): extension API servers trust the front-proxy CA
                f"--requestheader-client-ca-file={pki.front_proxy_ca_cert}",
                f"--requestheader-allowed-names={FRONT_PROXY_CLIENT}",
                "--requestheader-username-headers=X-Remote-User", "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={pki.client_cert(FRONT_PROXY_CLIENT)}",
                f"--proxy-client-key-file={pki.client_key(FRONT_PROXY_CLIENT)}",
                *([f"--audit-policy-file={layout.root / 'audit-policy.yaml'}", f"--audit-log-path={layout.audit_log}",
                   "--audit-log-format=json", "--audit-log-maxsize=0"] if audit else [])]
    if name == "kube-controller-manager":
        return [binary, f"--kubeconfig={layout.component_kubeconfig('controller-manager')}",
                "--leader-elect=false", "--secure-port=0", "--controllers=*",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={pki.service_account_key}",
                f"--root-ca-file={pki.ca_cert}",
                f"--cluster-signing-cert-file={pki.ca_cert}", f"--cluster-signing-key-file={pki.ca_key}",
                f"--cluster-cidr={POD_CIDR}", f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--cluster-name=tailor-devcluster", "--profiling=false",
                # the client rate limits of a large cluster, not the defaults (20/s, burst 30): hundreds of
                # simulated nodes and Jobs would otherwise queue behind the Job controller's own throttle
                "--kube-api-qps=200", "--kube-api-burst=400"]
    if name == "kube-scheduler":
        return [binary, f"--kubeconfig={layout.component_kubeconfig('scheduler')}",
                "--leader-elect=false", "--secure-port=0", "--profiling=false",
                "--kube-api-qps=200", "--kube-api-burst=400"]
    if name == "kwok":
        return [binary, f"--kubeconfig={layout.component_kubeconfig('kwok')}", f"--config={KWOK_STAGES_FILE}",
                "--manage-all-nodes=false", f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
                "--cidr=10.244.0.1/16", "--node-ip=127.0.0.1", f"--server-address=127.0.0.1:{ports.kwok}"]
    if name == "executor":  # this checkout's Python: pods on the executor node run in its environment
        return [sys.executable, "-m", "tailor.devcluster.executor", f"--kubeconfig={layout.kubeconfig}",
                f"--state={layout.root / 'executor'}", f"--scrape={metrics.scrape_folder(layout.root)}",
                f"--kubelet-cert={pki.kubelet_serving_cert}", f"--kubelet-key={pki.kubelet_serving_key}"]
    raise ValueError(f"unknown component {name!r}")


def _write_kubeconfig(path: Path, server: str, pki: Pki, stem: str, user: str) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "tailor-devcluster",
                      "cluster": {"server": server, "certificate-authority": str(pki.ca_cert)}}],
        "users": [{"name": user, "user": {"client-certificate": str(pki.client_cert(stem)),
                                          "client-key": str(pki.client_key(stem))}}],
        "contexts": [{"name": "tailor-devcluster", "context": {"cluster": "tailor-devcluster", "user": user}}],
        "current-context": "tailor-devcluster",
    }
    temporary = path.with_suffix(".tmp")
    temporary.write_text(yaml.safe_dump(config, sort_keys=False))
    temporary.replace(path)


def _pid_alive(pid: int, component: str) -> bool:
    """True when `pid` runs and is still the component we started (pids get reused): its binary, or for the
    executor, Python running `tailor.devcluster.executor`."""
    try:
        argv = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
    except OSError:
        return False
    return Path(argv[0]).name == component or f"tailor.devcluster.{component}" in argv


def running_pid(layout: Layout, component: str) -> int | None:
    try:
        pid = int(layout.pid_file(component).read_text())
    except (OSError, ValueError):
        return None
    return pid if _pid_alive(pid, component) else None


def _log_tail(layout: Layout, component: str, lines: int = 30) -> str:
    try:
        return "\n".join(layout.log_file(component).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# Components started by this process, by pid: kept so they are reaped when stopped from here
# (a long-lived caller such as a test session would otherwise collect zombies).
_children: dict[int, subprocess.Popen[bytes]] = {}


def _start(component: str, argv: list[str], layout: Layout) -> subprocess.Popen[bytes]:
    with layout.log_file(component).open("ab") as log_handle:
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log_handle, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    _children[process.pid] = process
    layout.pid_file(component).write_text(str(process.pid))
    return process


def _wait_until(what: str, check: Callable[[], bool], process: subprocess.Popen[bytes], layout: Layout,
                component: str, timeout_s: float = START_TIMEOUT_S) -> None:
    """Poll `check` until it holds; fail with the end of the component's log if it exits or times out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{component} exited with code {process.returncode} while waiting for {what}; "
                               f"the end of {layout.log_file(component)}:\n{_log_tail(layout, component)}")
        if check():
            return
        time.sleep(0.5)
    raise RuntimeError(f"timed out after {timeout_s:.0f}s waiting for {what}; the end of "
                       f"{layout.log_file(component)}:\n{_log_tail(layout, component)}")


def _http_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=3, context=context) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _admin_tls(pki: Pki) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.ca_cert))
    context.load_cert_chain(str(pki.client_cert("admin")), str(pki.client_key("admin")))
    return context


def tool(name: str, bin_dir: Path, layout: Layout, *args: str, stdin: str | None = None) -> str:
    """Run the devcluster's kubectl or helm against it as admin; its output, or an error with its stderr."""
    result = subprocess.run([str(bin_dir / name), f"--kubeconfig={layout.kubeconfig}", *args],
                            input=stdin, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{name} {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


def up(pools_file: Path = DEFAULT_POOLS_FILE, ports: Ports = Ports(), audit: bool = False,
       metrics_pipeline: bool = True, queueing: bool = False) -> Layout:
    """Bring the devcluster up (idempotent: components already running are kept); `audit` makes a newly
    started API server log every request (`Layout.audit_log`), which benchmarks count by user agent;
    `metrics_pipeline` starts Prometheus and prometheus-adapter (built on first use) and registers the custom
    metrics API; `queueing` starts Kueue (built on first use) with its CRDs. An `up` without `queueing` leaves a
    running Kueue alone."""
    layout = Layout(state_dir())
    pools = load_pools(pools_file)
    bin_dir = ensure_binaries()
    binaries = dict.fromkeys(COMPONENTS, bin_dir)
    if metrics_pipeline:
        binaries.update(dict.fromkeys(METRICS_COMPONENTS, ensure_metrics_binaries()))
    else:
        for name in METRICS_COMPONENTS:
            del binaries[name]
    if queueing:
        binaries["kueue"] = ensure_kueue_binaries()
    else:
        del binaries["kueue"]
    for folder in (layout.root, layout.run, layout.logs, layout.etcd_data):
        folder.mkdir(parents=True, exist_ok=True)
    pki = ensure_pki(layout.pki)
    server = f"https://127.0.0.1:{ports.apiserver}"
    _write_kubeconfig(layout.kubeconfig, server, pki, "admin", "kubernetes-admin")
    for client in CLIENTS:
        if client.file_stem != "admin":
            _write_kubeconfig(layout.component_kubeconfig(client.file_stem), server, pki, client.file_stem,
                              client.user)
    metrics.write_configs(layout.root)

    tls = _admin_tls(pki)
    custom_metrics = f"{server}/apis/{metrics.API_GROUP}/{metrics.API_VERSION}"
    readiness: dict[str, tuple[str, Callable[[], bool]]] = {
        "etcd": ("etcd health", lambda: _http_ok(f"http://127.0.0.1:{ports.etcd_client}/health")),
        "kube-apiserver": ("the API server's /readyz", lambda: _http_ok(f"{server}/readyz", tls)),
        "kube-controller-manager": ("the default ServiceAccount",
                                    lambda: _has_default_service_account(bin_dir, layout)),
        "prometheus": ("Prometheus's /-/ready", lambda: _http_ok(f"http://127.0.0.1:{ports.prometheus}/-/ready")),
        "prometheus-adapter": (f"the API server serving {custom_metrics}", lambda: _http_ok(custom_metrics, tls)),
        "kueue": ("Kueue's certificate and /readyz", lambda: _kueue_ready(bin_dir, layout, ports)),
    }
    started: list[str] = []
    try:
        for component, folder in binaries.items():
            if component == "prometheus-adapter":  # registered before it starts: ready means the API serves it
                tool("kubectl", bin_dir, layout, "apply", "--server-side", "--force-conflicts", "-f", "-",
                     stdin=yaml.safe_dump_all(metrics.manifests(pki, ports.prometheus_adapter)))
            if component == "kueue":  # its certificate manager writes to the CRDs: the API server must be done
                crds = kueue.crds(folder / "crds")
                tool("kubectl", bin_dir, layout, "apply", "--server-side", "--force-conflicts", "-f", "-",
                     stdin=yaml.safe_dump_all([*crds, *kueue.manifests()]))
                tool("kubectl", bin_dir, layout, "wait", "--for=condition=Established", "--timeout=60s",
                     *[f"crd/{crd['metadata']['name']}" for crd in crds])
            if running_pid(layout, component) is not None:
                log(f"{component} already running")
                continue
            if audit:
                (layout.root / "audit-policy.yaml").write_text(yaml.safe_dump(AUDIT_POLICY))
            process = _start(component, _component_argv(component, folder, layout, pki, ports, audit), layout)
            started.append(component)
            log(f"started {component} (pid {process.pid}, log {layout.log_file(component)})")
            if component in readiness:
                what, check = readiness[component]
                _wait_until(what, check, process, layout, component)
                log(f"{component} ready")
        if not metrics_pipeline:  # one an earlier `up` started goes, with its APIService: an aggregated API that
            # nobody serves makes discovery fail, and with it every namespace deletion
            _stop(layout, [name for name in reversed(METRICS_COMPONENTS) if running_pid(layout, name) is not None])
            tool("kubectl", bin_dir, layout, "delete", "--ignore-not-found", "apiservice",
                 f"{metrics.API_VERSION}.{metrics.API_GROUP}")

        nodes = node_manifests(pools)
        tool("kubectl", bin_dir, layout, "apply", "--server-side", "--force-conflicts", "-f", "-",
                 stdin=yaml.safe_dump_all(nodes))
        log(f"applied {len(nodes)} nodes from {pools_file}; waiting for kwok to make them Ready")
        tool("kubectl", bin_dir, layout, "wait", "--for=condition=Ready", "--timeout=120s",
                 *[f"node/{node['metadata']['name']}" for node in nodes])
    except BaseException:
        _stop(layout, [name for name in reversed(COMPONENTS) if name in started])
        if "prometheus-adapter" in started:  # registered, now served by nobody: it would stall discovery
            with contextlib.suppress(RuntimeError):
                tool("kubectl", bin_dir, layout, "delete", "--ignore-not-found", "apiservice",
                     f"{metrics.API_VERSION}.{metrics.API_GROUP}")
        raise
    log(f"devcluster up: export KUBECONFIG={layout.kubeconfig}")
    return layout


def _kueue_ready(bin_dir: Path, layout: Layout, ports: Ports) -> bool:
    """Kueue's certificate, once in its Secret, mounted for it (`kueue.mount_certificate`); then its /readyz."""
    secret = json.loads(tool("kubectl", bin_dir, layout, "get", "secret", "--namespace", kueue.NAMESPACE,
                             kueue.WEBHOOK_SECRET, "--output=json"))
    return kueue.mount_certificate(secret, layout.root) and _http_ok(f"http://127.0.0.1:{ports.kueue_health}/readyz")


def _has_default_service_account(bin_dir: Path, layout: Layout) -> bool:
    try:
        tool("kubectl", bin_dir, layout, "get", "serviceaccount", "default", "--namespace=default")
    except RuntimeError:
        return False
    return True


def _stop(layout: Layout, components: list[str]) -> None:
    """Stop `components` in the order given: SIGTERM to each process group, SIGKILL after 20 s."""
    for component in components:
        pid = running_pid(layout, component)
        if pid is not None:
            os.killpg(pid, signal.SIGTERM)
            deadline = time.monotonic() + 20
            while running_pid(layout, component) is not None and time.monotonic() < deadline:
                time.sleep(0.2)
            if running_pid(layout, component) is not None:
                os.killpg(pid, signal.SIGKILL)
                log(f"{component} did not stop within 20s: killed")
            if (child := _children.pop(pid, None)) is not None:
                child.wait(timeout=20)
            log(f"stopped {component}")
        layout.pid_file(component).unlink(missing_ok=True)


def down(purge: bool = False) -> None:
    """Stop every component `up` started, newest first; `purge` also deletes the cluster's data."""
    layout = Layout(state_dir())
    _stop(layout, list(reversed(COMPONENTS)))
    if purge:
        shutil.rmtree(layout.root, ignore_errors=True)
        log(f"deleted {layout.root}")


def status() -> dict[str, Any]:
    """Which components run, and what the API server says about itself and its nodes."""
    layout = Layout(state_dir())
    report: dict[str, Any] = {
        "stateDir": str(layout.root),
        "kubeconfig": str(layout.kubeconfig),
        # a metrics component is expected where `up` started it (its pid file stays until `down`)
        "components": {name: {"running": (pid := running_pid(layout, name)) is not None, "pid": pid,
                              "expected": name not in OPTIONAL_COMPONENTS or layout.pid_file(name).exists()}
                       for name in COMPONENTS},
    }
    if report["components"]["kube-apiserver"]["running"]:
        bin_dir = ensure_binaries()
        version = yaml.safe_load(tool("kubectl", bin_dir, layout, "version", "-o", "yaml"))
        report["serverVersion"] = version.get("serverVersion", {}).get("gitVersion")
        nodes = yaml.safe_load(tool("kubectl", bin_dir, layout, "get", "nodes", "-o", "yaml"))["items"]
        report["nodes"] = {
            "total": len(nodes),
            "ready": sum(1 for node in nodes for c in node["status"].get("conditions", [])
                         if c["type"] == "Ready" and c["status"] == "True"),
        }
    return report
