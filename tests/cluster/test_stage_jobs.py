"""Stage Jobs in the devcluster: pods land on nodes of the target GPU with their GPUs, an Indexed Job spreads
over nodes, and a failing stage exhausts its retries (kwok plays the containers)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from kubernetes import client, utils

from tailor.compressor.sizing.hardware import GpuCatalog
from tailor.operator import api as model
from tailor.operator.jobs import JOB_SERVICE_ACCOUNT, JobSettings, stage_job
from tailor.operator.names import job_name
from tailor.operator.placement import gpu_terms, scheduling

from conftest import REPO, wait_for

CATALOG = GpuCatalog.load()
H100 = scheduling(None, gpu_terms(CATALOG.get("H100")))  # any node whose labels name an H100


@pytest.fixture
def owner(api: client.ApiClient, namespace: str) -> Iterator[dict[str, Any]]:
    """A CompressedModel, its artifacts claim bound to a static volume, its plan ConfigMap, and the stage pods'
    ServiceAccount (all of which the operator creates)."""
    body: dict[str, Any] = yaml.safe_load((REPO / "examples" / "nemotron-super-h100.yaml").read_text())
    body["metadata"]["namespace"] = namespace
    created: dict[str, Any] = client.CustomObjectsApi(api).create_namespaced_custom_object(
        model.GROUP, model.API_VERSION, namespace, model.PLURAL, body)
    core = client.CoreV1Api(api)
    core.create_persistent_volume({"metadata": {"name": f"{namespace}-artifacts"}, "spec": {
        "capacity": {"storage": "1Ti"}, "accessModes": ["ReadWriteMany"], "hostPath": {"path": "/tmp/artifacts"},
        "claimRef": {"namespace": namespace, "name": "artifacts"}, "persistentVolumeReclaimPolicy": "Retain"}})
    core.create_namespaced_persistent_volume_claim(namespace, {"metadata": {"name": "artifacts"}, "spec": {
        "accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Ti"}}, "storageClassName": "",
        "volumeName": f"{namespace}-artifacts"}})
    core.create_namespaced_config_map(namespace, {"metadata": {"name": "plan"}, "data": {"plan.yaml": "{}"}})
    core.create_namespaced_service_account(namespace, {"metadata": {"name": JOB_SERVICE_ACCOUNT},
                                                       "automountServiceAccountToken": False})
    wait_for("the claim to bind", lambda: core.read_namespaced_persistent_volume_claim(
        "artifacts", namespace).status.phase == "Bound")
    yield created
    core.delete_persistent_volume(f"{namespace}-artifacts")


def _job(api: client.ApiClient, namespace: str, name: str) -> Any:
    return client.BatchV1Api(api).read_namespaced_job_status(name, namespace)


def _finished(api: client.ApiClient, namespace: str, name: str) -> str | None:
    conditions = _job(api, namespace, name).status.conditions or []
    return next((c.type for c in conditions if c.type in ("Complete", "Failed") and c.status == "True"), None)


@pytest.mark.usefixtures("crd")
def test_an_indexed_compression_job_runs_on_two_h100_nodes(api: client.ApiClient, namespace: str,
                                                            owner: dict[str, Any]) -> None:
    settings = JobSettings(image="tailor:dev", gpus_per_node=8, nodes=2)
    objects = stage_job(owner, "compress", 1, settings, H100, "artifacts", "plan")
    utils.create_from_yaml(api, yaml_objects=objects, namespace=namespace)  # the API server validates each
    name = job_name(owner["metadata"]["name"], 1, "compress")
    assert wait_for("the compression Job to finish", lambda: _finished(api, namespace, name), 90) == "Complete"
    pods = client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector="tailor.dev/stage=compress").items
    # on H100 nodes (GFD, GKE or EC2 labelled) with all 8 GPUs each (kwok may finish the first pod before the
    # second is placed, so both can land on the same node one after the other)
    core = client.CoreV1Api(api)
    found = [CATALOG.for_node(core.read_node(p.spec.node_name).metadata.labels) for p in pods]
    assert len(pods) == 2 and {gpu[0].name if gpu else None for gpu in found} == {"H100-80GB"}
    assert all(p.spec.containers[0].resources.limits["nvidia.com/gpu"] == "8" for p in pods)
    assert {p.metadata.annotations["batch.kubernetes.io/job-completion-index"] for p in pods} == {"0", "1"}


@pytest.mark.usefixtures("crd")
def test_a_failing_stage_is_retried_up_to_its_limit(api: client.ApiClient, namespace: str,
                                                    owner: dict[str, Any]) -> None:
    settings = JobSettings(image="tailor:dev", backoff_limit=1)
    objects = stage_job(owner, "quantize", 1, settings, H100, "artifacts", "plan",
                        placement=model.JobsSpec(pod_annotations={
                            "devcluster.tailor.dev/fail": "calibration ran out of memory"}))
    utils.create_from_yaml(api, yaml_objects=objects, namespace=namespace)
    name = job_name(owner["metadata"]["name"], 1, "quantize")
    assert wait_for("the quantization Job to fail", lambda: _finished(api, namespace, name), 120) == "Failed"
    failed = next(c for c in _job(api, namespace, name).status.conditions if c.type == "Failed")
    assert failed.reason == "BackoffLimitExceeded"
    pods = client.CoreV1Api(api).list_namespaced_pod(namespace, label_selector="tailor.dev/stage=quantize").items
    assert len(pods) == 2  # the first try and one retry
