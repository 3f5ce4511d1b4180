"""The devcluster's development executor: a stand-in kubelet for the nodes labelled `tailor.dev/executor=true`,
and a stand-in volume provisioner. Not for production: it exists so the operator's Jobs run the real compressor
and its Triton pods run the real tritonserver on this machine.

- **Node**: keeps the executor nodes Ready (status conditions and heartbeat, as a kubelet does).
- **Pods** bound to an executor node run as local processes: each container's command and args, in a folder of
  their own, with the spec's env and only what `pod_env` adds (this checkout's Python folder first on PATH, so
  `tailor`, `torchrun` and `python` are this checkout's; a HOME and TMPDIR of the pod's own): nothing of the
  executor's own environment (its KUBECONFIG, tokens, cloud credentials) reaches a pod. The image is ignored.
  Paths under a volume's mountPath in the command, args, env and ConfigMap files are rewritten to local folders:
  a PersistentVolumeClaim to its volume's hostPath, a ConfigMap to its files written out, `/dev/termination-log`
  to a file whose text becomes the termination message.
  `tritonserver` runs the server bundled in nvidia-pytriton (as `tailor serve` does). Container ports get free
  local ports; `--<name>-port=<containerPort>` args are rewritten to them and the pod is annotated
  `devcluster.tailor.dev/ports: {"http": 31234, ...}`. The servers the executor knows listen on 127.0.0.1 only
  (`LOOPBACK_ARGS`); a container beside them reaches them on the pod's loopback as on a real pod, its
  `--<name>-port=<containerPort>` args naming their ports (`tailor openai --triton-port=8000`). Readiness
  comes from the container's httpGet readiness probe, with a kubelet's thresholds (`Readiness`). Phase,
  readiness, restarts and exit codes go back through the pod's status.
- **Processes**: each container runs under a shim (`shim.py`), the leader of a process group of its own, which
  stops the container (SIGTERM to its main process, SIGKILL to the whole tree after the pod's grace period), also
  when the executor dies, and
  leaves the exit code in a file. A pod's ports, processes and exit codes are kept in `pod.json` in its folder,
  so that a restarted executor resumes a pod instead of starting it again: a container still running is
  adopted, one that has ended is reported as ended (and restarted only as its restartPolicy says), and the
  processes of a pod that is gone are killed. Stopping the executor stops every pod.
- **Services** (`services.py`): each Service port gets a loopback listener that spreads connections over the
  Service's ready pods that run here, as kube-proxy does; its port is announced like a pod's, on the Service. A
  pod being deleted leaves every Service before its processes are sent SIGTERM.
- **Scraping** (`metrics.py`): the pods that ask to be scraped (`prometheus.io/scrape`, `prometheus.io/port`)
  are written to Prometheus's file-discovery file at their loopback ports, with their namespace and name.
- **Volumes**: a claim that is Pending with no volume gets a hostPath PersistentVolume under the state folder,
  pre-bound to it, so the PV controller binds them. kwok's pods need bound claims to be scheduled too.
- **API access**: the projected volume the ServiceAccount admission plugin adds (or one in the manifest) is
  written out as a kubelet would: a token from the TokenRequest API for the pod's ServiceAccount, bound to
  the pod, renewed at 80% of its lifetime and readable by this user only (0600), `ca.crt` from the
  `kube-root-ca.crt` ConfigMap and the namespace from the downward API. The process gets
  `KUBERNETES_SERVICE_HOST`/`PORT` (this API server) and, since nothing can be mounted at the standard path,
  `TAILOR_SERVICE_ACCOUNT_DIR` naming the folder; so the operator's own pod runs with exactly its
  ServiceAccount's permissions.
- **Native sidecars** (init containers with restartPolicy Always) start first and run beside the containers,
  restarted whenever they exit, and are stopped once the other containers have ended for good (a Job's pod
  completes); their status goes to initContainerStatuses.
- **Container logs** (`kubelet.py`): `kubectl logs` (the API server's request to the node's kubelet endpoint,
  which the node's status announces) gets a container's output, with tailLines, limitBytes and follow.
- Not implemented: security contexts (processes run as this user), resource limits, init containers that run
  to completion, exec
  and tcp probes, liveness and startup probes, lifecycle hooks other than a preStop sleep, multi-node torchrun
  (an Indexed Job's ranks would all run here).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from tailor.devcluster import kubelet, metrics, services, shim
from tailor.devcluster.log import log
from tailor.devcluster.nodes import EXECUTOR_LABEL

PORTS_ANNOTATION = "devcluster.tailor.dev/ports"
TERMINATION_LOG = "/dev/termination-log"
SERVICE_ACCOUNT_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
TOKEN_RENEW_SHARE = 0.8  # a kubelet renews a projected token at 80% of its lifetime
MESSAGE_BYTES = 4096
HEARTBEAT_S = 10.0
POLL_S = 1.0
RESTART_DELAY_S = 5.0
# a probe's fields when its spec leaves them out, as Kubernetes defaults them
PROBE_DEFAULTS = {"periodSeconds": 10, "timeoutSeconds": 1, "successThreshold": 1, "failureThreshold": 3}
GRACE_S = 30.0  # a pod's terminationGracePeriodSeconds when its spec has none
STOP_ALL_S = 12.0  # stopping the executor stops every pod within this (`cluster.down` kills it after 20 s)
KILL_WAIT_S = 5.0  # how long a SIGKILLed process tree may take to go
RECORD = "pod.json"  # in a pod's folder: its ports and its containers' processes and exit codes

# The environment of a pod's process besides its spec's env (which overrides it): what a container image and a
# kubelet provide, never the executor's own environment.
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"  # an image's usual PATH (sh, ...)
POD_ENV = {
    "LANG": "C.UTF-8",  # UTF-8 text, as images set it
    "PYTHONUNBUFFERED": "1",  # Python's output reaches the pod's log as it is written
}
# PATH: this checkout's Python folder (`tailor`, `torchrun`, `python`), then SYSTEM_PATH.
# HOME, TMPDIR: folders of the pod's own (HOME_DIR, TMP_DIR in its folder), so that caches and scratch files are
#   neither the host user's nor shared between pods.
# HOSTNAME: the pod's name, as a container's hostname.
# KUBERNETES_SERVICE_HOST/PORT: this API server, as a kubelet sets them for every container.
# TAILOR_SERVICE_ACCOUNT_DIR: the projected ServiceAccount volume's folder, with such a volume: nothing can be
#   mounted at the standard path here.
# For `tritonserver` only, what its Python backend's stub needs (`server.environment`): PATH starts with the
#   engine's environment (vLLM's for `vllm` models), LD_LIBRARY_PATH finds libpython, and vLLM's CPU settings.
# A model cache is not among them: the stage Jobs name theirs (TAILOR_CACHE_DIR on their artifacts claim).
HOME_DIR, TMP_DIR = ".home", ".tmp"  # a container's name has no dot: no container folder is named so
# From the host's environment only where this machine keeps the public certificates it trusts, as an image bakes
# in its trust store: a stage downloads its text from the package index (through a TLS-inspecting proxy where
# this machine has one); and the caps on what torch and oneDNN dispatch (`ATEN_CPU_CAPABILITY=avx2`,
# `ONEDNN_MAX_CPU_ISA=AVX2` make a CPU with BF16 math act as one without), since the node's labels follow them
# (`nodes.host_cpu_flags`) and its pods must compute as those labels say. Never a credential: no KUBECONFIG,
# token, AWS_* or HF_* variable reaches a pod.
HOST_ENV = ("SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PIP_CERT",
            "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")

# The servers the executor starts, by the start of their argv, and the arguments that bind every listener of
# theirs to loopback (given ones are replaced): tritonserver listens on all interfaces by default (HTTP, gRPC,
# and metrics on the HTTP address), and `tailor operator` serves metrics and liveness on --bind 0.0.0.0.
LOOPBACK = "127.0.0.1"
LOOPBACK_ARGS: dict[tuple[str, ...], tuple[str, ...]] = {
    # its SageMaker and Vertex AI endpoints have no address option: they stay off
    ("tritonserver",): (f"--http-address={LOOPBACK}", f"--grpc-address={LOOPBACK}",
                        f"--metrics-address={LOOPBACK}", "--allow-sagemaker=false", "--allow-vertex-ai=false"),
    ("tailor", "operator"): (f"--bind={LOOPBACK}",),
    ("tailor", "openai"): (f"--bind={LOOPBACK}",),
}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


PORT_FLOOR = 24000  # above the devcluster's own fixed ports (`cluster.Ports`)
_handed_out: set[int] = set()


def _ephemeral_floor() -> int:
    """The lowest port the kernel gives outgoing connections as their source port."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free TCP port on loopback for a server to bind later, one this process has not handed out before.

    It lies below the kernel's ephemeral range: a port from `bind(0)` is one the kernel may give the next outgoing
    connection as its source port before the server binds it (the server then fails with EADDRINUSE), which a busy
    test suite made happen."""
    ceiling = max(_ephemeral_floor(), PORT_FLOOR + 1000)  # a range set unusually low: share it
    candidates = [port for port in range(PORT_FLOOR, ceiling) if port not in _handed_out]
    random.shuffle(candidates)
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port between {PORT_FLOOR} and {ceiling}")


@dataclass
class Readiness:
    """A container's readiness as a kubelet keeps it from its probe's results: not ready until `successThreshold`
    successes in a row, then ready until `failureThreshold` failures in a row (one slow answer from a busy server
    does not take it out of its Services)."""

    ready: bool = False
    streak: int = 0  # results in a row that disagree with `ready`

    def observe(self, success: bool, probe: Mapping[str, Any]) -> None:
        if success == self.ready:
            self.streak = 0
            return
        self.streak += 1
        if self.streak >= _probe_field(probe, "successThreshold" if success else "failureThreshold"):
            self.ready, self.streak = success, 0

    def reset(self) -> None:
        """The container started or ended: not ready until probed again."""
        self.ready, self.streak = False, 0


@dataclass
class Container:
    spec: dict[str, Any]
    folder: Path
    sidecar: bool = False  # an init container with restartPolicy Always: runs beside the others, stopped after them
    process: subprocess.Popen[bytes] | None = None  # the shim, when this executor started it
    pid: int | None = None  # the shim's (started by this executor or adopted from a record)
    pid_start: int | None = None  # when it started, to tell it from a later process given the same pid
    exit_code: int | None = None
    restarts: int = 0
    readiness: Readiness = field(default_factory=Readiness)
    started_at: str | None = None
    finished_at: str | None = None
    exited_monotonic: float = 0.0
    probed_monotonic: float = 0.0

    @property
    def message_file(self) -> Path:
        return self.folder / "termination-log"

    @property
    def log_file(self) -> Path:
        return self.folder / "output.log"

    @property
    def exit_file(self) -> Path:
        return self.folder / "exit-code"

    def running(self) -> bool:
        """Whether its shim still runs (reaped when this executor started it)."""
        if self.process is not None and self.process.poll() is not None:
            return False
        return self.pid is not None and shim.start_time(self.pid) == self.pid_start

    def last_exit_code(self) -> int:
        """How its last run ended: the code the shim wrote, else 128 + the signal that ended the shim, else 137
        (an end nobody saw: Kubernetes reports a container whose status is lost so)."""
        try:
            return int(self.exit_file.read_text())
        except (OSError, ValueError):
            pass
        if self.process is not None and self.process.returncode is not None:
            return shim.exit_code(self.process.returncode)
        return 128 + signal.SIGKILL


@dataclass
class Token:
    """A projected ServiceAccount token file and when to renew it."""

    file: Path
    service_account: str
    audience: str | None
    expiration_s: int
    renew_at: float = 0.0


@dataclass
class Draining:
    """A pod being deleted: when its containers get SIGTERM (after its preStop sleep), and when its grace period
    ends."""

    signal_at: float
    deadline: float
    signalled: bool = False


@dataclass
class LocalPod:
    uid: str
    namespace: str
    name: str
    folder: Path
    restart_policy: str
    grace_s: float = GRACE_S
    containers: list[Container] = field(default_factory=list)
    ports: dict[str, int] = field(default_factory=dict)  # port name (or number) -> local port
    paths: dict[str, str] = field(default_factory=dict)  # mountPath -> local folder
    tokens: list[Token] = field(default_factory=list)
    reported: str = ""  # the last status sent, to skip identical writes

    @property
    def record(self) -> Path:
        return self.folder / RECORD

    def save(self) -> None:
        """Its ports and its containers' processes and exit codes, for an executor that restarts."""
        _write_file(self.record, json.dumps({
            "uid": self.uid, "ports": self.ports,
            "containers": [{"name": c.spec["name"], "pid": c.pid, "pidStart": c.pid_start, "restarts": c.restarts,
                            "startedAt": c.started_at, "finishedAt": c.finished_at, "exitCode": c.exit_code}
                           for c in self.containers]}, indent=1))

    def resume(self, record: dict[str, Any]) -> None:
        """Take over the containers a previous executor recorded: one whose shim still runs is adopted, one that
        ended while no executor watched gets the exit code its shim left."""
        saved = {c["name"]: c for c in record["containers"]}
        for container in self.containers:
            entry = saved[container.spec["name"]]
            container.pid, container.pid_start, container.restarts = entry["pid"], entry["pidStart"], entry["restarts"]
            container.started_at, container.finished_at = entry["startedAt"], entry["finishedAt"]
            container.exit_code = entry["exitCode"]
            if container.exit_code is None and not container.running():
                container.exit_code, container.finished_at = container.last_exit_code(), _now()
                container.exited_monotonic = time.monotonic()


