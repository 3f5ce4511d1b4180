"""What each stage of `tailor compress` needs per rank: peak memory and an estimated time.

A model of the pipeline as it runs in bounded memory per rank: frozen weights are streamed one block at a time in
the plan's `computeDtype` (BF16 on GPUs, float32 on the `cpu` profile: `compute.resolve`), as are the residual
streams captured from them; token windows and captured streams are read from the claim a chunk at a time; the
stages that all ranks share split their work over them. Each term is a
small named function so that it can follow the pipeline when that changes. `tailor compress --dry-run` prints
it; the operator checks it before it creates the compression Job. No torch here: the operator imports it.

The child is only known after the search, so the terms that depend on it use an upper bound (`child_bounds`).
`Footprint.stage_files` is what the stages keep on the claim.
Times are estimated from FLOPs at an assumed model FLOPs utilisation (`MFU`), not measured.
"""

from __future__ import annotations

import math
from functools import cached_property
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tailor.compressor.compute import processor_of_family, resolve
from tailor.compressor.model.architecture import Architecture, Attention, Mamba, Mlp, Moe, NoOp, Part
from tailor.compressor.model.chunks import HEAD_SLICE, LAYER_TOKENS
from tailor.compressor.puzzle.options import is_hybrid, part_options
from tailor.compressor.puzzle.plan import Plan
from tailor.compressor.sizing.hardware import GpuProfile, Precision

GIB = 1024**3
MAX_NODES = 64  # the CompressedModel API's ceiling for spec.jobs.nodes
TEACHER_SHARE = 0.75  # of a rank's budget: GKD shards the parent beside the child when both shards fit it
WORKING_SHARE = 0.25  # of a rank's budget: scoring's variant streams, a streamed teacher's layer states
MFU = 0.35  # assumption: the share of the profile's dense peak the stages reach
TF32_SHARE = 0.5  # a float32 matmul on a GPU runs on TF32 tensor cores at half the BF16 peak (A100, H100, B200)
HEAD_TOKENS = 1024  # tokens (whole sequences, at least one) whose logits scoring holds at once
CHUNK_TOKENS = 128  # tokens (whole sequences, at least one) whose logits evaluation holds at once
WHOLE_MODEL_BYTES = 10  # per parameter of a model loaded whole to time its decoding: float32, then a BF16 copy
                        # made through another float32 one (`pipeline.fits`, `evaluate.decode_tokens_per_second`)
STORED_BYTES = 2  # per parameter of the embedding and LM head, kept as checkpoints store them (BF16)
GPU_RUNTIME_GIB = 2.0  # assumption: CUDA context, cuBLAS/NCCL workspaces and allocator slack per rank
CPU_RUNTIME_GIB = 0.8  # measured: a rank's resident set after imports and joining the process group (CUDA torch build)
CPU_KERNELS_GIB = 0.25  # measured: oneDNN's BF16 kernels and primitive cache once BLD has trained on a CPU
TRAIN_BYTES = 18  # per trained parameter: float32 weight, its gradient, AdamW's two moments, a BF16 autocast copy
SHARDED_TRAIN_BYTES = 16  # per parameter of GKD's sharded child: float32 weight, gradient, AdamW's two moments
KL_TOKENS = 4096  # tokens whose logits GKD's loss holds at once (`gkd.chunked_kl`)
KL_LOGITS = 7  # [tokens, vocab] float32 tensors alive at scoring's and evaluation's KL (both models' logits and
               # log-softmaxes, the product; within 5% of the 10x compress bench's peaks)
GKD_KL_LOGITS = 5.3  # measured (`bench/gkd_memory.py`): what a row of GKD's loss costs beyond its saved
                     # activations, in [tokens, vocab] float32 tensors (the child's logits, both log-softmaxes,
                     # their gradients; the teacher's float32 logits are counted apart only in BF16)
