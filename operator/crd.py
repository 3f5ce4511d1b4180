"""Generate the CompressedModel CustomResourceDefinition from the pydantic models in `api`.

pydantic writes JSON Schema (draft 2020-12); the API server wants a structural OpenAPI v3 schema:
every `$ref` inlined, `Optional[X]` as a plain optional X, exclusive bounds as booleans, no titles and
no `additionalProperties: false` beside `properties` (unknown fields are pruned by the server and
rejected by strict field validation).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tailor.operator import api

CRD_FILE = Path(__file__).resolve().parent.parent / "crds" / "compressedmodel.yaml"

# Keys that carry over unchanged from JSON Schema to the structural schema.
_KEPT = {"type", "description", "default", "enum", "format", "pattern", "minLength", "maxLength", "minimum",
         "maximum", "minItems", "maxItems", "minProperties", "maxProperties", "required",
         "x-kubernetes-validations", "x-kubernetes-list-type", "x-kubernetes-list-map-keys",
         "x-kubernetes-preserve-unknown-fields"}


def _structural(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Convert one pydantic JSON Schema node to its structural OpenAPI v3 form."""
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _structural(merged, defs)
    if "anyOf" in node:
        options = [option for option in node["anyOf"] if option.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"only Optional[X] unions map to a structural schema, got {node['anyOf']}")
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if rest.get("default", ...) is None:
            del rest["default"]
        return _structural({**options[0], **rest}, defs)

    out: dict[str, Any] = {k: v for k, v in node.items() if k in _KEPT}
    if "exclusiveMinimum" in node:
        out["minimum"], out["exclusiveMinimum"] = node["exclusiveMinimum"], True
    if "exclusiveMaximum" in node:
        out["maximum"], out["exclusiveMaximum"] = node["exclusiveMaximum"], True
    if "const" in node:
        out["enum"] = [node["const"]]
    if "properties" in node:
        out["type"] = "object"
        out["properties"] = {name: _structural(child, defs) for name, child in node["properties"].items()}
    elif isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = _structural(node["additionalProperties"], defs)
    if "items" in node:
        out["items"] = _structural(node["items"], defs)
    if "type" not in out:
        raise ValueError(f"schema node without a type cannot be structural: {node}")
    return out


def _schema(model: type[api.ApiModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _structural(raw, raw.get("$defs", {}))


PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Params(B)", "type": "number", "jsonPath": ".status.architecture.totalParamsBillions",
     "description": "Total parameters of the child, in billions"},
    {"name": "Active(B)", "type": "number", "jsonPath": ".status.architecture.activeParamsBillions",
     "description": "Parameters active per token, in billions"},
    {"name": "Precision", "type": "string", "jsonPath": ".status.architecture.precision"},
    {"name": "Ready", "type": "integer", "jsonPath": ".status.readyReplicas",
     "description": "Ready Triton replicas over all pools"},
    {"name": "Target", "type": "string", "jsonPath": ".spec.compression.targetGPU", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def build_crd() -> dict[str, Any]:
    """The CustomResourceDefinition manifest."""
    spec_schema = _schema(api.CompressedModelSpec)
    status_schema = _schema(api.CompressedModelStatus)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{api.PLURAL}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {"kind": api.KIND, "listKind": f"{api.KIND}List", "plural": api.PLURAL,
                      "singular": api.SINGULAR, "shortNames": list(api.SHORT_NAMES), "categories": ["tailor"]},
            "versions": [{
                "name": api.VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": PRINTER_COLUMNS,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "A large language model compressed, quantized and served to fit a GPU fleet.",
                    "required": ["spec"],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": spec_schema,
                        "status": status_schema,
                    },
                }},
            }],
        },
    }


HEADER = "# Generated from tailor/operator/api.py by `tailor crd generate`; do not edit by hand.\n"


def render_crd() -> str:
    return HEADER + yaml.safe_dump(build_crd(), sort_keys=False, width=120)


def write_crd(path: Path = CRD_FILE) -> None:
    """Write the CRD atomically."""
    temporary = path.with_suffix(".yaml.tmp")
    temporary.write_text(render_crd())
    temporary.replace(path)
