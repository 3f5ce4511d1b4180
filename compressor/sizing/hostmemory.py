"""What a pod holds in host memory (RAM), by term: its memory request, and its limit with headroom, so that one pod
cannot take a node's memory from its neighbours (and the kubelet's eviction from them all).

- A serving replica on the `cpu` development profile holds its weights and its whole KV cache and state in RAM (the
  sizing's footprint, per "GPU" of its group) beside the server's runtime, measured here: tritonserver, Triton's
  Python stub and vLLM's CPU engine serving SmolLM2 peak at 2.3 GiB proportional set size (3.2 GiB resident) beyond
  their weights and cache (`serving_need`; `bench/serving_memory.py` measures it).
- A replica on GPUs holds weights and cache on the devices; in RAM, each tensor-parallel worker's runtime (CUDA and
  torch libraries, pinned staging buffers, a tensor being loaded) and the server's own. Assumed, not measured:
  there is no GPU here.
- A compression pod on the `cpu` profile holds what the compression footprint says one node's ranks hold at its
  peak stage (`tailor compress --dry-run`), and what that footprint undercounts, measured: on the demo's plan
  (SmolLM2, `examples/smollm2-135m-cpu.yaml`) GKD peaked at 5.66 GiB resident where the dry run says 5.24 GiB
  (it said 3.84 before its activation and logits terms were measured per part; README, "The dry run against
  measured peaks"), and evaluation at 2.32 against 2.10: 25% more (`compression_need`).
- A compression pod on GPUs whose GKD offloads the child (`gkd.offload`) holds its ranks' shards of the child's
  float32 weights, gradients and AdamW moments in RAM (pinned), as the footprint models them, beside the per-GPU
  allowance below (`offload_need`).
  Elsewhere, where the operator knows no footprint (a parent whose config it cannot read, stages on GPUs, whose
  host memory the footprint does not model), an allowance per GPU, assumed (`stage_need`).
No torch here: the operator imports it.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from tailor.compressor.sizing.hardware import MIB
from tailor.compressor.sizing.memory import GIB

LIMIT_HEADROOM = 1.25  # the limit over the request: allocator slack, a burst of requests' temporaries
CPU_SERVING_RUNTIME_GIB = 3.0  # measured (module docstring), rounded up
GPU_WORKER_RUNTIME_GIB = 8.0  # assumed: one tensor-parallel worker's RAM beside its GPU
SERVER_RUNTIME_GIB = 2.0  # assumed: tritonserver and its Python stub on GPUs
STAGE_GIB_PER_GPU = 32.0  # assumed: a stage pod's RAM per GPU where no footprint is known (GPU nodes have 128+)
STAGE_CPU_GIB = 8.0  # assumed: a step without GPUs (packaging: files and configs, no model on a device)
UNDERCOUNTED = 0.25  # measured (module docstring): what the compression footprint leaves out, as a share of it


class HostNeed(BaseModel):
    """A pod's host memory: what it is made of, whether measured or modelled (`assumed`: an allowance)."""

    model_config = ConfigDict(frozen=True)

    parts: dict[str, int] = Field(description="Bytes per term.")
    assumed: bool = Field(description="An allowance, not the footprint of this model.")

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def request(self) -> str:
        return f"{math.ceil(self.total / MIB)}Mi"

    def limit(self, shared_memory: int = 0) -> str:
        """The limit: the request with headroom, and the pod's memory-backed /dev/shm (its pages are charged to the
        pod as they are written)."""
        return f"{math.ceil((self.total * LIMIT_HEADROOM + shared_memory) / MIB)}Mi"


def serving_need(on_cpu: bool, tensor_parallel: int, weights_per_gpu: int, cache_per_gpu: int) -> HostNeed:
    """A serving replica of `tensor_parallel` GPUs (or, `on_cpu`, of the cpu profile) whose weights and cache take
    `weights_per_gpu` and `cache_per_gpu` bytes on each."""
    if on_cpu:
        return HostNeed(parts={"weights": weights_per_gpu * tensor_parallel,
                               "KV cache and state": cache_per_gpu * tensor_parallel,
                               "runtime": round(CPU_SERVING_RUNTIME_GIB * GIB)}, assumed=False)
    return HostNeed(parts={"workers": round(GPU_WORKER_RUNTIME_GIB * GIB) * tensor_parallel,
                           "server": round(SERVER_RUNTIME_GIB * GIB)}, assumed=True)


def compression_need(footprint_bytes: int) -> HostNeed:
    """A compression pod whose ranks together hold `footprint_bytes` at their peak stage, as the dry run models it,
    and what the model undercounts."""
    return HostNeed(parts={"ranks at the peak stage (dry run)": footprint_bytes,
                           "beyond the dry run (measured)": round(footprint_bytes * UNDERCOUNTED)}, assumed=False)


def offload_need(offloaded_bytes: int, gpus: int) -> HostNeed:
    """A compression pod of `gpus` GPUs whose ranks keep `offloaded_bytes` of GKD's child state in RAM."""
    return HostNeed(parts={"GKD's offloaded child state (dry run)": offloaded_bytes,
                           "the ranks' allowance (assumed)": round(STAGE_GIB_PER_GPU * GIB) * gpus}, assumed=False)


def stage_need(gpus: int) -> HostNeed:
    """A stage pod with `gpus` GPUs (0: a step without any) whose footprint is not known: an allowance."""
    if gpus == 0:
        return HostNeed(parts={"step": round(STAGE_CPU_GIB * GIB)}, assumed=True)
    return HostNeed(parts={"ranks": round(STAGE_GIB_PER_GPU * GIB) * gpus}, assumed=True)