class Executor:
    def __init__(self, api: client.ApiClient, state: Path, scrape: Path | None = None) -> None:
        self.core = client.CoreV1Api(api)
        server = urllib.parse.urlsplit(api.configuration.host)
        self.api_env = {"KUBERNETES_SERVICE_HOST": server.hostname or "127.0.0.1",
                        "KUBERNETES_SERVICE_PORT": str(server.port or 443)}
        self.state = state
        self.pods: dict[str, LocalPod] = {}
        self.recovered = _records(state / "pods")  # uid -> the folder of a pod a previous executor ran
        self.last_heartbeat = 0.0
        self.scrape_file = None if scrape is None else scrape / "pods.json"
        self.proxy = services.ServiceProxy()
        self.terminating: dict[str, Draining] = {}  # by uid: the pods being deleted
        self.kubelet_port = 0  # the container-log endpoint's, announced in the nodes' status once it serves

    def container_log(self, namespace: str, pod: str, container: str) -> tuple[Path, Any] | None:
        """A container's log file and whether it runs, for the kubelet endpoint (called from its threads)."""
        for local in list(self.pods.values()):
            if (local.namespace, local.name) == (namespace, pod):
                for found in local.containers:
                    if found.spec["name"] == container:
                        return found.log_file, found.running
        return None

    # --- node and volumes -------------------------------------------------------------------------

    def nodes(self) -> list[str]:
        found: list[Any] = self.core.list_node(label_selector=f"{EXECUTOR_LABEL}=true").items
        return [n.metadata.name for n in found]

    def heartbeat(self, nodes: list[str]) -> None:
        now = _now()
        for node in nodes:
            conditions = [{"type": kind, "status": "False", "reason": f"KubeletHas{reason}", "message": "executor",
                           "lastHeartbeatTime": now, "lastTransitionTime": now}
                          for kind, reason in (("MemoryPressure", "SufficientMemory"),
                                               ("DiskPressure", "NoDiskPressure"), ("PIDPressure", "SufficientPID"))]
            conditions.append({"type": "Ready", "status": "True", "reason": "KubeletReady",
                               "message": "the devcluster executor runs this node's pods as local processes",
                               "lastHeartbeatTime": now, "lastTransitionTime": now})
            self.core.patch_node_status(node, {"status": {
                "conditions": conditions, "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                                                        {"type": "Hostname", "address": node}],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": self.kubelet_port}},
                "nodeInfo": {"architecture": "amd64", "operatingSystem": "linux",
                             "kubeletVersion": "devcluster-executor", "containerRuntimeVersion": "local-processes"}}})

    def provision(self) -> None:
        claims: list[Any] = self.core.list_persistent_volume_claim_for_all_namespaces().items
        for claim in claims:
            if claim.status.phase != "Pending" or claim.spec.volume_name:
                continue
            # a new folder per claim (by uid), as a dynamic provisioner gives a new claim an empty volume
            meta = claim.metadata
            folder = self.state / "volumes" / meta.namespace / f"{meta.name}-{meta.uid[:8]}"
            folder.mkdir(parents=True, exist_ok=True)
            volume: Any = {"apiVersion": "v1", "kind": "PersistentVolume",
                      "metadata": {"name": f"pvc-{claim.metadata.uid}",
                                   "labels": {"devcluster.tailor.dev/provisioned": "true"}},
                      "spec": {"capacity": {"storage": claim.spec.resources.requests["storage"]},
                               "accessModes": claim.spec.access_modes,
                               "persistentVolumeReclaimPolicy": "Retain",
                               "storageClassName": claim.spec.storage_class_name or "",
                               "hostPath": {"path": str(folder), "type": "DirectoryOrCreate"},
                               "claimRef": {"namespace": claim.metadata.namespace, "name": claim.metadata.name,
                                            "uid": claim.metadata.uid}}}
            try:
                self.core.create_persistent_volume(volume)
                log(f"provisioned {folder} for claim {claim.metadata.namespace}/{claim.metadata.name}")
            except ApiException as error:
                if error.status != 409:
                    raise

    # --- pods -------------------------------------------------------------------------------------

    def sync(self) -> None:
        """One pass: heartbeat, volumes, then every pod bound to an executor node."""
        nodes = self.nodes()
        if nodes and time.monotonic() - self.last_heartbeat > HEARTBEAT_S:
            self.heartbeat(nodes)
            self.last_heartbeat = time.monotonic()
        self.provision()
        seen = set()
        targets: list[dict[str, Any]] = []
        endpoints: list[services.LocalEndpoint] = []
        deleted: list[Any] = []
        for node in nodes:
            pods: list[Any] = self.core.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node}").items
            for pod in pods:
                uid = pod.metadata.uid
                seen.add(uid)
                local = self.pods.get(uid)
                if pod.metadata.deletion_timestamp is not None:
                    deleted.append(pod)  # drained once no Service sends it new connections
                    continue
                if local is None:
                    if pod.status.phase in ("Succeeded", "Failed"):
                        continue  # ended: never started again
                    try:
                        local = self.start(pod)
                    except (ValueError, OSError, ApiException, RuntimeError) as error:
                        self._fail_to_start(pod, str(error))
                        continue
                self.check(local, pod)
                self.report(local)
                target = metrics.scrape_target(local.namespace, local.name, pod.metadata.annotations, local.ports)
                if target is not None:
                    targets.append(target)
                endpoints.append(services.LocalEndpoint(
                    local.namespace, local.name, pod.metadata.labels or {},
                    bool(local.containers) and all(c.readiness.ready for c in local.containers), local.ports))
        try:
            self.sync_services(endpoints)
        finally:  # whatever the Services' state, pods being deleted go on draining
            for pod in deleted:
                self.drain(pod)
        for uid in set(self.pods) - seen:
            self.stop(uid)
        if self.scrape_file is not None and metrics.write_targets(self.scrape_file, targets):
            log(f"executor: {len(targets)} pod(s) to scrape, in {self.scrape_file}")
        if nodes:  # a whole pass over the nodes: a recorded pod not resumed is gone, or ended, and must not run
            for uid in set(self.recovered) - set(self.pods):
                _abandon(self.recovered[uid])
            self.recovered.clear()

    def sync_services(self, endpoints: list[services.LocalEndpoint]) -> None:
        """Every Service's loopback listeners over `endpoints` (`services.py`), their ports announced on it."""
        found: list[Any] = self.core.list_service_for_all_namespaces().items
        announced = {(s.metadata.namespace, s.metadata.name): announced_ports(s) for s in found}
        for (namespace, name), ports in self.proxy.sync(found, endpoints, announced).items():
            if ports != announced[(namespace, name)]:
                self.core.patch_namespaced_service(name, namespace, {"metadata": {"annotations": {
                    PORTS_ANNOTATION: json.dumps(ports)}}})
                log(f"service {namespace}/{name}: on loopback at {ports}")

    def drain(self, pod: Any) -> None:
        """A pod being deleted, once out of every Service: as a kubelet does, its preStop sleep first (a `sleep`
        action, or an exec hook that is `sleep N`: other hooks are not run here), then SIGTERM to each container's
        main process (a server refuses new requests and finishes those it holds), then left to end on its own
        while the executor goes on with the others; stopped and its API object removed once its containers
        ended, or killed when its grace period (counted from the first pass) ends."""
        uid, now = pod.metadata.uid, time.monotonic()
        local = self.pods.get(uid)
        if local is not None:
            draining = self.terminating.get(uid)
            if draining is None:
                delay = min(local.grace_s, max((_pre_stop_sleep(c.spec) for c in local.containers), default=0.0))
                draining = self.terminating[uid] = Draining(now + delay, now + local.grace_s)
                log(f"{local.namespace}/{local.name}: draining (SIGTERM after {delay:.0f}s, stopped within "
                    f"{local.grace_s:.0f}s)")
            if not draining.signalled and now >= draining.signal_at:
                draining.signalled = True
                for container in local.containers:
                    if container.exit_code is None and container.pid is not None and container.running():
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(container.pid, signal.SIGTERM)
            if now < draining.deadline and any(c.exit_code is None and c.running() for c in local.containers):
                return
        self.stop(uid, grace_s=0)
        self._force_delete(pod)

    def _force_delete(self, pod: Any) -> None:
        try:
            self.core.delete_namespaced_pod(pod.metadata.name, pod.metadata.namespace, grace_period_seconds=0)
        except ApiException as error:
            if error.status != 404:
                raise

    def _fail_to_start(self, pod: Any, message: str) -> None:
        log(f"{pod.metadata.namespace}/{pod.metadata.name}: cannot start: {message}")
        statuses = [{"name": c.name, "image": c.image, "ready": False, "restartCount": 0, "imageID": "",
                     "state": {"terminated": {"exitCode": 128, "reason": "StartError",
                                              "message": message[:MESSAGE_BYTES], "finishedAt": _now()}}}
                    for c in pod.spec.containers]
        self.core.patch_namespaced_pod_status(pod.metadata.name, pod.metadata.namespace, {"status": {
            "phase": "Failed", "message": message[:MESSAGE_BYTES], "reason": "StartError",
            "containerStatuses": statuses}})

    def start(self, pod: Any) -> LocalPod:
        """Run the pod's containers, or resume them from the record a previous executor left in its folder."""
        meta = pod.metadata
        folder = self.state / "pods" / f"{meta.namespace}_{meta.name}_{meta.uid[:8]}"
        for private in (folder / HOME_DIR, folder / TMP_DIR):
            private.mkdir(mode=0o700, parents=True, exist_ok=True)
        grace = pod.spec.termination_grace_period_seconds
        local = LocalPod(meta.uid, meta.namespace, meta.name, folder, pod.spec.restart_policy or "Always",
                         GRACE_S if grace is None else float(grace))
        record = _read_record(local.record)
        if record is not None and record.get("uid") != meta.uid:
            record = None
        if record is not None:
            local.ports = {name: int(port) for name, port in record["ports"].items()}
        volumes = {v.name: self._volume(v, pod, local) for v in pod.spec.volumes or []}
        init = pod.spec.init_containers or []
        if any(spec.restart_policy != "Always" for spec in init):
            raise ValueError("the executor runs native sidecars (init containers with restartPolicy Always) only, "
                             "not init containers that run to completion")
        for index, spec in enumerate([*init, *pod.spec.containers]):  # sidecars first, as a kubelet starts them
            container = Container(spec=client.ApiClient().sanitize_for_serialization(spec),  # type: ignore[no-untyped-call]
                                  folder=folder / spec.name, sidecar=index < len(init))
            container.folder.mkdir(exist_ok=True)
            for mount in spec.volume_mounts or []:
                local_path = Path(volumes[mount.name]) / (mount.sub_path or "")
                local.paths[mount.mount_path] = str(local_path)
            for port in spec.ports or []:
                local.ports[port.name or str(port.container_port)] = local.ports.setdefault(
                    str(port.container_port), free_port())
            local.containers.append(container)
        for volume in pod.spec.volumes or []:  # a plan file names paths as the container sees them
            if volume.config_map is not None:
                for file in Path(volumes[volume.name]).iterdir():
                    file.write_text(self._rewrite_paths(local, file.read_text()))
        if local.ports:
            named = {name: port for name, port in local.ports.items() if not name.isdigit()}
            self.core.patch_namespaced_pod(meta.name, meta.namespace,
                                           {"metadata": {"annotations": {PORTS_ANNOTATION: json.dumps(named)}}})
        if record is not None:
            local.resume(record)
            self.recovered.pop(meta.uid, None)
            log(f"{meta.namespace}/{meta.name}: resumed {len(local.containers)} container(s) in {folder} "
                f"({sum(c.exit_code is None for c in local.containers)} running)")
        else:
            try:
                for container in local.containers:
                    self._launch(local, container)
            except BaseException:  # none of its processes may outlive a pod that failed to start
                self._terminate([local], 0.0)
                local.record.unlink(missing_ok=True)
                raise
            log(f"{meta.namespace}/{meta.name}: started {len(local.containers)} container(s) in {folder}")
        self.pods[meta.uid] = local
        local.save()
        return local

    def _volume(self, volume: Any, pod: Any, local: LocalPod) -> str:
        namespace = pod.metadata.namespace
        if volume.persistent_volume_claim is not None:
            claim: Any = self.core.read_namespaced_persistent_volume_claim(volume.persistent_volume_claim.claim_name,
                                                                      namespace)
            if not claim.spec.volume_name:
                raise ValueError(f"claim {claim.metadata.name} is not bound")
            pv: Any = self.core.read_persistent_volume(claim.spec.volume_name)
            if pv.spec.host_path is None:
                raise ValueError(f"volume {pv.metadata.name} is not a hostPath volume")
            return str(pv.spec.host_path.path)
        target = local.folder / "volumes" / volume.name
        target.mkdir(parents=True, exist_ok=True)
        if volume.config_map is not None:
            self._config_map(volume.config_map, namespace, target)
            return str(target)
        if volume.projected is not None:
            for source in volume.projected.sources or []:
                if source.service_account_token is not None:
                    token = source.service_account_token
                    local.tokens.append(Token(target / token.path, pod.spec.service_account_name or "default",
                                              token.audience, token.expiration_seconds or 3607))
                    self._renew(local, local.tokens[-1])
                elif source.config_map is not None:
                    self._config_map(source.config_map, namespace, target)
                elif source.downward_api is not None:
                    for item in source.downward_api.items or []:
                        (target / item.path).write_text(_field(pod, item.field_ref.field_path))
            return str(target)
        if volume.empty_dir is not None:
            return str(target)
        raise ValueError(f"volume {volume.name}: only persistentVolumeClaim, configMap, projected and emptyDir are "
                         "supported")

    def _config_map(self, source: Any, namespace: str, target: Path) -> None:
        """A ConfigMap's keys as files (only `items`, under their paths, when the source lists them)."""
        data = self.core.read_namespaced_config_map(source.name, namespace).data or {}
        items = {item.key: item.path for item in source.items or []} or {key: key for key in data}
        for key, path in items.items():
            (target / path).write_text(data[key])

    def _renew(self, local: LocalPod, token: Token) -> None:
        """Request a token bound to the pod, as a kubelet does, and write it where the pod reads it."""
        body: Any = {"spec": {"audiences": [token.audience] if token.audience else None,
                              "expirationSeconds": token.expiration_s,
                              "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": local.name,
                                                 "uid": local.uid}}}
        request: Any = self.core.create_namespaced_service_account_token(token.service_account, local.namespace, body)
        _write_file(token.file, request.status.token, mode=0o600)
        token.renew_at = time.monotonic() + TOKEN_RENEW_SHARE * token.expiration_s

    @staticmethod
    def _rewrite_paths(local: LocalPod, text: str) -> str:
        return replace_paths(text, local.paths)

    def _rewrite(self, local: LocalPod, container: Container, text: str) -> str:
        text = self._rewrite_paths(local, text.replace(TERMINATION_LOG, str(container.message_file)))
        return _replace_ports(text, local.ports)

    def _launch(self, local: LocalPod, container: Container) -> None:
        """Start the container's command under its shim, the leader of a new process group."""
        spec = container.spec
        argv = [self._rewrite(local, container, a) for a in [*(spec.get("command") or []), *(spec.get("args") or [])]]
        if not argv:
            raise ValueError(f"container {spec['name']}: the executor runs command/args; it cannot read the image's "
                             "entrypoint")
        # a server started by a command before it (Triton's code check, `codecheck`, execs it) is set up the same
        at = next((i for i, arg in enumerate(argv) if Path(arg).name == "tritonserver"), 0)
        wrapper, argv = argv[:at], loopback_args(argv[at:])
        api = dict(self.api_env)
        if SERVICE_ACCOUNT_MOUNT in local.paths:  # nothing can be mounted at the standard path here
            api["TAILOR_SERVICE_ACCOUNT_DIR"] = local.paths[SERVICE_ACCOUNT_MOUNT]
        given = {e["name"]: self._rewrite(local, container, e.get("value", "")) for e in spec.get("env") or []
                 if "valueFrom" not in e}
        work = container.folder / f"run-{container.restarts}"
        work.mkdir(parents=True, exist_ok=True)
        runtime: dict[str, str] = {}
        bin_dir = Path(sys.executable).parent
        if Path(argv[0]).name == "tritonserver":
            from tailor.compressor.serving.server import local_command

            argv, runtime = local_command(argv[1:], work)
            bin_dir = Path(runtime.pop("PATH").split(os.pathsep)[0])
        argv = [*wrapper, *argv]
        env = pod_env(given, os.environ, bin_dir, local.folder, local.name, api, runtime)
        if shutil.which(argv[0], path=env["PATH"]) is None:
            raise FileNotFoundError(f"container {spec['name']}: {argv[0]}: no such command on PATH {env['PATH']}")
        container.message_file.unlink(missing_ok=True)
        container.exit_file.unlink(missing_ok=True)
        command = [sys.executable, "-I", "-m", "tailor.devcluster.shim", str(os.getpid()), str(local.grace_s),
                   str(container.exit_file), *argv]
        with container.log_file.open("ab") as sink:
            container.process = subprocess.Popen(command, cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=sink,
                                                 stderr=subprocess.STDOUT, start_new_session=True)
        container.pid, container.pid_start = container.process.pid, shim.start_time(container.process.pid)
        container.started_at, container.exit_code = _now(), None
        container.readiness.reset()
        local.save()

    def check(self, local: LocalPod, pod: Any) -> None:
        """Token renewals, exits, restarts (restartPolicy Always or OnFailure) and readiness probes."""
        for token in local.tokens:
            if time.monotonic() > token.renew_at:
                self._renew(local, token)
        for container in local.containers:
            if container.exit_code is None and not container.running():
                container.exit_code, container.finished_at = container.last_exit_code(), _now()
                container.exited_monotonic = time.monotonic()
                container.readiness.reset()
                local.save()
                log(f"{local.namespace}/{local.name}: {container.spec['name']} exited with {container.exit_code}")
        finished = self._finished(local)
        if finished and any(c.sidecar and c.exit_code is None for c in local.containers):
            self._terminate([local], local.grace_s, sidecars=True)  # the pod's work is done: its sidecars stop
            local.save()
        for container in local.containers:
            if container.exit_code is not None and not finished and self._restarts(local, container) and \
                    time.monotonic() - container.exited_monotonic > RESTART_DELAY_S:
                container.restarts += 1
                self._launch(local, container)
            probe = container.spec.get("readinessProbe") or {}
            # probed every pass while not ready (a pod is Ready sooner than a kubelet's period allows), then every
            # periodSeconds
            if container.exit_code is None and (not container.readiness.ready or time.monotonic()
                                                - container.probed_monotonic >= _probe_field(probe, "periodSeconds")):
                container.readiness.observe(self._probe(local, container.spec.get("readinessProbe")), probe)
                container.probed_monotonic = time.monotonic()

    @staticmethod
    def _restarts(local: LocalPod, container: Container) -> bool:
        return container.sidecar or local.restart_policy == "Always" or (
            local.restart_policy == "OnFailure" and container.exit_code != 0)

    @classmethod
    def _finished(cls, local: LocalPod) -> bool:
        """Whether every container but the sidecars has ended for good (the pod is Succeeded or Failed)."""
        main = [c for c in local.containers if not c.sidecar]
        return all(c.exit_code is not None and not cls._restarts(local, c) for c in main)

    @staticmethod
    def _probe(local: LocalPod, probe: dict[str, Any] | None) -> bool:
        if probe is None:
            return True
        http = probe.get("httpGet")
        if http is None:
            return True  # exec and tcp probes are not run: a running process counts as ready
        port = local.ports.get(str(http["port"]))
        if port is None:
            return False
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{http.get('path', '/')}",
                                        timeout=_probe_field(probe, "timeoutSeconds")) as reply:
                return bool(200 <= reply.status < 400)
        except (urllib.error.URLError, OSError):
            return False

    def report(self, local: LocalPod) -> None:
        statuses: dict[bool, list[dict[str, Any]]] = {True: [], False: []}  # by sidecar or not
        phase = "Running"
        if self._finished(local) and all(c.exit_code is not None for c in local.containers):  # sidecars too
            phase = "Succeeded" if all(c.exit_code == 0 for c in local.containers if not c.sidecar) else "Failed"
        for container in local.containers:
            spec = container.spec
            if container.exit_code is None:
                state: dict[str, Any] = {"running": {"startedAt": container.started_at}}
            else:
                state = {"terminated": {"exitCode": container.exit_code, "startedAt": container.started_at,
                                        "finishedAt": container.finished_at,
                                        "reason": "Completed" if container.exit_code == 0 else "Error",
                                        **({"message": message} if (message := self._message(container)) else {})}}
            statuses[container.sidecar].append({
                "name": spec["name"], "image": spec.get("image", ""), "imageID": "", "ready": container.readiness.ready,
                "started": container.exit_code is None, "restartCount": container.restarts, "state": state})
        ready = phase == "Running" and all(c.readiness.ready for c in local.containers)
        condition = "True" if ready else "False"
        body = {"status": {"phase": phase, "podIP": "127.0.0.1", "podIPs": [{"ip": "127.0.0.1"}],
                           "hostIP": "127.0.0.1", "startTime": local.containers[0].started_at,
                           "containerStatuses": statuses[False],
                           **({"initContainerStatuses": statuses[True]} if statuses[True] else {}),
                           "conditions": [{"type": "Initialized", "status": "True"},
                                          {"type": "ContainersReady", "status": condition},
                                          {"type": "Ready", "status": condition}]}}
        text = json.dumps(body, sort_keys=True)
        if text == local.reported:
            return
        try:
            self.core.patch_namespaced_pod_status(local.name, local.namespace, body)
            local.reported = text
        except ApiException as error:
            if error.status != 404:
                raise
        if phase in ("Succeeded", "Failed"):
            log(f"{local.namespace}/{local.name}: {phase}")

    @staticmethod
    def _message(container: Container) -> str | None:
        """The termination message: the file, else the end of the log for a failure (FallbackToLogsOnError)."""
        if container.message_file.exists():
            return container.message_file.read_text(errors="replace")[:MESSAGE_BYTES] or None
        if container.exit_code and container.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            tail = container.log_file.read_bytes()[-2048:].decode(errors="replace")
            return "\n".join(tail.splitlines()[-80:]) or None
        return None

    def stop(self, uid: str, grace_s: float | None = None) -> None:
        """Stop a pod that is gone or going: its processes within `grace_s` (its grace period by default); its
        record goes too."""
        local = self.pods.pop(uid, None)
        self.terminating.pop(uid, None)
        if local is None:
            if uid in self.recovered:
                _abandon(self.recovered.pop(uid))
            return
        self._terminate([local], local.grace_s if grace_s is None else grace_s)
        local.record.unlink(missing_ok=True)
        log(f"{local.namespace}/{local.name}: stopped")

    def stop_all(self) -> None:
        """Stop every pod, all at once, within STOP_ALL_S; their records stay, with how each container ended."""
        pods = list(self.pods.values())
        self.pods.clear()
        self._terminate(pods, STOP_ALL_S)  # each shim kills its tree after its own pod's grace period
        for local in pods:
            local.save()
        if pods:
            log(f"executor: stopped {len(pods)} pod(s)")

    @staticmethod
    def _terminate(pods: list[LocalPod], grace_s: float, sidecars: bool = False) -> None:
        """SIGTERM to each running container's shim (`sidecars`: the sidecars' only), which passes it to the
        container's main process; SIGKILL to the process trees still running after `grace_s`. Each container's
        exit code is kept."""
        running = [c for local in pods for c in local.containers
                   if c.exit_code is None and c.running() and (c.sidecar or not sidecars)]
        for container in running:
            assert container.pid is not None
            with contextlib.suppress(ProcessLookupError):
                os.kill(container.pid, signal.SIGTERM)
        _wait_until_ended(running, grace_s)
        for container in running:
            if container.running():
                assert container.pid is not None
                shim.kill_tree(container.pid)
        _wait_until_ended(running, KILL_WAIT_S)
        for container in running:
            container.exit_code, container.finished_at = container.last_exit_code(), _now()
            container.readiness.reset()


