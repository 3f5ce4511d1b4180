"""The pre-flight check: before the compression Job is created, does every stage fit the GPUs it asks for?

A plan that cannot fit fails the object with the stage and the shortfall (reason DoesNotFit) instead of a pod
that runs out of memory hours in. The check needs the parent's config, and the operator reads neither claims
nor the Hub: it knows the built-in models (`compressor/models`), by their Hub names or by a pvc:// folder of
the same name. For any other parent the check is skipped, and the Job's own run is the first to find out.
Pure and torch-free (`compressor/puzzle/footprint.py`).
"""

from __future__ import annotations

import functools
import math

from tailor.compressor.architecture import Architecture, builtin_models, load_architecture
from tailor.compressor.buildplan import BuildPlan
from tailor.compressor.hardware import MIB
from tailor.compressor.puzzle.footprint import GIB, Footprint, footprint
from tailor.operator.api import CompressedModelSpec
from tailor.operator.conditions import Reason, Refused

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


def memory_request(fp: Footprint | None) -> str | None:
    """A CPU run's pod memory request: what the node's ranks hold together at the peak stage. None on GPUs
    (their need is device memory; the Job keeps its per-GPU floor) and when nothing was checked."""
    if fp is None or not fp.on_cpu:
        return None
    return f"{math.ceil(fp.host_bytes_per_node() / MIB)}Mi"


def summary(fp: Footprint) -> str:
    peak = max(fp.stages, key=lambda need: need.peak_bytes)
    return (f"the compression fits {fp.nodes} node(s) x {fp.gpus_per_node} {fp.gpu}: at most "
            f"{peak.peak_bytes / GIB:.1f} GiB per rank (stage {peak.stage}) of {fp.budget_bytes / GIB:.1f} GiB")
