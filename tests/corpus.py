"""Valid and invalid CompressedModel objects, shared by the pydantic tests and the API-server tests.

Each invalid case names the field path the API server's message must contain.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.yaml"))

BASE: dict[str, Any] = {
    "apiVersion": "tailor.dev/v1alpha1",
    "kind": "CompressedModel",
    "metadata": {"name": "corpus"},
    "spec": {
        "source": {"uri": "hf://nvidia/NVIDIA-Nemotron-3-Super-120B-A12B-BF16"},
        "compression": {"targetGPU": "H100-80GB", "memoryBudgetPerGPU": "78Gi", "contextLength": 1048576},
        "deployment": {
            "pools": [{"name": "h100", "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                       "concurrency": {"perNode": 8}}],
            "contextLength": 1048576,
        },
    },
}

DELETE = object()


def patched(patch: dict[str, Any], base: dict[str, Any] | None = None) -> dict[str, Any]:
    """Deep-merge `patch` into a copy of BASE; a DELETE value removes the key."""
    result = copy.deepcopy(BASE if base is None else base)

    def merge(target: dict[str, Any], change: dict[str, Any]) -> None:
        for key, value in change.items():
            if value is DELETE:
                target.pop(key, None)
            elif isinstance(value, dict):  # into what is there, or a new mapping: DELETE holds inside it too
                if not isinstance(target.get(key), dict):
                    target[key] = {}
                merge(target[key], value)
            else:
                target[key] = copy.deepcopy(value)

    merge(result, patch)
    return result


@dataclass(frozen=True)
class Case:
    name: str
    patch: dict[str, Any]
    field: str = ""  # for invalid cases: the path the server's message names

    @property
    def body(self) -> dict[str, Any]:
        return patched(self.patch)


def _spec(**parts: Any) -> dict[str, Any]:
    return {"spec": parts}


def _data(**fields: Any) -> dict[str, Any]:
    """spec.compression.data: text on a claim, with `fields` changed."""
    return _spec(compression={"data": {"claimName": "corpora", "path": "train", **fields}})


POOL = BASE["spec"]["deployment"]["pools"][0]

VALID = [
    Case("base", {}),
    Case("minimal-no-deployment", _spec(deployment=DELETE)),
    Case("pvc-source", _spec(source={"uri": "pvc://models/nemotron-super"})),
    Case("throughput-only", _spec(compression={"memoryBudgetPerGPU": DELETE, "throughputFactor": 2})),
    Case("param-caps", _spec(compression={"maxTotalParamsBillions": 75.3, "maxActiveParamsBillions": 9.3})),
    Case("nvfp4-on-blackwell", _spec(compression={"targetGPU": "B200-180GB"}, quantization={"precision": "nvfp4"})),
    Case("nvfp4-on-hopper-weight-only", _spec(quantization={"precision": "nvfp4"})),
    Case("jobs-and-plan-overrides", _spec(jobs={"gpusPerNode": 8, "nodes": 2, "backoffLimit": 0},
                                          compression={"batch": 8, "planOverrides": {"evalTokens": 64,
                                                                                      "library": {"noOp": False}}})),
    Case("a100-bf16", _spec(compression={"targetGPU": "A100-80GB"}, quantization={"precision": "none",
                                                                                   "kvCacheDtype": "bf16"})),
    Case("total-concurrency", _spec(deployment={"pools": [{**POOL, "concurrency": {"total": 100}}]})),
    Case("existing-claim", _spec(storage={"existingClaim": "artifacts"})),
    Case("retention-one", _spec(compression={"minQualityRetention": 1})),
    Case("text-on-a-claim", _spec(compression={"data": {"claimName": "corpora", "path": "legal/train",
                                                        "heldOutPath": "legal/eval.jsonl", "textField": "body"}})),
    Case("text-held-out-every", _spec(compression={"data": {"claimName": "corpora", "path": "./train.jsonl",
                                                            "heldOutEvery": 4}})),
    Case("placement", _spec(jobs={
        "tolerations": [{"key": "cloud.google.com/gke-spot", "operator": "Exists", "effect": "NoSchedule"},
                        {"key": "example.com/drain", "value": "soon", "effect": "NoExecute", "tolerationSeconds": 60}],
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{
            "matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["us-east-1a"]},
                                 {"key": "example.com/gpu-count", "operator": "Gt", "values": ["7"]}]}]},
            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 10, "preference": {"matchExpressions": [
                {"key": "example.com/spot", "operator": "DoesNotExist"}]}}]},
        "priorityClassName": "gpu-batch", "podLabels": {"team": "ml", "example.com/cost-center": "42"},
        "resources": {"requests": {"cpu": "16", "memory": "200Gi", "vpc.amazonaws.com/efa": "32"},
                      "limits": {"memory": "400Gi"}},
        "queueName": "gpu-builds"},
        deployment={"pools": [{**POOL, "tolerations": [{"key": "example.com/serving", "operator": "Exists"}],
                               "priorityClassName": "serving", "podLabels": {"tier": "serving"},
                               "resources": {"requests": {"cpu": "500m"}}}]})),
]

INVALID = [
    Case("missing-source", _spec(source=DELETE), "spec.source"),
    Case("missing-compression", _spec(compression=DELETE), "spec.compression"),
    Case("source-uri-scheme", _spec(source={"uri": "ftp://example.com/model"}), "spec.source.uri"),
    Case("credentials-with-pvc", _spec(source={"uri": "pvc://models/x", "credentialsSecret": {"name": "t"}}),
         "spec.source.credentialsSecret"),
    Case("plan-overrides-parent", _spec(compression={"planOverrides": {"parent": "/etc"}}),
         "spec.compression.planOverrides"),
    Case("plan-overrides-target-batch", _spec(compression={"planOverrides": {"target": {"batch": 64}}}),
         "spec.compression.planOverrides"),
    Case("pool-node-selector-value-too-long", _spec(deployment={"pools": [{**POOL, "nodeSelector": {
        "nvidia.com/gpu.product": "H" * 64}}]}), "spec.deployment.pools[0].nodeSelector"),
    Case("plan-overrides-nested-in-a-list", _spec(compression={"planOverrides": {"library": {"ffnWidths": [[0.5]]}}}),
         "spec.compression.planOverrides.library.ffnWidths"),
    Case("plan-overrides-unknown-nested", _spec(compression={"planOverrides": {"gkd": {"schedule": {"warmup": {}}}}}),
         "spec.compression.planOverrides.gkd.schedule"),
    Case("pvc-source-leaves-its-claim", _spec(source={"uri": "pvc://other-artifacts/../../"}), "spec.source.uri"),
    Case("pvc-source-dotdot-inside", _spec(source={"uri": "pvc://models/a/../../etc"}), "spec.source.uri"),
    Case("unknown-gpu", _spec(compression={"targetGPU": "H300-1TB"}), "spec.compression.targetGPU"),
    Case("negative-memory-budget", _spec(compression={"memoryBudgetPerGPU": "-10Gi"}),
         "spec.compression.memoryBudgetPerGPU"),
    Case("zero-memory-budget", _spec(compression={"memoryBudgetPerGPU": "0"}), "spec.compression.memoryBudgetPerGPU"),
    Case("throughput-below-parent", _spec(compression={"throughputFactor": 0.5}), "spec.compression.throughputFactor"),
    Case("throughput-wrong-type", _spec(compression={"throughputFactor": "fast"}),
         "spec.compression.throughputFactor"),
    Case("latency-zero", _spec(compression={"latencyFactor": 0}), "spec.compression.latencyFactor"),
    Case("active-above-total", _spec(compression={"maxTotalParamsBillions": 9, "maxActiveParamsBillions": 12}),
         "spec.compression.maxActiveParamsBillions"),
    Case("no-target", _spec(compression={"memoryBudgetPerGPU": DELETE}), "spec.compression"),
    Case("context-length-zero", _spec(compression={"contextLength": 0}), "spec.compression.contextLength"),
    Case("retention-above-one", _spec(compression={"minQualityRetention": 1.2}),
         "spec.compression.minQualityRetention"),
    Case("rounds-zero", _spec(compression={"rounds": 0}), "spec.compression.rounds"),
    Case("tokens-negative", _spec(compression={"distillation": {"globalTokens": -1}}),
         "spec.compression.distillation.globalTokens"),
    Case("unknown-precision", _spec(quantization={"precision": "int3"}), "spec.quantization.precision"),
    Case("nvfp4-on-ampere", _spec(compression={"targetGPU": "A100-80GB"}, quantization={"precision": "nvfp4"}),
         "spec.quantization"),
    Case("jobs-zero-gpus", _spec(jobs={"gpusPerNode": 0}), "spec.jobs.gpusPerNode"),
    Case("unknown-deletion-policy", _spec(storage={"deletionPolicy": "Keep"}), "spec.storage.deletionPolicy"),
    Case("fp8-kv-on-ampere", _spec(compression={"targetGPU": "A100-40GB"}, quantization={"kvCacheDtype": "fp8"}),
         "spec.quantization"),
    Case("calibration-zero", _spec(quantization={"calibrationSamples": 0}), "spec.quantization.calibrationSamples"),
    Case("serve-longer-than-sized", _spec(compression={"contextLength": 8192}), "spec.deployment.contextLength"),
    Case("replicas-min-above-max", _spec(deployment={"minReplicas": 5, "maxReplicas": 2}),
         "spec.deployment.minReplicas"),
    Case("scale-to-zero", _spec(deployment={"minReplicas": 0}), "spec.deployment.minReplicas"),
    Case("kv-cache-target-above-one", _spec(deployment={"autoscaling": {"kvCacheTarget": 1.5}}),
         "spec.deployment.autoscaling.kvCacheTarget"),
    Case("drain-too-short", _spec(deployment={"drainSeconds": 1}), "spec.deployment.drainSeconds"),
    Case("no-pools", _spec(deployment={"pools": []}), "spec.deployment.pools"),
    Case("duplicate-pools", _spec(deployment={"pools": [POOL, POOL]}), "spec.deployment.pools"),
    Case("concurrency-both", _spec(deployment={"pools": [{**POOL, "concurrency": {"perNode": 8, "total": 9}}]}),
         "spec.deployment.pools[0].concurrency"),
    Case("concurrency-neither", _spec(deployment={"pools": [{**POOL, "concurrency": {}}]}),
         "spec.deployment.pools[0].concurrency"),
    Case("empty-node-selector", _spec(deployment={"pools": [{**POOL, "nodeSelector": {}}]}),
         "spec.deployment.pools[0].nodeSelector"),
    Case("claim-and-class", _spec(storage={"existingClaim": "a", "storageClassName": "fast"}),
         "spec.storage.existingClaim"),
    Case("unknown-field", _spec(compresion={"targetGPU": "H100-80GB"}), "spec.compresion"),
    Case("s3-source", _spec(source={"uri": "s3://bucket/model"}), "spec.source.uri"),
    # the text's paths stay inside its claim
    Case("data-absolute-path", _data(path="/etc"), "spec.compression.data.path"),
    Case("data-path-leaves-the-claim", _data(path="train/../../other"), "spec.compression.data.path"),
    Case("data-held-out-leaves-the-claim", _data(heldOutPath=".."), "spec.compression.data.heldOutPath"),
    Case("data-two-held-out-rules", _data(heldOutPath="eval", heldOutEvery=4), "spec.compression.data.heldOutEvery"),
    Case("data-without-a-claim", _data(claimName=DELETE), "spec.compression.data.claimName"),
    # placement: Tailor's labels and GPU counts stay Tailor's; tolerations and node conditions are well formed
    Case("label-tailor-owns", _spec(jobs={"podLabels": {"tailor.dev/egress": "any"}}), "spec.jobs.podLabels"),
    Case("label-key-malformed", _spec(jobs={"podLabels": {"team name": "ml"}}), "spec.jobs.podLabels"),
    # what the API server would refuse in the pods, refused on the object: a label name past 63 characters, a key
    # prefix past 253, an annotation past 4 KiB (32 of them would pass the 256 KiB an object may carry)
    Case("label-name-too-long", _spec(jobs={"podLabels": {"t" * 64: "ml"}}), "spec.jobs.podLabels"),
    Case("toleration-key-prefix-too-long", _spec(jobs={"tolerations": [{"key": ".".join(["a" * 60] * 5) + "/x",
                                                                        "operator": "Exists"}]}),
         "spec.jobs.tolerations[0].key"),
    Case("annotation-too-large", _spec(jobs={"podAnnotations": {"prometheus.io/path": "p" * 4097}}),
         "spec.jobs.podAnnotations"),
    Case("gpus-in-resources", _spec(deployment={"pools": [{**POOL, "resources": {"limits": {"nvidia.com/gpu": "2"}}}]}),
         "spec.deployment.pools[0].resources.limits"),
    Case("toleration-without-key", _spec(jobs={"tolerations": [{"operator": "Exists"}]}),
         "spec.jobs.tolerations[0].key"),
    Case("toleration-exists-with-value", _spec(jobs={"tolerations": [{"key": "a", "operator": "Exists",
                                                                       "value": "b"}]}),
         "spec.jobs.tolerations[0].value"),
    Case("toleration-seconds-without-no-execute", _spec(jobs={"tolerations": [{"key": "a", "tolerationSeconds": 5}]}),
         "spec.jobs.tolerations[0].tolerationSeconds"),
    Case("affinity-gt-not-a-number", _spec(jobs={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpus", "operator": "Gt", "values": ["many"]}]}]}}}),
         "spec.jobs.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0]"
         ".matchExpressions[0].values"),
    Case("affinity-in-without-values", _spec(jobs={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In"}]}]}}}),
         "spec.jobs.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0]"
         ".matchExpressions[0].values"),
    Case("priority-class-malformed", _spec(jobs={"priorityClassName": "High Priority"}), "spec.jobs.priorityClassName"),
    # derived names (Services, Jobs, Deployments) must stay DNS labels of 63 characters
    Case("name-starts-with-a-digit", {"metadata": {"name": "1model"}}, "metadata.name"),
    Case("name-with-a-dot", {"metadata": {"name": "model.v2"}}, "metadata.name"),
    Case("name-too-long", {"metadata": {"name": "m" * 45}}, "metadata.name"),
    Case("name-and-pool-too-long", {"metadata": {"name": "m" * 40}, **_spec(deployment={"pools": [
        {**POOL, "name": "p" * 7}]})}, "metadata.name"),
]


def example_bodies() -> list[tuple[str, dict[str, Any]]]:
    return [(path.name, yaml.safe_load(path.read_text())) for path in EXAMPLES]
