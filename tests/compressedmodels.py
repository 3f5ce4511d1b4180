"""The CompressedModel bodies and operator settings the operator's unit tests start from: the fake-API tests
(tests/unit/test_operator_reconcile.py) and the table tests of `decide` on hand-built `Observed` values
(tests/unit/test_operator_decide_table.py); and every pool of a deployment sized at once (`plan_deployment`).
Torch-free, as every operator test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tailor.compressor.sizing.hardware import GpuCatalog
from tailor.devcluster.simulated import published_results
from tailor.operator.allowlists import TenancyLimits
from tailor.operator.api import DeploymentSpec
from tailor.operator.pools import Built, PoolPlan, plan_pool
from tailor.operator.settings import OperatorSettings

REPO = Path(__file__).resolve().parents[1]
SETTINGS = OperatorSettings(tenancy=TenancyLimits(  # kwok's results ride on devcluster.tailor.dev/ annotations
    allowed_annotation_prefixes=[*TenancyLimits().allowed_annotation_prefixes, "devcluster.tailor.dev/"]))
H100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
A100 = {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"}
PRIVATE_PARENT = "hf://example-org/private-parent"  # not a built-in model: the operator cannot check its fit


def manifest(name: str = "m", results: dict[str, str] | None = None, **deployment: Any) -> dict[str, Any]:
    """The H100 example (NVFP4, weight-only on Hopper, 10^6 tokens) on an H100 and an A100-40GB pool; the
    stage results ride on pod annotations, as on the devcluster."""
    body = yaml.safe_load((REPO / "examples" / "nemotron-super-h100.yaml").read_text())
    body["metadata"] = {"name": name, "namespace": "ns"}
    body["spec"]["source"] = {"uri": PRIVATE_PARENT,  # its config is unknown here: no pre-flight check
                              "credentialsSecret": {"name": f"{name}-credentials"}}  # its own
    body["spec"]["jobs"] = {"podAnnotations": published_results() if results is None else results}
    body["spec"]["deployment"]["pools"] = [
        {"name": "h100", "nodeSelector": H100, "concurrency": {"perNode": 16}},
        {"name": "a100", "nodeSelector": A100, "concurrency": {"perNode": 8}}]
    body["spec"]["deployment"].update({"maxReplicas": 8, **deployment})
    return body


def builtin_super(jobs: dict[str, Any], global_tokens: int) -> dict[str, Any]:
    """The H100 example from the built-in Nemotron-3-Super staged on a claim, on `jobs`' GPUs."""
    body = manifest()
    body["spec"]["source"] = {"uri": "pvc://models/nemotron-3-super-120b-a12b"}
    body["spec"]["jobs"].update(jobs)
    body["spec"]["compression"]["distillation"] = {"blockwiseTokens": 10**6, "globalTokens": global_tokens}
    return body


def plan_deployment(deployment: DeploymentSpec, nodes: list[dict[str, Any]], built: Built, catalog: GpuCatalog,
                    held: dict[str, int] | None = None, counted_in: tuple[str, ...] | None = None) -> list[PoolPlan]:
    """Every pool of a deployment sized as the rollout sizes each (`plan_pool`)."""
    return [plan_pool(pool, nodes, built, deployment, catalog, held, counted_in) for pool in deployment.pools]
