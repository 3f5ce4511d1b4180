"""The one rule for the dtype a device computes in (`compute.resolve`), over the processors it meets, and what
this machine resolves to."""

from __future__ import annotations

import pytest
import torch

from tailor.compressor.compute import (
    ComputeDtype,
    Processor,
    nfd_labels,
    processor_from_labels,
    processor_of_family,
    resolve,
)
from tailor.compressor.model.device import autocast, compute_for, detect, torch_dtype

AUTO, BF16, FP32 = ComputeDtype.AUTO, ComputeDtype.BFLOAT16, ComputeDtype.FLOAT32


def cpu(level: str, *bf16: str) -> Processor:
    return Processor(kind="cpu", cpu_capability=level, bf16_instructions=bf16)


def cuda(major: int, minor: int) -> Processor:
    return Processor(kind="cuda", cuda_capability=(major, minor))


@pytest.mark.parametrize(("processor", "expected"), [
    (cpu("DEFAULT"), FP32),
    (cpu("AVX2"), FP32),  # most laptops and many cloud VMs: BF16 is emulated, 20-55x slower
    (cpu("AVX512"), FP32),  # AVX-512 without its BF16 instructions (Skylake, Cascade Lake)
    (cpu("AVX512", "AVX512_BF16"), BF16),  # Cooper Lake, Zen 4
    (cpu("AVX512", "AMX_BF16"), BF16),  # Sapphire Rapids on
    (cpu("AVX512", "AVX512_BF16", "AMX_BF16"), BF16),
    (cpu("AVX2", "AVX512_BF16"), FP32),  # torch told to dispatch AVX2 kernels (ATEN_CPU_CAPABILITY=avx2)
    (cpu("SVE256"), FP32),  # ARM: not counted on
    (cuda(7, 5), FP32),  # T4: no BF16 tensor cores
    (cuda(8, 0), BF16),  # A100
    (cuda(8, 9), BF16),  # L4, L40S
    (cuda(9, 0), BF16),  # H100, H200
    (cuda(10, 0), BF16),  # B200
])
def test_auto_computes_in_bf16_only_where_the_device_has_bf16_math(processor: Processor,
                                                                   expected: ComputeDtype) -> None:
    found = resolve(AUTO, processor)
    assert found.dtype is expected
    assert ("has BF16 math" in found.reason) == (expected is BF16)


def test_a_dtype_set_in_the_plan_is_kept_and_a_slow_one_says_so() -> None:
    assert resolve(FP32, cuda(9, 0)).dtype is FP32
    slow = resolve(BF16, cpu("AVX2"))
    assert slow.dtype is BF16 and "no BF16 math" in slow.reason and "set in the plan" in slow.reason
    assert "slower" not in resolve(BF16, cpu("AVX512", "AMX_BF16")).reason


def test_gpu_profiles_plan_for_bf16_and_the_cpu_profile_for_float32() -> None:
    """The dry run plans for a profile before it runs there: every GPU family in the profiles has BF16 math; the
    `cpu` profile names no ISA, so it plans for the CPU without it."""
    for family in ("ampere", "ada-lovelace", "hopper", "blackwell"):
        assert resolve(AUTO, processor_of_family(family)).dtype is BF16
    assert resolve(AUTO, processor_of_family("cpu")).dtype is FP32


@pytest.mark.parametrize(("flags", "expected"), [
    ({"avx", "avx2", "fma"}, FP32),
    ({"avx2", "avx512f", "avx512bw"}, FP32),
    ({"avx2", "avx512f", "avx512_bf16"}, BF16),
    ({"avx2", "avx512f", "amx_bf16", "amx_tile"}, BF16),
])
def test_a_cpu_node_resolves_from_the_labels_node_feature_discovery_gives_its_cpu(flags: set[str],
                                                                                  expected: ComputeDtype) -> None:
    labels = nfd_labels(flags)
    assert all(key.startswith("feature.node.kubernetes.io/cpu-cpuid.") for key in labels)
    assert resolve(AUTO, processor_from_labels(labels, "node-0")).dtype is expected


def test_a_node_without_nfd_labels_computes_in_float32() -> None:
    found = resolve(AUTO, processor_from_labels({"kubernetes.io/os": "linux"}, "node-0"))
    assert found.dtype is FP32 and "node-0" in found.reason


def test_this_machine_resolves_to_what_its_cpu_computes_fast() -> None:
    """Read from torch directly, not through `detect`: BF16 only with AVX-512 kernels and AVX512_BF16 or AMX."""
    level = torch.backends.cpu.get_cpu_capability()
    has_bf16 = level == "AVX512" and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    found = compute_for(torch.device("cpu"))
    assert found.dtype is (BF16 if has_bf16 else FP32), found.reason
    assert detect(torch.device("cpu")).cpu_capability == level
    assert torch_dtype(found) == (torch.bfloat16 if has_bf16 else torch.float32)


def test_onednn_capped_below_bf16_makes_a_bf16_cpu_act_as_one_without(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert detect(torch.device("cpu")).bf16_instructions == ()
    assert compute_for(torch.device("cpu")).dtype is FP32


def test_what_trains_runs_under_bf16_autocast_only_when_computing_in_bf16() -> None:
    weight = torch.randn(4, 4)
    with autocast(torch.device("cpu"), torch.bfloat16):
        assert (weight @ weight).dtype == torch.bfloat16
    with autocast(torch.device("cpu"), torch.float32):
        assert (weight @ weight).dtype == torch.float32
