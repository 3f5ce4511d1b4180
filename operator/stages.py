"""From a CompressedModel's spec to the commands its stage Jobs run: the compression plan (validated with the
compressor's own `Plan`, which needs no torch), and the `tailor compress / quantize / evaluate / package`
arguments, with every path inside the artifacts claim.

Layout of the claim, per object: `<name>/g<build>/compress/child` (the Puzzle child), `<name>/g<build>/quantized`
(the exported checkpoint), `<name>/g<generation>/triton-<pool>/repository` (a pool's model repository). `build`
is the generation whose spec fields that change the model (source, compression, quantization) were built;
a later generation that changes only the deployment reuses it.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import ValidationError

from tailor.compressor.hardware import GpuCatalog, Precision
from tailor.compressor.memory import KvDtype, preferred_kv_dtype
from tailor.compressor.puzzle.plan import Plan, Training
from tailor.operator.api import CompressedModelSpec
from tailor.operator.jobs import ARTIFACTS, PLAN, SOURCE
from tailor.operator.pools import PoolPlan

PLAN_FILE = "plan.yaml"
RESULT_FILE = "/dev/termination-log"
BUILD_FIELDS = ("source", "compression", "quantization")
_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
          "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15}


class InvalidPlan(ValueError):
    """The spec (with its planOverrides) does not make a valid compression plan; the message names the field."""


def quantity_bytes(quantity: str) -> float:
    for suffix in sorted(_UNITS, key=len, reverse=True):
        if quantity.endswith(suffix):
            return float(quantity[:-len(suffix)]) * _UNITS[suffix]
    return float(quantity)


def fingerprint(spec: CompressedModelSpec) -> str:
    """What the artifacts depend on: equal fingerprints mean a generation can reuse another's build."""
    fields = spec.model_dump(mode="json", by_alias=True, include=set(BUILD_FIELDS))
    fields["image"] = spec.jobs.image
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def weight_precision(spec: CompressedModelSpec, catalog: GpuCatalog) -> Precision:
    """The checkpoint's precision: `auto` resolved for the target GPU, `none` is BF16."""
    precision = spec.quantization.precision
    if precision == "auto":
        return catalog.get(spec.compression.target_gpu.value).preferred_precision()
    return Precision.BF16 if precision == "none" else Precision(precision)


def quantizes(spec: CompressedModelSpec, catalog: GpuCatalog) -> bool:
    """Whether there is a quantization stage: not for `none`, nor for `auto` on a GPU without FP8 or NVFP4."""
    return weight_precision(spec, catalog) is not Precision.BF16


def kv_cache_dtype(spec: CompressedModelSpec, catalog: GpuCatalog) -> KvDtype:
    dtype = spec.quantization.kv_cache_dtype
    if dtype == "auto":
        return preferred_kv_dtype(catalog.get(spec.compression.target_gpu.value))
    return KvDtype.FP8 if dtype == "fp8" else KvDtype.BF16


def parent_location(spec: CompressedModelSpec) -> tuple[str, str | None]:
    """The parent as the compression Job sees it, and the claim to mount for a pvc:// source."""
    uri = spec.source.uri
    if uri.startswith("pvc://"):
        claim, _, path = uri.removeprefix("pvc://").partition("/")
        return f"{SOURCE}/{path}", claim
    return uri if spec.source.revision == "main" else f"{uri}@{spec.source.revision}", None


def job_env(spec: CompressedModelSpec) -> list[dict[str, Any]]:
    """The stage containers' environment: downloads cached on the artifacts claim (a retried or later stage
    reuses them), and the source's credentials from its Secret."""
    env: list[dict[str, Any]] = [{"name": "TAILOR_CACHE_DIR", "value": f"{ARTIFACTS}/.cache"}]
    secret = spec.source.credentials_secret
    if secret is not None:
        env += [{"name": key, "valueFrom": {"secretKeyRef": {"name": secret.name, "key": key, "optional": True}}}
                for key in ("HF_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")]
    return env


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key),
                                                                                           dict) else value
    return merged


