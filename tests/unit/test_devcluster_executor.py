"""The devcluster executor without a cluster: real pod processes on this machine, the API server played by a fake
CoreV1Api. A pod gets only its spec's environment, servers listen on loopback, tokens are private, and no pod
process outlives the executor or runs twice across a restart."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kubernetes import client

from tailor.devcluster import executor as executor_module
from tailor.devcluster.executor import SERVICE_ACCOUNT_MOUNT, Executor

from processes import sleeping

NODE = "local-0"
API_HOST = "https://127.0.0.1:16443"
SECRETS = {"KUBECONFIG": "/home/dev/.kube/config", "HF_TOKEN": "hf_secret", "AWS_ACCESS_KEY_ID": "AKIASECRET",
           "AWS_SECRET_ACCESS_KEY": "aws-secret", "GITHUB_TOKEN": "ghp_secret", "MY_SERVICE_PASSWORD": "hunter2"}


class FakeCore:
    """The CoreV1Api calls the executor makes, answered from `pods`; status patches update them."""

    def __init__(self, *pods: client.V1Pod) -> None:
        self.pods = list(pods)
        self.statuses: dict[str, dict[str, Any]] = {}

    def list_node(self, label_selector: str) -> Any:
        return SimpleNamespace(items=[client.V1Node(metadata=client.V1ObjectMeta(name=NODE))])

    def patch_node_status(self, name: str, body: Any) -> None:
        pass

    def list_persistent_volume_claim_for_all_namespaces(self) -> Any:
        return SimpleNamespace(items=[])

    def list_pod_for_all_namespaces(self, field_selector: str) -> Any:
        return SimpleNamespace(items=list(self.pods))

    def list_service_for_all_namespaces(self) -> Any:
        return SimpleNamespace(items=[])

    def patch_namespaced_pod(self, name: str, namespace: str, body: Any) -> None:
        pass

    def patch_namespaced_pod_status(self, name: str, namespace: str, body: dict[str, Any]) -> None:
        self.statuses[name] = body["status"]
        for pod in self.pods:
            if pod.metadata.name == name:
                pod.status.phase = body["status"]["phase"]

    def delete_namespaced_pod(self, name: str, namespace: str, grace_period_seconds: int) -> None:
        self.pods = [p for p in self.pods if p.metadata.name != name]

    def create_namespaced_service_account_token(self, name: str, namespace: str, body: Any) -> Any:
        return SimpleNamespace(status=SimpleNamespace(token=f"token-of-{name}-{uuid.uuid4().hex[:6]}"))

    def read_namespaced_config_map(self, name: str, namespace: str) -> Any:
        return SimpleNamespace(data={"ca.crt": "-----BEGIN CERTIFICATE-----\n"})


def new_executor(state: Path, core: FakeCore) -> Executor:
    executor = Executor(client.ApiClient(client.Configuration(host=API_HOST)), state)
    executor.core = core  # type: ignore[assignment]
    return executor


def reap(gone: Executor) -> None:
    """Collect the ended processes of an executor that a test dropped as if it had died (its Popen objects would
    warn that they were never waited for)."""
    for local in gone.pods.values():
        for started in local.containers:
            if started.process is not None:
                started.process.wait(timeout=10)


def pod(name: str, *containers: client.V1Container, restart_policy: str = "Never", grace_s: int = 2,
        volumes: list[client.V1Volume] | None = None) -> client.V1Pod:
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, namespace="ns", uid=str(uuid.uuid4())),
        spec=client.V1PodSpec(node_name=NODE, restart_policy=restart_policy, containers=list(containers),
                              termination_grace_period_seconds=grace_s, volumes=volumes,
                              service_account_name="sa"),
        status=client.V1PodStatus(phase="Pending"))


def container(name: str, *command: str, **fields: Any) -> client.V1Container:
    return client.V1Container(name=name, image="ignored", command=list(command), **fields)


def processes(marker: str) -> list[int]:
    """The running processes with `marker` in their command line."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker in cmdline.read_bytes().decode(errors="replace") and int(cmdline.parent.name) != os.getpid():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float = 20) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (value := probe()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(0.05)
    return value


@pytest.fixture
def marker() -> Iterator[str]:
    """A `sleep` duration no other process uses, to find a test's processes; they are killed afterwards."""
    value = f"600.{uuid.uuid4().int % 10**9:09d}"
    yield value
    for pid in processes(value):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def output(state: Path, running: client.V1Pod, name: str) -> str:
    meta = running.metadata
    return (state / "pods" / f"{meta.namespace}_{meta.name}_{meta.uid[:8]}" / name / "output.log").read_text()


# --- environment ----------------------------------------------------------------------------------------------


