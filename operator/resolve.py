"""From a CompressedModel's spec to its `BuildPlan`: every decision made once, here.

`resolve` is pure and torch-free: the same spec, settings, build and batch give the same plan. The batch
(`target_batch`) is the spec's, or what the deployment's pools ask of each GPU of the nodes they have when the
build is planned. The operator writes the plan into a ConfigMap that each stage Job reads (`--plan`), and reads
it back from there on later passes, so what the Jobs run and what the operator believes they run cannot drift
apart (nor the batch move with the nodes).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from tailor.compressor.buildplan import (
    DATA_MOUNT,
    SOURCE_MOUNT,
    ArtifactLayout,
    BuildPlan,
    EvaluateStep,
    QuantizeStep,
)
from tailor.compressor.puzzle.plan import Plan, Training, problems
from tailor.compressor.sizing.hardware import GpuCatalog, Precision, resolve_precision
from tailor.compressor.sizing.memory import KvDtype, resolve_kv_dtype
from tailor.operator import names
from tailor.operator.api import MAX_BATCH, CompressedModelSpec
from tailor.operator.manifest import quantity_value
from tailor.operator.pools import GpuAsk, gpu_ask

BUILD_FIELDS = ("source", "compression", "quantization")
CALIBRATION_WINDOW = 256  # tokens per calibration sequence of `tailor quantize` (QuantizeJob.seq_len)
class InvalidPlan(ValueError):
    """The spec (with its planOverrides) does not make a valid build plan; the message names the field."""


def fingerprint(spec: CompressedModelSpec, floor: bool = False) -> str:
    """What the artifacts depend on: equal fingerprints mean a generation can reuse another's build. Not the
    quality floor, which only the gate reads (`decide.floor_plan`); `floor`: with it, as builds recorded before it
    left (`decide.start_build` takes those over: no rebuild on upgrade)."""
    fields = spec.model_dump(mode="json", by_alias=True, include=set(BUILD_FIELDS))
    if spec.compression.data is None:  # the built-in text, as before the field was added: no rebuild on upgrade
        del fields["compression"]["data"]
    if not floor:
        del fields["compression"]["minQualityRetention"]
    fields["image"] = spec.jobs.image
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def parent_location(spec: CompressedModelSpec) -> tuple[str, str | None]:
    """The parent as the stage pods see it, and the claim to mount for a pvc:// source."""
    uri = spec.source.uri
    if uri.startswith("pvc://"):
        claim, _, path = uri.removeprefix("pvc://").partition("/")
        return posixpath.normpath(posixpath.join(SOURCE_MOUNT, path.lstrip("/"))), claim  # no '..': the spec says
    return uri if spec.source.revision == "main" else f"{uri}@{spec.source.revision}", None


def mounted_claims(spec: CompressedModelSpec, data: bool) -> dict[str, str]:
    """The claims a stage's pods mount read-only, by mount path: a pvc:// source's, and with `data` (the build
    stages) spec.compression.data's."""
    claims = {SOURCE_MOUNT: claim} if (claim := parent_location(spec)[1]) is not None else {}
    if data and spec.compression.data is not None:
        claims[DATA_MOUNT] = spec.compression.data.claim_name
    return claims


def plan_data(spec: CompressedModelSpec) -> dict[str, Any]:
    """The plan's data fields from spec.compression.data, its paths where the stage pods mount its claim; {} for
    the built-in text."""
    data = spec.compression.data
    if data is None:
        return {}

    def in_pod(path: str) -> str:
        return posixpath.normpath(f"{DATA_MOUNT}/{path}")

    fields: dict[str, Any] = {"text": in_pod(data.path), "textField": data.text_field}
    if data.held_out_path is not None:
        fields["heldout"] = in_pod(data.held_out_path)
    if data.held_out_every is not None:
        fields["heldoutEvery"] = data.held_out_every
    return fields


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        nested = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = _merge(merged[key], value) if nested else value
    return merged


class TargetBatch(BaseModel):
    """The concurrent requests per GPU the plan's constraints are computed at, and where that number came from."""

    model_config = ConfigDict(frozen=True)

    value: int
    source: str
    left_out: tuple[str, ...] = ()  # "pool (why)" of each pool that will not serve the build on its nodes

    def message(self) -> str:
        return f"batch {self.value} per GPU from {self.source}"