def pod_env(given: Mapping[str, str], host: Mapping[str, str], bin_dir: Path, pod_folder: Path, hostname: str,
            api: Mapping[str, str], runtime: Mapping[str, str] | None = None) -> dict[str, str]:
    """A pod process's environment: POD_ENV, PATH (`bin_dir` first), HOME and TMPDIR in `pod_folder`, HOSTNAME,
    the trust-store paths of HOST_ENV from `host` (and nothing else of it), what the `runtime` needs, the API
    server's (`api`), then the spec's env (`given`) over all of these."""
    env = {**POD_ENV, "PATH": f"{bin_dir}{os.pathsep}{SYSTEM_PATH}", "HOME": str(pod_folder / HOME_DIR),
           "TMPDIR": str(pod_folder / TMP_DIR), "HOSTNAME": hostname}
    env.update({name: host[name] for name in HOST_ENV if name in host})
    return {**env, **(runtime or {}), **api, **given}


def loopback_args(argv: list[str]) -> list[str]:
    """`argv` with the LOOPBACK_ARGS of the server it starts in place of any given ones (`--flag=value` or
    `--flag value`)."""
    for start, forced in LOOPBACK_ARGS.items():
        if Path(argv[0]).name != start[0] or tuple(argv[1:len(start)]) != start[1:]:
            continue
        flags = {arg.split("=", 1)[0] for arg in forced}
        kept: list[str] = []
        skip = False
        for arg in argv:
            if skip:
                skip = False
            elif arg in flags:
                skip = True  # its value is the next argument
            elif arg.split("=", 1)[0] not in flags:
                kept.append(arg)
        return [*kept, *forced]
    return argv