def test_pod_env_is_the_spec_env_and_what_the_executor_provides(tmp_path: Path) -> None:
    host = {**SECRETS, "PATH": "/home/dev/bin:/usr/bin", "HOME": "/home/dev", "SSL_CERT_FILE": "/etc/ssl/ca.pem",
            "AWS_CA_BUNDLE": "/etc/ssl/ca.pem", "HF_HOME": "/home/dev/hf", "TAILOR_CACHE_DIR": "/home/dev/cache",
            "ATEN_CPU_CAPABILITY": "avx2"}
    api = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "16443",
           "TAILOR_SERVICE_ACCOUNT_DIR": "/state/sa"}
    env = executor_module.pod_env({"TAILOR_CACHE_DIR": "/artifacts/.cache", "LANG": "en_US.UTF-8"}, host,
                                  Path("/venv/bin"), tmp_path, "pod-a", api, {"LD_LIBRARY_PATH": "/py/lib"})
    assert env == {
        "PATH": f"/venv/bin:{executor_module.SYSTEM_PATH}", "HOME": str(tmp_path / ".home"),
        "TMPDIR": str(tmp_path / ".tmp"), "HOSTNAME": "pod-a", "LANG": "en_US.UTF-8", "PYTHONUNBUFFERED": "1",
        "SSL_CERT_FILE": "/etc/ssl/ca.pem", "ATEN_CPU_CAPABILITY": "avx2", "LD_LIBRARY_PATH": "/py/lib", **api,
        "TAILOR_CACHE_DIR": "/artifacts/.cache"}
    assert not any(secret in value for value in env.values() for secret in SECRETS.values())


def test_a_pod_process_gets_none_of_the_executors_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               marker: str) -> None:
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    dump = "import json, os; print(json.dumps(dict(os.environ)))"
    running = pod("env", container("main", "python", "-c", dump, marker,
                                   env=[client.V1EnvVar(name="GREETING", value="hello")]))
    executor = new_executor(tmp_path, FakeCore(running))
    executor.start(running)
    text = wait_for("the environment", lambda: output(tmp_path, running, "main").strip())
    env = json.loads(text.splitlines()[-1])
    assert not set(SECRETS) & set(env), "the executor's KUBECONFIG and credentials reached the pod"
    assert env["GREETING"] == "hello" and env["HOSTNAME"] == "env"
    assert env["PATH"].split(os.pathsep)[0] == str(Path(sys.executable).parent)
    assert env["KUBERNETES_SERVICE_HOST"] == "127.0.0.1" and env["KUBERNETES_SERVICE_PORT"] == "16443"
    pod_folder = tmp_path / "pods" / f"ns_env_{running.metadata.uid[:8]}"
    assert Path(env["HOME"]).parent == pod_folder and Path(env["TMPDIR"]).parent == pod_folder
    executor.stop_all()


# --- loopback ------------------------------------------------------------------------------------------------


def test_servers_are_bound_to_loopback_whatever_their_args_say() -> None:
    triton = executor_module.loopback_args(["tritonserver", "--model-repository=/m", "--http-address=0.0.0.0",
                                            "--grpc-address", "0.0.0.0", "--http-port=31000"])
    assert triton == ["tritonserver", "--model-repository=/m", "--http-port=31000", "--http-address=127.0.0.1",
                      "--grpc-address=127.0.0.1", "--metrics-address=127.0.0.1", "--allow-sagemaker=false",
                      "--allow-vertex-ai=false"]
    operator = executor_module.loopback_args(["tailor", "operator", "--namespace", "a", "--bind", "0.0.0.0",
                                              "--metrics-port=31001"])
    assert operator == ["tailor", "operator", "--namespace", "a", "--metrics-port=31001", "--bind=127.0.0.1"]
    assert executor_module.loopback_args(["tailor", "compress", "--bind", "x"]) == ["tailor", "compress", "--bind",
                                                                                    "x"]


def test_free_ports_are_distinct_bindable_and_never_an_outgoing_connections_source_port() -> None:
    floor = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [executor_module.free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports), "a port was handed out twice"
    assert all(executor_module.PORT_FLOOR <= port < floor for port in ports), "a port in the ephemeral range"
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))


def test_mount_paths_are_rewritten_once_even_where_a_local_folder_lies_under_another_mount() -> None:
    """A claim's local folder under /tmp, beside a scratch folder mounted at /tmp: the claim's path is not taken
    for the scratch folder's after it was rewritten."""
    paths = {"/tmp": "/state/pod/scratch", "/models": "/tmp/pytest/pv-1", "/models/extra": "/x"}
    assert executor_module.replace_paths("--model-repository=/models/g1/repository /tmp/home /models/extra/y",
                                         paths) == "--model-repository=/tmp/pytest/pv-1/g1/repository " \
                                                   "/state/pod/scratch/home /x/y"
    assert executor_module.replace_paths("/modelsx /tmpfile", paths) == "/modelsx /tmpfile"  # not a mount's path


