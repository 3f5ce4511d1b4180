"""Generate the CompressedModel CustomResourceDefinition from the pydantic models in `api` (their structural
schema: `schema.structural`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from tailor.operator import api
from tailor.operator.schema import structural

ROOT = Path(__file__).resolve().parent.parent
CRD_FILE = ROOT / "crds" / "compressedmodel.yaml"
CHART_CRD_FILE = ROOT / "charts" / "tailor" / "crds" / "compressedmodel.yaml"  # Helm installs it from there
REFERENCE_FILE = ROOT / "docs" / "reference" / "compressedmodel.md"

PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Progress", "type": "string", "jsonPath": ".status.progress",
     "description": "The build stage under way: its current step's share, or why it waits"},
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
    spec_schema = structural(api.CompressedModelSpec)
    status_schema = structural(api.CompressedModelStatus)
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
                "name": api.API_VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": PRINTER_COLUMNS,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "A large language model compressed, quantized and served to fit a GPU fleet.",
                    "required": ["spec"],
                    **api.cel_rules(api.NAME_IS_LABEL, api.NAME_FITS, api.POOL_NAMES_FIT),
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


def _constraints(node: dict[str, Any]) -> str:
    """The validation of one schema node, in words."""
    parts = []
    if "enum" in node:
        parts.append("one of " + ", ".join(f"`{v}`" for v in node["enum"]))
    for key, word in (("minimum", ">="), ("maximum", "<="), ("minLength", "length >="), ("maxLength", "length <="),
                      ("minItems", "items >="), ("maxItems", "items <="), ("maxProperties", "entries <=")):
        if key in node:
            parts.append(f"{word} {node[key]}")
    if "pattern" in node:
        parts.append(f"matches `{node['pattern']}`")
    if node.get("x-kubernetes-preserve-unknown-fields"):
        parts.append("free-form")
    return "; ".join(parts)


def _rows(node: dict[str, Any], path: str, required: bool) -> list[str]:
    kind = node.get("type", "")
    if kind == "array":
        kind = f"[]{node.get('items', {}).get('type', '')}"
    default = f"`{json.dumps(node['default'])}`" if "default" in node else ""
    description = " ".join(node.get("description", "").split()).replace("|", "\\|")
    rules = [r["message"] for r in node.get("x-kubernetes-validations", [])]
    notes = "; ".join(filter(None, [_constraints(node), *rules])).replace("|", "\\|")
    rows = [f"| `{path}` | {kind} | {'yes' if required else ''} | {default} | {description} | {notes} |"]
    children = node.get("properties") or node.get("items", {}).get("properties") or {}
    child_required = set(node.get("required") or node.get("items", {}).get("required") or [])
    prefix = f"{path}[]" if node.get("type") == "array" else path
    for name, child in children.items():
        rows += _rows(child, f"{prefix}.{name}", name in child_required)
    return rows


def render_reference() -> str:
    """The CompressedModel field reference (docs/reference/compressedmodel.md), from the same schema as the CRD."""
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    lines = ["<!-- Generated from tailor/operator/api.py by `tailor crd generate`; do not edit by hand. -->",
             f"# CompressedModel field reference ({api.GROUP}/{api.API_VERSION})", "",
             schema["description"], "",
             "Rules that span fields (the API server enforces them with CEL) are listed on the field they name.",
             "`kubectl explain compressedmodel.spec` shows the same text from the cluster.", ""]
    for part in ("spec", "status"):
        node = schema["properties"][part]
        lines += [f"## {part}", "", " ".join(node.get("description", "").split()), "",
                  "| field | type | required | default | description | validation |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [row for name, child in node["properties"].items()
                  for row in _rows(child, f"{part}.{name}", name in set(node.get("required", [])))]
        lines.append("")
    return "\n".join(lines)


def generated() -> dict[Path, str]:
    """Every file generated from the models, and its text."""
    text = render_crd()
    return {CRD_FILE: text, CHART_CRD_FILE: text, REFERENCE_FILE: render_reference()}
