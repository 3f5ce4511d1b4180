"""The CompressedModel API (tailor.dev/v1alpha1): spec and status as pydantic models.

These models are the single source of the CRD: `tailor.operator.crd` turns them into the structural
schema in `crds/compressedmodel.yaml`, CEL rules included. Every cross-field rule is written twice on
purpose, once as CEL for the API server and once as a validator here, and `tests/cluster/test_api_server.py`
checks that both reach the same verdict on a corpus of valid and invalid objects (`tests/corpus.py`).

Status models ignore fields they do not know: a status written by a newer operator must not break this one.
"""

from __future__ import annotations

import datetime
import re
from enum import StrEnum
from importlib import metadata
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel

from tailor.compressor.puzzle.plan import Plan
from tailor.compressor.sizing import hardware
from tailor.operator import wire
from tailor.operator.schema import structural

GROUP = "tailor.dev"
API_VERSION = "v1alpha1"
KIND = "CompressedModel"
PLURAL = "compressedmodels"
SINGULAR = "compressedmodel"
SHORT_NAMES = ("cmodel",)

# Kubernetes quantity suffixes -> their factor (`manifest.quantity_bytes` reads them; the patterns below allow them)
QUANTITY_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50,
                  "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "m": 10**-3}
_WHOLE_UNITS = "|".join(unit for unit in QUANTITY_UNITS if unit != "m")  # a size has no milli-bytes
QUANTITY_PATTERN = rf"^([1-9][0-9]*(\.[0-9]+)?|0\.[0-9]*[1-9][0-9]*)({_WHOLE_UNITS})?$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
MAX_CONTEXT_LENGTH = 16 * 1024 * 1024
MAX_BATCH = 4096  # tailor.compressor.puzzle.plan.Target.batch

Quantity = Annotated[str, Field(pattern=QUANTITY_PATTERN, max_length=32)]
DnsLabel = Annotated[str, Field(pattern=DNS_LABEL_PATTERN, min_length=1, max_length=63)]


def cel(rule: str, message: str, field_path: str | None = None) -> dict[str, str]:
    """One x-kubernetes-validations entry; `field_path` points the error at the offending field."""
    entry = {"rule": rule, "message": message}
    if field_path is not None:
        entry["fieldPath"] = field_path
    return entry


def cel_rules(*rules: dict[str, str]) -> dict[str, Any]:
    return {"x-kubernetes-validations": list(rules)}


class ApiModel(BaseModel):
    """Base for everything users write: camelCase on the wire, unknown fields rejected."""

    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True)


_BUILTIN_GPUS = hardware.GpuCatalog.load().profiles.values()
# The GPU profiles a model can be compressed for (`spec.compression.targetGPU`): the built-ins of
# compressor/sizing/gpus.yaml, one member each (H100_80GB = "H100-80GB"), so the CRD's enum is that file's list.
TargetGpu = StrEnum("TargetGpu", [(p.name.upper().replace("-", "_"), p.name)  # type: ignore[misc]
                                  for p in _BUILTIN_GPUS])
VERSION_OF_TAILOR = metadata.version("tailor")  # pyproject.toml: the one place the version is written
# images/Dockerfile's runtime target: the stage Jobs, and Triton pods of the Python fallback engine
RUNTIME_IMAGE = f"ghcr.io/tailor-dev/tailor-runtime:{VERSION_OF_TAILOR}"
# images/Dockerfile's serving target: NVIDIA's Triton with the engine of serving.toml (vLLM's CUDA build at the
# versions the devcluster runs): the Triton pods of every vLLM pool
SERVING_IMAGE = f"ghcr.io/tailor-dev/tailor-serving:{VERSION_OF_TAILOR}"
NO_FP8_PROFILES = tuple(TargetGpu(p.name) for p in _BUILTIN_GPUS if not p.serves_quantized)


def _cel_list(profiles: tuple[TargetGpu, ...]) -> str:
    return "[" + ", ".join(f"'{p.value}'" for p in profiles) + "]"


# --- spec -------------------------------------------------------------------------------------------


class SecretReference(ApiModel):
    """A Secret in the CompressedModel's namespace."""

    name: DnsLabel = Field(description="Name of the Secret.")


CREDENTIALS_ONLY_REMOTE = cel(
    "!has(self.credentialsSecret) || !self.uri.startsWith('pvc://')",
    "credentialsSecret applies to hf:// sources only; a pvc:// source is read from the claim",
    ".credentialsSecret",
)
NO_S3 = cel("!self.uri.startsWith('s3://')", "s3:// sources are not supported yet: copy the parent to a claim "
             "and use pvc://<claim>/<path>, or use hf://", ".uri")
PVC_PATH_INSIDE = cel("!self.uri.startsWith('pvc://') || !self.uri.matches('^pvc://[^/]+/(.*/)?[.][.](/|$)')",
                      "a pvc:// source must name a folder inside its claim: pvc://<claim>/<path> without '..'", ".uri")
SOURCE_IMMUTABLE = cel("self == oldSelf", "source is immutable; create a new CompressedModel for another model")


class SourceSpec(ApiModel):
    """The parent model to compress. Immutable once created."""

    model_config = ConfigDict(json_schema_extra=cel_rules(CREDENTIALS_ONLY_REMOTE, NO_S3, PVC_PATH_INSIDE,
                                                          SOURCE_IMMUTABLE))

    uri: str = Field(
        pattern=r"^(hf://[^/\s]+/[^/\s]+|s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/\S*)?|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?/\S*)$",
        max_length=1024,
        description="Where the parent checkpoint is: hf://<org>/<name> or pvc://<claim>/<path> (a "
        "PersistentVolumeClaim in this namespace). s3:// is refused: not supported yet.",
    )
    revision: str = Field(default="main", min_length=1, max_length=128,
                          description="Revision (branch, tag or commit) of an hf:// source.")
    credentials_secret: SecretReference | None = Field(
        default=None, description="Secret with HF_TOKEN for an hf:// source.")

    @model_validator(mode="after")
    def _credentials_only_remote(self) -> SourceSpec:
        if self.credentials_secret is not None and self.uri.startswith("pvc://"):
            raise ValueError(CREDENTIALS_ONLY_REMOTE["message"])
        if self.uri.startswith("s3://"):
            raise ValueError(NO_S3["message"])
        if self.uri.startswith("pvc://") and ".." in self.uri.removeprefix("pvc://").split("/")[1:]:
            raise ValueError(PVC_PATH_INSIDE["message"])
        return self


