"""Roofline cost of each block: decode and prefill latency on a GPU profile at a precision.

A block's time is the larger of the bytes it moves over the memory bandwidth and the FLOPs it does
over the peak for the precision they run in (weights a recipe quantizes run at that precision where
the GPU has it natively, everything else at BF16). This is what Puzzle's search uses as cost when it
cannot measure on the target; `tailor.compressor.puzzle.measure` times the same blocks with torch where it
can. No torch here.

- Decode: one new token for each of `batch` requests that already hold `context` tokens. Weights are
  read once per step (for a mixture of experts, only the experts some token routes to), the KV cache
  of every request is read, Mamba state is read and written.
- Prefill: `batch` prompts of `context` tokens. Weights are read once, KV and state are written,
  activations go in and out, attention is causal (S^2 / 2 score pairs per head).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tailor.compressor.model.architecture import Architecture, Attention, Block, Mamba, Moe, NoOp, Part, TensorGroup
from tailor.compressor.sizing.hardware import GpuProfile, Precision
from tailor.compressor.sizing.memory import KV_BYTES, STATE_BYTES, KvDtype, QuantRecipe

ACTIVATION_BYTES = 2  # BF16 activations
SSM_FLOPS_PER_ELEMENT = 6  # decay, input and readout per state element and token


class Phase(StrEnum):
    DECODE = "decode"
    PREFILL = "prefill"


class Workload(BaseModel):
    """What a block is timed on."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    phase: Phase
    batch: int = Field(gt=0, description="Concurrent requests.")
    context: int = Field(gt=0, description="Decode: tokens already cached. Prefill: prompt length.")

    @property
    def tokens(self) -> int:
        """Tokens that pass through the weights in one call."""
        return self.batch * (1 if self.phase is Phase.DECODE else self.context)


class Cost(BaseModel):
    """Roofline time of one call and the two quantities behind it."""

    model_config = ConfigDict(frozen=True)

    seconds: float
    bytes_moved: float
    flops: float
    bound: Literal["memory", "compute"]

    def __add__(self, other: Cost) -> Cost:
        memory = self.bytes_moved + other.bytes_moved
        return Cost(seconds=self.seconds + other.seconds, bytes_moved=memory, flops=self.flops + other.flops,
                    bound=self.bound if self.seconds >= other.seconds else other.bound)


ZERO = Cost(seconds=0.0, bytes_moved=0.0, flops=0.0, bound="memory")


def expected_experts_touched(moe: Moe, tokens: int) -> float:
    """Distinct experts `tokens` tokens route to, each picking top_k of num_experts at random."""
    return moe.num_experts * (1.0 - float((1 - moe.top_k / moe.num_experts) ** tokens))


class CostModel:
    """Roofline costs on one GPU profile under one quantization recipe."""

    def __init__(self, gpu: GpuProfile, recipe: QuantRecipe, kv_dtype: KvDtype = KvDtype.BF16,
                 ssm_dtype: str = "float32") -> None:
        self.gpu, self.recipe, self.kv_dtype, self.ssm_bytes = gpu, recipe, kv_dtype, STATE_BYTES[ssm_dtype]

    def _roofline(self, bytes_moved: float, flops_by_precision: dict[Precision, float]) -> Cost:
        memory_s = bytes_moved / (self.gpu.bandwidth_gbps * 1e9)
        compute_s = sum(flops / (self.gpu.compute_tflops(p) * 1e12) for p, flops in flops_by_precision.items())
        return Cost(seconds=max(memory_s, compute_s), bytes_moved=bytes_moved,
                    flops=sum(flops_by_precision.values()), bound="memory" if memory_s >= compute_s else "compute")

    def _weights(self, part: Part, hidden: int, work: Workload) -> tuple[float, dict[Precision, float]]:
        """Weight bytes read and matmul FLOPs by the precision they run in."""
        read = part.params(hidden)
        if isinstance(part, Moe):
            touched = expected_experts_touched(part, work.tokens)
            read[TensorGroup.EXPERTS] = round(read[TensorGroup.EXPERTS] * touched / part.num_experts)
        bytes_read = sum(count * self.recipe.bits_for(group) / 8 for group, count in read.items())
        flops: dict[Precision, float] = {}
        for group, count in part.active_params(hidden).items():
            precision = self.recipe.precision if group in self.recipe.quantized else Precision.BF16
            flops[precision] = flops.get(precision, 0.0) + 2.0 * count * work.tokens
        return bytes_read, flops

    def part_cost(self, part: Part, hidden: int, work: Workload) -> Cost:
        if isinstance(part, NoOp):
            return ZERO
        bytes_moved, flops = self._weights(part, hidden, work)
        bf16 = flops.setdefault(Precision.BF16, 0.0)
        if work.phase is Phase.PREFILL:
            bytes_moved += 2 * work.tokens * hidden * ACTIVATION_BYTES
        if isinstance(part, Attention):
            kv_token = part.kv_elements_per_token() * KV_BYTES[self.kv_dtype]
            if work.phase is Phase.DECODE:
                bytes_moved += work.batch * (work.context + 1) * kv_token
                bf16 += 4.0 * work.batch * work.context * part.num_heads * part.head_dim
            else:
                bytes_moved += work.tokens * kv_token
                bf16 += 2.0 * work.batch * work.context**2 * part.num_heads * part.head_dim
        elif isinstance(part, Mamba):
            state = part.ssm_elements() * self.ssm_bytes + part.conv_elements() * ACTIVATION_BYTES
            bytes_moved += work.batch * state * (2 if work.phase is Phase.DECODE else 1)
            bf16 += SSM_FLOPS_PER_ELEMENT * part.ssm_elements() * work.tokens
        flops[Precision.BF16] = bf16
        return self._roofline(bytes_moved, flops)

    def block_cost(self, block: Block, hidden: int, work: Workload) -> Cost:
        total = ZERO
        for part in block.parts():
            total = total + self.part_cost(part, hidden, work)
        return total

    def model_cost(self, arch: Architecture, work: Workload) -> Cost:
        """All blocks plus the LM head (embedding lookups move a row per token: negligible)."""
        total = ZERO
        for block in arch.blocks:
            total = total + self.block_cost(block, arch.hidden_size, work)
        logits_tokens = work.batch  # only the last position of each sequence needs logits
        head = arch.vocab_size * arch.hidden_size
        return total + self._roofline(head * ACTIVATION_BYTES, {Precision.BF16: 2.0 * head * logits_tokens})

    def decode_tokens_per_second(self, arch: Architecture, batch: int, context: int) -> float:
        return batch / self.model_cost(arch, Workload(phase=Phase.DECODE, batch=batch, context=context)).seconds
