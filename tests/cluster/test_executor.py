"""The development executor as the devcluster runs it (`local-0`): a pod gets none of the executor's environment
and a private token, and stopping, killing or restarting the executor neither leaves a pod's process running nor
runs one twice."""

from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tailor.devcluster import cluster
from tailor.devcluster.nodes import EXECUTOR_LABEL, GPU_TAINT

from conftest import wait_for
from processes import sleeping

TESTS = Path(__file__).resolve().parents[1]  # tests/processes.py, for a pod's process
REPORT = ("import json, os; folder = os.environ.get('TAILOR_SERVICE_ACCOUNT_DIR', '')\n"
          "mode = oct(os.stat(f'{folder}/token').st_mode & 0o777) if folder else None\n"
          "open('/dev/termination-log', 'w').write(json.dumps({'env': sorted(os.environ), 'tokenMode': mode}))")


def _pod(name: str, command: list[str], restart_policy: str) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {
        "nodeSelector": {EXECUTOR_LABEL: "true"},
        "tolerations": [{"key": GPU_TAINT["key"], "operator": "Exists", "effect": "NoSchedule"}],
        "restartPolicy": restart_policy, "terminationGracePeriodSeconds": 2,
        "containers": [{"name": "main", "image": "busybox", "command": command}]}}


def _status(core: client.CoreV1Api, namespace: str, name: str) -> Any:
    return core.read_namespaced_pod_status(name, namespace).status


def _restarted(core: client.CoreV1Api, namespace: str, name: str, restarts: int) -> bool:
    """Whether the pod's container runs again after `restarts` restarts."""
    (status,) = _status(core, namespace, name).container_statuses or [None]
    return status is not None and status.restart_count == restarts and status.state.running is not None


def _stop_executor(layout: cluster.Layout, number: signal.Signals) -> None:
    pid = cluster.running_pid(layout, "executor")
    assert pid is not None
    os.kill(pid, number)
    wait_for("the executor to exit", lambda: cluster.running_pid(layout, "executor") is None, 30)