INSIDE_THE_CLAIM = cel("!self.startsWith('/') && !self.matches('(^|/)[.][.](/|$)')",
                       "must be a path inside the claim: relative, without '..'")


def _inside_the_claim(path: str) -> str:
    if path.startswith("/") or ".." in path.split("/"):
        raise ValueError(INSIDE_THE_CLAIM["message"])
    return path


ClaimPath = Annotated[str, Field(min_length=1, max_length=1024, json_schema_extra=cel_rules(INSIDE_THE_CLAIM)),
                      AfterValidator(_inside_the_claim)]
ONE_HELD_OUT_RULE = cel("!(has(self.heldOutPath) && has(self.heldOutEvery))",
                        "heldOutEvery applies without heldOutPath: set one of them", ".heldOutEvery")


class DataSpec(ApiModel):
    """Text on a PersistentVolumeClaim of this namespace, mounted read-only into the compression, quantization and
    evaluation Jobs: compression distils on the training text; scoring, the reports and the quality gate are
    measured on the held-out text, never trained on."""

    model_config = ConfigDict(json_schema_extra=cel_rules(ONE_HELD_OUT_RULE))

    claim_name: DnsLabel = Field(description="The PersistentVolumeClaim holding the text.")
    path: ClaimPath = Field(description="The training text in the claim: a folder of .txt and .jsonl files, or one "
                            "such file. Each .txt file is a document, and each line of a .jsonl file (a JSON object).")
    held_out_path: ClaimPath | None = Field(
        default=None, description="Held-out text in the same claim (the same forms), e.g. another domain; all of "
        "path is then trained on. Unset: every heldOutEvery-th document of path is held out.")
    text_field: str = Field(default="text", min_length=1, max_length=256,
                            description="The field of each JSONL object holding its text.")
    held_out_every: int | None = Field(
        default=None, ge=2, le=1000, description="Without heldOutPath: every n-th document of path (in file name "
        "order) is held out; of a single .txt file, its last 1/n of lines. Default 8.")

    @model_validator(mode="after")
    def _one_held_out_rule(self) -> DataSpec:
        if self.held_out_path is not None and self.held_out_every is not None:
            raise ValueError(ONE_HELD_OUT_RULE["message"])
        return self


class DistillationSpec(ApiModel):
    """Token budgets for the two distillation phases of Puzzle."""

    blockwise_tokens: int = Field(default=500_000_000, ge=1, le=10**12,
                                  description="Tokens for blockwise local distillation (BLD) of every variant.")
    global_tokens: int = Field(default=4_000_000_000, ge=1, le=10**13,
                               description="Tokens for global knowledge distillation (GKD) of each round's child.")


ACTIVE_WITHIN_TOTAL = cel(
    "!has(self.maxActiveParamsBillions) || !has(self.maxTotalParamsBillions)"
    " || self.maxActiveParamsBillions <= self.maxTotalParamsBillions",
    "maxActiveParamsBillions must not exceed maxTotalParamsBillions",
    ".maxActiveParamsBillions",
)
TARGET_FIELDS = ("memoryBudgetPerGPU", "throughputFactor", "latencyFactor", "requestTokensPerSecond",
                 "maxTotalParamsBillions", "maxActiveParamsBillions")
SOME_TARGET = cel(
    " || ".join(f"has(self.{name})" for name in TARGET_FIELDS),
    "set at least one target: " + ", ".join(TARGET_FIELDS),
)


# Plan fields the operator derives from the spec, with the spec field that does: planOverrides may not change
# them (refused at admission and by the operator, `resolve.compression_plan`).
DECIDED = {"parent": "spec.source", "data.text": "spec.compression.data.path",
           "data.heldout": "spec.compression.data.heldOutPath",
           "target.gpu": "spec.compression.targetGPU",
           "target.precision": "spec.quantization.precision",
           "target.kvDtype": "spec.quantization.kvCacheDtype",
           "target.batch": "spec.compression.batch or spec.deployment.pools",
           "target.context": "spec.compression.contextLength",
           "rounds": "spec.compression.rounds",
           "target.requestTokensPerSecond": "spec.compression.requestTokensPerSecond",
           "bld.tokens": "spec.compression.distillation.blockwiseTokens",
           "gkd.tokens": "spec.compression.distillation.globalTokens",
           "device": "the operator"}
# Decided by spec.compression.data when it is set; planOverrides may tune them for the built-in text.
DATA_DECIDED = {"data.textField": "spec.compression.data.textField",
                "data.heldoutEvery": "spec.compression.data.heldOutEvery"}


def _overrides_set(paths: dict[str, str]) -> str:
    """CEL: one of `paths` (dotted, under planOverrides) is set."""
    def one(path: str) -> str:
        parts = path.split(".")
        return " && ".join(f"has(self.planOverrides.{'.'.join(parts[:i + 1])})" for i in range(len(parts)))
    return " || ".join(f"({one(path)})" for path in paths)


MAX_OVERRIDE_STRING = 1024  # a plan's free strings (a model or text name, a device)
# how deep planOverrides may nest, counting the object itself: the plan's deepest field is a list in a section
# (library.ffnWidths); the schema refuses deeper, and so does the operator where it reads one stored before
MAX_OVERRIDE_DEPTH = 3


def overrides_schema() -> dict[str, Any]:
    """planOverrides' schema: the plan's own (`Plan`), every field optional and without its default (the operator
    merges what is set over what it derives), free strings bounded; the fields the spec decides say so, and
    OVERRIDES_NOT_DECIDED refuses them. Typed to the leaf: nothing in it nests deeper than the plan does."""

    def optional(node: dict[str, Any]) -> dict[str, Any]:
        out = {key: value for key, value in node.items() if key not in ("required", "default")}
        if "properties" in out:
            out["properties"] = {name: optional(child) for name, child in out["properties"].items()}
        if "items" in out:
            out["items"] = optional(out["items"])
        if out["type"] == "string" and "enum" not in out:
            out.setdefault("maxLength", MAX_OVERRIDE_STRING)
        return out

    root = optional(structural(Plan))
    del root["description"]  # the field's own says what planOverrides is
    for path, decider in (DECIDED | DATA_DECIDED).items():
        node = root
        *parents, leaf = path.split(".")
        for part in parents:
            node = node["properties"][part]
        node["properties"][leaf]["description"] = f"Set from {decider}; refused here."
    return root