def _listeners(port: int) -> set[str]:
    """The local addresses (hex, as /proc/net/tcp* writes them) that listen on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


# 127.0.0.1, ::ffff:127.0.0.1 (gRPC's IPv6 socket) and ::1, as /proc/net/tcp* writes them
LOOPBACK_HEX = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}


@pytest.mark.timeout(120)
def test_tritonserver_listens_on_loopback_only(tmp_path: Path) -> None:
    pytest.importorskip("pytriton")
    repository = tmp_path / "models"
    repository.mkdir()
    ports = [client.V1ContainerPort(name=name, container_port=port)
             for name, port in (("http", 8000), ("grpc", 8001), ("metrics", 8002))]
    running = pod("triton", container("server", "tritonserver", args=[
        f"--model-repository={repository}", "--http-port=8000", "--grpc-port=8001", "--metrics-port=8002"],
        ports=ports))
    executor = new_executor(tmp_path / "state", FakeCore(running))
    local = executor.start(running)
    try:
        mapped = [local.ports[name] for name in ("http", "grpc", "metrics")]
        (server,) = local.containers

        def listening() -> bool:
            if server.process is not None and server.process.poll() is not None:
                output = server.log_file.read_text(errors="replace")[-3000:]
                raise AssertionError(f"tritonserver exited; the end of its output:\n{output}")
            return all(_listeners(p) for p in mapped)

        wait_for("tritonserver to listen on its three ports", listening, 90)
        exposed = {port: _listeners(port) - LOOPBACK_HEX for port in mapped}
        assert exposed == {port: set() for port in mapped}, "tritonserver listens beyond loopback"
    finally:
        executor.stop_all()


# --- tokens -------------------------------------------------------------------------------------------------


def test_projected_service_account_tokens_are_readable_by_this_user_only(tmp_path: Path, marker: str) -> None:
    projected = client.V1ProjectedVolumeSource(sources=[
        client.V1VolumeProjection(service_account_token=client.V1ServiceAccountTokenProjection(
            path="token", expiration_seconds=3607)),
        client.V1VolumeProjection(config_map=client.V1ConfigMapProjection(
            name="kube-root-ca.crt", items=[client.V1KeyToPath(key="ca.crt", path="ca.crt")])),
        client.V1VolumeProjection(downward_api=client.V1DownwardAPIProjection(items=[
            client.V1DownwardAPIVolumeFile(path="namespace",
                                           field_ref=client.V1ObjectFieldSelector(field_path="metadata.namespace"))]))])
    running = pod("api", container("main", "sleep", marker, volume_mounts=[
        client.V1VolumeMount(name="kube-api-access", mount_path=SERVICE_ACCOUNT_MOUNT)]),
        volumes=[client.V1Volume(name="kube-api-access", projected=projected)])
    executor = new_executor(tmp_path, FakeCore(running))
    previous = os.umask(0o022)
    try:
        local = executor.start(running)
        (token,) = local.tokens
        assert token.file.read_text().startswith("token-of-sa-")
        assert stat.S_IMODE(token.file.stat().st_mode) == 0o600, "others can read the token"
        first = token.file.read_text()
        executor._renew(local, token)  # a renewal replaces the file: still private
        assert token.file.read_text() != first and stat.S_IMODE(token.file.stat().st_mode) == 0o600
    finally:
        os.umask(previous)
        executor.stop_all()


# --- stopping and restarting ------------------------------------------------------------------------------------

NEW_SESSION = "import subprocess, sys; subprocess.Popen(['sleep', sys.argv[1]], start_new_session=True)" \
              "; subprocess.run(['sleep', sys.argv[1]])"  # as torchrun starts its workers


@pytest.mark.timeout(60)
def test_stopping_the_executor_leaves_no_pod_process(tmp_path: Path, marker: str) -> None:
    pods = [pod("group", container("main", "sh", "-c", f"sleep {marker} & sleep {marker}")),
            pod("session", container("main", "python", "-c", NEW_SESSION, marker)),
            pod("stubborn", container("main", "sh", "-c", f"trap '' TERM; sleep {marker}"), grace_s=1)]
    executor = new_executor(tmp_path, FakeCore(*pods))
    for running in pods:
        executor.start(running)
    wait_for("the pods' processes", lambda: len(sleeping(marker)) == 5)
    started = time.monotonic()
    executor.stop_all()
    took = time.monotonic() - started
    time.sleep(0.2)
    assert processes(marker) == [], "pod processes outlived the executor"
    assert took < 10, "`tailor devcluster down` kills an executor that takes 20 s to stop"


DYING_EXECUTOR = """
import os, signal, sys, time
from pathlib import Path
from kubernetes import client
from tailor.devcluster.executor import Executor