@pytest.mark.timeout(240)  # restarts the executor and waits for its pods: seconds each, mostly waiting
def test_the_executor_keeps_its_environment_and_never_leaks_or_repeats_a_pod(
        api: client.ApiClient, devcluster: cluster.Layout, namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    core = client.CoreV1Api(api)
    wait_for("the default ServiceAccount", lambda: core.list_namespaced_service_account(
        namespace, field_selector="metadata.name=default").items)
    # an executor that runs with the admin's KUBECONFIG and a credential in its environment
    monkeypatch.setenv("KUBECONFIG", str(devcluster.kubeconfig))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-for-pods")
    _stop_executor(devcluster, signal.SIGTERM)
    cluster.up()

    core.create_namespaced_pod(namespace, _pod("report", ["python", "-c", REPORT], "Never"))
    wait_for("the report pod to succeed", lambda: _status(core, namespace, "report").phase == "Succeeded", 60)
    report = json.loads(_status(core, namespace, "report").container_statuses[0].state.terminated.message)
    assert "KUBECONFIG" not in report["env"] and "AWS_SECRET_ACCESS_KEY" not in report["env"]
    assert {"KUBERNETES_SERVICE_HOST", "TAILOR_SERVICE_ACCOUNT_DIR", "HOME", "PATH"} <= set(report["env"])
    assert report["tokenMode"] == "0o600"

    marker = f"600.{uuid.uuid4().int % 10**9:09d}"
    core.create_namespaced_pod(namespace, _pod("server", ["sleep", marker], "Always"))
    wait_for("the server pod to run", lambda: _status(core, namespace, "server").phase == "Running", 60)
    wait_for("one process of the pod", lambda: len(sleeping(marker)) == 1, 10)  # the shim starts it just after

    _stop_executor(devcluster, signal.SIGTERM)  # `tailor devcluster down` stops it so
    assert sleeping(marker) == [], "a pod's process outlived the executor"
    cluster.up()
    wait_for("the server pod to run again", lambda: _restarted(core, namespace, "server", 1), 60)
    wait_for("one process of the pod", lambda: len(sleeping(marker)) == 1, 10)  # the shim starts it just after
    assert _status(core, namespace, "report").phase == "Succeeded"

    monkeypatch.undo()  # the executor the other tests get runs in the test session's environment
    _stop_executor(devcluster, signal.SIGKILL)  # no stop_all: its pods' shims stop them
    wait_for("the pod's process to end with the executor", lambda: not sleeping(marker), 10)
    cluster.up()
    wait_for("the server pod to run again", lambda: _restarted(core, namespace, "server", 2), 60)
    wait_for("one process of the pod", lambda: len(sleeping(marker)) == 1, 10)  # the shim starts it just after


@pytest.mark.timeout(120)
def test_a_native_sidecar_runs_beside_the_job_container_and_stops_after_it(
        api: client.ApiClient, devcluster: cluster.Layout, namespace: str) -> None:
    """The speed Job's shape: a sidecar (an init container with restartPolicy Always) starts first and is
    restarted if it exits; once the main container has ended the sidecar is stopped and the pod Succeeds with
    the main container's termination message."""
    core = client.CoreV1Api(api)
    wait_for("the default ServiceAccount", lambda: core.list_namespaced_service_account(
        namespace, field_selector="metadata.name=default").items)
    marker = f"300.{uuid.uuid4().int % 10**9:09d}"
    main = ("import pathlib, time\n"  # waits until it sees the sidecar's process, then leaves its message
            "from processes import sleeping\n"
            f"while not sleeping('{marker}'): time.sleep(0.2)\n"
            "time.sleep(1)\n"
            "open('/dev/termination-log', 'w').write('measured')\n")
    pod = _pod("sidecar", ["python", "-c", main], "Never")
    pod["spec"]["containers"][0]["env"] = [{"name": "PYTHONPATH", "value": str(TESTS)}]
    pod["spec"]["initContainers"] = [{"name": "server", "image": "busybox", "restartPolicy": "Always",
                                      "command": ["sleep", marker]}]
    core.create_namespaced_pod(namespace, pod)
    wait_for("the sidecar pod to succeed", lambda: _status(core, namespace, "sidecar").phase == "Succeeded", 60)
    status = _status(core, namespace, "sidecar")
    assert status.container_statuses[0].state.terminated.message == "measured"
    (sidecar,) = status.init_container_statuses
    assert sidecar.name == "server" and sidecar.state.terminated is not None
    wait_for("the sidecar's process to end", lambda: not sleeping(marker), 10)

    one_shot = _pod("one-shot-init", ["sleep", "1"], "Never")  # an init container that runs to completion
    one_shot["spec"]["initContainers"] = [{"name": "setup", "image": "busybox", "command": ["true"]}]
    core.create_namespaced_pod(namespace, one_shot)
    wait_for("the pod to fail to start", lambda: _status(core, namespace, "one-shot-init").phase == "Failed", 30)
    assert "native sidecars" in _status(core, namespace, "one-shot-init").message


@pytest.mark.timeout(120)
def test_kubectl_logs_reads_an_executor_pod_as_from_a_kubelet(api: client.ApiClient, namespace: str,
                                                             kubectl: Any) -> None:
    """The API server's log requests reach the executor's kubelet endpoint (the node's announced port, its
    certificate checked): the last lines, a byte limit, and a log followed until the container ends."""
    core = client.CoreV1Api(api)
    count = "for i in 1 2 3 4 5 6; do echo line $i; sleep 0.5; done"
    core.create_namespaced_pod(namespace, _pod("talker", ["sh", "-c", count], "Never"))
    wait_for("the talker pod to run", lambda: _status(core, namespace, "talker").phase == "Running", 60)
    followed = kubectl("logs", "talker", "-n", namespace, "--follow").stdout  # returns when the container ends
    assert followed.splitlines() == [f"line {i}" for i in range(1, 7)]
    assert kubectl("logs", "talker", "-n", namespace, "--tail=2").stdout == "line 5\nline 6\n"
    assert core.read_namespaced_pod_log("talker", namespace, limit_bytes=8) == "line 1\nl"
    # a simulated (kwok) node has no kubelet: its address is loopback too, so a log request for it never leaves
    kwok = next(n for n in core.list_node(label_selector="type=kwok").items)
    assert [a.address for a in kwok.status.addresses if a.type == "InternalIP"] == ["127.0.0.1"]

