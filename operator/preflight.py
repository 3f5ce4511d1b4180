"""The pre-flight checks: before the compression Job is created, does every stage fit the GPUs it asks for, and
does the artifacts claim hold what the build writes?

A plan that cannot fit fails the object with the stage and the shortfall (reason DoesNotFit) instead of a pod
that runs out of memory hours in. The check needs the parent's config, and the operator reads neither claims
nor the Hub: it knows the built-in models (`compressor/model/models`), by their Hub names or by a pvc:// folder of
the same name. For any other parent the check is skipped, and the Job's own run is the first to find out.
Pure and torch-free (`compressor/puzzle/footprint.py`).
"""

from __future__ import annotations

import functools
import math

from pydantic import BaseModel, Field

from tailor.compressor.buildplan import BuildPlan
from tailor.compressor.model.architecture import Architecture, builtin_models, load_architecture
from tailor.compressor.puzzle.footprint import GIB, Footprint, footprint
from tailor.compressor.sizing.hostmemory import HostNeed, compression_need, offload_need
from tailor.operator.api import CompressedModelSpec
from tailor.operator.conditions import Reason, Refused
from tailor.operator.manifest import quantity_value

# Hugging Face Hub names of the built-in models (their checkpoints there carry the same config.json)
HUB_MODELS = {
    "nvidia/nvidia-nemotron-3-super-120b-a12b-bf16": "nemotron-3-super-120b-a12b",
    "huggingfacetb/smollm2-135m": "smollm2-135m",
    "huggingfacetb/smollm2-135m-instruct": "smollm2-135m",
}
NODES_FIELD = "spec.jobs.nodes"


def builtin_parent(uri: str) -> str | None:
    """The built-in model a source names: an hf:// model in `HUB_MODELS`, or a pvc:// folder named as a
    built-in model (staged as is); None for anything else."""
    if uri.startswith("hf://"):
        return HUB_MODELS.get(uri.removeprefix("hf://").casefold())
    name = uri.rstrip("/").rpartition("/")[2]
    return name if uri.startswith("pvc://") and name in builtin_models() else None


@functools.lru_cache(maxsize=8)
def _architecture(name: str) -> Architecture:
    return load_architecture(name)


def check_fits(spec: CompressedModelSpec, plan: BuildPlan) -> Footprint | None:
    """The compression's footprint on spec.jobs' GPUs of the target; refused (DoesNotFit) when a stage needs
    more than a rank has. None when the parent's config is not known here: nothing is checked."""
    name = builtin_parent(spec.source.uri)
    if name is None:
        return None
    gpu = plan.catalog().get(plan.target_gpu)
    fp = footprint(_architecture(name), plan.puzzle, gpu, spec.jobs.gpus_per_node, spec.jobs.nodes)
    if not fp.fits:
        raise Refused(Reason.DOES_NOT_FIT, f"the compression does not fit {spec.jobs.nodes} node(s) x "
                                           f"{spec.jobs.gpus_per_node} {gpu.name}: "
                                           + "; ".join(fp.shortfalls(NODES_FIELD)))
    return fp


class ClaimNeed(BaseModel):
    """What a build writes on its artifacts claim at most, in bytes, by part (derived from parameter counts)."""

    parent: int = Field(description="the hf:// parent's BF16 download (0 for a pvc:// parent)")
    rounds: int = Field(description="each round's assembled and distilled child, BF16, kept for resuming")
    gkd_checkpoints: int = Field(description="GKD's fp32 weights and two AdamW moments, twice while one is saved")
    child: int = Field(description="the final child, BF16")
    quantized: int = Field(description="the quantized child, at most 1 byte per parameter")
    stage_files: int = Field(description="the stages' token windows, captured streams and trained variants "
                                         "(`Footprint.stage_files`; 0 where no footprint was worked out)")

    @property
    def total(self) -> int:
        return self.parent + self.rounds + self.gkd_checkpoints + self.child + self.quantized + self.stage_files

    def describe(self) -> str:
        parts = {"parent download": self.parent, "round children": self.rounds,
                 "GKD checkpoints": self.gkd_checkpoints, "child": self.child, "quantized child": self.quantized,
                 "stage files": self.stage_files}
        return ", ".join(f"{name} {size / 1e9:,.0f} GB" for name, size in parts.items() if size)


def claim_need(spec: CompressedModelSpec, arch: Architecture, fp: Footprint | None = None) -> ClaimNeed:
    """The most a build of `arch` writes: its child is taken at maxTotalParamsBillions, else the parent's size;
    the stages' own files from the compression's footprint `fp`, where there is one."""
    parent = arch.total_params
    cap = spec.compression.max_total_params_billions
    child = min(parent, int(cap * 1e9)) if cap is not None else parent
    return ClaimNeed(parent=2 * parent if spec.source.uri.startswith("hf://") else 0,
                     rounds=spec.compression.rounds * 2 * 2 * child, gkd_checkpoints=2 * 12 * child,
                     child=2 * child, quantized=0 if spec.quantization.precision == "none" else child,
                     stage_files=0 if fp is None else sum(fp.stage_files.values()))


def check_claim(spec: CompressedModelSpec, claim: str, capacity: str, to_create: bool,
                fp: Footprint | None = None) -> ClaimNeed | None:
    """Refused (ClaimTooSmall) when the claim's `capacity` (a quantity; `to_create`: the size Tailor's claim would
    get) cannot hold what the build writes (the stages' files from the compression's footprint `fp`); None when
    the parent's config is not known here: nothing is checked."""
    name = builtin_parent(spec.source.uri)
    if name is None:
        return None
    need, holds = claim_need(spec, _architecture(name), fp), quantity_value(capacity)
    if need.total > holds:
        fix = ("set spec.storage.size" if to_create else "expand the claim (if its StorageClass allows) or use "
               "another in spec.storage.existingClaim" if spec.storage.existing_claim else "expand the claim (if "
               "its StorageClass allows) or delete it, and set spec.storage.size")
        held = "would hold" if to_create else "holds"
        raise Refused(Reason.CLAIM_TOO_SMALL, f"PersistentVolumeClaim {claim} {held} {capacity} "
                                              f"({holds / 1e9:,.0f} GB), but the build writes up to "
                                              f"{need.total / 1e9:,.0f} GB ({need.describe()}): {fix} to at least "
                                              f"{math.ceil(need.total / 2**40 * 10) / 10}Ti; nothing was started")
    return need


def host_need(fp: Footprint | None) -> HostNeed | None:
    """A CPU run's host memory: what the node's ranks hold together at the peak stage; on GPUs, GKD's offloaded
    child state beside the per-GPU allowance. None on GPUs without offload (the footprint models device memory;
    the Job gets the per-GPU allowance) and when nothing was checked."""
    if fp is None:
        return None
    if fp.on_cpu:
        return compression_need(fp.host_bytes_per_node())
    return offload_need(fp.offloaded_bytes_per_node, fp.gpus_per_node) if fp.offloaded_bytes_per_node else None


def summary(fp: Footprint) -> str:
    peak = max(fp.stages, key=lambda need: need.peak_bytes)
    return (f"the compression fits {fp.nodes} node(s) x {fp.gpus_per_node} {fp.gpu}: at most "
            f"{peak.peak_bytes / GIB:.1f} GiB per rank (stage {peak.stage}) of {fp.budget_bytes / GIB:.1f} GiB")