def _probe_field(probe: Mapping[str, Any], name: str) -> int:
    return int(probe.get(name, PROBE_DEFAULTS[name]))


def _pre_stop_sleep(spec: Mapping[str, Any]) -> float:
    """Seconds a container's preStop hook sleeps: its `sleep` action, or an exec hook that is `sleep N`."""
    hook = (spec.get("lifecycle") or {}).get("preStop") or {}
    if "sleep" in hook:
        return float(hook["sleep"].get("seconds", 0))
    command = (hook.get("exec") or {}).get("command") or []
    if len(command) == 2 and command[0] == "sleep" and command[1].replace(".", "", 1).isdigit():
        return float(command[1])
    return 0.0


def announced_ports(found: Any) -> dict[str, int]:
    """The loopback ports announced on a pod or Service (a V1Pod or V1Service), or none where the annotation is
    missing or not ours."""
    try:
        ports = json.loads((found.metadata.annotations or {}).get(PORTS_ANNOTATION, "{}"))
        return {str(name): int(port) for name, port in ports.items()}
    except (ValueError, TypeError, AttributeError):
        return {}


def _write_file(path: Path, text: str, mode: int = 0o644) -> None:
    """Replace `path` at once with `text`, created with `mode` (never wider while being written)."""
    staged = path.with_name(f".{path.name}.tmp")
    descriptor = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(descriptor, "w") as handle:
        os.fchmod(descriptor, mode)  # a file left by an earlier write keeps its mode through O_CREAT
        handle.write(text)
    staged.replace(path)