state, marker = Path(sys.argv[1]), sys.argv[2]
executor = Executor(client.ApiClient(client.Configuration(host="https://127.0.0.1:16443")), state)
executor.start(client.V1Pod(
    metadata=client.V1ObjectMeta(name="orphan", namespace="ns", uid="0123456789"),
    spec=client.V1PodSpec(node_name="local-0", restart_policy="Never", termination_grace_period_seconds=2,
                          containers=[client.V1Container(name="main", command=["sleep", marker])])))
while not any(cmdline.read_bytes().startswith(f"sleep\\0{marker}".encode())
              for cmdline in Path("/proc").glob("[0-9]*/cmdline") if cmdline.exists()):
    time.sleep(0.05)
print("sleeping", flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no stop_all: as when the executor is killed
"""


@pytest.mark.timeout(60)
def test_an_executor_that_dies_takes_its_pods_down(tmp_path: Path, marker: str) -> None:
    done = subprocess.run([sys.executable, "-c", DYING_EXECUTOR, str(tmp_path), marker], capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == -signal.SIGKILL and done.stdout == "sleeping\n", done.stderr
    wait_for("the pod's process to end with the executor", lambda: not processes(marker), 10)


@pytest.mark.timeout(60)
def test_a_restarted_executor_adopts_a_running_pod_instead_of_starting_it_again(tmp_path: Path,
                                                                               marker: str) -> None:
    running = pod("server", container("main", "sleep", marker), restart_policy="Always")
    core = FakeCore(running)
    first = new_executor(tmp_path, core)
    first.sync()
    (original,) = wait_for("the pod's process", lambda: sleeping(marker))
    assert core.statuses["server"]["phase"] == "Running"

    second = new_executor(tmp_path, core)  # the first one is gone without stopping anything
    second.sync()
    time.sleep(0.5)
    second.sync()
    assert sleeping(marker) == [original], "the restarted executor started the pod a second time"
    (status,) = core.statuses["server"]["containerStatuses"]
    assert "running" in status["state"] and status["restartCount"] == 0
    second.stop_all()
    assert processes(marker) == []
    reap(first)


@pytest.mark.timeout(60)
def test_a_pod_that_ran_to_completion_is_not_started_again_after_a_restart(tmp_path: Path, marker: str) -> None:
    runs = tmp_path / "runs.txt"
    job = pod("stage", container("main", "sh", "-c", f"echo run >> {runs}; sleep 0.5", marker))
    core = FakeCore(job)
    first = new_executor(tmp_path / "state", core)
    first.sync()
    assert core.statuses["stage"]["phase"] == "Running"
    wait_for("the stage to finish", lambda: runs.exists() and not processes(f"{runs}; sleep 0.5"))

    second = new_executor(tmp_path / "state", core)  # the first one never saw it finish
    second.sync()
    time.sleep(1)
    second.sync()
    assert runs.read_text() == "run\n", "the restarted executor ran the finished stage again"
    assert core.statuses["stage"]["phase"] == "Succeeded"
    assert core.statuses["stage"]["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 0
    reap(first)


@pytest.mark.timeout(60)
def test_a_restarted_executor_kills_the_processes_of_a_pod_deleted_meanwhile(tmp_path: Path, marker: str) -> None:
    running = pod("deleted", container("main", "sleep", marker), restart_policy="Always")
    core = FakeCore(running)
    first = new_executor(tmp_path, core)
    first.sync()
    wait_for("the pod's process", lambda: sleeping(marker))
    core.pods = []  # deleted (with --force) while no executor ran
    new_executor(tmp_path, core).sync()
    wait_for("the deleted pod's process to end", lambda: not processes(marker), 10)
    reap(first)


@pytest.mark.timeout(60)
def test_a_pod_that_fails_to_start_leaves_no_process(tmp_path: Path, marker: str) -> None:
    broken = pod("broken", container("first", "sleep", marker), container("second"))  # no command
    core = FakeCore(broken)
    executor = new_executor(tmp_path, core)
    executor.sync()
    assert core.statuses["broken"]["reason"] == "StartError"
    wait_for("the first container's process to end", lambda: not processes(marker), 10)


def test_readiness_follows_the_probes_thresholds_as_a_kubelet_does() -> None:
    probe = {"failureThreshold": 3, "successThreshold": 2}
    readiness = executor_module.Readiness()
    verdicts = []
    for success in (True, False, True, True, False, False, True, False, False, False, True):
        readiness.observe(success, probe)
        verdicts.append(readiness.ready)
    # ready after 2 successes in a row; one failure, or two, between successes leave it ready; 3 in a row do not
    assert verdicts == [False, False, False, True, True, True, True, True, True, False, False]
    readiness.observe(True, {})  # Kubernetes' defaults: one success makes it ready, three failures unready
    assert readiness.ready
    for _ in range(2):
        readiness.observe(False, {})
    assert readiness.ready
    readiness.observe(False, {})
    assert not readiness.ready
