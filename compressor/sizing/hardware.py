"""GPU profiles: memory, bandwidth, dense throughput per precision, and how GPU Feature Discovery names them.

Built in from vendor data sheets (`gpus.yaml`), overridable from a YAML file of the same shape: an entry
whose name is known replaces the fields it sets, a new name adds a profile. The operator reads the same
format from a ConfigMap. No torch here.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

BUILTIN_FILE = Path(__file__).parent / "gpus.yaml"
MIB = 1024**2


class Precision(StrEnum):
    """Weight and activation precisions a model can be served in."""

    BF16 = "bf16"
    FP8 = "fp8"
    NVFP4 = "nvfp4"


PRODUCT_LABEL = "nvidia.com/gpu.product"  # GPU Feature Discovery's (the GPU Operator's): the product name
MEMORY_LABEL = "nvidia.com/gpu.memory"  # GFD: MiB per GPU as the device reports it


class UnknownGpuError(ValueError):
    """A GPU name that no profile has; the message lists the known ones."""


class GpuProfile(BaseModel):
    """One accelerator as the sizing and the cost model see it."""

    model_config = ConfigDict(frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True)

    name: str = Field(min_length=1)
    aliases: tuple[str, ...] = ()
    family: Literal["ampere", "ada-lovelace", "hopper", "blackwell", "cpu"]
    memory_mib: int = Field(gt=0, alias="memoryMiB", description="Memory the device reports (nvidia-smi).")
    bandwidth_gbps: float = Field(gt=0, alias="bandwidthGBps", description="Memory bandwidth, GB/s.")
    host_memory_gib: float | None = Field(None, gt=0, alias="hostMemoryGiB",
                                          description="Host memory (RAM) of one node of these GPUs: the smallest "
                                                      "of the instance types it lists. The dry run checks GKD's "
                                                      "offloaded child state against it; None: not checked.")
    tflops: dict[Precision, float] = Field(description="Dense tensor-core TFLOPS per natively supported precision.")
    gfd_products: tuple[str, ...] = Field(default=(), description="nvidia.com/gpu.product label values.")
    node_labels: dict[str, tuple[str, ...]] = Field(
        default_factory=dict, description="Other node labels, by key, whose values mean this GPU: GKE's "
        "cloud.google.com/gke-accelerator, a cloud's node.kubernetes.io/instance-type, a platform team's own.")

    def identifying_labels(self) -> dict[str, tuple[str, ...]]:
        """Every node label (key -> values) that says a node has this GPU."""
        found = {PRODUCT_LABEL: self.gfd_products} if self.gfd_products else {}
        for key, values in self.node_labels.items():
            found[key] = tuple(dict.fromkeys((*found.get(key, ()), *values)))
        return found

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MIB

    def runs_natively(self, precision: Precision) -> bool:
        return precision in self.tflops

    @property
    def serves_quantized(self) -> bool:
        """Whether FP8 and NVFP4 checkpoints can be served here: a GPU with FP8 math (NVFP4 weight-only on
        Hopper and Ada), or the `cpu` development profile, where the project's Python backend dequantizes
        them (their real bytes and quality, emulated speed). Not Ampere."""
        return self.runs_natively(Precision.FP8) or self.family == "cpu"

    def compute_tflops(self, precision: Precision) -> float:
        """Peak for a precision; one the GPU lacks runs at the widest precision it has (weights upcast)."""
        if precision in self.tflops:
            return self.tflops[precision]
        return self.tflops[Precision.BF16]

    def preferred_precision(self) -> Precision:
        """The `auto` choice: NVFP4 where native (Blackwell), else FP8 where native (Hopper, Ada), else BF16."""
        return next(p for p in (Precision.NVFP4, Precision.FP8, Precision.BF16) if self.runs_natively(p))

    def fallback_note(self, precision: Precision) -> str | None:
        """What serving engines do with a precision this GPU cannot compute in, or None if it can."""
        if self.runs_natively(precision):
            return None
        if precision is Precision.NVFP4:
            instead = "weight-only NVFP4 (W4A16): weights stay 4.5-bit in memory, matmuls run in BF16"
            if self.runs_natively(Precision.FP8):
                instead += "; FP8 is the faster choice here"
        else:
            instead = "weight-only FP8 (W8A16): weights stay 8-bit in memory, matmuls run in BF16"
        return f"{self.name} ({self.family}) has no native {precision.value} math; engines fall back to {instead}"


def resolve_precision(requested: str, gpu: GpuProfile) -> Precision:
    """The one place `auto` becomes a precision: NVFP4 where `gpu` computes in it, else FP8 where it does,
    else BF16; `none` is BF16; anything else names a precision."""
    if requested == "auto":
        return gpu.preferred_precision()
    return Precision.BF16 if requested == "none" else Precision(requested)


class GpuCatalog:
    """The profiles in force: built-ins plus overrides; looks up by name, alias or GFD product."""

    def __init__(self, profiles: list[GpuProfile]) -> None:
        self.profiles = {profile.name: profile for profile in profiles}

    @classmethod
    def load(cls, override: Path | None = None) -> GpuCatalog:
        catalog = cls(_read_profiles(BUILTIN_FILE, {}))
        if override is not None:
            catalog = cls(_read_profiles(override, catalog.profiles))
        return catalog

    @property
    def names(self) -> list[str]:
        return list(self.profiles)

    def get(self, name: str) -> GpuProfile:
        wanted = name.casefold()
        for profile in self.profiles.values():
            if wanted == profile.name.casefold() or wanted in (alias.casefold() for alias in profile.aliases):
                return profile
        raise UnknownGpuError(f"unknown GPU {name!r}; known profiles: {', '.join(self.names)}")

    def for_node(self, labels: dict[str, str]) -> tuple[GpuProfile, str] | None:
        """The profile a node's labels name, and the label that named it (`key=value`), if any: GPU Feature
        Discovery's product first, then the profiles' other labels."""
        for profile in self.profiles.values():
            for key, values in profile.identifying_labels().items():
                if labels.get(key) in values:
                    return profile, f"{key}={labels[key]}"
        return None


def _read_profiles(path: Path, base: dict[str, GpuProfile]) -> list[GpuProfile]:
    """Profiles from a YAML file, each entry merged over the profile of the same name in `base`."""
    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ValueError(f"{path}: cannot read GPU profiles ({error})") from error
    entries = document.get("profiles") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a mapping with a 'profiles' list")
    merged = dict(base)
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise ValueError(f"{path}: profiles[{index}] must be a mapping with a 'name'")
        known = merged.get(entry["name"])
        fields: dict[str, Any] = known.model_dump(by_alias=True) if known else {}
        fields.update(entry)
        try:
            merged[entry["name"]] = GpuProfile.model_validate(fields)
        except ValidationError as error:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
            raise ValueError(f"{path}: profiles[{index}] ({entry['name']}): {problems}") from error
    return list(merged.values())
