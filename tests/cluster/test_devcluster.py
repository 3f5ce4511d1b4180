"""The devcluster behaves like a real cluster: scheduling on GPU pools, Jobs, garbage collection."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tailor.devcluster import build
from tailor.devcluster.nodes import GPU_RESOURCE, load_pools

from conftest import wait_for

H100 = "NVIDIA-H100-80GB-HBM3"
GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}


def gpu_deployment(name: str, gpus: int, product: str) -> dict[str, Any]:
    labels = {"app": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "nodeSelector": {"nvidia.com/gpu.product": product},
                    "tolerations": [GPU_TOLERATION],
                    "containers": [{"name": "server", "image": "nvcr.io/nvidia/tritonserver:25.10-py3",
                                    "resources": {"limits": {GPU_RESOURCE: str(gpus)}}}],
                },
            },
        },
    }


def test_server_reports_its_true_version(api: client.ApiClient) -> None:
    version = client.VersionApi(api).get_code()
    assert version.git_version == build.kubernetes_version()
    assert (version.major, version.minor) == tuple(build.kubernetes_version().lstrip("v").split(".")[:2])


def test_node_pools_are_ready_with_gpu_capacity_labels_and_taints(api: client.ApiClient) -> None:
    pools = load_pools()
    nodes = {node.metadata.name: node for node in client.CoreV1Api(api).list_node().items}
    assert len(nodes) == sum(pool.count for pool in pools.pools)
    for pool in pools.pools:
        for index in range(pool.count):
            node = nodes[f"{pool.name}-{index}"]
            ready = [c.status for c in node.status.conditions if c.type == "Ready"]
            assert ready == ["True"], node.metadata.name
            if pool.gpu is None:
                assert GPU_RESOURCE not in node.status.allocatable
                assert not node.spec.taints
                continue
            assert node.status.capacity[GPU_RESOURCE] == str(pool.gpu.count)
            assert node.status.allocatable[GPU_RESOURCE] == str(pool.gpu.count)
            assert all(node.metadata.labels[key] == value for key, value in pool.labels.items())
            if pool.gpu.product is None:  # labelled as a cluster without GPU Feature Discovery labels it
                assert not any(key.startswith("nvidia.com/gpu.") for key in node.metadata.labels)
            else:
                assert node.metadata.labels["nvidia.com/gpu.product"] == pool.gpu.product
                assert node.metadata.labels["nvidia.com/gpu.memory"] == str(pool.gpu.memory_mib)
                assert node.metadata.labels["nvidia.com/gpu.count"] == str(pool.gpu.count)
                assert node.metadata.labels["nvidia.com/gpu.family"] == pool.gpu.family
            assert [(t.key, t.value, t.effect) for t in node.spec.taints] == [
                (GPU_RESOURCE, "present", "NoSchedule")]


def test_gpu_deployment_lands_on_the_selected_pool_and_becomes_available(
        api: client.ApiClient, namespace: str) -> None:
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    apps.create_namespaced_deployment(namespace, gpu_deployment("two-gpus", 2, H100))

    wait_for("the Deployment to become Available",
             lambda: has_condition(apps.read_namespaced_deployment_status("two-gpus", namespace).status, "Available"))
    pods = core.list_namespaced_pod(namespace, label_selector="app=two-gpus").items
    assert len(pods) == 1
    node = core.read_node(pods[0].spec.node_name)
    assert node.metadata.labels["nvidia.com/gpu.product"] == H100
    assert pods[0].status.phase == "Running"


def test_request_beyond_any_node_stays_pending_with_failed_scheduling(
        api: client.ApiClient, namespace: str) -> None:
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    apps.create_namespaced_deployment(namespace, gpu_deployment("nine-gpus", 9, H100))
    pod = wait_for("the pod to be created",
                   lambda: core.list_namespaced_pod(namespace, label_selector="app=nine-gpus").items)[0]

    def failed_scheduling() -> list[Any]:
        events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={pod.metadata.name}")
        return [e for e in events.items if e.reason == "FailedScheduling"]

    events = wait_for("a FailedScheduling event", failed_scheduling)
    assert "Insufficient nvidia.com/gpu" in events[0].message
    pod = core.read_namespaced_pod(pod.metadata.name, namespace)
    assert pod.status.phase == "Pending"
    assert pod.spec.node_name is None


def job(name: str, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {"backoffLimit": 0, "template": {
            "metadata": {"annotations": annotations or {}},
            "spec": {"restartPolicy": "Never",
                     "containers": [{"name": "work", "image": "busybox", "command": ["true"]}]}}},
    }


def has_condition(status: Any, condition_type: str) -> bool:
    return any(c.type == condition_type and c.status == "True" for c in status.conditions or [])


def test_job_runs_to_completion(api: client.ApiClient, namespace: str) -> None:
    batch = client.BatchV1Api(api)
    batch.create_namespaced_job(namespace, job("work"))
    wait_for("the Job to complete",
             lambda: has_condition(batch.read_namespaced_job_status("work", namespace).status, "Complete"))
    assert batch.read_namespaced_job_status("work", namespace).status.succeeded == 1


def test_job_whose_pod_fails_reports_failed(api: client.ApiClient, namespace: str) -> None:
    batch = client.BatchV1Api(api)
    batch.create_namespaced_job(namespace, job("broken", {"devcluster.tailor.dev/fail": "simulated OOM"}))
    wait_for("the Job to fail",
             lambda: has_condition(batch.read_namespaced_job_status("broken", namespace).status, "Failed"))
    assert batch.read_namespaced_job_status("broken", namespace).status.failed == 1


def test_deleting_an_owner_garbage_collects_its_dependents(api: client.ApiClient, namespace: str) -> None:
    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    owner = core.create_namespaced_config_map(namespace, {"metadata": {"name": "owner"}})
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "dependent", "ownerReferences": [{
        "apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner.metadata.uid}]}})
    apps.create_namespaced_deployment(namespace, gpu_deployment("owned", 1, H100))
    wait_for("the Deployment's pod", lambda: core.list_namespaced_pod(namespace, label_selector="app=owned").items)

    core.delete_namespaced_config_map("owner", namespace)
    apps.delete_namespaced_deployment("owned", namespace)  # background propagation: the GC removes the rest

    def gone() -> bool:
        names = [cm.metadata.name for cm in core.list_namespaced_config_map(namespace).items]
        replica_sets = apps.list_namespaced_replica_set(namespace, label_selector="app=owned").items
        pods = core.list_namespaced_pod(namespace, label_selector="app=owned").items
        return "dependent" not in names and not replica_sets and not pods

    wait_for("the garbage collector to delete the dependents", gone)


def test_resource_quota_admission_limits_gpus(api: client.ApiClient, namespace: str) -> None:
    core = client.CoreV1Api(api)
    core.create_namespaced_resource_quota(namespace, {
        "metadata": {"name": "gpus"}, "spec": {"hard": {f"requests.{GPU_RESOURCE}": "1"}}})
    wait_for("the quota to be counted",
             lambda: (core.read_namespaced_resource_quota("gpus", namespace).status.hard or {}))
    pod = gpu_deployment("over-quota", 2, H100)["spec"]["template"]
    pod["metadata"] = {"name": "over-quota"}
    with pytest.raises(ApiException) as raised:
        core.create_namespaced_pod(namespace, pod)
    assert raised.value.status == 403
    assert "exceeded quota" in raised.value.body


def test_rbac_denies_a_service_account_without_bindings(namespace: str, kubectl: Callable[..., Any]) -> None:
    user = f"system:serviceaccount:{namespace}:default"
    denied = kubectl("auth", "can-i", "list", "pods", f"--namespace={namespace}", f"--as={user}", check=False)
    assert denied.stdout.strip() == "no"
    kubectl("create", "rolebinding", "view", "--clusterrole=view", f"--serviceaccount={namespace}:default",
            f"--namespace={namespace}")
    allowed = kubectl("auth", "can-i", "list", "pods", f"--namespace={namespace}", f"--as={user}", check=False)
    assert allowed.stdout.strip() == "yes"


def test_hpa_controller_acts_on_a_triton_queue_metric(api: client.ApiClient, namespace: str) -> None:
    apps, autoscaling = client.AppsV1Api(api), client.AutoscalingV2Api(api)
    apps.create_namespaced_deployment(namespace, gpu_deployment("served", 1, H100))
    autoscaling.create_namespaced_horizontal_pod_autoscaler(namespace, {
        "metadata": {"name": "served"},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": "served"},
            "minReplicas": 1,
            "maxReplicas": 3,
            "metrics": [{"type": "Pods", "pods": {
                "metric": {"name": "nv_inference_queue_duration_us"},
                "target": {"type": "AverageValue", "averageValue": "50"}}}],
        },
    })

    def conditions() -> dict[str, tuple[str, str]]:
        status = autoscaling.read_namespaced_horizontal_pod_autoscaler_status("served", namespace).status
        return {c.type: (c.status, c.reason) for c in status.conditions or []}

    # No custom-metrics API is installed yet, so the controller reports that it cannot read the metric.
    found = wait_for("the HPA controller to evaluate the metric", lambda: conditions().get("ScalingActive"))
    assert found == ("False", "FailedGetPodsMetric")
    assert conditions()["AbleToScale"][0] == "True"
