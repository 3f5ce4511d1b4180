"""What each stage of `tailor compress` needs per rank: peak memory and an estimated time.

A model of the pipeline as it runs in bounded memory per rank: frozen weights are streamed one block at a time,
residual streams are float32, and the stages that all ranks share split their work over them. Each term is a
small named function so that it can follow the pipeline when that changes. `tailor compress --dry-run` prints
it; the operator checks it before it creates the compression Job. No torch here: the operator imports it.

The child is only known after the search, so the terms that depend on it use an upper bound (`child_share`).
Times are estimated from FLOPs at an assumed model FLOPs utilisation (`MFU`), not measured.
"""

from __future__ import annotations

import math
from functools import cached_property
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tailor.compressor.architecture import Architecture, Attention, Mamba, Mlp, Moe, NoOp, Part
from tailor.compressor.hardware import GpuProfile, Precision
from tailor.compressor.puzzle.options import is_hybrid, part_options
from tailor.compressor.puzzle.plan import Plan

GIB = 1024**3
MAX_NODES = 64  # the CompressedModel API's ceiling for spec.jobs.nodes
TEACHER_SHARE = 0.75  # of a rank's budget: GKD shards the parent beside the child when both shards fit it
WORKING_SHARE = 0.25  # of a rank's budget: scoring's variant streams, a streamed teacher's layer states
MFU = 0.35  # assumption: the share of the profile's dense BF16 peak the stages reach
LOGITS_CHUNK = 8  # sequences whose logits (and layer inputs) are held at once when scoring
CHUNK_TOKENS = 128  # tokens whose logits (and KL's temporaries, a few times their size) are held when evaluating
FROZEN_BYTES = 4  # per frozen (streamed) parameter: the pipeline reads every model in float32, on a GPU too
STORED_BYTES = 2  # per parameter of the embedding and LM head, kept as checkpoints store them (BF16)
HEAD_SLICE = 8192  # vocabulary rows of a kept-as-stored LM head widened to float32 at a time (`lazy.StoredHead`)
GPU_RUNTIME_GIB = 2.0  # assumption: CUDA context, cuBLAS/NCCL workspaces and allocator slack per rank
CPU_RUNTIME_GIB = 0.8  # measured: a rank's resident set after imports and joining the process group (CUDA torch build)
CPU_KERNELS_GIB = 0.25  # measured: oneDNN's BF16 kernels and primitive cache once BLD has trained on a CPU
TRAIN_BYTES = 18  # per trained parameter: float32 weight, its gradient, AdamW's two moments, a BF16 autocast copy
EVAL_ROWS = 8  # captured rows a BLD no-grad pass runs at once (`bld.EVAL_ROWS`)
MAMBA_CHUNK = 256  # tokens per quadratic Mamba-2 scan (`mamba.CHUNK`)
ASSUMPTIONS = (f"times are estimated from FLOPs at {MFU:.0%} of the profile's BF16 peak, not measured",
               f"each rank's runtime overhead is assumed: {GPU_RUNTIME_GIB:g} GiB on a GPU, {CPU_RUNTIME_GIB:g} GiB "
               "on a CPU",
               "the child's parameters are bounded by the target's tightest share of the parent's; the child is "
               "only known after the search")

StageName = Literal["capture", "bld", "scoring", "assembly", "gkd", "evaluation"]
Ranks = Literal["all", "rank 0"]


class StageNeed(BaseModel):
    """One stage's peak memory per rank, what it is made of, and its estimated time."""

    model_config = ConfigDict(frozen=True)

    stage: StageName
    ranks: Ranks = Field(description="Whether every rank runs the stage or rank 0 alone.")
    peak_bytes: int = Field(description="Peak memory per rank: the sum of `parts`.")
    parts: dict[str, int] = Field(description="What the peak is made of, in bytes.")
    seconds: float = Field(description="Estimated from the FLOPs at MFU, not measured.")


