"""What a model is made of: a per-block description read from a Hugging Face `config.json`.

Every block is a residual sub-layer pair: a token mixer (attention, Mamba-2, a linear map or nothing)
and a feed-forward part (dense MLP, mixture of experts, a linear map or nothing). A Llama layer fills
both; a NemotronH block fills one. Puzzle children vary these per block, so a block carries its own
sizes rather than reading them from model-wide fields.

Parameters are counted by tensor group (`TensorGroup`), the unit a quantization recipe keeps in
higher precision or quantizes. No torch here: this module is imported by the operator.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, cast

from pydantic import BaseModel, ConfigDict, Field

MODELS_DIR = Path(__file__).parent / "models"
# model_type of a child -> the config class engines read it through: a file of tailor's copied beside the weights
# and named in `auto_map` (transformers has neither type). No other code travels with a checkpoint.
CONFIG_CLASSES = {"nemotron-nas": ("configuration_decilm.py", "configuration_decilm.DeciLMConfig"),
                  "nemotron_h_puzzle": ("configuration_nemotron_h_puzzle.py",
                                        "configuration_nemotron_h_puzzle.NemotronHPuzzleConfig")}
MAX_BLOCKS = 4096  # layers a config may have: real models have a few hundred; more is not a model, and would be
#                   built block by block before anything else could refuse it


class ConfigError(ValueError):
    """A config.json that cannot be read into an architecture; names the file and the field."""


class TensorGroup(StrEnum):
    """Kinds of weight tensors, as quantization recipes see them."""

    EMBEDDING = "embedding"
    LM_HEAD = "lm_head"
    NORM = "norm"
    ATTENTION = "attention"
    LINEAR = "linear"
    MAMBA_PROJ = "mamba_proj"
    MAMBA_OTHER = "mamba_other"
    MLP = "mlp"
    ROUTER = "router"
    LATENT = "latent"
    EXPERTS = "experts"
    SHARED_EXPERTS = "shared_experts"


Params = Counter[TensorGroup]


class Part(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    code: ClassVar[str]  # one character, as in NemotronH's hybrid pattern

    def params(self, hidden: int) -> Params:
        """Parameters of this sub-layer, pre-norm included, by tensor group."""
        raise NotImplementedError

    def active_params(self, hidden: int) -> Params:
        """Parameters one token touches (all of them, except in a mixture of experts)."""
        return self.params(hidden)

    def _with_norm(self, hidden: int, groups: dict[TensorGroup, int]) -> Params:
        return Counter({TensorGroup.NORM: hidden, **groups})


class Attention(Part):
    """Grouped-query self-attention; the only part with a KV cache."""

    code: ClassVar[str] = "*"
    kind: Literal["attention"] = "attention"
    num_heads: int = Field(gt=0)
    num_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)

    def params(self, hidden: int) -> Params:
        q_and_o = 2 * hidden * self.num_heads * self.head_dim
        k_and_v = 2 * hidden * self.num_kv_heads * self.head_dim
        return self._with_norm(hidden, {TensorGroup.ATTENTION: q_and_o + k_and_v})

    def kv_elements_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim


class Mamba(Part):
    """A Mamba-2 mixer: its state per request is fixed, whatever the context length."""

    code: ClassVar[str] = "M"
    kind: Literal["mamba"] = "mamba"
    num_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    state_size: int = Field(gt=0)
    n_groups: int = Field(gt=0)
    conv_kernel: int = Field(gt=0)

    @property
    def inner(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.inner + 2 * self.n_groups * self.state_size

    def params(self, hidden: int) -> Params:
        in_proj = hidden * (self.inner + self.conv_dim + self.num_heads)
        out_proj = self.inner * hidden
        conv = self.conv_dim * self.conv_kernel + self.conv_dim
        per_head = 3 * self.num_heads  # A_log, D, dt_bias
        gated_norm = self.inner
        return self._with_norm(hidden, {
            TensorGroup.MAMBA_PROJ: in_proj + out_proj,
            TensorGroup.MAMBA_OTHER: conv + per_head + gated_norm,
        })

    def ssm_elements(self) -> int:
        return self.num_heads * self.head_dim * self.state_size

    def conv_elements(self) -> int:
        return self.conv_dim * (self.conv_kernel - 1)


class Linear(Part):
    """A sub-layer replaced by one hidden x hidden linear map (Puzzle's `replace_with_linear`)."""

    code: ClassVar[str] = "L"
    kind: Literal["linear"] = "linear"

    def params(self, hidden: int) -> Params:
        return self._with_norm(hidden, {TensorGroup.LINEAR: hidden * hidden})


class NoOp(Part):
    """A sub-layer removed altogether: the residual stream passes through."""

    code: ClassVar[str] = "0"
    kind: Literal["noop"] = "noop"

    def params(self, hidden: int) -> Params:
        return Counter()


class Mlp(Part):
    """A dense feed-forward network; gated (SwiGLU, three matrices) or not (ReLU^2, two)."""

    code: ClassVar[str] = "-"
    kind: Literal["mlp"] = "mlp"
    intermediate_size: int = Field(gt=0)
    gated: bool

    def params(self, hidden: int) -> Params:
        matrices = 3 if self.gated else 2
        return self._with_norm(hidden, {TensorGroup.MLP: matrices * hidden * self.intermediate_size})


class Moe(Part):
    """A mixture of experts with a router, optional shared expert and optional latent projection."""

    code: ClassVar[str] = "E"
    kind: Literal["moe"] = "moe"
    num_experts: int = Field(gt=0)
    top_k: int = Field(gt=0)
    expert_width: int = Field(gt=0)
    shared_width: int = Field(ge=0)
    latent_size: int | None = Field(default=None, gt=0)
    gated: bool = False

    def _expert_params(self, hidden: int) -> int:
        matrices = 3 if self.gated else 2
        return matrices * (self.latent_size or hidden) * self.expert_width

    def _groups(self, hidden: int, experts: int) -> Params:
        groups = {
            TensorGroup.ROUTER: self.num_experts * hidden,  # its score-correction bias is a buffer
            TensorGroup.EXPERTS: experts * self._expert_params(hidden),
            TensorGroup.SHARED_EXPERTS: 2 * hidden * self.shared_width,
        }
        if self.latent_size:
            groups[TensorGroup.LATENT] = 2 * hidden * self.latent_size
        return self._with_norm(hidden, groups)

    def params(self, hidden: int) -> Params:
        return self._groups(hidden, self.num_experts)

    def active_params(self, hidden: int) -> Params:
        return self._groups(hidden, self.top_k)


Mixer = Annotated[Attention | Mamba | Linear | NoOp, Field(discriminator="kind")]
FeedForward = Annotated[Mlp | Moe | Linear | NoOp, Field(discriminator="kind")]


class Block(BaseModel):
    """One residual block: a token mixer, a feed-forward part, or both."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mixer: Mixer | None = None
    ffn: FeedForward | None = None

    def parts(self) -> list[Part]:
        return [part for part in (self.mixer, self.ffn) if part is not None]

    def params(self, hidden: int) -> Params:
        return sum((part.params(hidden) for part in self.parts()), Counter())

    def active_params(self, hidden: int) -> Params:
        return sum((part.active_params(hidden) for part in self.parts()), Counter())

    @property
    def code(self) -> str:
        """One character per part, as in NemotronH's hybrid pattern (M, E, *, -; L linear, 0 no-op)."""
        return "".join(part.code for part in self.parts())


class Architecture(BaseModel):
    """A decoder-only language model, block by block."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    hidden_size: int = Field(gt=0)
    vocab_size: int = Field(gt=0)
    tie_word_embeddings: bool
    max_position_embeddings: int | None = None
    ssm_cache_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    blocks: list[Block] = Field(min_length=1)

    def params(self) -> Params:
        """All parameters by tensor group, embeddings and LM head included."""
        total = self._outer()
        for block in self.blocks:
            total.update(block.params(self.hidden_size))
        return total

    def active_params(self) -> Params:
        total = self._outer()
        for block in self.blocks:
            total.update(block.active_params(self.hidden_size))
        return total

    def _outer(self) -> Params:
        embedding = self.vocab_size * self.hidden_size
        groups = Counter({TensorGroup.EMBEDDING: embedding, TensorGroup.NORM: self.hidden_size})
        if not self.tie_word_embeddings:
            groups[TensorGroup.LM_HEAD] = embedding
        return groups

    @property
    def total_params(self) -> int:
        return int(sum(self.params().values()))

    @property
    def active_param_count(self) -> int:
        return int(sum(self.active_params().values()))

    def attention_layers(self) -> list[Attention]:
        return [block.mixer for block in self.blocks if isinstance(block.mixer, Attention)]

    def mamba_layers(self) -> list[Mamba]:
        return [block.mixer for block in self.blocks if isinstance(block.mixer, Mamba)]

    @property
    def is_hybrid(self) -> bool:
        """Mamba or MoE blocks: quantization then follows modelopt's Mamba-MoE presets."""
        return any(isinstance(part, Mamba | Moe) for block in self.blocks for part in block.parts())

    @property
    def pattern(self) -> str:
        return "".join(block.code for block in self.blocks)


# --- reading config.json ------------------------------------------------------------------------------


class _Fields:
    """Typed access to a config dict that names the file and the field in every error."""

    def __init__(self, data: dict[str, Any], source: str, where: str = "") -> None:
        self.data, self.source, self.where = data, source, where

    def _fail(self, key: str, expected: str) -> ConfigError:
        return ConfigError(f"{self.source}: field {self.where}{key!r} {expected}")

    def integer(self, key: str, default: int | None = None, *, minimum: int = 1) -> int:
        value = self.data.get(key, default)
        if value is None:
            raise self._fail(key, "is required (an integer)")
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self._fail(key, f"must be an integer >= {minimum}, got {value!r}")
        return value

    def optional_integer(self, key: str) -> int | None:
        return None if self.data.get(key) is None else self.integer(key)

    def number(self, key: str) -> float:
        value = self.data.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise self._fail(key, f"must be a positive number, got {value!r}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if not isinstance(value, bool):
            raise self._fail(key, f"must be true or false, got {value!r}")
        return value

    def text(self, key: str, default: str | None = None) -> str:
        value = self.data.get(key, default)
        if not isinstance(value, str) or not value:
            raise self._fail(key, "is required (a string)" if value is None else f"must be a string, got {value!r}")
        return value

    def layers(self, key: str) -> int:
        """A count of layers: at most MAX_BLOCKS, checked before anything is built per layer."""
        count = self.integer(key)
        if count > MAX_BLOCKS:
            raise self._fail(key, f"is {count}; at most {MAX_BLOCKS} layers are read")
        return count

    def items(self, key: str, length: int | None = None) -> list[Any]:
        value = self.data.get(key)
        if not isinstance(value, list):
            raise self._fail(key, "is required (a list)" if value is None else f"must be a list, got {value!r}")
        if len(value) > MAX_BLOCKS:
            raise self._fail(key, f"has {len(value)} entries; at most {MAX_BLOCKS} layers are read")
        if length is not None and len(value) != length:
            raise self._fail(key, f"must have one entry per layer ({length}), got {len(value)}")
        return value

    def section(self, key: str, index: int | None = None) -> _Fields:
        value = self.data.get(key)
        if index is not None:
            value = value[index] if isinstance(value, list) and index < len(value) else None
        where = f"{self.where}{key}[{index}]." if index is not None else f"{self.where}{key}."
        if not isinstance(value, dict):
            raise self._fail(key, f"must be an object, got {value!r}")
        return _Fields(value, self.source, where)

    def merged(self, overrides: dict[str, Any], where: str) -> _Fields:
        return _Fields({**self.data, **overrides}, self.source, where)


def _llama_attention(f: _Fields, kv_heads: int | None = None) -> Attention:
    heads = f.integer("num_attention_heads")
    return Attention(num_heads=heads, num_kv_heads=kv_heads or f.integer("num_key_value_heads", heads),
                     head_dim=f.integer("head_dim", f.integer("hidden_size") // heads))


def _llama_blocks(f: _Fields) -> list[Block]:
    layers = f.layers("num_hidden_layers")
    block = Block(mixer=_llama_attention(f), ffn=Mlp(intermediate_size=f.integer("intermediate_size"), gated=True))
    return [block] * layers


def _deci_ffn_width(ffn_mult: float, hidden: int) -> int:
    """DeciLM's rule: 2/3 of ffn_mult x hidden, rounded up to a multiple of 256."""
    return math.ceil(int(2 * ffn_mult * hidden / 3) / 256) * 256


def _nemotron_nas_blocks(f: _Fields) -> list[Block]:
    """`nemotron-nas` (DeciLM) children: per-layer attention and FFN choices in block_configs."""
    layers = f.layers("num_hidden_layers")
    heads = f.integer("num_attention_heads")
    blocks = []
    for index, _ in enumerate(f.items("block_configs", layers)):
        entry = f.section("block_configs", index).data
        layer = _Fields(entry, f.source, f"block_configs[{index}].")
        attention, ffn = layer.section("attention"), layer.section("ffn")
        mixer: Attention | Linear | NoOp
        if attention.flag("no_op", False):
            mixer = NoOp()
        elif attention.flag("replace_with_linear", False):
            mixer = Linear()
        else:
            mixer = _llama_attention(f, heads // attention.integer("n_heads_in_group"))
        feed: Mlp | Linear | NoOp
        if ffn.flag("no_op", False):
            feed = NoOp()
        elif ffn.flag("replace_with_linear", False):
            feed = Linear()
        elif "intermediate_size" in ffn.data:
            feed = Mlp(intermediate_size=ffn.integer("intermediate_size"), gated=True)
        else:
            feed = Mlp(intermediate_size=_deci_ffn_width(ffn.number("ffn_mult"), f.integer("hidden_size")), gated=True)
        blocks.append(Block(mixer=mixer, ffn=feed))
    return blocks


_NEMOTRON_H_TYPES = {"M": "mamba", "E": "moe", "*": "attention", "-": "mlp"}


def _nemotron_h_types(f: _Fields) -> list[str]:
    if "hybrid_override_pattern" in f.data:
        pattern = f.text("hybrid_override_pattern")
        if len(pattern) > MAX_BLOCKS:
            raise f._fail("hybrid_override_pattern", f"has {len(pattern)} blocks; at most {MAX_BLOCKS} are read")
        unknown = sorted(set(pattern) - set(_NEMOTRON_H_TYPES))
        if unknown:
            raise ConfigError(f"{f.source}: field 'hybrid_override_pattern' has unknown block codes {unknown}; "
                              f"expected characters from {''.join(_NEMOTRON_H_TYPES)}")
        return [_NEMOTRON_H_TYPES[code] for code in pattern]
    aliases = {"linear_attention": "mamba", "full_attention": "attention"}
    types = [aliases.get(kind, kind) for kind in f.items("layers_block_type")]
    unknown = sorted(set(types) - set(_NEMOTRON_H_TYPES.values()))
    if unknown:
        raise ConfigError(f"{f.source}: field 'layers_block_type' has unknown block types {unknown}")
    return types


def nemotron_h_block_types(config: dict[str, Any], source: str = "config.json") -> list[str]:
    """Block types of a NemotronH config (mamba, moe, attention, mlp), from its pattern or type list."""
    return _nemotron_h_types(_Fields(config, source))


def _nemotron_h_part(kind: str, f: _Fields) -> Attention | Mamba | Moe | Mlp | Linear | NoOp:
    """One NemotronH block from model-wide fields, overridden per block for Puzzle children."""
    if f.flag("no_op", False):
        return NoOp()
    if f.flag("replace_with_linear", False):
        return Linear()
    if kind == "mamba":
        return Mamba(num_heads=f.integer("mamba_num_heads"), head_dim=f.integer("mamba_head_dim"),
                     state_size=f.integer("ssm_state_size"), n_groups=f.integer("n_groups"),
                     conv_kernel=f.integer("conv_kernel"))
    if kind == "attention":
        return _llama_attention(f)
    if kind == "moe":
        width = f.integer("moe_shared_expert_intermediate_size", minimum=0)
        shared = width * f.integer("n_shared_experts", 1, minimum=0)
        return Moe(num_experts=f.integer("n_routed_experts"), top_k=f.integer("num_experts_per_tok"),
                   expert_width=f.integer("moe_intermediate_size"), shared_width=shared,
                   latent_size=f.optional_integer("moe_latent_size"))
    return Mlp(intermediate_size=f.integer("intermediate_size"), gated=False)


def _nemotron_h_blocks(f: _Fields, per_block: bool) -> list[Block]:
    types = _nemotron_h_types(f)
    overrides = f.items("block_configs", len(types)) if per_block else [{}] * len(types)
    blocks = []
    for index, kind in enumerate(types):
        entry = f.section("block_configs", index).data if per_block else overrides[index]
        declared = entry.get("block_type")
        if declared is not None and _NEMOTRON_H_TYPES.get(declared, declared) != kind:
            raise ConfigError(f"{f.source}: field block_configs[{index}].block_type is {declared!r} but the "
                              f"layer pattern has {kind!r} at that position")
        part = _nemotron_h_part(kind, f.merged(entry, f"block_configs[{index}]." if per_block else ""))
        is_mixer = kind in ("mamba", "attention")
        blocks.append(Block(mixer=part) if is_mixer else Block(ffn=part))
    return blocks


def _ssm_cache_dtype(f: _Fields) -> Literal["float32", "bfloat16", "float16"]:
    dtype = f.text("mamba_ssm_cache_dtype", "float32")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ConfigError(f"{f.source}: field 'mamba_ssm_cache_dtype' is {dtype!r}; expected float32, bfloat16 "
                          "or float16")
    return cast(Literal["float32", "bfloat16", "float16"], dtype)


def architecture_from_config(config: dict[str, Any], source: str = "config.json") -> Architecture:
    """Read a Hugging Face config dict (Llama, nemotron-nas, nemotron_h, nemotron_h_puzzle)."""
    f = _Fields(config, source)
    model_type = f.text("model_type")
    if model_type in ("llama", "mistral"):
        blocks = _llama_blocks(f)
    elif model_type == "nemotron-nas":
        blocks = _nemotron_nas_blocks(f)
    elif model_type in ("nemotron_h", "nemotron_h_puzzle"):
        blocks = _nemotron_h_blocks(f, per_block=model_type == "nemotron_h_puzzle")
    else:
        raise ConfigError(f"{source}: field 'model_type' is {model_type!r}; expected one of llama, mistral, "
                          "nemotron-nas, nemotron_h, nemotron_h_puzzle")
    return Architecture(
        name=str(config.get("_name_or_path") or Path(source).parent.name or "model"),
        hidden_size=f.integer("hidden_size"),
        vocab_size=f.integer("vocab_size"),
        tie_word_embeddings=f.flag("tie_word_embeddings", model_type not in ("nemotron_h", "nemotron_h_puzzle")),
        max_position_embeddings=f.optional_integer("max_position_embeddings"),
        ssm_cache_dtype=_ssm_cache_dtype(f),
        blocks=blocks,
    )


def builtin_models() -> list[str]:
    """Names of the reference configs shipped in `compressor/model/models`."""
    return sorted(path.stem for path in MODELS_DIR.glob("*.json"))


def load_architecture(model: str | Path) -> Architecture:
    """A built-in model name, a config.json, or a checkpoint folder holding one."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        if str(model) in builtin_models():
            path = MODELS_DIR / f"{model}.json"
        else:
            raise ConfigError(f"{model}: no such config.json or folder, and not a built-in model "
                              f"(built-in: {', '.join(builtin_models())})")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}: not valid JSON ({error})") from error
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: expected a JSON object at the top level")
    config.setdefault("_name_or_path", path.stem if path.name != "config.json" else path.parent.name)
    return architecture_from_config(config, str(path))
