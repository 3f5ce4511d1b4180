"""The dtype a device computes in: BF16 where it has BF16 math, float32 where it does not.

A CPU runs BF16 matmuls at speed only with AVX512_BF16 or AMX-BF16 (oneDNN's BF16 kernels); on an AVX2 CPU torch
emulates them, 20-55x slower than float32 (measured on a 2-core AMD EPYC with AVX2: a 1024x576 by 576x1536 matmul,
36 ms in float32, 2,047 ms in BF16). A GPU has BF16 tensor cores from Ampere (compute capability 8.0) on.
`resolve` is the one rule; every stage that runs a model follows it: GKD's autocast, the frozen models and the
residual streams captured from them, BLD, scoring, evaluation, the measured costs and speeds, packaging and the
engine of a CPU pool. What trains is float32 either way (under BF16 autocast where BF16 is chosen).

Pure: no torch (the operator resolves a CPU pool's dtype from its nodes' labels). `model/device.py` reads what
torch reports of the device this process runs on.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict

BF16_CUDA_CAPABILITY = (8, 0)  # Ampere: the first GPUs with BF16 tensor cores
# torch.backends.cpu.get_cpu_capability()'s level whose kernels use AVX-512 (and so AVX512_BF16 or AMX); an ARM
# CPU's levels (SVE256, DEFAULT) resolve to float32, BF16 or not
AVX512_LEVEL = "AVX512"
BF16_INSTRUCTIONS = ("AVX512_BF16", "AMX_BF16")
# Node Feature Discovery's CPUID labels (the GPU Operator installs NFD): `true` where the node's CPU has it
NFD_CPUID = "feature.node.kubernetes.io/cpu-cpuid."
NFD_FLAGS = {"AVX512_BF16": "AVX512BF16", "AMX_BF16": "AMXBF16", "AVX512": "AVX512F", "AVX2": "AVX2"}


class ComputeDtype(StrEnum):
    """A plan's `computeDtype`: auto follows the device (`resolve`)."""

    AUTO = "auto"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"

    @property
    def bytes(self) -> int:
        """Bytes per element of a resolved dtype."""
        if self is ComputeDtype.AUTO:
            raise ValueError("computeDtype auto has no size until it is resolved for a device")
        return 2 if self is ComputeDtype.BFLOAT16 else 4


class Processor(BaseModel):
    """What a device computes fast, as torch (or a node's labels) report it."""

    model_config = ConfigDict(frozen=True)

    kind: Literal["cpu", "cuda"]
    name: str = ""
    cpu_capability: str | None = None  # torch.backends.cpu.get_cpu_capability(): DEFAULT, AVX2, AVX512, ...
    bf16_instructions: tuple[str, ...] = ()  # of BF16_INSTRUCTIONS, those the CPU has and torch may use
    cuda_capability: tuple[int, int] | None = None

    def describe(self) -> str:
        if self.kind == "cuda":
            major, minor = self.cuda_capability or (0, 0)
            return f"{self.name or 'CUDA GPU'} (compute capability {major}.{minor})"
        found = ", ".join(self.bf16_instructions) or "no AVX512_BF16 or AMX"
        return f"{self.name or 'CPU'} ({self.cpu_capability or 'unknown ISA'}; {found})"


class Compute(BaseModel):
    """The dtype a run computes in, and why."""

    model_config = ConfigDict(frozen=True)

    dtype: Literal[ComputeDtype.BFLOAT16, ComputeDtype.FLOAT32]
    reason: str

    def describe(self) -> str:
        return f"{self.dtype.value}: {self.reason}"


def has_bf16_math(processor: Processor) -> bool:
    """Whether the device runs BF16 matmuls at speed."""
    if processor.kind == "cuda":
        return processor.cuda_capability is not None and processor.cuda_capability >= BF16_CUDA_CAPABILITY
    return processor.cpu_capability == AVX512_LEVEL and bool(processor.bf16_instructions)


def resolve(requested: ComputeDtype, processor: Processor) -> Compute:
    """`requested` where it names a dtype; for auto, BF16 where `processor` has BF16 math, else float32."""
    fast = has_bf16_math(processor)
    where = processor.describe()
    if requested is not ComputeDtype.AUTO:
        slow = "" if fast or requested is ComputeDtype.FLOAT32 else \
            " (this device has no BF16 math: BF16 runs many times slower than float32 here)"
        return Compute(dtype=requested, reason=f"computeDtype {requested.value} set in the plan, on {where}{slow}")
    if fast:
        return Compute(dtype=ComputeDtype.BFLOAT16, reason=f"{where} has BF16 math")
    if processor.kind == "cuda":
        return Compute(dtype=ComputeDtype.FLOAT32, reason=f"{where} has no BF16 tensor cores (Ampere, 8.0, on)")
    return Compute(dtype=ComputeDtype.FLOAT32,
                   reason=f"{where} has no BF16 math: BF16 would be emulated, 20-55x slower than float32")


# the lowest compute capability of each GPU family in the profiles (`sizing/gpus.yaml`)
FAMILY_CUDA_CAPABILITY = {"ampere": (8, 0), "ada-lovelace": (8, 9), "hopper": (9, 0), "blackwell": (10, 0)}


def processor_of_family(family: str) -> Processor:
    """A GPU profile's family as a processor, for what is planned for it before it runs there (the dry run). The
    `cpu` profile names no ISA: it plans for a CPU without BF16 math."""
    if family in FAMILY_CUDA_CAPABILITY:
        return Processor(kind="cuda", name=family, cuda_capability=FAMILY_CUDA_CAPABILITY[family])
    return Processor(kind="cpu", name=family)


def processor_from_labels(labels: dict[str, str], name: str = "") -> Processor:
    """A CPU node as Node Feature Discovery labels it (`feature.node.kubernetes.io/cpu-cpuid.AVX512BF16=true`,
    `...AMXBF16`, `...AVX512F`, `...AVX2`). A node without NFD's labels reads as a CPU without BF16 math: float32
    is slower than BF16 only where BF16 has math, never 20x."""

    def has(flag: str) -> bool:
        return labels.get(NFD_CPUID + NFD_FLAGS[flag]) == "true"

    level = "AVX512" if has("AVX512") else "AVX2" if has("AVX2") else None
    return Processor(kind="cpu", name=name, cpu_capability=level,
                     bf16_instructions=tuple(flag for flag in BF16_INSTRUCTIONS if has(flag)))


def nfd_labels(cpu_flags: set[str]) -> dict[str, str]:
    """The NFD CPUID labels (`processor_from_labels`) a CPU with these /proc/cpuinfo flags gets."""
    flags = {"AVX512_BF16": "avx512_bf16", "AMX_BF16": "amx_bf16", "AVX512": "avx512f", "AVX2": "avx2"}
    return {NFD_CPUID + NFD_FLAGS[name]: "true" for name, flag in flags.items() if flag in cpu_flags}