def decided_overrides(overrides: dict[str, Any], with_data: bool) -> list[str]:
    """What planOverrides sets that the spec decides, each with the spec field that does."""
    fixed = DECIDED | (DATA_DECIDED if with_data else {})
    return sorted(f"planOverrides.{path} is set from {fixed[path]}" for path in fixed
                  if _has_path(overrides, path.split(".")))


def _has_path(tree: Any, parts: list[str]) -> bool:
    return not parts or (isinstance(tree, dict) and parts[0] in tree and _has_path(tree[parts[0]], parts[1:]))


OVERRIDES_NOT_DECIDED = cel(
    f"!has(self.planOverrides) || !({_overrides_set(DECIDED)})"
    f" && !(has(self.data) && ({_overrides_set(DATA_DECIDED)}))",
    "planOverrides may not set what the spec decides: " + ", ".join(sorted(DECIDED | DATA_DECIDED)),
    ".planOverrides")


class CompressionSpec(ApiModel):
    """What the child must fit: Puzzle's hardware constraints, search rounds and quality floor."""

    model_config = ConfigDict(json_schema_extra=cel_rules(ACTIVE_WITHIN_TOTAL, SOME_TARGET, OVERRIDES_NOT_DECIDED))

    target_gpu: TargetGpu = Field(alias="targetGPU", description="GPU profile the child is searched for.")
    memory_budget_per_gpu: Quantity | None = Field(
        default=None, alias="memoryBudgetPerGPU",
        description="Memory the model may use on one GPU (weights, KV cache and state), e.g. 78Gi.")
    throughput_factor: float | None = Field(
        default=None, ge=1, le=100, description="Throughput wanted relative to the parent, e.g. 2.0 for 2x.")
    latency_factor: float | None = Field(
        default=None, gt=0, le=1, description="Per-token latency wanted relative to the parent, e.g. 0.5.")
    request_tokens_per_second: float | None = Field(
        default=None, gt=0, le=1_000_000, alias="requestTokensPerSecond",
        description="Decode speed every request must get at `batch` concurrent requests per GPU (Puzzle's "
        "per-user floor, e.g. 100), by the cost model of targetGPU.")
    max_total_params_billions: float | None = Field(
        default=None, gt=0, le=10_000, description="Cap on the child's total parameters, in billions.")
    max_active_params_billions: float | None = Field(
        default=None, gt=0, le=10_000, description="Cap on the child's parameters active per token, in billions.")
    context_length: int = Field(
        default=131072, ge=1, le=MAX_CONTEXT_LENGTH,
        description="Sequence length the constraints are computed at (KV cache and state per request).")
    batch: int | None = Field(
        default=None, ge=1, le=MAX_BATCH,
        description="Concurrent requests per GPU the constraints are computed at: memoryBudgetPerGPU holds the "
        "weights plus this many requests' KV cache and state, and throughput is decode throughput at this batch. "
        "Unset: the most a pool of spec.deployment asks of each GPU of its Ready, schedulable nodes (perNode over "
        "the GPUs per node, or total over nodes x GPUs per node, rounded up), taken when the build is planned; "
        "1 without a deployment or without such nodes. status.build.batchSource says which. Changing the pools "
        "later does not rebuild; setting batch does.")
    rounds: int = Field(default=3, ge=1, le=10, description="Rounds of Iterative Puzzle (1 is one-shot Puzzle).")
    distillation: DistillationSpec = Field(default_factory=DistillationSpec, json_schema_extra={"default": {}})
    data: DataSpec | None = Field(default=None, description="The distillation and evaluation text. Unset: the "
                                  "built-in broad corpus (Shakespeare, eight books by other authors, ABC news "
                                  "stories and Python's reference documentation), a demo default.")
    min_quality_retention: float = Field(
        default=0.97, gt=0, le=1,
        description="Share of the parent's quality the child must keep to pass the quality gate. Changing it does "
        "not rebuild: the gate is decided again from the measured scores (status.quality).")
    quality_tokens: int = Field(
        default=4096, ge=256, le=10_000_000,
        description="Held-out tokens the quality gate (and the quantization report) compares child and parent on.")
    plan_overrides: dict[str, Any] | None = Field(
        default=None, json_schema_extra=overrides_schema(),
        description="Advanced: fields of the compressor's plan (tailor.compressor.puzzle.plan.Plan, camelCase) "
        "merged over what Tailor derives from this spec, e.g. {library: {ffnWidths: [0.5]}, evalTokens: 8192}. "
        "Typed as the plan is: a field it does not know is refused (strict field validation, kubectl's default) "
        "or dropped by the API server; the merged plan is checked again by the operator (reason InvalidPlan).")

    @model_validator(mode="after")
    def _consistent_targets(self) -> CompressionSpec:
        if self.plan_overrides and (depth := wire.nesting(self.plan_overrides)) > MAX_OVERRIDE_DEPTH:
            raise ValueError(f"planOverrides nests {depth} levels deep where the plan's fields nest at most "
                             f"{MAX_OVERRIDE_DEPTH} (planOverrides.library.ffnWidths)")
        if self.plan_overrides and (decided := decided_overrides(self.plan_overrides, self.data is not None)):
            raise ValueError("; ".join(decided))
        active, total = self.max_active_params_billions, self.max_total_params_billions
        if active is not None and total is not None and active > total:
            raise ValueError(ACTIVE_WITHIN_TOTAL["message"])
        on_the_wire = self.model_dump(by_alias=True)
        if all(on_the_wire[name] is None for name in TARGET_FIELDS):
            raise ValueError(SOME_TARGET["message"])
        return self


RequestedPrecision = Literal["auto", "nvfp4", "fp8", "none"]
KvCacheDtype = Literal["auto", "fp8", "bf16", "fp16"]


class QuantizationSpec(ApiModel):
    """Post-compression quantization with nvidia-modelopt."""

    precision: RequestedPrecision = Field(
        default="auto", description="Weight precision: auto picks nvfp4 on Blackwell, fp8 on Hopper and Ada, "
        "none elsewhere.")
    kv_cache_dtype: KvCacheDtype = Field(default="auto", description="KV-cache dtype; auto follows precision.")
    calibration_samples: int = Field(default=512, ge=1, le=65536,
                                     description="Calibration sequences for activation scales.")


class Concurrency(ApiModel):
    """Concurrent requests wanted: per node of the pool, or in total across it. Exactly one."""

    model_config = ConfigDict(json_schema_extra=cel_rules(
        cel("has(self.perNode) != has(self.total)", "set exactly one of perNode or total")))

    per_node: int | None = Field(default=None, ge=1, le=4096, description="Concurrent requests per node.")
    total: int | None = Field(default=None, ge=1, le=1_000_000, description="Concurrent requests over the pool.")

    @model_validator(mode="after")
    def _exactly_one(self) -> Concurrency:
        if (self.per_node is None) == (self.total is None):
            raise ValueError("set exactly one of perNode or total")
        return self