def target_batch(spec: CompressedModelSpec, nodes: list[dict[str, Any]], catalog: GpuCatalog) -> TargetBatch:
    """spec.compression.batch when set; else the most a pool of spec.deployment that can serve the build asks of
    each GPU of its schedulable `nodes` (`pools.gpu_ask`); else 1."""
    if spec.compression.batch is not None:
        return TargetBatch(value=spec.compression.batch, source="spec.compression.batch")
    if spec.deployment is None:
        return TargetBatch(value=1, source="the default: no spec.deployment to take it from")
    precision = resolve_precision(spec.quantization.precision, catalog.get(spec.compression.target_gpu.value))
    asks = {pool.name: gpu_ask(pool, nodes, catalog, precision) for pool in spec.deployment.pools}
    left_out = tuple(f"{name} ({ask})" for name, ask in asks.items() if isinstance(ask, str))
    known = [ask for ask in asks.values() if isinstance(ask, GpuAsk)]
    if not known:
        return TargetBatch(value=1, left_out=left_out, source="the default: no pool of spec.deployment can serve "
                           f"the build on its nodes yet ({'; '.join(left_out)}); set spec.compression.batch to "
                           "choose it")
    top = max(known, key=lambda ask: ask.per_gpu)
    if top.per_gpu > MAX_BATCH:
        raise InvalidPlan(f"spec.deployment.pools: pool {top.pool} asks {top.per_gpu} concurrent requests per GPU "
                          f"({top.why}), above the {MAX_BATCH} a build is planned for; set spec.compression.batch")
    source = f"pool {top.pool} ({top.why})" + (f"; left out: {'; '.join(left_out)}" if left_out else "")
    return TargetBatch(value=top.per_gpu, source=source, left_out=left_out)


def compression_plan(spec: CompressedModelSpec, batch: int, precision: Precision,
                     kv_dtype: KvDtype = KvDtype.BF16) -> Plan:
    """The Puzzle plan the compression Job runs, its constraints computed at `batch` (`target_batch`).

    `latencyFactor` is per-token (decode) latency at that batch, so it becomes a decode throughput
    target of 1 / latencyFactor; the plan's own `latency` (prefill) is left to planOverrides."""
    c = spec.compression
    overrides = c.plan_overrides or {}
    throughputs = [t for t in (c.throughput_factor, None if c.latency_factor is None else 1 / c.latency_factor)
                   if t is not None]
    target: dict[str, Any] = {"gpu": c.target_gpu.value, "precision": precision.value, "kvDtype": kv_dtype.value,
                              "batch": batch, "context": c.context_length}
    if throughputs:
        target["throughput"] = max(throughputs)
    if c.request_tokens_per_second is not None:
        target["requestTokensPerSecond"] = c.request_tokens_per_second
    if c.memory_budget_per_gpu is not None:
        target["memoryGiB"] = quantity_value(c.memory_budget_per_gpu) / 2**30
    if c.max_total_params_billions is not None:
        target["paramsBillions"] = c.max_total_params_billions
    if c.max_active_params_billions is not None:
        target["activeParamsBillions"] = c.max_active_params_billions

    def training(default: Training, tokens: int) -> dict[str, Any]:
        return {"tokens": tokens, "lr": default.lr, "batch": default.batch}

    defaults = Plan.model_fields
    plan = {"parent": parent_location(spec)[0], "data": plan_data(spec), "target": target, "rounds": c.rounds,
            "bld": training(defaults["bld"].default, c.distillation.blockwise_tokens),
            "gkd": training(defaults["gkd"].default, c.distillation.global_tokens)}
    try:
        return Plan.model_validate(_merge(plan, overrides))
    except ValidationError as error:
        raise InvalidPlan(f"spec.compression (with planOverrides) makes an invalid plan: {problems(error)}") from error


def resolve(spec: CompressedModelSpec, model: dict[str, Any], build: int, catalog: GpuCatalog, batch: int,
            keep: list[int] | None = None) -> BuildPlan:
    """The build plan of `model`'s build `build`, with `catalog` the GPU profiles in force and the constraints
    computed at `batch`; the folders of the generations `keep` outlive the build (`decide.kept`)."""
    gpu = catalog.get(spec.compression.target_gpu.value)
    if not gpu.gfd_products:
        raise InvalidPlan(f"spec.compression.targetGPU: GPU profile {gpu.name} names no nvidia.com/gpu.product to "
                          "select nodes by (gfdProducts in the GPU profiles)")
    precision = resolve_precision(spec.quantization.precision, gpu)
    kv_dtype = resolve_kv_dtype(spec.quantization.kv_cache_dtype, gpu)
    quality_tokens = spec.compression.quality_tokens
    return BuildPlan(
        model=model["metadata"]["name"], fingerprint=fingerprint(spec), parent=parent_location(spec)[0],
        target_gpu=gpu.name, target_product=gpu.gfd_products[0], precision=precision,
        kv_cache_dtype=kv_dtype,
        gpu_profiles=list(catalog.profiles.values()),
        layout=ArtifactLayout(folder=names.folder(model), build=build, keep=keep or []),
        puzzle=compression_plan(spec, batch, precision, kv_dtype),
        quantize=None if precision is Precision.BF16 else QuantizeStep(
            format=precision.value, calibration_tokens=spec.quantization.calibration_samples * CALIBRATION_WINDOW,
            eval_tokens=quality_tokens),
        evaluate=EvaluateStep(min_retention=spec.compression.min_quality_retention, eval_tokens=quality_tokens))
