"""pydantic models as the API server's structural OpenAPI v3 schema.

pydantic writes JSON Schema (draft 2020-12); the API server wants a structural schema: every `$ref` inlined,
`Optional[X]` as a plain optional X, exclusive bounds as booleans, no titles and no `additionalProperties: false`
beside `properties` (unknown fields are pruned by the server and rejected by strict field validation).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

# Keys that carry over unchanged from JSON Schema to the structural schema.
_KEPT = {"type", "description", "default", "enum", "format", "pattern", "minLength", "maxLength", "minimum",
         "maximum", "minItems", "maxItems", "minProperties", "maxProperties", "required",
         "x-kubernetes-validations", "x-kubernetes-list-type", "x-kubernetes-list-map-keys"}


def _node(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Convert one pydantic JSON Schema node to its structural OpenAPI v3 form."""
    if "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _node(merged, defs)
    if "anyOf" in node:
        options = [option for option in node["anyOf"] if option.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"only Optional[X] unions map to a structural schema, got {node['anyOf']}")
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if rest.get("default", ...) is None:
            del rest["default"]
        return _node({**options[0], **rest}, defs)

    out: dict[str, Any] = {k: v for k, v in node.items() if k in _KEPT}
    for exclusive, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(node.get(exclusive), bool):  # structural already: a schema given whole (planOverrides')
            out[exclusive] = node[exclusive]
        elif exclusive in node:
            out[bound], out[exclusive] = node[exclusive], True
    if "const" in node:
        out["enum"] = [node["const"]]
    if "properties" in node:
        out["type"] = "object"
        out["properties"] = {name: _node(child, defs) for name, child in node["properties"].items()}
    elif isinstance(node.get("additionalProperties"), dict):
        out["additionalProperties"] = _node(node["additionalProperties"], defs)
    if "items" in node:
        out["items"] = _node(node["items"], defs)
    if "type" not in out:
        raise ValueError(f"schema node without a type cannot be structural: {node}")
    return out


def structural(model: type[BaseModel]) -> dict[str, Any]:
    """`model`'s structural schema, by its aliases."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    return _node(raw, raw.get("$defs", {}))
