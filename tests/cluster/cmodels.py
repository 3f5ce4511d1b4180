"""Helpers for tests that drive CompressedModels through the operator."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tailor.operator import api as model


class _Objects:
    """create / patch / delete CompressedModels through the custom objects API."""

    def create(self, objects: client.CustomObjectsApi, namespace: str, body: dict[str, Any]) -> None:
        body = {"apiVersion": f"{model.GROUP}/{model.API_VERSION}", "kind": model.KIND, **body}
        objects.create_namespaced_custom_object(model.GROUP, model.API_VERSION, namespace, model.PLURAL, body)

    def patch(self, objects: client.CustomObjectsApi, namespace: str, name: str, patch: dict[str, Any]) -> None:
        objects.api_client.set_default_header("Content-Type", "application/merge-patch+json")
        try:
            objects.patch_namespaced_custom_object(model.GROUP, model.API_VERSION, namespace, model.PLURAL, name, patch)
        finally:
            objects.api_client.default_headers.pop("Content-Type", None)


    def delete(self, objects: client.CustomObjectsApi, namespace: str, name: str) -> None:
        objects.delete_namespaced_custom_object(model.GROUP, model.API_VERSION, namespace, model.PLURAL, name)


OBJECTS = _Objects()
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def h100_example(name: str, annotations: dict[str, str]) -> dict[str, Any]:
    """`examples/nemotron-super-h100.yaml` (NVFP4 weights, weight-only on Hopper, at 10^6 tokens) named `name`, its
    stage pods annotated with `annotations` (how kwok learns their results), its parent private."""
    body: dict[str, Any] = yaml.safe_load((EXAMPLES / "nemotron-super-h100.yaml").read_text())
    body["metadata"] = {"name": name}
    spec = body["spec"]
    spec["source"] = {"uri": "hf://example-org/private-parent",  # its config is unknown here: no pre-flight check
                      "credentialsSecret": {"name": f"{name}-credentials"}}  # its own
    spec["jobs"] = {"podAnnotations": annotations, "backoffLimit": 1}
    return body


def cmodel(objects: client.CustomObjectsApi, namespace: str, name: str) -> dict[str, Any] | None:
    try:
        found: dict[str, Any] = objects.get_namespaced_custom_object(model.GROUP, model.API_VERSION, namespace,
                                                                      model.PLURAL, name)
        return found
    except ApiException as error:
        if error.status == 404:
            return None
        raise


def wait_phase(objects: client.CustomObjectsApi, namespace: str, name: str, phase: str, operator: Any,
               generation: int = 1, timeout_s: float = 90) -> dict[str, Any]:
    """Wait until the object reports `phase` for `generation`; fail with its status and the operator's log."""
    deadline, found = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        found = cmodel(objects, namespace, name)
        status = (found or {}).get("status") or {}
        if status.get("phase") == phase and status.get("observedGeneration") == generation:
            return found or {}
        time.sleep(0.3)
    raise AssertionError(f"{name} did not reach {phase} (generation {generation}) in {timeout_s:.0f}s; status: "
                         f"{(found or {}).get('status')}\noperator log:\n{operator.log_tail()}")


def jobs(api: client.ApiClient, namespace: str) -> list[str]:
    return sorted(j.metadata.name for j in client.BatchV1Api(api).list_namespaced_job(namespace).items)


def events(api: client.ApiClient, namespace: str, name: str) -> list[str]:
    found = client.CoreV1Api(api).list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name},involvedObject.kind={model.KIND}").items
    return [e.reason for e in found]
