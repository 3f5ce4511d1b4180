"""What torch reports of the device this process computes on, and the dtype a run computes in there
(`compute.resolve`, the one rule)."""

from __future__ import annotations

import contextlib
import os
import platform
from typing import Any

import torch

from tailor.compressor.compute import BF16_INSTRUCTIONS, Compute, ComputeDtype, Processor, processor_of_family, resolve

# oneDNN's ISA caps (ONEDNN_MAX_CPU_ISA) under which its BF16 kernels still run: a lower cap makes a BF16 CPU act
# as one without, as `ATEN_CPU_CAPABILITY=avx2` does for torch's own kernels
ONEDNN_BF16_ISAS = frozenset({"AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX10_1_512", "AVX10_1_512_AMX",
                              "AVX512_CORE_AMX", "AVX10_1_512_AMX_FP16", "AVX512_CORE_AMX_FP16", "ALL"})


def _cpu_bf16_instructions() -> tuple[str, ...]:
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper()
    if cap not in ONEDNN_BF16_ISAS:
        return ()
    found = {"AVX512_BF16": torch.cpu._is_avx512_bf16_supported(),
             "AMX_BF16": torch.cpu._is_amx_tile_supported()}
    return tuple(name for name in BF16_INSTRUCTIONS if found[name])


def detect(device: torch.device) -> Processor:
    """The processor behind `device`: a GPU's compute capability, or the CPU's ISA level as torch dispatches it
    (`torch.backends.cpu.get_cpu_capability()`, which `ATEN_CPU_CAPABILITY` lowers) and its BF16 instructions."""
    if device.type == "cuda":
        return Processor(kind="cuda", name=torch.cuda.get_device_name(device),
                         cuda_capability=torch.cuda.get_device_capability(device))
    return Processor(kind="cpu", name=platform.processor() or platform.machine(),
                     cpu_capability=torch.backends.cpu.get_cpu_capability(),
                     bf16_instructions=_cpu_bf16_instructions())


def compute_for(device: torch.device, requested: ComputeDtype = ComputeDtype.AUTO) -> Compute:
    """The dtype a run on `device` computes in, and why."""
    return resolve(requested, detect(device))


def compute_for_profile(family: str, requested: ComputeDtype = ComputeDtype.AUTO) -> Compute:
    """The dtype a model packaged here for a GPU profile's `family` computes in: on the `cpu` profile, this
    machine's CPU decides (it is the one that serves it); on a GPU, its family (`compute.processor_of_family`)."""
    if family == "cpu":
        return compute_for(torch.device("cpu"), requested)
    return resolve(requested, processor_of_family(family))


def torch_dtype(compute: Compute | ComputeDtype) -> torch.dtype:
    dtype = compute.dtype if isinstance(compute, Compute) else compute
    return torch.bfloat16 if dtype is ComputeDtype.BFLOAT16 else torch.float32


def autocast(device: torch.device, dtype: torch.dtype) -> contextlib.AbstractContextManager[Any]:
    """What trains (float32 weights) computes in `dtype`: under BF16 autocast, or plainly in float32."""
    if dtype == torch.bfloat16:
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()
