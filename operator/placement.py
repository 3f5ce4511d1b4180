"""Where a CompressedModel's pods go, from Tailor's choice of nodes and the spec's placement fields
(`api.PodPlacement`: `spec.jobs` for stage Jobs, `spec.deployment.pools[]` for Triton pods).

Tailor picks the nodes (the target GPU's labels for build Jobs, a pool's nodeSelector for its pods) and always
tolerates the GPU taint; the spec adds tolerations, node affinity ANDed with Tailor's choice, a priority class,
labels and annotations, and requests and limits over Tailor's. What a tenant may set is checked by `admit`;
the same rules, read against a node, decide which of a pool's nodes its pods can land on (`admits_node`).
"""

from __future__ import annotations

from typing import Any

from tailor.compressor.sizing.hardware import GpuProfile
from tailor.operator.api import GPU_RESOURCE, NodeSelectorRequirement, NodeSelectorTerm, PodPlacement
from tailor.operator.conditions import Reason, Refused
from tailor.operator.manifest import quantity_value

GPU_TAINT_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"


def tolerations(placement: PodPlacement | None) -> list[dict[str, Any]]:
    """The GPU taint's toleration and the spec's."""
    own = [t.model_dump(by_alias=True, exclude_none=True) for t in (placement.tolerations if placement else [])]
    return [GPU_TAINT_TOLERATION, *own]


def gpu_terms(gpu: GpuProfile) -> list[dict[str, Any]]:
    """Node-affinity terms that find nodes with `gpu`, however the cluster labels them: one per label that names
    it (GPU Feature Discovery's product, GKE's accelerator, an instance type, a team's own), any of which may
    match."""
    return [{"matchExpressions": [{"key": key, "operator": "In", "values": list(values)}]}
            for key, values in gpu.identifying_labels().items()]


def _term(term: NodeSelectorTerm) -> dict[str, Any]:
    return term.model_dump(by_alias=True)


def scheduling(placement: PodPlacement | None, terms: list[dict[str, Any]] | None = None,
               node_selector: dict[str, str] | None = None) -> dict[str, Any]:
    """The pod spec fields that place a pod: Tailor's node-affinity `terms` (any one may match) or
    `node_selector`, each of them ANDed with every required term of the spec, the spec's preferred terms,
    tolerations and priority class."""
    spec: dict[str, Any] = {"tolerations": tolerations(placement)}
    if node_selector:
        spec["nodeSelector"] = dict(sorted(node_selector.items()))
    affinity = placement.node_affinity if placement else None
    required = [_term(t) for t in affinity.required_during_scheduling_ignored_during_execution.node_selector_terms
                ] if affinity and affinity.required_during_scheduling_ignored_during_execution else []
    if terms and required:  # OR of terms, each an AND: Tailor's (t1 | t2) & spec's (s1 | s2) is (ti & sj) for all
        required = [{"matchExpressions": t["matchExpressions"] + s["matchExpressions"]} for t in terms
                    for s in required]
    else:
        required = list(terms or required)
    node_affinity: dict[str, Any] = {}
    if required:
        node_affinity["requiredDuringSchedulingIgnoredDuringExecution"] = {"nodeSelectorTerms": required}
    if affinity and affinity.preferred_during_scheduling_ignored_during_execution:
        node_affinity["preferredDuringSchedulingIgnoredDuringExecution"] = [
            p.model_dump(by_alias=True) for p in affinity.preferred_during_scheduling_ignored_during_execution]
    if node_affinity:
        spec["affinity"] = {"nodeAffinity": node_affinity}
    if placement and placement.priority_class_name:
        spec["priorityClassName"] = placement.priority_class_name
    return spec


