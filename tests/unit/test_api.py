"""The pydantic models and the CRD generated from them, without a cluster."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from tailor.operator import crd
from tailor.operator.api import CompressedModel

from corpus import INVALID, VALID, example_bodies


@pytest.mark.parametrize("case", VALID, ids=lambda c: c.name)
def test_valid_objects_parse(case: Any) -> None:
    CompressedModel.model_validate(case.body)


@pytest.mark.parametrize(("name", "body"), example_bodies())
def test_examples_parse(name: str, body: dict[str, Any]) -> None:
    CompressedModel.model_validate(body)


@pytest.mark.parametrize("case", INVALID, ids=lambda c: c.name)
def test_invalid_objects_are_rejected(case: Any) -> None:
    with pytest.raises(ValidationError):
        CompressedModel.model_validate(case.body)


@pytest.mark.parametrize("case", [c for c in INVALID if c.name.startswith("data-")], ids=lambda c: c.name)
def test_bad_text_on_a_claim_is_refused_naming_the_field(case: Any) -> None:
    with pytest.raises(ValidationError) as raised:
        CompressedModel.model_validate(case.body)
    (error,) = raised.value.errors()
    where, field = ".".join(str(part) for part in error["loc"]), case.field.rsplit(".", 1)
    assert where == case.field or (where == field[0] and field[1] in error["msg"]), (where, error["msg"])


def test_defaults_fill_in() -> None:
    spec = CompressedModel.model_validate(VALID[0].body).spec
    assert spec.quantization.precision == "auto"
    assert spec.compression.rounds == 3
    assert spec.compression.min_quality_retention == 0.97
    assert spec.deployment is not None and spec.deployment.autoscaling.metric == "requestsWaiting"


def test_crd_file_is_generated_from_the_models() -> None:
    assert crd.CRD_FILE.read_text() == crd.render_crd(), "run `tailor crd generate`"


def _walk(node: dict[str, Any], path: str) -> list[str]:
    """Paths of schema nodes that are not structural (no type, or leftovers of JSON Schema)."""
    problems = [] if "type" in node else [path]
    problems += [f"{path}.{key}" for key in ("$ref", "anyOf", "allOf", "title", "$defs") if key in node]
    for name, child in node.get("properties", {}).items():
        problems += _walk(child, f"{path}.{name}")
    if isinstance(node.get("additionalProperties"), dict):
        problems += _walk(node["additionalProperties"], f"{path}.*")
    if "items" in node:
        problems += _walk(node["items"], f"{path}[]")
    return problems


def test_crd_schema_is_structural() -> None:
    schema = yaml.safe_load(crd.CRD_FILE.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert _walk(schema, "") == []
    assert schema["properties"]["spec"]["properties"]["compression"]["properties"]["throughputFactor"]["minimum"] == 1


def test_every_field_is_described() -> None:
    schema = yaml.safe_load(crd.CRD_FILE.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]

    def undescribed(node: dict[str, Any], path: str) -> list[str]:
        missing = [] if "description" in node or path.count(".") == 0 else [path]
        for name, child in node.get("properties", {}).items():
            missing += undescribed(child, f"{path}.{name}")
        return missing

    assert undescribed(schema["properties"]["spec"], "spec") == []


def test_operator_imports_without_torch_or_modelopt() -> None:
    code = ("import sys, tailor.operator.api, tailor.operator.crd; "
            "heavy = [m for m in ('torch', 'modelopt', 'transformers') if m in sys.modules]; "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)
