"""The CompressedModel CRD in a real API server: validation, defaults, printer columns, agreement."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from tailor.operator import api as model

from corpus import BASE, INVALID, VALID, Case, example_bodies, patched

Objects = client.CustomObjectsApi


def create(api: client.ApiClient, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
    return Objects(api).create_namespaced_custom_object(  # type: ignore[no-any-return]
        model.GROUP, model.API_VERSION, namespace, model.PLURAL, body, field_validation="Strict")


def server_verdict(api: client.ApiClient, namespace: str, body: dict[str, Any]) -> str | None:
    """None if the API server accepts `body`, else its message."""
    try:
        create(api, namespace, body)
    except ApiException as error:
        assert error.status in (400, 422), error
        return str(json.loads(error.body)["message"])
    return None


def pydantic_accepts(body: dict[str, Any]) -> bool:
    try:
        model.CompressedModel.model_validate(body)
    except ValidationError:
        return False
    return True


@pytest.mark.usefixtures("crd")
@pytest.mark.parametrize("case", INVALID, ids=lambda c: c.name)
def test_invalid_object_is_rejected_naming_the_field(api: client.ApiClient, namespace: str, case: Case) -> None:
    message = server_verdict(api, namespace, case.body)
    assert message is not None, f"{case.name} was accepted"
    assert case.field in message, message
    assert not pydantic_accepts(case.body), "pydantic and the API server disagree"


@pytest.mark.usefixtures("crd")
def test_valid_objects_and_examples_are_accepted_by_both(api: client.ApiClient, namespace: str) -> None:
    bodies = [(c.name, c.body) for c in VALID] + example_bodies()
    for index, (name, body) in enumerate(bodies):
        body["metadata"] = {"name": f"valid-{index}"}
        assert server_verdict(api, namespace, body) is None, name
        assert pydantic_accepts(body), name


@pytest.mark.usefixtures("crd")
def test_server_defaults_equal_pydantic_defaults(api: client.ApiClient, namespace: str) -> None:
    stored = create(api, namespace, patched({"metadata": {"name": "defaults"}}))
    expected = model.CompressedModelSpec.model_validate(BASE["spec"]).model_dump(
        by_alias=True, exclude_none=True, mode="json")
    assert stored["spec"] == expected


@pytest.mark.usefixtures("crd")
def test_source_is_immutable(api: client.ApiClient, namespace: str) -> None:
    create(api, namespace, patched({"metadata": {"name": "immutable"}}))
    with pytest.raises(ApiException) as raised:
        Objects(api).patch_namespaced_custom_object(
            model.GROUP, model.API_VERSION, namespace, model.PLURAL, "immutable",
            {"spec": {"source": {"uri": "hf://other/model"}}})
    assert raised.value.status == 422
    assert "spec.source" in raised.value.body and "immutable" in raised.value.body


@pytest.mark.usefixtures("crd")
def test_status_is_a_validated_subresource(api: client.ApiClient, namespace: str) -> None:
    objects = Objects(api)
    create(api, namespace, patched({"metadata": {"name": "status"}, "status": {"phase": "Ready"}}))
    stored = objects.get_namespaced_custom_object(model.GROUP, model.API_VERSION, namespace, model.PLURAL, "status")
    assert "status" not in stored, "status must only change through the status subresource"
    with pytest.raises(ApiException) as raised:
        objects.patch_namespaced_custom_object_status(model.GROUP, model.API_VERSION, namespace, model.PLURAL,
                                                      "status", {"status": {"phase": "Bogus"}})
    assert "status.phase" in raised.value.body


@pytest.mark.usefixtures("crd")
def test_kubectl_get_shows_the_printer_columns(api: client.ApiClient, namespace: str,
                                               kubectl: Callable[..., Any]) -> None:
    create(api, namespace, patched({"metadata": {"name": "printed"}}))
    status = model.CompressedModelStatus(
        phase="Quantizing", progress="Quantize 40%", observed_generation=1, ready_replicas=2,
        architecture=model.ArchitectureSummary(total_params_billions=75.3, active_params_billions=9.3,
                                               precision="fp8"))
    Objects(api).patch_namespaced_custom_object_status(
        model.GROUP, model.API_VERSION, namespace, model.PLURAL, "printed",
        {"status": status.model_dump(by_alias=True, exclude_none=True, mode="json")})
    lines = kubectl("get", "cmodel", "-A").stdout.splitlines()
    assert lines[0].split() == ["NAMESPACE", "NAME", "PHASE", "PROGRESS", "PARAMS(B)", "ACTIVE(B)", "PRECISION",
                                "READY", "AGE"]
    row = next(re.split(r"\s{2,}", line) for line in lines[1:] if line.split()[:2] == [namespace, "printed"])
    assert row[2:8] == ["Quantizing", "Quantize 40%", "75.3", "9.3", "fp8", "2"]