def pod_metadata(placement: PodPlacement | None, labels: dict[str, str],
                 annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """The pod template's labels and annotations: the spec's, with Tailor's over them."""
    return {"labels": {**(placement.pod_labels if placement else {}), **labels},
            "annotations": {**(placement.pod_annotations if placement else {}), **(annotations or {})}}


MEMORY_RATIO = 4  # a spec's memory request is at least Tailor's over this; its limit at most this times the request


def _memory_bounded(field: str, tailors: tuple[str, str | None], asked: tuple[str | None, str | None],
                    request: str) -> None:
    """Refused when the spec's memory request (`asked`) is below Tailor's over MEMORY_RATIO, or its memory limit
    above both Tailor's limit and MEMORY_RATIO times the pod's request: a request of "1" under a limit of 1Pi would
    undo every pod's memory bound (scheduled as nothing, free to take the node). A larger request than Tailor's is
    the spec's to ask (a stage's figure is an allowance, not the model's need), and its limit may follow it."""
    if asked[0] is not None and quantity_value(asked[0]) < quantity_value(tailors[0]) / MEMORY_RATIO:
        raise Refused(Reason.INVALID_SPEC, f"{field}: the memory request {asked[0]} is below a {MEMORY_RATIO}th "
                                           f"of Tailor's {tailors[0]} (what this pod holds)")
    ceiling = max(quantity_value(tailors[1] or "0"), MEMORY_RATIO * quantity_value(request))
    if asked[1] is not None and quantity_value(asked[1]) > ceiling:
        raise Refused(Reason.INVALID_SPEC, f"{field}: the memory limit {asked[1]} is more than {MEMORY_RATIO}x the "
                                           f"request {request} and Tailor's limit: raise the request with it")


def resources(requests: dict[str, str], gpus: int, placement: PodPlacement | None, field: str,
              limits: dict[str, str] | None = None) -> dict[str, Any]:
    """A container's requests and limits: Tailor's `requests` and `limits` with the spec's over them, and `gpus`
    GPUs, which stay Tailor's. A spec's request above Tailor's limit raises that limit to it (the spec asked for
    more); a limit the spec sets below its request, and a memory request or limit out of MEMORY_RATIO
    (`_memory_bounded`), are refused naming `field`, before the API server refuses the pod."""
    own = placement.resources if placement else None
    asked = own.requests if own else {}
    tailors = requests.get("memory"), (limits or {}).get("memory")
    requests = {**requests, **asked}
    limits = {**{name: max(limit, asked[name], key=quantity_value) if name in asked else limit
                 for name, limit in (limits or {}).items()}, **(own.limits if own else {})}
    for name, limit in limits.items():
        if name in requests and quantity_value(limit) < quantity_value(requests[name]):
            raise Refused(Reason.INVALID_SPEC, f"{field}: the {name} limit {limit} is below its request "
                                               f"{requests[name]} (Tailor's, or the spec's)")
    if "memory" in requests:
        _memory_bounded(field, (tailors[0] or requests["memory"], tailors[1]),
                        (asked.get("memory"), (own.limits if own else {}).get("memory")), requests["memory"])
    if gpus:
        requests[GPU_RESOURCE] = limits[GPU_RESOURCE] = str(gpus)
    return {"requests": requests, **({"limits": limits} if limits else {})}


def _meets(requirement: NodeSelectorRequirement, labels: dict[str, str]) -> bool:
    value, op = labels.get(requirement.key), requirement.operator
    if op in ("Exists", "DoesNotExist"):
        return (value is not None) == (op == "Exists")
    if op in ("In", "NotIn"):
        return (value in requirement.values) == (op == "In")
    if value is None or not value.lstrip("-").isdigit():
        return False
    return int(value) > int(requirement.values[0]) if op == "Gt" else int(value) < int(requirement.values[0])


def _tolerated(taint: dict[str, Any], placement: PodPlacement | None) -> bool:
    for toleration in tolerations(placement):
        if toleration.get("effect") not in (None, taint.get("effect")) or toleration["key"] != taint.get("key"):
            continue
        if toleration.get("operator") == "Exists" or toleration.get("value") == taint.get("value"):
            return True
    return False


def admits_node(placement: PodPlacement | None, node: dict[str, Any]) -> str | None:
    """None when pods with this placement can be scheduled on `node` (its taints tolerated, the spec's required
    node affinity met), else why not."""
    name, labels = node["metadata"]["name"], node["metadata"].get("labels") or {}
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not _tolerated(taint, placement):
            shown = f"{taint.get('key')}{'=' + taint['value'] if taint.get('value') else ''}:{taint.get('effect')}"
            return f"node {name} has the taint {shown}, which the pool's tolerations do not tolerate"
    affinity = placement.node_affinity if placement else None
    required = affinity.required_during_scheduling_ignored_during_execution if affinity else None
    if required and not any(all(_meets(r, labels) for r in term.match_expressions)
                            for term in required.node_selector_terms):
        return f"node {name} meets none of the pool's nodeAffinity required terms"
    return None