HOST_LINK_GBPS = 50.0  # assumption: what pinned copies reach per GPU and direction over PCIe Gen5 x16 (64 GB/s)
HOST_MEMORY_GBPS = 400.0  # assumption: a node's DDR5 bandwidth that AdamW's streaming step on the host reaches
                          # (two sockets of 8 channels peak at about 700 GB/s)
ADAMW_HOST_BYTES = 28  # per parameter of a host AdamW step: weight, gradient and both moments read (16), the
                       # weight and moments written (12)
OFFLOAD_COPIES = 3  # float32 shard copies per micro-batch with `gkd.offload`: in for the forward's gather and
                    # for backward's, the gradient out
EVAL_ROWS = 8  # captured rows a BLD no-grad pass runs at once (`bld.EVAL_ROWS`)
MAMBA_CHUNK = 256  # tokens per quadratic Mamba-2 scan (`mamba.CHUNK`)
ASSUMPTIONS = (f"times are estimated from FLOPs at {MFU:.0%} of the profile's dense peak (BF16 for what trains "
               f"under autocast and for BF16 frozen models; float32 on a GPU at {TF32_SHARE:g}x that, TF32), not "
               "measured",
               f"each rank's runtime overhead is assumed: {GPU_RUNTIME_GIB:g} GiB on a GPU, {CPU_RUNTIME_GIB:g} GiB "
               "on a CPU",
               "the child's parameters are bounded by the target's params and activeParams (the parent's where it "
               "sets none); the child is only known after the search",
               f"with gkd.offload: copies at {HOST_LINK_GBPS:g} GB/s per GPU and direction (PCIe Gen5 x16), AdamW "
               f"on the host at {HOST_MEMORY_GBPS:g} GB/s of a node's memory bandwidth, neither overlapped with "
               "compute (assumed, not measured)")

StageName = Literal["capture", "bld", "scoring", "assembly", "gkd", "evaluation"]
Ranks = Literal["all", "rank 0"]