# --- where pods go ----------------------------------------------------------------------------------

# An optional DNS-subdomain prefix and "/", then a name of up to 63 characters, as the API server checks label and
# annotation keys; the prefix's 253 characters in all by LABEL_KEY_LENGTHS (one RE2 pattern cannot count both).
LABEL_KEY_PATTERN = (r"^([a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?([.][a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)*/)?"
                     r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
LABEL_KEY_LENGTHS = r"^([^/]{1,253}/)?[^/]{1,63}$"
LABEL_KEY_MAX = 317
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
RESOURCE_QUANTITY_PATTERN = rf"^([0-9]+(\.[0-9]+)?|\.[0-9]+)(m|{_WHOLE_UNITS})?$"
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# Labels Tailor's selectors, Services and NetworkPolicy rely on: a tenant's pod labels may not set them
RESERVED_LABEL_PREFIXES = ("tailor.dev/", "app.kubernetes.io/")
GPU_RESOURCE = "nvidia.com/gpu"  # what the device plugin (or GKE's, or the GPU Operator) advertises

KEY_IS_A_NAME = cel(f"self.matches('{LABEL_KEY_LENGTHS}')", "a label key's prefix may have up to 253 characters")


def _key_lengths(key: str) -> str:
    if not re.fullmatch(LABEL_KEY_LENGTHS, key):
        raise ValueError(f"{KEY_IS_A_NAME['message']}; got {key!r}")
    return key


LabelKey = Annotated[str, Field(pattern=LABEL_KEY_PATTERN, min_length=1, max_length=LABEL_KEY_MAX,
                                json_schema_extra=cel_rules(KEY_IS_A_NAME)), AfterValidator(_key_lengths)]
LabelValue = Annotated[str, Field(pattern=LABEL_VALUE_PATTERN, max_length=63)]
KEYS_ARE_NAMES = cel(f"self.all(k, size(k) <= {LABEL_KEY_MAX} && k.matches('{LABEL_KEY_PATTERN}') && "
                     f"k.matches('{LABEL_KEY_LENGTHS}'))",
                     "keys must be label-style names: an optional DNS prefix of up to 253 characters and '/', then "
                     "up to 63 of a-z, A-Z, 0-9, '-', '_', '.'")
OWN_LABELS = cel("self.all(k, " + " && ".join(f"!k.startsWith('{p}')" for p in RESERVED_LABEL_PREFIXES) + ")",
                 f"labels under {', '.join(RESERVED_LABEL_PREFIXES)} are Tailor's own (its selectors and "
                 "NetworkPolicy rely on them)")
NO_GPU_RESOURCE = cel(f"!('{GPU_RESOURCE}' in self)",
                      f"{GPU_RESOURCE} is set by Tailor (spec.jobs.gpusPerNode for compression, the sizing for "
                      "Triton); leave it out")


def _names(keys: dict[str, Any]) -> dict[str, Any]:
    bad = sorted(k for k in keys if len(k) > LABEL_KEY_MAX or not re.fullmatch(LABEL_KEY_PATTERN, k)
                 or not re.fullmatch(LABEL_KEY_LENGTHS, k))
    if bad:
        raise ValueError(f"{KEYS_ARE_NAMES['message']}; got {bad}")
    return keys


def _own_labels(labels: dict[str, str]) -> dict[str, str]:
    if any(k.startswith(RESERVED_LABEL_PREFIXES) for k in labels):
        raise ValueError(OWN_LABELS["message"])
    return labels


def _no_gpu_resource(resources: dict[str, str]) -> dict[str, str]:
    if GPU_RESOURCE in resources:
        raise ValueError(NO_GPU_RESOURCE["message"])
    return _names(resources)


PodLabels = Annotated[dict[str, LabelValue], Field(max_length=16, json_schema_extra=cel_rules(
    KEYS_ARE_NAMES, OWN_LABELS)), AfterValidator(_own_labels), AfterValidator(_names)]
ANNOTATION_VALUE_MAX = 4096  # 32 of them with their keys stay well under the API server's 256 KiB per object
PodAnnotations = Annotated[dict[str, Annotated[str, Field(max_length=ANNOTATION_VALUE_MAX)]], Field(
    max_length=32, json_schema_extra=cel_rules(KEYS_ARE_NAMES)), AfterValidator(_names)]
ResourceList = Annotated[
    dict[str, Annotated[str, Field(pattern=RESOURCE_QUANTITY_PATTERN, max_length=32)]],
    Field(max_length=8, json_schema_extra={**cel_rules(KEYS_ARE_NAMES, NO_GPU_RESOURCE), "default": {}}),
    AfterValidator(_no_gpu_resource)]

EXISTS_HAS_NO_VALUE = cel("self.operator != 'Exists' || !has(self.value)",
                          "a toleration with operator Exists matches any value: leave value out", ".value")
SECONDS_ONLY_NO_EXECUTE = cel("!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
                              "tolerationSeconds applies to effect NoExecute only", ".tolerationSeconds")


class Toleration(ApiModel):
    """A taint the pods tolerate (core/v1 Toleration), naming its key: a toleration of every taint would put
    them on control-plane and system nodes."""

    model_config = ConfigDict(json_schema_extra=cel_rules(EXISTS_HAS_NO_VALUE, SECONDS_ONLY_NO_EXECUTE))

    key: LabelKey = Field(description="The taint's key, e.g. cloud.google.com/gke-spot.")
    operator: Literal["Equal", "Exists"] = Field(default="Equal", description="Equal: the value must match; "
                                                 "Exists: any value.")
    value: LabelValue | None = Field(default=None, description="The taint's value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="The taint effect tolerated; unset: every effect.")
    toleration_seconds: int | None = Field(default=None, ge=0, le=10**9,
                                           description="How long a NoExecute taint is tolerated once added.")

    @model_validator(mode="after")
    def _consistent(self) -> Toleration:
        if self.operator == "Exists" and self.value is not None:
            raise ValueError(EXISTS_HAS_NO_VALUE["message"])
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError(SECONDS_ONLY_NO_EXECUTE["message"])
        return self


VALUES_FIT_OPERATOR = cel(
    "self.operator in ['In', 'NotIn'] ? size(self.values) > 0 : self.operator in ['Exists', 'DoesNotExist'] ? "
    "size(self.values) == 0 : size(self.values) == 1 && self.values[0].matches('^-?[0-9]+$')",
    "values: In and NotIn need at least one, Exists and DoesNotExist none, Gt and Lt exactly one integer",
    ".values")


class NodeSelectorRequirement(ApiModel):
    """One condition on a node's labels (core/v1 NodeSelectorRequirement)."""

    model_config = ConfigDict(json_schema_extra=cel_rules(VALUES_FIT_OPERATOR))

    key: LabelKey = Field(description="The node label.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"] = Field(description="How it is compared.")
    values: list[LabelValue] = Field(default_factory=list, max_length=64, json_schema_extra={"default": []},
                                     description="The values compared with (In, NotIn; one integer for Gt, Lt).")

    @model_validator(mode="after")
    def _values_fit_operator(self) -> NodeSelectorRequirement:
        wanted = {"In": len(self.values) > 0, "NotIn": len(self.values) > 0, "Exists": not self.values,
                  "DoesNotExist": not self.values}.get(
            self.operator, len(self.values) == 1 and re.fullmatch(r"-?[0-9]+", self.values[0] if self.values else ""))
        if not wanted:
            raise ValueError(VALUES_FIT_OPERATOR["message"])
        return self


class NodeSelectorTerm(ApiModel):
    """Conditions a node must all meet (core/v1 NodeSelectorTerm; matchExpressions only)."""

    match_expressions: list[NodeSelectorRequirement] = Field(min_length=1, max_length=16,
                                                             description="Conditions on the node's labels.")


class NodeSelector(ApiModel):
    """Terms of which a node must meet one."""

    node_selector_terms: list[NodeSelectorTerm] = Field(min_length=1, max_length=8,
                                                        description="A node must meet one of these.")


class PreferredSchedulingTerm(ApiModel):
    """A term the scheduler favours nodes by, with its weight."""

    weight: int = Field(ge=1, le=100, description="How much a node meeting the term is favoured, 1 to 100.")
    preference: NodeSelectorTerm = Field(description="The conditions.")


class NodeAffinity(ApiModel):
    """Node affinity (core/v1 NodeAffinity), combined with the nodes Tailor selects: a required term is added to
    each of Tailor's (GPU labels, a pool's nodeSelector), so a node must meet both."""

    required_during_scheduling_ignored_during_execution: NodeSelector | None = Field(
        default=None, description="Nodes the pods may run on only.")
    preferred_during_scheduling_ignored_during_execution: list[PreferredSchedulingTerm] = Field(
        default_factory=list, max_length=8, json_schema_extra={"default": []},
        description="Nodes the scheduler favours.")


class ResourceRequirements(ApiModel):
    """Requests and limits of the pods' main container, over Tailor's (GPUs excepted: Tailor sets them). Extended
    resources (such as vpc.amazonaws.com/efa) only as the chart's tenancy.allowedExtendedResources lists them."""

    requests: ResourceList = Field(default_factory=dict, description="Requests, e.g. {cpu: '16', memory: 200Gi}.")
    limits: ResourceList = Field(default_factory=dict, description="Limits, e.g. {memory: 400Gi}.")


class PodPlacement(ApiModel):
    """Where pods go and what they carry besides what Tailor sets. Bounded for tenants: no security context,
    volumes or namespace can be chosen here; annotation and label keys, tolerations, priority classes and extended
    resources are limited by the chart's tenancy allowlists (at admission and by the operator), Tailor's own labels
    cannot be set."""

    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=16, json_schema_extra={"default": []},
        description="Taints the pods tolerate, besides nvidia.com/gpu (always tolerated); keys as the chart's "
                    "tenancy.allowedTolerationKeys lists them.")
    node_affinity: NodeAffinity | None = Field(
        default=None, description="Further conditions on the nodes, combined with Tailor's choice of nodes.")
    priority_class_name: str | None = Field(
        default=None, pattern=DNS_SUBDOMAIN_PATTERN, max_length=253,
        description="PriorityClass of the pods, one the chart's tenancy.allowedPriorityClasses lists.")
    pod_labels: PodLabels = Field(default_factory=dict, json_schema_extra={"default": {}},
                                  description="Labels for the pods (not under tailor.dev/ or app.kubernetes.io/); keys "
                                              "under a prefix the chart's tenancy.allowedPodLabelPrefixes lists.")
    pod_annotations: PodAnnotations = Field(
        default_factory=dict, json_schema_extra={"default": {}},
        description="Annotations for the pods; keys must start with a prefix the operator allows (the chart's "
                    "tenancy.allowedAnnotationPrefixes).")
    resources: ResourceRequirements | None = Field(
        default=None, description="Requests and limits over Tailor's for the pods' main container.")


class NodePoolTarget(PodPlacement):
    """A group of GPU nodes to serve on. The placement fields apply to its Triton pods, and, for scheduling
    (tolerations, nodeAffinity, priorityClassName), to the package and speed Jobs that run on its nodes."""

    name: DnsLabel = Field(description="Name of the pool; names the Deployment serving on it.")
    node_selector: Annotated[dict[str, LabelValue], AfterValidator(_names)] = Field(
        min_length=1, max_length=16, json_schema_extra=cel_rules(KEYS_ARE_NAMES),
        description="Labels that select the pool's nodes, e.g. nvidia.com/gpu.product: NVIDIA-H100-80GB-HBM3.")
    concurrency: Concurrency = Field(description="Concurrent requests the pool must hold.")
    startup_seconds: int | None = Field(
        default=None, ge=60, le=24 * 3600,
        description="How long a Triton replica may take to become ready (loading the weights, the engine's "
                    "warm-up); the revision fails 5 minutes (scheduling, a cold image pull) after that. Unset: "
                    "the weights at 200 MB/s plus 10 minutes for vLLM (2 for the Python engine).")


MIN_WITHIN_MAX = cel("self.minReplicas <= self.maxReplicas", "minReplicas must not exceed maxReplicas",
                     ".minReplicas")
NO_SCALE_TO_ZERO = cel(
    "self.minReplicas >= 1",
    "minReplicas 0 (scale to zero) is not supported: the HorizontalPodAutoscaler scales on the replicas' own "
    "engine metrics, which a pool with no replica does not report, so it could never scale up again; use 1 or more",
    ".minReplicas")


class Autoscaling(ApiModel):
    """Horizontal scaling on the engine's queue metrics (a stabilisation window on each side; scale-down removes
    one replica per minute, each drained of its requests first)."""

    metric: Literal["requestsWaiting", "kvCacheUsage", "queueTimeSeconds"] = Field(
        default="requestsWaiting",
        description="Requests waiting for a place in the running batch (vllm:num_requests_waiting), the share of "
                    "the KV cache in use (vllm:kv_cache_usage_perc, 0-1), or the average time a request waited "
                    "before running (vllm:request_queue_time_seconds), per replica.")
    target: float | None = Field(
        default=None, gt=0,
        description="Average value per replica that triggers scaling. Unset: derived from the pool's sizing for "
                    "requestsWaiting (a quarter of a replica's max_num_seqs, at least 1), 0.8 for kvCacheUsage, "
                    "2 seconds for queueTimeSeconds.")
    kv_cache_target: float = Field(
        default=0.9, gt=0, le=1,
        description="Second metric of vLLM pools whose metric is not kvCacheUsage: scale out as well when the "
                    "replicas' average KV-cache usage passes this share.")
    scale_up_stabilization_seconds: int = Field(
        default=0, ge=0, le=3600, description="Scale up to the lowest recommendation of this window.")
    scale_down_stabilization_seconds: int = Field(
        default=300, ge=0, le=3600,
        description="Scale down only to the highest recommendation of this window (load that dips briefly keeps "
                    "its replicas).")


class DeploymentSpec(ApiModel):
    """How the child is served with Triton Inference Server."""

    model_config = ConfigDict(json_schema_extra=cel_rules(MIN_WITHIN_MAX, NO_SCALE_TO_ZERO))

    pools: list[NodePoolTarget] = Field(
        min_length=1, max_length=16,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="Node pools to serve on; each gets its own Deployment sized to its GPUs.")
    context_length: int = Field(default=131072, ge=1, le=MAX_CONTEXT_LENGTH,
                                description="Context length each request may use (prompt and output).")
    triton_image: str = Field(default=SERVING_IMAGE, min_length=1, max_length=512,
                              description="Triton Inference Server image with vLLM as its engine: Tailor's serving "
                              "image (NVIDIA's Triton with the vLLM, torch and transformers of serving.toml); it "
                              "serves every vLLM pool. A pool the Python fallback engine serves runs the operator's "
                              "job image.")
    min_replicas: int = Field(default=1, ge=0, le=1000, description="Fewest replicas per pool (at least 1).")
    max_replicas: int = Field(default=4, ge=1, le=1000, description="Most replicas per pool.")
    autoscaling: Autoscaling = Field(default_factory=Autoscaling, json_schema_extra={"default": {}})
    measure_speedup: bool = Field(
        default=True,
        description="Once a generation serves, measure the child's tokens/s over the parent's through the first "
                    "pool's engine (vLLM pools): a Job on one of its nodes runs Triton with both, same engine "
                    "arguments, interleaved, for a few minutes on the pool's GPUs; the figures go to "
                    "status.servedSpeedup.")
    drain_seconds: int = Field(
        default=600, ge=10, le=86400,
        description="How long a replica being removed (scale-down, rollout) may finish the requests it holds: it "
                    "stops taking new ones at once, and is stopped when they are done or this has passed.")

    @model_validator(mode="after")
    def _consistent(self) -> DeploymentSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(MIN_WITHIN_MAX["message"])
        if self.min_replicas < 1:
            raise ValueError(NO_SCALE_TO_ZERO["message"])
        names = [pool.name for pool in self.pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pool names must be unique, got {names}")
        return self


CLAIM_OR_CLASS = cel("!(has(self.existingClaim) && (has(self.storageClassName) || has(self.size)))",
                     "existingClaim excludes storageClassName and size", ".existingClaim")


class StorageSpec(ApiModel):
    """Where checkpoints and artifacts of every stage are kept."""

    model_config = ConfigDict(json_schema_extra=cel_rules(CLAIM_OR_CLASS))

    existing_claim: DnsLabel | None = Field(default=None, description="Use this PersistentVolumeClaim as is.")
    storage_class_name: DnsLabel | None = Field(default=None,
                                                description="Storage class of the claim Tailor creates.")
    size: Quantity | None = Field(default=None, description="Size of the claim Tailor creates (default 1Ti).")
    deletion_policy: Literal["Retain", "Delete"] = Field(
        default="Retain", description="On deleting the CompressedModel: keep the claim Tailor created, or delete it "
        "with its artifacts. An existingClaim is always kept.")

    @model_validator(mode="after")
    def _claim_or_class(self) -> StorageSpec:
        if self.existing_claim is not None and (self.storage_class_name is not None or self.size is not None):
            raise ValueError(CLAIM_OR_CLASS["message"])
        return self


FP8_NEEDS_SUPPORT = cel(
    f"!(self.compression.targetGPU in {_cel_list(NO_FP8_PROFILES)})"
    " || (self.quantization.precision in ['auto', 'none'] && self.quantization.kvCacheDtype != 'fp8')",
    "fp8 or nvfp4 weights and an fp8 KV cache need a Hopper, Ada or Blackwell targetGPU (NVFP4 runs natively on "
    "Blackwell and weight-only on Hopper and Ada; the cpu development profile emulates both); Ampere has neither",
    ".quantization",
)
CONTEXT_WITHIN_COMPRESSION = cel(
    "!has(self.deployment) || self.deployment.contextLength <= self.compression.contextLength",
    "deployment.contextLength must not exceed compression.contextLength, the length the child was sized for",
    ".deployment.contextLength",
)


class JobsSpec(PodPlacement):
    """How the compression, quantization and evaluation Jobs run. The placement fields apply to every stage Job's
    pods (resources to the compression, quantization and evaluation containers only); the package and speed
    Jobs, which run on a pool's nodes, are scheduled by that pool's."""

    image: str | None = Field(default=None, min_length=1, max_length=512,
                              description="Image with tailor[compressor]; default: the operator's --job-image.")
    gpus_per_node: int = Field(default=1, ge=1, le=16, alias="gpusPerNode",
                               description="GPUs per node for compression (torchrun above 1); quantization and "
                                           "evaluation run as one process on one GPU.")
    nodes: int = Field(default=1, ge=1, le=64,
                       description="Nodes for compression: above 1, an Indexed Job running torchrun across them.")
    backoff_limit: int = Field(default=2, ge=0, le=100,
                               description="Retries of a failed stage before the object is Failed.")
    active_deadline_seconds: int = Field(default=7 * 24 * 3600, ge=60, le=90 * 24 * 3600,
                                         description="Longest a stage's Job may run.")
    queue_name: DnsLabel | None = Field(
        default=None, description="Kueue LocalQueue of this namespace to queue every stage Job in: each Job is "
        "created suspended with the label kueue.x-k8s.io/queue-name, for Kueue to admit once its quota holds all "
        "of the Job's pods. Unset: the operator's default (the chart's jobs.queueName), if any.")


class CompressedModelSpec(ApiModel):
    """A model to compress and quantize for a GPU target, then serve on node pools."""

    model_config = ConfigDict(json_schema_extra=cel_rules(FP8_NEEDS_SUPPORT, CONTEXT_WITHIN_COMPRESSION))

    source: SourceSpec
    compression: CompressionSpec
    quantization: QuantizationSpec = Field(default_factory=QuantizationSpec, json_schema_extra={"default": {}})
    deployment: DeploymentSpec | None = Field(default=None, description="Omit to compress without serving.")
    storage: StorageSpec = Field(default_factory=StorageSpec, json_schema_extra={"default": {}})
    jobs: JobsSpec = Field(default_factory=JobsSpec, json_schema_extra={"default": {}})

    @model_validator(mode="after")
    def _cross_field(self) -> CompressedModelSpec:
        gpu, quant = self.compression.target_gpu, self.quantization
        if gpu in NO_FP8_PROFILES and (quant.precision not in ("auto", "none") or quant.kv_cache_dtype == "fp8"):
            raise ValueError(FP8_NEEDS_SUPPORT["message"])
        if self.deployment is not None and self.deployment.context_length > self.compression.context_length:
            raise ValueError(CONTEXT_WITHIN_COMPRESSION["message"])
        return self


# --- status -----------------------------------------------------------------------------------------


class StatusModel(ApiModel):
    """Base of the status: fields this operator does not know (a newer one wrote them) are ignored."""

    model_config = ConfigDict(extra="ignore")


Phase = Literal["Pending", "Compressing", "Quantizing", "Evaluating", "Deploying", "Ready", "Failed"]
StageName = Literal["Compress", "Quantize", "Evaluate", "Deploy"]
STAGE_PHASES: dict[str, Phase] = {"Compress": "Compressing", "Quantize": "Quantizing", "Evaluate": "Evaluating",
                                  "Deploy": "Deploying"}
StageState = Literal["Pending", "Running", "Succeeded", "Failed"]


class Condition(StatusModel):
    """A Kubernetes condition (metav1.Condition)."""

    type: str = Field(pattern=r"^[A-Z][A-Za-z0-9]*$", max_length=316)
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", min_length=1, max_length=1024)
    message: str = Field(default="", max_length=32768)
    last_transition_time: datetime.datetime
    observed_generation: int | None = Field(default=None, ge=0)


class StageProgress(StatusModel):
    """Progress of one pipeline stage."""

    name: StageName
    state: StageState = "Pending"
    progress: float | None = Field(default=None, ge=0, le=1, description="Share of the stage done, 0 to 1.")
    job_name: str | None = Field(default=None, description="The Job running the stage.")
    reason: str | None = Field(default=None, max_length=128, description="Why the stage is in its state, "
                               "e.g. JobSucceeded, BackoffLimitExceeded, InvalidResult, QualityGateFailed.")
    started_at: datetime.datetime | None = None
    completed_at: datetime.datetime | None = None
    message: str | None = None


class ArchitectureSummary(StatusModel):
    """The child the search chose."""

    total_params_billions: float | None = Field(default=None, ge=0)
    active_params_billions: float | None = Field(default=None, ge=0)
    precision: str | None = None
    blocks: int | None = Field(default=None, ge=0)
    summary: str | None = Field(default=None, description="One line per kind of block change.")


class QualityReport(StatusModel):
    """Parent and child on the same evaluation."""

    metric: str | None = None
    parent_score: float | None = None
    child_score: float | None = None
    retention: float | None = Field(default=None, ge=0, description="child / parent, compared with the floor.")
    min_quality_retention: float | None = Field(default=None, description="The floor the verdict was decided at: "
                                                "the plan's (status.build.planGeneration).")
    passed: bool | None = None
    simulated: str | None = Field(default=None, max_length=512, description="Why the scores are canned (the "
                                  "devcluster's simulated pools), not measured.")


class RevisionFailure(StatusModel):
    """A revision of this generation that could not become available on the pool, and what makes the operator
    try the pool again: a spec change (any; a new generation), or, where its pods could not be scheduled, free
    GPUs for the replicas it asked for."""

    generation: int = Field(ge=1)
    deployment: str
    replicas: int = Field(ge=0, description="The replicas it asked for.")
    retry: Literal["SpecChange", "Capacity"]
    message: str = Field(max_length=8192, description="Why it failed, and what its pods said.")


class PoolStatus(StatusModel):
    """Sizing and readiness of one node pool's deployment."""

    name: str
    skipped: str | None = Field(default=None, description="Why the pool gets no deployment.")
    revision: str | None = Field(default=None, description="The revision the pool's Service sends traffic to.")
    gpu_product: str | None = None
    engine: str | None = Field(default=None, description="The engine serving it: vllm, or tailor-python (the "
                                                         "fallback where no vLLM build runs the model).")
    notes: list[str] = Field(default_factory=list, description="What the pool serves differently from the build "
                                                               "(the BF16 child, the fallback engine) and why, "
                                                               "and sizing warnings.")
    gpus_per_replica: int | None = Field(default=None, ge=0)
    concurrency_per_gpu: int | None = Field(default=None, ge=0)
    concurrency_per_replica: int | None = Field(default=None, ge=0)
    replicas: int | None = Field(default=None, ge=0)
    ready_replicas: int | None = Field(default=None, ge=0)
    startup_seconds: int | None = Field(default=None, ge=0, description="How long a replica may take to become "
                                        "ready (spec, or derived from the weights and the engine).")
    failed: RevisionFailure | None = Field(default=None, description="This generation's revision that failed here "
                                           "and what retries it; none is made again until then.")


class BuildStatus(StatusModel):
    """The artifacts the current spec is built into: reused by later generations that change only deployment or
    minQualityRetention."""

    generation: int = Field(ge=0, description="The generation whose Jobs build (or built) the artifacts.")
    fingerprint: str = Field(description="Hash of the spec fields the artifacts depend on (not "
                             "minQualityRetention).")
    plan_generation: int | None = Field(default=None, ge=1, description="The generation whose plan ConfigMap "
                                        "(<name>-g<N>-plan) is in force: a later one than the build's when a "
                                        "generation changed only minQualityRetention (the build's plan with the "
                                        "new floor, gated from the build's measured scores); unset: the build's.")
    child_config: str | None = Field(default=None, description="The child's config.json (gzip, base64), from "
                                     "the compression Job; deployments are sized from it.")
    precision: str | None = Field(default=None, description="Weight precision the build resolved (auto decided).")
    kv_cache_dtype: str | None = Field(default=None, alias="kvCacheDtype",
                                       description="KV-cache dtype the build resolved.")
    target_product: str | None = Field(default=None, description="nvidia.com/gpu.product the build's Jobs run on.")
    batch: int | None = Field(default=None, ge=1, description="Concurrent requests per GPU the build's "
                              "constraints are computed at.")
    batch_source: str | None = Field(default=None, description="Where batch came from: spec.compression.batch, "
                                     "or the pool asking the most of each GPU, e.g. pool h100 (perNode 64 over 8 "
                                     "GPUs), or why it is the default 1.")
    recipe: str | None = Field(default=None, description="The quantization recipe the build produced (bf16 "
                               "without quantization); pools are sized with it.")
    weight_bytes: int | None = Field(default=None, ge=0, description="Bytes of the quantized weights.")
    predicted_speedup: float | None = Field(default=None, ge=0, description="The child's decode speed-up over "
                                            "the parent that the compression predicted.")
    compute: str | None = Field(default=None, max_length=512, description="The dtype the compression Job computed "
                                "in and why: bfloat16 where its device has BF16 math (CUDA 8.0 on; a CPU with "
                                "AVX512_BF16 or AMX), else float32.")
    last_good: int | None = Field(default=None, ge=1, description="The last earlier build whose child passed its "
                                  "quality gate: its folder is kept until this build's child passes its own.")


class SpeedRatioStatus(StatusModel):
    """The child's served tokens/s over the parent's at one concurrency."""

    concurrency: int = Field(ge=1)
    ratio: float = Field(ge=0, description="The median over rounds.")
    per_round: list[float] = Field(default_factory=list)
    contended: bool = Field(default=False, description="A row behind it was measured while other processes used "
                                                       "the node's CPU (the figure is less trustworthy).")


class ServedSpeedup(StatusModel):
    """The Puzzle child's tokens/s over its parent's through the serving engine (measured by the speed Job: both
    BF16 in one Triton + vLLM with the same engine arguments, interleaved), beside the decoder's prediction."""

    generation: int = Field(ge=1, description="The generation measured.")
    pool: str = Field(description="The pool whose nodes, GPUs and engine it was measured on.")
    state: Literal["Running", "Measured", "NotMeasured", "Failed"]
    job_name: str | None = None
    predicted: float | None = Field(default=None, ge=0, description="The compression's predicted decode "
                                                                    "speed-up (the Puzzle cost model).")
    ratios: list[SpeedRatioStatus] = Field(default_factory=list)
    message: str | None = Field(default=None, description="What was measured where, or why not.")


class Endpoint(StatusModel):
    """Where a pool serves: Triton's HTTP and gRPC, and on vLLM pools the OpenAI-compatible API (`/v1/...`)."""

    pool: str
    url: str
    protocol: Literal["http", "grpc", "openai"]


class CompressedModelStatus(StatusModel):
    """What is true now, written by the operator."""

    phase: Phase | None = Field(default=None, description="Summary of the conditions, for printer columns.")
    progress: str | None = Field(default=None, description="The build stage under way and how far it is (the "
                                 "current step's share, from its log), or why it has not started, e.g. Compress "
                                 "27% or Compress: Queued; status.stages[].message has the step.")
    observed_generation: int | None = Field(default=None, ge=0)
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
    stages: list[StageProgress] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})
    architecture: ArchitectureSummary | None = None
    quality: QualityReport | None = None
    pools: list[PoolStatus] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})
    ready_replicas: int | None = Field(default=None, ge=0)
    endpoints: list[Endpoint] = Field(default_factory=list)
    build: BuildStatus | None = None
    serving_generation: int | None = Field(default=None, ge=0,
                                           description="The generation whose revisions the Services send traffic to.")
    served_speedup: ServedSpeedup | None = None