def _read_record(path: Path) -> dict[str, Any] | None:
    try:
        record: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record


def _records(pods: Path) -> dict[str, Path]:
    """uid -> folder of each pod a record was left for."""
    found = {}
    for path in pods.glob(f"*/{RECORD}"):
        record = _read_record(path)
        if record is not None and isinstance(record.get("uid"), str):
            found[record["uid"]] = path.parent
    return found


def _abandon(folder: Path) -> None:
    """Kill what still runs of a recorded pod that is not to run (gone, or ended), and forget its record."""
    record = _read_record(folder / RECORD) or {}
    for entry in record.get("containers", []):
        if entry.get("pid") is not None and shim.start_time(entry["pid"]) == entry.get("pidStart"):
            shim.kill_tree(entry["pid"])
            log(f"executor: killed {entry['name']} of {folder.name}, a pod that is not to run")
    (folder / RECORD).unlink(missing_ok=True)


def _wait_until_ended(containers: list[Container], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(c.running() for c in containers) and time.monotonic() < deadline:
        time.sleep(0.05)


def _field(pod: Any, path: str) -> str:
    """A downward-API field the executor knows: the pod's namespace, name or uid."""
    fields = {"metadata.namespace": pod.metadata.namespace, "metadata.name": pod.metadata.name,
              "metadata.uid": pod.metadata.uid}
    if path not in fields:
        raise ValueError(f"downward API field {path}: the executor supplies only {', '.join(fields)}")
    return str(fields[path])


def replace_paths(text: str, paths: Mapping[str, str]) -> str:
    """Each mount path of `paths` where it begins a path (start of text, or after `=`, `:` or a space) becomes its
    local folder, in one pass: a local folder that begins with another mount path (a claim's under /tmp, beside a
    scratch folder mounted at /tmp) is not rewritten again."""
    if not paths:
        return text
    mounts = "|".join(re.escape(mount) for mount in sorted(paths, key=len, reverse=True))  # the longest first
    return re.sub(rf"(?:(?<=^)|(?<=[=:\s]))({mounts})(?=/|$|\s|:)", lambda found: paths[found.group(1)], text,
                  flags=re.MULTILINE)


def _replace_ports(text: str, ports: dict[str, int]) -> str:
    def local(match: re.Match[str]) -> str:
        return f"{match.group(1)}{ports.get(match.group(2), match.group(2))}"

    return re.sub(r"^(--[a-z-]+-port=)(\d+)$", local, text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--state", type=Path, required=True, help="folder for volumes and pod folders")
    parser.add_argument("--scrape", type=Path, help="folder for Prometheus's file-discovery file of the pods to "
                                                    "scrape (pods.json)")
    parser.add_argument("--kubelet-cert", type=Path, required=True, help="serving certificate of the container-log "
                                                                         "endpoint (for 127.0.0.1)")
    parser.add_argument("--kubelet-key", type=Path, required=True)
    args = parser.parse_args()
    api = config.new_client_from_config(config_file=str(args.kubeconfig))  # type: ignore[no-untyped-call]
    executor = Executor(api, args.state, args.scrape)
    logs = kubelet.LogServer(executor.container_log, args.kubelet_cert, args.kubelet_key)
    executor.kubelet_port = logs.port
    stopping = False

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log(f"executor: running pods of nodes labelled {EXECUTOR_LABEL}=true; state in {args.state}")
    try:
        while not stopping:
            try:
                executor.sync()
            except (ApiException, urllib.error.URLError, OSError) as error:
                log(f"executor: {error}; retrying")
            time.sleep(POLL_S)
    finally:
        executor.stop_all()
        executor.proxy.close()
        logs.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