class Footprint(BaseModel):
    """The stages' needs on one placement (ranks = GPUs per node x nodes) against the memory per rank."""

    model_config = ConfigDict(frozen=True)

    gpu: str
    on_cpu: bool = Field(description="The `cpu` family: ranks are processes sharing the host's RAM.")
    gpus_per_node: int = Field(ge=1)
    nodes: int = Field(ge=1)
    budget_bytes: int = Field(description="Memory per rank: the GPU's, or the stated budget.")
    budget_stated: bool = Field(description="The budget was stated (--memory-budget or the plan's budgetGiB), "
                                            "not the profile's memory.")
    stages: list[StageNeed]
    fitting_nodes: int | None = Field(description="The fewest nodes (same GPUs per node) on which every stage fits; "
                                                  f"None when none up to {MAX_NODES} does.")
    assumptions: list[str] = Field(default_factory=lambda: list(ASSUMPTIONS))

    @property
    def ranks(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def fits(self) -> bool:
        return all(need.peak_bytes <= self.budget_bytes for need in self.stages)

    def shortfalls(self, nodes_setting: str = "--nodes") -> list[str]:
        """One message per stage that does not fit, naming it and the shortfall; `nodes_setting` is what the
        advice calls the node count (a CLI flag or a spec field)."""
        has = (f"the budget is {self.budget_bytes / GIB:.1f} GiB per rank" if self.budget_stated
               else f"the {self.gpu} has {self.budget_bytes / GIB:.1f} GiB")
        if self.fitting_nodes is not None:
            advice = f"try {nodes_setting} {self.fitting_nodes}"
        else:
            advice = f"no node count up to {MAX_NODES} fits it; try a GPU with more memory"
        messages = []
        for need in self.stages:
            short = need.peak_bytes - self.budget_bytes
            if short > 0:
                where = "per rank" if need.ranks == "all" else "on rank 0"
                biggest = max(need.parts, key=lambda part: need.parts[part])
                messages.append(f"stage {need.stage} needs {need.peak_bytes / GIB:.1f} GiB {where} (most of it "
                                f"{biggest}), {has}: {short / GIB:.1f} GiB short; {advice}")
        return messages

    def host_bytes_per_node(self) -> int:
        """Memory one node's ranks hold together at the peak stage (for a CPU run: the pod's memory request);
        ranks idle during a rank-0 stage keep their runtime."""
        idle = round((CPU_RUNTIME_GIB if self.on_cpu else GPU_RUNTIME_GIB) * GIB)
        return max(need.peak_bytes * self.gpus_per_node if need.ranks == "all"
                   else need.peak_bytes + (self.gpus_per_node - 1) * idle for need in self.stages)


# --- sizes --------------------------------------------------------------------------------------------


def teacher_is_sharded(teacher_bytes: float, child_params: float, largest_block_params: int, ranks: int,
                       budget: float | None) -> bool:
    """GKD's rule: shard the teacher (`teacher_bytes` in all) beside the child (16 bytes per parameter: fp32
    weights, gradients, AdamW) when both shards and one child block whole (weights and gradients) fit
    TEACHER_SHARE of the budget; else stream it. No budget: shard."""
    need = (teacher_bytes + 16 * child_params) / ranks + 8 * largest_block_params
    return budget is None or need <= TEACHER_SHARE * budget


def runtime_bytes(gpu: GpuProfile) -> int:
    return round((CPU_RUNTIME_GIB if gpu.family == "cpu" else GPU_RUNTIME_GIB) * GIB)


def activation_bytes(arch: Architecture, tokens: int) -> int:
    """Residual streams of `tokens` tokens, in float32."""
    return tokens * arch.hidden_size * 4


def training_bytes_per_token(part: Part, hidden: int, seq: int) -> int:
    """What one BF16-autocast BLD step saves for backward, per token (measured with saved-tensor hooks on the
    CPU, rounded up): a Mamba-2 scan's per-chunk states grow with its chunk, a MoE with its top-k experts."""
    if isinstance(part, Mamba):
        return (36 * part.inner + 8 * part.num_heads * (part.state_size + min(seq, MAMBA_CHUNK)) + 4 * part.conv_dim
                + 8 * hidden)
    if isinstance(part, Moe):
        latent = part.latent_size or hidden
        return 8 * hidden + 8 * latent + part.top_k * (2 * latent + 6 * part.expert_width) + 6 * part.shared_width
    if isinstance(part, Attention):  # SDPA: no sequence x sequence scores kept
        return 6 * hidden + 6 * (part.num_heads + 2 * part.num_kv_heads) * part.head_dim
    if isinstance(part, Mlp):
        return 4 * hidden + (10 if part.gated else 5) * part.intermediate_size
    return 8 * hidden


def inference_bytes_per_token(part: Part, hidden: int, seq: int) -> int:
    """What a float32 no-grad pass of the part holds at its peak, per token (the same measurement)."""
    if isinstance(part, Mamba):
        projected = part.inner + part.conv_dim + part.num_heads
        return 4 * (2 * projected + 3 * part.conv_dim + 4 * part.inner
                    + part.num_heads * (4 * part.state_size + min(seq, MAMBA_CHUNK)) + 4 * hidden)
    if isinstance(part, Moe):
        latent = part.latent_size or hidden
        return 4 * (2 * hidden + 2 * latent + part.top_k * part.expert_width + part.shared_width)
    if isinstance(part, Attention):
        return 4 * (3 * hidden + (part.num_heads + 2 * part.num_kv_heads) * part.head_dim)
    if isinstance(part, Mlp):
        return 4 * (2 * hidden + (3 if part.gated else 2) * part.intermediate_size)
    return 8 * hidden


def block_params(arch: Architecture) -> list[int]:
    return [int(sum(block.params(arch.hidden_size).values())) for block in arch.blocks]


def vocab_bytes(arch: Architecture, per_param: int) -> int:
    """The embedding, or the LM head: vocabulary x hidden parameters (one tensor when they are tied)."""
    return arch.vocab_size * arch.hidden_size * per_param


def logits_bytes(arch: Architecture, sequences: int, seq_len: int) -> int:
    """float32 logits of `sequences` sequences."""
    return sequences * seq_len * arch.vocab_size * 4


def child_share(arch: Architecture, plan: Plan) -> float:
    """An upper bound on the child's size as a share of the parent's: the tightest of the target's parameter
    share, active-parameter share and 1 / throughput (the child is only known after the search)."""
    target = plan.target.for_parent(arch.total_params, arch.active_param_count)
    shares = [target.params, target.active_params, None if target.throughput is None else 1 / target.throughput]
    return min([1.0, *(share for share in shares if share is not None)])


def variants_per_slot(arch: Architecture, plan: Plan) -> list[tuple[int, Part, int]]:
    """(block index, part, variant count) per slot of the parent: what the library offers in the first round
    (`options.part_options`, the same function the pipeline uses)."""
    hybrid = is_hybrid(arch)
    return [(index, part, len(part_options(part, part, index, plan.library, plan.engine, hybrid)))
            for index, block in enumerate(arch.blocks) for part in block.parts()]


# --- the stages -----------------------------------------------------------------------------------------


class _Model:
    """The formulas for one parent, plan and GPU profile, at a number of ranks."""

    def __init__(self, arch: Architecture, plan: Plan, gpu: GpuProfile, budget: int) -> None:
        self.arch, self.plan, self.gpu, self.budget = arch, plan, gpu, budget
        self.fb = FROZEN_BYTES
        self.hidden, self.seq, self.layers = arch.hidden_size, plan.data.seq_len, len(arch.blocks)
        self.block_max = max(block_params(arch))
        self.lmax = self.block_max * self.fb
        self.head = vocab_bytes(arch, STORED_BYTES) + HEAD_SLICE * self.hidden * 4
        self.embedding = vocab_bytes(arch, STORED_BYTES)
        self.ends = vocab_bytes(arch, STORED_BYTES) * (1 if arch.tie_word_embeddings else 2)
        self.slots = variants_per_slot(arch, plan)
        self.variants = sum(count for _, _, count in self.slots)
        share = child_share(arch, plan)
        self.child, self.child_active = arch.total_params * share, arch.active_param_count * share
        self.flops_per_s = gpu.compute_tflops(Precision.BF16) * 1e12 * MFU
        self.stage_flops = self.flops()

    def seconds(self, flops: float, ranks: int) -> float:
        return flops / (ranks * self.flops_per_s)

    def capture(self) -> dict[str, int]:
        tokens = self.plan.bld_activation_tokens + self.plan.scoring_tokens
        return {"largest block": self.lmax, "embedding": self.embedding,
                "activations": 2 * activation_bytes(self.arch, tokens)}

    def bld(self) -> dict[str, int]:
        """The worst slot a rank can be dealt: its whole layer in float32, the captured rows and their targets,
        and its most demanding trained variant at its peak: a training step, the variant's initialisation (the
        parent part's statistics, EVAL_ROWS rows at a time) or the final evaluation (as many rows at a time)."""
        arch, plan, hidden, seq = self.arch, self.plan, self.hidden, self.seq
        rows = math.ceil(plan.bld_activation_tokens / seq) * seq  # whole sequences, as the pipeline captures them
        step, evaluated = plan.bld.batch * seq, min(rows, EVAL_ROWS * seq)
        worst: dict[str, int] = {}
        hybrid = is_hybrid(arch)
        for index, block in enumerate(arch.blocks):
            layer = 4 * int(sum(block.params(hidden).values()))
            for part in block.parts():
                for variant in part_options(part, part, index, plan.library, plan.engine, hybrid)[1:]:
                    if isinstance(variant, NoOp):
                        continue
                    params = int(sum(variant.params(hidden).values()))
                    peak = max(TRAIN_BYTES * params + step * training_bytes_per_token(variant, hidden, seq),
                               4 * params + evaluated * inference_bytes_per_token(part, hidden, seq),
                               4 * params + evaluated * inference_bytes_per_token(variant, hidden, seq))
                    terms = {"the slot's layer (fp32)": layer, "a variant at its peak": peak}
                    if sum(terms.values()) > sum(worst.values()):
                        worst = terms
        kernels = round(CPU_KERNELS_GIB * GIB) if self.gpu.family == "cpu" else 0
        return {**worst, "inputs and targets": 2 * activation_bytes(arch, rows), "BF16 kernels (CPU)": kernels}

    def scoring(self, ranks: int) -> dict[str, int]:
        tokens = self.plan.scoring_tokens
        return {"largest block": self.lmax, "LM head": self.head,
                "variant outputs": self._streams(math.ceil(self.variants / ranks), activation_bytes(self.arch, tokens)),
                "residual stream": activation_bytes(self.arch, tokens),
                "logits chunk": 3 * logits_bytes(self.arch, LOGITS_CHUNK, self.seq)}

    def _streams(self, count: int, each: int) -> int:
        """Variant streams a scoring sweep holds: as many as WORKING_SHARE of the budget takes (at least one)."""
        return min(count, max(1, int(WORKING_SHARE * self.budget) // each)) * each

    def assembly(self) -> dict[str, int]:
        """One layer read and written at a time, then the ends (embedding, final norm, LM head) in BF16; writing a
        shard serialises a copy of it."""
        return {"a block, or the ends, and its serialised copy": max(2 * self.lmax, 2 * self.ends)}

    def gkd(self, ranks: int) -> dict[str, int]:
        """The child sharded (FSDP2); the parent sharded beside it or streamed (`teacher_is_sharded`, the rule
        `gkd.py` applies), its states then kept for WORKING_SHARE of the budget's worth of steps."""
        batch, tokens = self.plan.gkd.batch, self.plan.gkd.tokens
        child = round(16 * self.child / ranks)
        parts = {"child shard, grads and AdamW (fp32)": child,
                 "one child block unsharded (fp32)": 2 * self.lmax * 4 // self.fb,
                 "teacher block": self.lmax,
                 "activations for backward": batch * self.seq * self.hidden * 4 * self.layers * 4,
                 "logits": 3 * logits_bytes(self.arch, batch, self.seq)}
        if teacher_is_sharded(self.fb * self.arch.total_params, self.child, self.block_max, ranks, self.budget):
            return {**parts, "teacher shard": round(self.fb * self.arch.total_params / ranks)}
        return {**parts, "LM head": self.head,
                "teacher layer states (bf16)": self._teacher(tokens / ranks * self.hidden * 2 * self.layers)}

    def _teacher(self, every_row: float) -> int:
        """A streamed teacher's states are kept for the steps WORKING_SHARE of the budget holds (at least one)."""
        step = self.plan.gkd.batch * self.seq * self.hidden * 2 * self.layers
        return round(min(every_row, max(step, WORKING_SHARE * self.budget)))

    def evaluation(self) -> dict[str, int]:
        """One model and one LM head at a time (`evaluate.logit_chunks`), CHUNK_TOKENS tokens of logits."""
        return {"largest block": self.lmax, "LM head": self.head,
                "activations": activation_bytes(self.arch, self.plan.eval_tokens),
                "logits chunks": 5 * CHUNK_TOKENS * self.arch.vocab_size * 4}

    def flops(self) -> dict[StageName, float]:
        """Per stage over the whole run: capture, BLD and scoring run every round; the GKD budget is the total."""
        plan, hidden, active = self.plan, self.hidden, self.arch.active_param_count
        rounds = plan.rounds
        per_block = [int(sum(block.active_params(hidden).values())) for block in self.arch.blocks]
        after = [sum(per_block[index + 1:]) for index in range(self.layers)]
        bld = sum(count * 6 * int(sum(part.params(hidden).values())) * plan.bld.tokens
                  for _, part, count in self.slots)
        scoring = sum(count * 2 * after[index] * plan.scoring_tokens for index, _, count in self.slots)
        return {"capture": rounds * 2 * active * (plan.bld_activation_tokens + plan.scoring_tokens),
                "bld": rounds * bld, "scoring": rounds * scoring, "assembly": 0.0,
                "gkd": (6 * self.child_active + 2 * active) * plan.gkd.tokens,
                "evaluation": 2 * (active + self.child_active) * plan.eval_tokens}

    @cached_property
    def rank_free(self) -> dict[str, dict[str, int]]:
        """The stages whose need does not depend on the number of ranks, worked out once (BLD walks every
        variant of every block) for all the node counts `footprint` tries."""
        return {"capture": self.capture(), "bld": self.bld(), "assembly": self.assembly(),
                "evaluation": self.evaluation()}

    def needs(self, ranks: int) -> list[StageNeed]:
        runtime = runtime_bytes(self.gpu)
        flops, fixed = self.stage_flops, self.rank_free
        stages: list[tuple[StageName, Ranks, dict[str, int]]] = [
            ("capture", "rank 0", fixed["capture"]), ("bld", "all", fixed["bld"]),
            ("scoring", "all", self.scoring(ranks)), ("assembly", "rank 0", fixed["assembly"]),
            ("gkd", "all", self.gkd(ranks)), ("evaluation", "rank 0", fixed["evaluation"])]
        return [StageNeed(stage=name, ranks=who, parts={**parts, "runtime": runtime},
                          peak_bytes=sum(parts.values()) + runtime,
                          seconds=self.seconds(flops[name], ranks if who == "all" else 1))
                for name, who, parts in stages]


def budget_bytes(gpu: GpuProfile, gpus_per_node: int, memory_gib: float | None) -> int:
    """Memory per rank: the stated budget, else the GPU's; on the `cpu` profile (whose memory is the host's
    RAM) the ranks of a node share it."""
    if memory_gib is not None:
        return round(memory_gib * GIB)
    return gpu.memory_bytes // gpus_per_node if gpu.family == "cpu" else gpu.memory_bytes


def footprint(arch: Architecture, plan: Plan, gpu: GpuProfile, gpus_per_node: int = 1, nodes: int = 1,
              memory_gib: float | None = None) -> Footprint:
    """Every stage's need on `nodes` x `gpus_per_node` ranks of `gpu`, and the fewest nodes that fit; the budget
    per rank is `memory_gib`, else the plan's `budgetGiB`, else the GPU's memory."""
    memory_gib = memory_gib if memory_gib is not None else plan.budget_gib
    budget = budget_bytes(gpu, gpus_per_node, memory_gib)
    model = _Model(arch, plan, gpu, budget)

    def fits(count: int) -> bool:
        return all(need.peak_bytes <= budget for need in model.needs(gpus_per_node * count))

    return Footprint(gpu=gpu.name, on_cpu=gpu.family == "cpu", gpus_per_node=gpus_per_node, nodes=nodes,
                     budget_bytes=budget, budget_stated=memory_gib is not None,
                     stages=model.needs(gpus_per_node * nodes),
                     fitting_nodes=next((n for n in range(1, MAX_NODES + 1) if fits(n)), None))
