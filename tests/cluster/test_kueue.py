"""Stage Jobs queued by a real Kueue (its manager built from its Go module: `tailor devcluster up --kueue`), as a
platform team's cluster queues them: a ClusterQueue with less GPU quota than two builds need at once."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from tailor.devcluster import cluster
from tailor.devcluster.simulated import published_results

from cmodels import OBJECTS, cmodel, h100_example, wait_phase
from conftest import wait_for

KUEUE = ("kueue.x-k8s.io", "v1beta2")


@pytest.fixture
def gpu_queue(devcluster: cluster.Layout, api: client.ApiClient, namespace: str) -> Iterator[str]:
    """Kueue running, and a LocalQueue `builds` in `namespace` on a ClusterQueue of one GPU (and ample CPU and
    memory) for that namespace alone."""
    cluster.up(queueing=True)  # keeps what runs; starts Kueue if it does not
    objects = client.CustomObjectsApi(api)
    flavor = {"apiVersion": "/".join(KUEUE), "kind": "ResourceFlavor", "metadata": {"name": namespace}}
    queue = {"apiVersion": "/".join(KUEUE), "kind": "ClusterQueue", "metadata": {"name": namespace}, "spec": {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
        "resourceGroups": [{"coveredResources": ["cpu", "memory", "nvidia.com/gpu"], "flavors": [{
            "name": namespace, "resources": [{"name": "cpu", "nominalQuota": "1000"},
                                             {"name": "memory", "nominalQuota": "100Ti"},
                                             {"name": "nvidia.com/gpu", "nominalQuota": "1"}]}]}]}}
    local = {"apiVersion": "/".join(KUEUE), "kind": "LocalQueue", "metadata": {"name": "builds"},
             "spec": {"clusterQueue": namespace}}
    objects.create_cluster_custom_object(*KUEUE, "resourceflavors", flavor)
    objects.create_cluster_custom_object(*KUEUE, "clusterqueues", queue)
    objects.create_namespaced_custom_object(*KUEUE, namespace, "localqueues", local)
    yield "builds"
    objects.delete_namespaced_custom_object(*KUEUE, namespace, "localqueues", "builds")
    objects.delete_cluster_custom_object(*KUEUE, "clusterqueues", namespace)
    objects.delete_cluster_custom_object(*KUEUE, "resourceflavors", namespace)


def test_kueue_admits_one_build_stage_at_a_time_within_its_gpu_quota(api: client.ApiClient, namespace: str,
                                                                       operator: Any, gpu_queue: str) -> None:
    """Two builds, one GPU of quota: every stage Job is created suspended in the queue; while one runs, the other
    object is Pending with Kueue's reason in its status; each starts once quota is free, and both become Ready."""
    objects, batch = client.CustomObjectsApi(api), client.BatchV1Api(api)
    for name in ("first", "second"):
        body = h100_example(name, published_results())
        del body["spec"]["deployment"]  # builds only: the GPUs they ask for are what the quota holds
        body["spec"]["jobs"]["queueName"] = gpu_queue
        OBJECTS.create(objects, namespace, body)
        wait_for(f"{name}'s compress Job", lambda n=name: batch.list_namespaced_job(
            namespace, label_selector=f"tailor.dev/model={n}").items)

    def second_waits() -> dict[str, Any] | None:
        status = (cmodel(objects, namespace, "second") or {}).get("status") or {}
        stages = status.get("stages") or [{}]
        return stages[0] if status.get("phase") == "Pending" and stages[0].get("reason") == "Queued" else None

    compress = wait_for("the second build to wait in Kueue's queue", second_waits, timeout_s=60)
    assert compress["state"] == "Pending" and compress["message"].startswith(f"waiting in Kueue LocalQueue {gpu_queue}")
    assert "insufficient unused quota for nvidia.com/gpu" in compress["message"], compress["message"]
    for name in ("first", "second"):
        wait_phase(objects, namespace, name, "Ready", operator, timeout_s=240)

    ran = sorted((job.status.start_time, job.status.completion_time, job.metadata.name)
                 for job in batch.list_namespaced_job(namespace).items)
    assert len(ran) == 6  # compress, quantize and evaluate of each, every one queued
    for job in batch.list_namespaced_job(namespace).items:
        assert job.metadata.labels["kueue.x-k8s.io/queue-name"] == gpu_queue and job.spec.suspend is False
    for (_, ended, before), (started, _, after) in itertools.pairwise(ran):
        assert started >= ended, f"{after} started before {before} ended: the quota holds one GPU"
    workloads = objects.list_namespaced_custom_object(*KUEUE, namespace, "workloads")["items"]
    assert len(workloads) == 6 and all(
        any(c["type"] == "Finished" and c["status"] == "True" for c in w["status"]["conditions"]) for w in workloads)