# Derived names (Services, Jobs, Deployments) must stay DNS labels of 63 characters that start with a
# letter, with up to 6 generation digits: a package Job <name>-g<generation>-package-<pool> and a result
# reader Job <name>-g<generation>-<stage>-r are the longest.
NAME_BUDGET = 63 - len("-g") - 6 - len("-package-")  # for the object's name and a pool's name together
NAME_MAX = 63 - len("-g") - 6 - len("-evaluate-r")
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
NAME_IS_LABEL = cel(f"self.metadata.name.matches('{NAME_PATTERN}')",
                    "metadata.name must start with a letter and hold only a-z, 0-9 and '-' (no dots): it names "
                    "the model's Services, Jobs and Deployments")
NAME_FITS = cel(f"size(self.metadata.name) <= {NAME_MAX}",
                f"metadata.name must be at most {NAME_MAX} characters: the Job <name>-g<generation>-evaluate-r "
                "and the other derived names must fit 63")
POOL_NAMES_FIT = cel(
    f"!has(self.spec.deployment) || self.spec.deployment.pools.all(p, size(self.metadata.name) + size(p.name)"
    f" <= {NAME_BUDGET})",
    f"metadata.name and each spec.deployment.pools[].name must together be at most {NAME_BUDGET} characters: the "
    "package Job <name>-g<generation>-package-<pool> must fit 63")


class CompressedModel(ApiModel):
    """The whole object as the API server stores it."""

    model_config = ConfigDict(extra="ignore")

    api_version: Literal["tailor.dev/v1alpha1"]
    kind: Literal["CompressedModel"]
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: CompressedModelSpec
    status: CompressedModelStatus | None = None

    @model_validator(mode="after")
    def _names_fit(self) -> CompressedModel:
        name = self.metadata.get("name")
        if name is None:
            return self
        if not re.fullmatch(NAME_PATTERN, name):
            raise ValueError(NAME_IS_LABEL["message"])
        if len(name) > NAME_MAX:
            raise ValueError(NAME_FITS["message"])
        if self.spec.deployment and any(len(name) + len(p.name) > NAME_BUDGET for p in self.spec.deployment.pools):
            raise ValueError(POOL_NAMES_FIT["message"])
        return self
