"""Pool sizing from the devcluster's real Node objects, and the serving objects built from it, created in the
real API server (schema validation, ownership) and garbage-collected with their CompressedModel."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from kubernetes import client, utils

from tailor.compressor.model.architecture import load_architecture
from tailor.compressor.sizing.engines import Engine
from tailor.compressor.sizing.hardware import GpuCatalog, Precision
from tailor.compressor.sizing.memory import KvDtype, recipe_for
from tailor.operator import api as model
from tailor.operator.deployment import manifests, service
from tailor.operator.pools import Built

from compressedmodels import plan_deployment
from conftest import REPO, wait_for

KINDS = ("Deployment", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler")


def _owned(api: client.ApiClient, namespace: str) -> list[str]:
    """kind/name of the serving objects in the namespace."""
    selector = {"label_selector": "app.kubernetes.io/managed-by=tailor"}
    listings = {
        "Deployment": client.AppsV1Api(api).list_namespaced_deployment(namespace, **selector),
        "Service": client.CoreV1Api(api).list_namespaced_service(namespace, **selector),
        "PodDisruptionBudget": client.PolicyV1Api(api).list_namespaced_pod_disruption_budget(namespace, **selector),
        "HorizontalPodAutoscaler": client.AutoscalingV2Api(api).list_namespaced_horizontal_pod_autoscaler(
            namespace, **selector),
    }
    return sorted(f"{kind}/{item.metadata.name}" for kind, listing in listings.items() for item in listing.items)


@pytest.mark.usefixtures("crd")
def test_pools_sized_from_live_nodes_deploy_and_go_with_their_model(api: client.ApiClient, namespace: str) -> None:
    body: dict[str, Any] = yaml.safe_load((REPO / "examples" / "nemotron-super-b200.yaml").read_text())
    body["metadata"]["namespace"] = namespace
    created = client.CustomObjectsApi(api).create_namespaced_custom_object(
        model.GROUP, model.API_VERSION, namespace, model.PLURAL, body)
    spec = model.CompressedModel.model_validate(created).spec
    nodes = [client.ApiClient().sanitize_for_serialization(node)
             for node in client.CoreV1Api(api).list_node().items]
    assert spec.deployment is not None
    child = load_architecture("nemotron-3-puzzle-75b-a9b")
    built = Built(arch=child, recipe=recipe_for(Precision.NVFP4, child), kv_dtype=KvDtype.FP8)
    plans = plan_deployment(spec.deployment, nodes, built, GpuCatalog.load())
    assert [(p.name, p.gpu_profile, len(p.nodes), p.skipped) for p in plans] == [
        ("b200", "B200-180GB", 1, None), ("h100", "H100-80GB", 2, None)]
    assert spec.deployment is not None
    engine = {"max_num_seqs": 8}  # the engine arguments' annotation, validated by the API server with the rest
    objects = [m for plan in plans for m in (service(created, plan.name, 1, Engine.VLLM),
                                             *manifests(created, plan, spec.deployment, "artifacts", "g1/repo", 1,
                                                        spec.deployment.triton_image, engine,
                                                        frontend_image=model.RUNTIME_IMAGE))]
    utils.create_from_yaml(api, yaml_objects=objects, namespace=namespace)  # the API server validates each
    name = body["metadata"]["name"]
    assert _owned(api, namespace) == sorted([f"{kind}/{name}-{pool}-g1" for pool in ("b200", "h100") for kind in KINDS
                                             if kind != "Service"] + [f"Service/{name}-b200", f"Service/{name}-h100"])
    client.CustomObjectsApi(api).delete_namespaced_custom_object(
        model.GROUP, model.API_VERSION, namespace, model.PLURAL, body["metadata"]["name"])
    wait_for("the garbage collector to delete the owned objects", lambda: not _owned(api, namespace), timeout_s=90)