def compression_plan(spec: CompressedModelSpec, catalog: GpuCatalog) -> dict[str, Any]:
    """The plan the compression Job runs, as YAML-ready camelCase fields.

    `latencyFactor` is per-token (decode) latency at the spec's batch, so it becomes a decode throughput
    target of 1 / latencyFactor; the plan's own `latency` (prefill) is left to planOverrides."""
    c = spec.compression
    throughputs = [t for t in (c.throughput_factor, None if c.latency_factor is None else 1 / c.latency_factor)
                   if t is not None]
    target: dict[str, Any] = {"gpu": c.target_gpu.value, "precision": weight_precision(spec, catalog).value,
                              "batch": c.batch, "context": c.context_length}
    if throughputs:
        target["throughput"] = max(throughputs)
    if c.memory_budget_per_gpu is not None:
        target["memoryGiB"] = quantity_bytes(c.memory_budget_per_gpu) / 2**30
    if c.max_total_params_billions is not None:
        target["paramsBillions"] = c.max_total_params_billions
    if c.max_active_params_billions is not None:
        target["activeParamsBillions"] = c.max_active_params_billions

    def training(default: Training, tokens: int) -> dict[str, Any]:
        return {"tokens": tokens, "lr": default.lr, "batch": default.batch}

    defaults = Plan.model_fields
    plan = {"parent": parent_location(spec)[0], "target": target, "rounds": c.rounds,
            "bld": training(defaults["bld"].default, c.distillation.blockwise_tokens),
            "gkd": training(defaults["gkd"].default, c.distillation.global_tokens)}
    plan = _merge(plan, c.plan_overrides or {})
    try:
        Plan.model_validate(plan)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(plan)'}: {e['msg']}" for e in error.errors())
        raise InvalidPlan(f"spec.compression (with planOverrides) makes an invalid plan: {problems}") from error
    return plan


CALIBRATION_WINDOW = 256  # tokens per calibration sequence in `tailor quantize` (QuantJob.seq_len)


def artifacts_folder(model: dict[str, Any]) -> str:
    """The object's folder on the artifacts claim: its name and uid, so that a claim kept (deletionPolicy
    Retain) for a deleted object is never mistaken for a new object's of the same name."""
    meta = model["metadata"]
    return f"{meta['name']}-{meta['uid'][:8]}"


def build_dir(folder: str, build: int) -> str:
    return f"{ARTIFACTS}/{folder}/g{build}"


def compress_args(folder: str, build: int) -> list[str]:
    return ["compress", "--config", f"{PLAN}/{PLAN_FILE}", "--out", f"{build_dir(folder, build)}/compress",
            "--result-file", RESULT_FILE]


def checkpoint(spec: CompressedModelSpec, folder: str, build: int, catalog: GpuCatalog) -> str:
    """The checkpoint that is evaluated and served: the quantized one, or the BF16 child."""
    if not quantizes(spec, catalog):
        return f"{build_dir(folder, build)}/compress/child"
    return f"{build_dir(folder, build)}/quantized"


def quantize_args(spec: CompressedModelSpec, folder: str, build: int, catalog: GpuCatalog) -> list[str]:
    fmt = spec.quantization.precision  # auto, nvfp4 or fp8; `none` has no quantization Job
    return ["quantize", "--model", f"{build_dir(folder, build)}/compress/child", "--out",
            checkpoint(spec, folder, build, catalog),
            "--format", fmt, "--gpu", spec.compression.target_gpu.value,
            "--kv-cache", kv_cache_dtype(spec, catalog).value, "--parent", parent_location(spec)[0],
            "--calibration-tokens", str(spec.quantization.calibration_samples * CALIBRATION_WINDOW),
            "--eval-tokens", str(spec.compression.quality_tokens), "--result-file", RESULT_FILE]


def evaluate_args(spec: CompressedModelSpec, folder: str, build: int, catalog: GpuCatalog) -> list[str]:
    return ["evaluate", "--model", checkpoint(spec, folder, build, catalog), "--parent", parent_location(spec)[0],
            "--min-retention", str(spec.compression.min_quality_retention),
            "--eval-tokens", str(spec.compression.quality_tokens), "--result-file", RESULT_FILE]


def repository(folder: str, generation: int, pool: str) -> str:
    """The pool's package folder, relative to the claim's root."""
    return f"{folder}/g{generation}/triton-{pool}"


def package_args(spec: CompressedModelSpec, name: str, folder: str, build: int, generation: int, plan: PoolPlan,
                 catalog: GpuCatalog) -> list[str]:
    """`tailor package` of the build's checkpoint for a pool, served under the object's `name`."""
    assert plan.gpu_profile is not None and plan.concurrency_per_replica is not None
    assert spec.deployment is not None
    return ["package", "--model", checkpoint(spec, folder, build, catalog), "--out",
            f"{ARTIFACTS}/{repository(folder, generation, plan.name)}", "--name", name, "--gpu", plan.gpu_profile,
            "--context", str(spec.deployment.context_length),
            "--max-batch-size", str(min(plan.concurrency_per_replica, 64)),
            "--tensor-parallel", str(plan.tensor_parallel)]
