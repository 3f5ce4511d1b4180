"""Stage 4, costs: what each variant costs on the target, from the cost model of `tailor.compressor.sizing.costs`.

Per variant: decode seconds (one token for `batch` requests holding `context` tokens), prefill seconds
(`batch` prompts of `context` tokens), weight bytes under the precision's recipe, KV bytes per token, Mamba
state bytes per request and parameters. Times come from the roofline on the target GPU profile, or are
measured with torch (`tailor.compressor.puzzle.measure`) when this machine is the target. What is not a block
(embeddings, final norm, LM head) is a fixed cost shared by every candidate. No torch is imported unless
measuring.
"""

from __future__ import annotations

from typing import Protocol

from pydantic import BaseModel

from tailor.compressor.model.architecture import Architecture, Attention, Block, Mamba, NoOp, Part
from tailor.compressor.puzzle.plan import CostSource, Target
from tailor.compressor.sizing.costs import CostModel, Phase, Workload
from tailor.compressor.sizing.hardware import GpuCatalog, GpuProfile, Precision
from tailor.compressor.sizing.memory import (
    KV_BYTES,
    KvDtype,
    block_weight_bytes,
    mamba_state_bytes,
    recipe_for,
    resolve_kv_dtype,
    weight_bytes,
)


class Price(BaseModel):
    decode_s: float
    prefill_s: float
    weight_bytes: float
    kv_bytes_per_token: float
    params: int
    active_params: int  # parameters a token uses (a MoE's routed top-k of its experts)
    state_bytes: float = 0.0  # Mamba state (SSM + convolution window) one request holds

    def memory_bytes(self, target: Target) -> float:
        """Weights plus the KV cache and Mamba state of `batch` requests at `context` tokens."""
        return self.weight_bytes + target.batch * (target.context * self.kv_bytes_per_token + self.state_bytes)

    @classmethod
    def total(cls, prices: list[Price]) -> Price:
        return cls(**{name: sum(getattr(p, name) for p in prices) for name in cls.model_fields})


def kv_dtype_for(target: Target, gpu: GpuProfile) -> KvDtype:
    """The target's KV dtype (the operator's build plan sets it); for a plan without one, bf16 beside bf16
    weights, else the GPU's `auto` choice."""
    if target.kv_dtype is not None:
        return target.kv_dtype
    return KvDtype.BF16 if target.precision is Precision.BF16 else resolve_kv_dtype("auto", gpu)


def resolve_source(target: Target, on_cpu: bool) -> CostSource:
    if target.costs is not CostSource.AUTO:
        return target.costs
    return CostSource.MEASURED if on_cpu and target.gpu.lower() == "cpu" else CostSource.ROOFLINE


class Timer(Protocol):
    """Measured seconds on this machine (`tailor.compressor.puzzle.measure.MeasuredCosts`)."""

    def seconds(self, part: Part, hidden: int, work: Workload) -> float: ...

    def head_seconds(self, hidden: int, vocab: int, work: Workload) -> float: ...


class Pricer:
    """Prices parts of one architecture family on one target: roofline, or `timer` when measuring."""

    def __init__(self, arch: Architecture, target: Target, timer: Timer | None = None) -> None:
        self.arch, self.target, self.timer = arch, target, timer
        self.gpu = GpuCatalog.load().get(target.gpu)
        self.recipe = recipe_for(target.precision, arch)
        self.kv_dtype = kv_dtype_for(target, self.gpu)
        self.model = CostModel(self.gpu, self.recipe, self.kv_dtype, arch.ssm_cache_dtype)
        self.decode = Workload(phase=Phase.DECODE, batch=target.batch, context=target.context)
        self.prefill = Workload(phase=Phase.PREFILL, batch=target.batch, context=target.context)
        self.fixed = self._fixed()
        self.per_block_s = 0.0

    def calibrate_decode(self, fixed_s: float, per_block_s: float = 0.0) -> None:
        """Measured costs (`calibration.calibrate`): the parent's decode step with every block removed becomes the
        fixed decode cost (never below the LM head's own timing), and what each kept block adds in a whole step
        beyond its timing alone is added to every kept variant's decode time, so predicted speed-ups are ratios of
        real steps."""
        head = self._fixed()
        self.fixed = head.model_copy(update={"decode_s": max(head.decode_s, fixed_s)})
        self.per_block_s = per_block_s

    def _seconds(self, part: Part, work: Workload) -> float:
        if self.timer is not None:
            return self.timer.seconds(part, self.arch.hidden_size, work)
        return self.model.part_cost(part, self.arch.hidden_size, work).seconds

    def price(self, part: Part, kind: str) -> Price:
        hidden = self.arch.hidden_size
        block = Block(mixer=part) if kind == "mixer" else Block(ffn=part)
        kv = part.kv_elements_per_token() * KV_BYTES[self.kv_dtype] if isinstance(part, Attention) else 0
        state = mamba_state_bytes([part], self.arch.ssm_cache_dtype).total if isinstance(part, Mamba) else 0
        decode_s = self._seconds(part, self.decode)
        if not isinstance(part, NoOp):
            decode_s = max(0.0, decode_s + self.per_block_s)
        return Price(decode_s=decode_s, prefill_s=self._seconds(part, self.prefill),
                     weight_bytes=block_weight_bytes(block, hidden, self.recipe), kv_bytes_per_token=kv,
                     params=int(sum(part.params(hidden).values())),
                     active_params=int(sum(part.active_params(hidden).values())), state_bytes=state)

    def _fixed(self) -> Price:
        """Embeddings, final norm and LM head: the whole model minus its blocks."""
        arch, hidden = self.arch, self.arch.hidden_size
        blocks_bytes = sum(block_weight_bytes(block, hidden, self.recipe) for block in arch.blocks)
        blocks_params = sum(int(sum(block.params(hidden).values())) for block in arch.blocks)
        blocks_active = sum(int(sum(block.active_params(hidden).values())) for block in arch.blocks)
        if self.timer is not None:
            decode_s, prefill_s = (self.timer.head_seconds(hidden, arch.vocab_size, work)
                                   for work in (self.decode, self.prefill))
        else:
            decode_s, prefill_s = (self.model.model_cost(arch, work).seconds - sum(
                self.model.block_cost(block, hidden, work).seconds for block in arch.blocks)
                for work in (self.decode, self.prefill))
        return Price(decode_s=decode_s, prefill_s=prefill_s, weight_bytes=weight_bytes(arch, self.recipe) -
                     blocks_bytes, kv_bytes_per_token=0, params=arch.total_params - blocks_params,
                     active_params=arch.active_param_count - blocks_active)