class StageNeed(BaseModel):
    """One stage's peak memory per rank, what it is made of, and its estimated time."""

    model_config = ConfigDict(frozen=True)

    stage: StageName
    ranks: Ranks = Field(description="Whether every rank runs the stage or rank 0 alone.")
    peak_bytes: int = Field(description="Peak memory per rank: the sum of `parts`.")
    parts: dict[str, int] = Field(description="What the peak is made of, in bytes.")
    seconds: float = Field(description="Estimated from the FLOPs at MFU, not measured (with `gkd.offload`, "
                                       "plus its copies and the host's AdamW step).")
    host_parts: dict[str, int] = Field(default_factory=dict,
                                       description="What the rank keeps in the node's host memory besides, in "
                                                   "bytes: GKD's offloaded child state (`gkd.offload`).")

    @property
    def host_bytes(self) -> int:
        return sum(self.host_parts.values())


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
    host_budget_bytes: int | None = Field(None, description="A node's host memory (the profile's hostMemoryGiB), "
                                                            "which the ranks' host parts must fit; None: unknown, "
                                                            "not checked.")
    stages: list[StageNeed]
    fitting_nodes: int | None = Field(description="The fewest nodes (same GPUs per node) on which every stage fits; "
                                                  f"None when none up to {MAX_NODES} does.")
    stage_files: dict[str, int] = Field(description="What the stages keep on the claim at most, by kind, in bytes "
                                                    "(the children and GKD's checkpoint besides: "
                                                    "`operator/preflight.ClaimNeed`).")
    assumptions: list[str] = Field(default_factory=lambda: list(ASSUMPTIONS))

    @property
    def ranks(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def fits(self) -> bool:
        return all(need.peak_bytes <= self.budget_bytes for need in self.stages) and self.host_fits

    @property
    def offloaded_bytes_per_node(self) -> int:
        """What one node's ranks keep in host memory at once beside their devices (GKD's offloaded child)."""
        return max(need.host_bytes for need in self.stages) * self.gpus_per_node

    @property
    def host_fits(self) -> bool:
        return self.host_budget_bytes is None or self.offloaded_bytes_per_node <= self.host_budget_bytes

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
        if not self.host_fits:
            assert self.host_budget_bytes is not None
            messages.append(f"GKD's offloaded child state needs {self.offloaded_bytes_per_node / GIB:,.0f} GiB of "
                            f"host memory per node, a {self.gpu} node has {self.host_budget_bytes / GIB:,.0f} GiB "
                            f"(its profile's hostMemoryGiB); {advice}")
        return messages

    def host_bytes_per_node(self) -> int:
        """Memory one node's ranks hold together at the peak stage (for a CPU run: the pod's memory request);
        ranks idle during a rank-0 stage keep their runtime."""
        idle = round((CPU_RUNTIME_GIB if self.on_cpu else GPU_RUNTIME_GIB) * GIB)
        return max(need.peak_bytes * self.gpus_per_node if need.ranks == "all"
                   else need.peak_bytes + (self.gpus_per_node - 1) * idle for need in self.stages)


# --- sizes --------------------------------------------------------------------------------------------


def child_state_bytes(child_params: float, ranks: int) -> int:
    """A rank's share of GKD's child training state: its float32 shard, gradients and AdamW's moments (on the
    device, or in host memory with `gkd.offload`)."""
    return round(SHARDED_TRAIN_BYTES * child_params / ranks)


def teacher_is_sharded(teacher_bytes: float, child_params: float, largest_block_params: int, ranks: int,
                       budget: float | None, offload: bool = False) -> bool:
    """GKD's rule: shard the teacher (`teacher_bytes` in all) beside the child (16 bytes per parameter: fp32
    weights, gradients, AdamW; none with `offload`, which keeps them in host memory) when both shards and one
    child block whole (weights and gradients) fit TEACHER_SHARE of the budget; else stream it. No budget: shard."""
    need = (teacher_bytes + (0 if offload else SHARDED_TRAIN_BYTES) * child_params) / ranks + 8 * largest_block_params
    return budget is None or need <= TEACHER_SHARE * budget


def runtime_bytes(gpu: GpuProfile) -> int:
    return round((CPU_RUNTIME_GIB if gpu.family == "cpu" else GPU_RUNTIME_GIB) * GIB)


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


def child_bounds(arch: Architecture, plan: Plan) -> tuple[float, float]:
    """Upper bounds on the child's parameters and active parameters (it is only known after the search): the
    target's params and activeParams shares (absolute caps turned into shares), the parent's where it sets
    none. A throughput or latency target bounds no parameter count: the published 2x child keeps 62% of them."""
    target = plan.target.for_parent(arch.total_params, arch.active_param_count)
    total = arch.total_params * min(1.0, target.params or 1.0)
    return total, min(total, arch.active_param_count * min(1.0, target.active_params or 1.0))


def saved_bytes_per_token(arch: Architecture, seq: int) -> int:
    """What a training step of the whole model saves for backward, per token: every part's (the parent's; the
    child's parts are no larger)."""
    return sum(training_bytes_per_token(part, arch.hidden_size, seq) for block in arch.blocks
               for part in block.parts())


def variants_per_slot(arch: Architecture, plan: Plan) -> list[tuple[int, Part, int]]:
    """(block index, part, variant count) per slot of the parent: what the library offers in the first round
    (`options.part_options`, the same function the pipeline uses)."""
    hybrid = is_hybrid(arch)
    return [(index, part, len(part_options(part, part, index, plan.library, plan.engine, hybrid)))
            for index, block in enumerate(arch.blocks) for part in block.parts()]


# --- the stages -----------------------------------------------------------------------------------------


class _Model:
    """The formulas for one parent, plan and GPU profile, at a number of ranks."""

    def __init__(self, arch: Architecture, plan: Plan, gpu: GpuProfile, budget: int, gpus_per_node: int) -> None:
        self.arch, self.plan, self.gpu, self.budget = arch, plan, gpu, budget
        self.gpus_per_node = gpus_per_node
        on_gpu = gpu.family != "cpu"
        self.fb = resolve(plan.compute_dtype, processor_of_family(gpu.family)).dtype.bytes  # frozen, streams
        self.hidden, self.seq, self.layers = arch.hidden_size, plan.data.seq_len, len(arch.blocks)
        self.block_max = max(block_params(arch))
        self.lmax = self.block_max * self.fb
        self.head = vocab_bytes(arch, STORED_BYTES) + HEAD_SLICE * self.hidden * 4
        self.embedding = vocab_bytes(arch, STORED_BYTES)
        self.ends = vocab_bytes(arch, STORED_BYTES) * (1 if arch.tie_word_embeddings else 2)
        self.slots = variants_per_slot(arch, plan)
        self.variants = sum(count for _, _, count in self.slots)
        self.child, self.child_active = child_bounds(arch, plan)
        self.bld_rows = math.ceil(plan.bld_activation_tokens / self.seq)  # whole sequences, as captured
        self.chunk_tokens = min(self.bld_rows, max(1, plan.activation_chunk_tokens // self.seq)) * self.seq
        self.scoring_tokens = math.ceil(plan.scoring_tokens / self.seq) * self.seq
        peak = gpu.compute_tflops(Precision.BF16) * 1e12 * MFU
        # what trains runs under BF16 autocast, or in float32 (TF32 on a GPU) like the frozen models
        self.train_flops_per_s = self.frozen_flops_per_s = peak * (TF32_SHARE if on_gpu and self.fb == 4 else 1.0)
        self.stage_flops = self.flops()

    def stream_bytes(self, tokens: int) -> int:
        """Residual streams of `tokens` tokens, in the frozen models' dtype."""
        return tokens * self.hidden * self.fb

    def layer_rows_tokens(self) -> int:
        return max(1, LAYER_TOKENS // self.seq) * self.seq

    def worst_inference_per_token(self) -> int:
        return max(inference_bytes_per_token(part, self.hidden, self.seq) for block in self.arch.blocks
                   for part in block.parts())

    def capture(self) -> dict[str, int]:
        """One layer, one chunk of the BLD rows in and out (and its token ids), the scoring rows in and out, and a
        layer's working set on LAYER_TOKENS tokens."""
        return {"largest block": self.lmax, "embedding": self.embedding,
                "a chunk of BLD rows, in and out": 2 * self.stream_bytes(self.chunk_tokens),
                "its token ids": 8 * self.chunk_tokens,
                "scoring rows, in and out": 2 * self.stream_bytes(self.scoring_tokens),
                "a layer's working set": self.layer_rows_tokens() * self.worst_inference_per_token()}

    def bld(self) -> dict[str, int]:
        """The worst slot a rank can be dealt: its whole layer, one chunk of captured rows and their targets, and
        its most demanding trained variant at its peak: a training step, the variant's initialisation (the parent
        part's statistics, EVAL_ROWS rows at a time) or an evaluation (as many rows at a time)."""
        arch, plan, hidden, seq = self.arch, self.plan, self.hidden, self.seq
        step, evaluated = plan.bld.batch * seq, min(self.chunk_tokens, EVAL_ROWS * seq)
        worst: dict[str, int] = {}
        hybrid = is_hybrid(arch)
        for index, block in enumerate(arch.blocks):
            layer = self.fb * int(sum(block.params(hidden).values()))
            for part in block.parts():
                for variant in part_options(part, part, index, plan.library, plan.engine, hybrid)[1:]:
                    if isinstance(variant, NoOp):
                        continue
                    params = int(sum(variant.params(hidden).values()))
                    peak = max(TRAIN_BYTES * params + step * training_bytes_per_token(variant, hidden, seq),
                               4 * params + evaluated * inference_bytes_per_token(part, hidden, seq),
                               4 * params + evaluated * inference_bytes_per_token(variant, hidden, seq))
                    terms = {"the slot's layer": layer, "a variant at its peak": peak}
                    if sum(terms.values()) > sum(worst.values()):
                        worst = terms
        kernels = round(CPU_KERNELS_GIB * GIB) if self.gpu.family == "cpu" else 0
        return {**worst, "a chunk of inputs and targets": 2 * self.stream_bytes(self.chunk_tokens),
                "BF16 kernels (CPU)": kernels}

    def scoring(self, ranks: int) -> dict[str, int]:
        tokens = self.scoring_tokens
        head_tokens = max(1, HEAD_TOKENS // self.seq) * self.seq
        return {"largest block": self.lmax, "LM head": self.head,
                "variant outputs": self._streams(math.ceil(self.variants / ranks), self.stream_bytes(tokens)),
                "residual stream": self.stream_bytes(tokens), "reference stream": self.stream_bytes(tokens),
                "a layer's working set": self.layer_rows_tokens() * self.worst_inference_per_token(),
                "logits chunk": KL_LOGITS * head_tokens * self.arch.vocab_size * 4}

    def _streams(self, count: int, each: int) -> int:
        """Variant streams a scoring sweep holds: as many as WORKING_SHARE of the budget takes (at least one)."""
        return min(count, max(1, int(WORKING_SHARE * self.budget) // each)) * each

    def assembly(self) -> dict[str, int]:
        """One layer read and written at a time, then the ends (embedding, final norm, LM head) in BF16; writing a
        shard serialises a copy of it."""
        return {"a block, or the ends, and its serialised copy": max(2 * self.lmax, 2 * self.ends)}

    def gkd(self, ranks: int) -> dict[str, int]:
        """The child sharded (FSDP2), a layer gathered at a time (in BF16 with BF16 frozen models); the parent
        sharded beside it or streamed (`teacher_is_sharded`, the rule `gkd.py` applies), its states then kept for
        WORKING_SHARE of the budget's worth of steps. A rank runs its share of each step's rows (`gkd.batch` /
        ranks, rounded up), `gkd.microBatch` of them at once; with `gkd.recompute` it keeps one layer's
        activations for backward, not every layer's; the KL's logits are held KL_TOKENS tokens at a time. With
        `gkd.offload` the child's shard, gradients and AdamW moments are in host memory (`gkd_host`); a block's
        float32 shard and its gradient pass through the device."""
        plan, arch, seq = self.plan, self.arch, self.seq
        rows, micro, steps = self.gkd_rows(ranks)
        held = micro * seq  # tokens a forward and backward holds
        gathered = 2 if self.fb == 2 else 4
        saved = (max(sum(training_bytes_per_token(part, self.hidden, seq) for part in block.parts())
                     for block in arch.blocks) if plan.gkd.recompute else saved_bytes_per_token(arch, seq))
        child = ({"a block's shard and its gradient in transit (fp32)": 2 * 4 * math.ceil(self.block_max / ranks)}
                 if plan.gkd.offload else {"child shard, grads and AdamW (fp32)": child_state_bytes(self.child, ranks)})
        parts = {**child,
                 "one child block gathered, and its gradients": 2 * self.block_max * gathered,
                 "teacher block": self.lmax,
                 "activations for backward": held * saved,
                 "child layer states (cosine loss)": held * self.hidden * 4 * self.layers,
                 "teacher logits (bf16)": held * arch.vocab_size * 2 if self.fb == 2 else 0,  # else among the 7
                 "logits and the KL's temporaries": round(GKD_KL_LOGITS * min(held, KL_TOKENS) * arch.vocab_size * 4),
                 "batch row indices": 8 * rows * ranks * steps}
        if teacher_is_sharded(self.fb * arch.total_params, self.child, self.block_max, ranks, self.budget,
                              plan.gkd.offload):
            return {**parts, "teacher shard": round(self.fb * arch.total_params / ranks),
                    "teacher layer states": held * self.hidden * self.fb * self.layers}
        return {**parts, "LM head": self.head,
                "teacher layer states (bf16)": self._teacher(rows, plan.gkd.tokens / ranks * self.hidden * 2
                                                             * self.layers)}

    def gkd_rows(self, ranks: int) -> tuple[int, int, int]:
        """A rank's rows per step (its share of `gkd.batch`, rounded up), rows per micro-batch, and the steps."""
        rows = math.ceil(self.plan.gkd.batch / ranks)
        steps = max(1, math.ceil(self.plan.gkd.tokens / (rows * ranks * self.seq)))
        return rows, min(rows, self.plan.gkd.micro_batch or rows), steps

    def gkd_host(self, ranks: int) -> dict[str, int]:
        """A rank's share of host memory with `gkd.offload`: its shard of the child's training state."""
        if not self.plan.gkd.offload:
            return {}
        return {"child shard, grads and AdamW (fp32, offloaded)": child_state_bytes(self.child, ranks)}

    def offload_seconds(self, ranks: int) -> float:
        """What `gkd.offload` adds to GKD, not overlapped with compute (an upper bound): every micro-batch copies
        each layer's float32 shard to the device twice and its gradient back (HOST_LINK_GBPS), and every step
        runs AdamW over the node's shards in host memory (HOST_MEMORY_GBPS)."""
        if not self.plan.gkd.offload:
            return 0.0
        rows, micro, steps = self.gkd_rows(ranks)
        shard = self.child / ranks
        copies = steps * math.ceil(rows / micro) * OFFLOAD_COPIES * 4 * shard / (HOST_LINK_GBPS * 1e9)
        adamw = steps * ADAMW_HOST_BYTES * shard * self.gpus_per_node / (HOST_MEMORY_GBPS * 1e9)
        return copies + adamw

    def _teacher(self, rows: int, every_row: float) -> int:
        """A streamed teacher's states are kept for the steps WORKING_SHARE of the budget holds (at least one)."""
        step = rows * self.seq * self.hidden * 2 * self.layers
        return round(min(every_row, max(step, WORKING_SHARE * self.budget)))

    def evaluation(self) -> dict[str, int]:
        """The larger of its two passes. Quality: one model and one LM head at a time (`evaluate.logit_chunks`),
        the stream of every evaluation token in and out of a layer, CHUNK_TOKENS tokens (whole sequences, at
        least one) of logits with the KL's temporaries. Decode timing, for models that fit the budget whole
        (`pipeline.fits`): the whole model, a BF16 copy on the way, and the prompt's BF16 logits."""
        arch, plan = self.arch, self.plan
        chunk = max(1, CHUNK_TOKENS // self.seq) * self.seq
        quality = {"largest block": self.lmax, "LM head": self.head,
                   "streams of the evaluation tokens, in and out": 2 * self.stream_bytes(plan.eval_tokens),
                   "a layer's working set": self.layer_rows_tokens() * self.worst_inference_per_token(),
                   "logits chunks": KL_LOGITS * chunk * arch.vocab_size * 4}
        if WHOLE_MODEL_BYTES * arch.total_params >= self.budget:
            return quality
        context = min(plan.target.context, plan.measure_context)
        timing = {"whole model for the decode timing": WHOLE_MODEL_BYTES * arch.total_params,
                  "prompt logits (bf16)": plan.target.batch * context * arch.vocab_size * 2}
        return timing if sum(timing.values()) > sum(quality.values()) else quality

    def stage_files(self) -> dict[str, int]:
        """What the stages keep on the claim at their largest: the token windows, one round's captured streams
        (every slot's BLD rows and scoring rows) and its trained variants (BF16)."""
        plan, hidden = self.plan, self.hidden
        train = max(plan.bld.tokens, plan.gkd.tokens)
        heldout = plan.scoring_tokens + plan.eval_tokens + self.seq
        streams = len(self.slots) * self.stream_bytes(self.bld_rows * self.seq + self.scoring_tokens)
        variants = sum((count - 1) * 2 * int(sum(part.params(hidden).values())) for _, part, count in self.slots)
        return {"token windows (int32)": 4 * (train + heldout), "captured streams (one round)": streams,
                "trained variants (one round)": variants}

    def flops(self) -> dict[StageName, float]:
        """Per stage over the whole run: capture, BLD and scoring run every round; the GKD budget is the total
        (recomputing the child's layers adds a forward pass). Every figure counts active parameters (a MoE token
        runs its top-k experts)."""
        plan, hidden, active = self.plan, self.hidden, self.arch.active_param_count
        rounds = plan.rounds
        per_block = [int(sum(block.active_params(hidden).values())) for block in self.arch.blocks]
        after = [sum(per_block[index + 1:]) for index in range(self.layers)]
        bld = sum(count * 6 * int(sum(part.active_params(hidden).values())) * plan.bld.tokens
                  for _, part, count in self.slots)
        scoring = sum(count * 2 * after[index] * plan.scoring_tokens for index, _, count in self.slots)
        return {"capture": rounds * 2 * active * (plan.bld_activation_tokens + plan.scoring_tokens),
                "bld": rounds * bld, "scoring": rounds * scoring, "assembly": 0.0,
                "gkd": ((8 if plan.gkd.recompute else 6) * self.child_active + 2 * active) * plan.gkd.tokens,
                "evaluation": 2 * (active + self.child_active) * plan.eval_tokens}

    def seconds(self, stage: StageName, ranks: int) -> float:
        """The stage's FLOPs at MFU of the peak its passes run at: training (BLD, GKD's child) under BF16
        autocast, forward passes of frozen models in their dtype."""
        flops = self.stage_flops[stage]
        if stage == "gkd":
            teacher = 2 * self.arch.active_param_count * self.plan.gkd.tokens
            return (((flops - teacher) / self.train_flops_per_s + teacher / self.frozen_flops_per_s) / ranks
                    + self.offload_seconds(ranks))
        rate = self.train_flops_per_s if stage == "bld" else self.frozen_flops_per_s
        return flops / (ranks * rate)

    @cached_property
    def rank_free(self) -> dict[str, dict[str, int]]:
        """The stages whose need does not depend on the number of ranks, worked out once (BLD walks every
        variant of every block) for all the node counts `footprint` tries."""
        return {"capture": self.capture(), "bld": self.bld(), "assembly": self.assembly(),
                "evaluation": self.evaluation()}

    def needs(self, ranks: int) -> list[StageNeed]:
        runtime = runtime_bytes(self.gpu)
        fixed = self.rank_free
        stages: list[tuple[StageName, Ranks, dict[str, int]]] = [
            ("capture", "rank 0", fixed["capture"]), ("bld", "all", fixed["bld"]),
            ("scoring", "all", self.scoring(ranks)), ("assembly", "rank 0", fixed["assembly"]),
            ("gkd", "all", self.gkd(ranks)), ("evaluation", "rank 0", fixed["evaluation"])]
        return [StageNeed(stage=name, ranks=who, parts={**parts, "runtime": runtime},
                          peak_bytes=sum(parts.values()) + runtime,
                          seconds=self.seconds(name, ranks if who == "all" else 1),
                          host_parts=self.gkd_host(ranks) if name == "gkd" else {})
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
    model = _Model(arch, plan, gpu, budget, gpus_per_node)
    host = round(gpu.host_memory_gib * GIB) if gpu.host_memory_gib is not None else None

    def fits(count: int) -> bool:
        needs = model.needs(gpus_per_node * count)
        return (all(need.peak_bytes <= budget for need in needs)
                and (host is None or max(need.host_bytes for need in needs) * gpus_per_node <= host))

    return Footprint(gpu=gpu.name, on_cpu=gpu.family == "cpu", gpus_per_node=gpus_per_node, nodes=nodes,
                     budget_bytes=budget, budget_stated=memory_gib is not None, host_budget_bytes=host,
                     stages=model.needs(gpus_per_node * nodes), stage_files=model.stage_files(),
                     fitting_nodes=next((n for n in range(1, MAX_NODES + 1) if fits(n)), None))
