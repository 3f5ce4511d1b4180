"""The project's own modeling code for the parents it compresses and their heterogeneous Puzzle children.

A model is built from an `Architecture` (the same description the cost model prices), so every block
has its own sizes. Two families, two parameter layouts:

- Llama (`family="llama"`): a layer holds an attention (any number of KV heads, a linear map, or
  nothing) and a gated FFN (any width, a linear map, or nothing). Names follow Hugging Face Llama and
  DeciLM (`nemotron-nas`): `model.layers.{i}.self_attn.q_proj.weight`, `...self_attn.linear_attn.weight`,
  `...mlp.linear_mlp.weight`.
- NemotronH (`family="nemotron_h"`): a layer holds one part: Mamba-2, attention without rotary
  positions, a ReLU^2 MLP or a mixture of experts (or a linear/no-op replacement). Names follow the
  published NemotronH checkpoints: `backbone.embeddings`, `backbone.layers.{i}.norm`,
  `backbone.layers.{i}.mixer.*`, `backbone.norm_f`.

A removed sub-layer has no parameters at all, its norm included. Each sub-layer is a residual branch,
`x + op(norm(x))`: Puzzle's slots. `Decoder.slots()` lists them in order, which is what blockwise
distillation, scoring and assembly iterate over.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tailor.compressor.model.architecture import Architecture, Attention, Block, Linear, Mamba, Mlp, Moe, NoOp, Part
from tailor.compressor.model.mamba import Mamba2, MambaCache
from tailor.compressor.model.moe import MixtureOfExperts, ReluSquaredMlp, Routing


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


@dataclass
class KVCache:
    """Preallocated keys and values of one attention op; `length` tokens are filled."""

    keys: torch.Tensor  # [batch, kv_heads, capacity, head_dim]
    values: torch.Tensor
    length: int = 0


class Rotary(nn.Module):
    """Rotary position embedding (the `default` rope type), cos/sin computed per call."""

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta
        self.register_buffer("inv_freq", self.frequencies(), persistent=False)

    def frequencies(self, device: torch.device | None = None) -> torch.Tensor:
        """The inverse frequencies (not in the checkpoint: recomputed for a layer built on the meta device)."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        result: torch.Tensor = 1.0 / (self.theta ** exponents)
        return result

    def forward(self, x: torch.Tensor, start: int) -> torch.Tensor:
        positions = torch.arange(start, start + x.shape[-2], device=x.device, dtype=torch.float32)
        angles = torch.outer(positions, self.inv_freq)
        cos = torch.cat((angles, angles), -1).cos().to(x.dtype)
        sin = torch.cat((angles, angles), -1).sin().to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), -1)
        return x * cos + rotated * sin


class KeepPrecision(nn.Identity):
    """A KV cache kept in the model's dtype. modelopt's exporter asks every module's `k_bmm_quantizer`
    whether it `is_enabled`."""

    is_enabled = False


class SelfAttention(nn.Module):
    """Causal grouped-query attention with an optional KV cache; rotary positions (Llama) or none
    (NemotronH, `rope_theta=None`)."""

    def __init__(self, part: Attention, hidden: int, rope_theta: float | None) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = part.num_heads, part.num_kv_heads, part.head_dim
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        self.rotary = Rotary(self.head_dim, rope_theta) if rope_theta is not None else None
        # where keys and values are rounded to the KV cache's precision (modelopt's names)
        self.k_bmm_quantizer: nn.Module = KeepPrecision()
        self.v_bmm_quantizer: nn.Module = KeepPrecision()

    def new_cache(self, batch: int, capacity: int, like: torch.Tensor) -> KVCache:
        shape = (batch, self.kv_heads, capacity, self.head_dim)
        return KVCache(like.new_zeros(shape), like.new_zeros(shape))

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        batch, tokens, _ = x.shape
        start = cache.length if cache is not None else 0
        q = self.q_proj(x).view(batch, tokens, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, tokens, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.rotary is not None:
            q, k = self.rotary(q, start), self.rotary(k, start)
        k, v = self.k_bmm_quantizer(k), self.v_bmm_quantizer(v)
        if cache is not None:
            if start and tokens > 1:
                raise ValueError("a cached attention call takes one prompt from position 0 or one token at a time")
            cache.keys[:, :, start:start + tokens] = k
            cache.values[:, :, start:start + tokens] = v
            cache.length = start + tokens
            k, v = cache.keys[:, :, :cache.length], cache.values[:, :, :cache.length]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=tokens > 1, enable_gqa=self.kv_heads != self.heads)
        result: torch.Tensor = self.o_proj(out.transpose(1, 2).reshape(batch, tokens, -1))
        return result


class LinearAttention(nn.Module):
    """Attention replaced by one linear map: each token attends only to itself."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear_attn = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        result: torch.Tensor = self.linear_attn(x)
        return result


class GatedMlp(nn.Module):
    """SwiGLU feed-forward network."""

    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        """The input of down_proj."""
        result: torch.Tensor = F.silu(self.gate_proj(x)) * self.up_proj(x)
        return result

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.down_proj(self.inner(x))
        return result


class LinearMlp(nn.Module):
    """FFN replaced by one linear map."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear_mlp = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.linear_mlp(x)
        return result


@dataclass(frozen=True)
class ModelSettings:
    """What a config.json says beyond the block structure."""

    family: Literal["llama", "nemotron_h"] = "llama"
    rms_norm_eps: float = 1e-5
    rope_theta: float | None = 10000.0  # None: no rotary positions (NemotronH attention)
    time_step_min: float = 0.001  # Mamba-2: the smallest time step
    routing: Routing = field(default_factory=Routing)


Cache = KVCache | MambaCache | None
Branch = tuple[nn.Module, nn.Module] | None  # (norm, op) of a residual branch; None when removed


def build_mixer(part: Part, hidden: int, settings: ModelSettings) -> nn.Module | None:
    if isinstance(part, Attention):
        return SelfAttention(part, hidden, settings.rope_theta)
    if isinstance(part, Mamba):
        return Mamba2(part, hidden, settings.rms_norm_eps, settings.time_step_min)
    if isinstance(part, Linear):
        return LinearAttention(hidden)
    if isinstance(part, NoOp):
        return None
    raise ValueError(f"no modeling for a {type(part).__name__} token mixer (attention, mamba, linear or noop)")


def build_ffn(part: Part, hidden: int, settings: ModelSettings) -> nn.Module | None:
    if isinstance(part, Mlp):
        return GatedMlp(hidden, part.intermediate_size) if part.gated else ReluSquaredMlp(hidden,
                                                                                          part.intermediate_size)
    if isinstance(part, Moe):
        return MixtureOfExperts(part, hidden, settings.routing)
    if isinstance(part, Linear):
        return LinearMlp(hidden)
    if isinstance(part, NoOp):
        return None
    raise ValueError(f"no modeling for a {type(part).__name__} feed-forward part (mlp, moe, linear or noop)")


def residual(branch: Branch, x: torch.Tensor, cache: Cache = None) -> torch.Tensor:
    """`x + op(norm(x))`, or `x` itself for a removed branch."""
    if branch is None:
        return x
    norm, op = branch
    takes_cache = isinstance(op, SelfAttention | LinearAttention | Mamba2)
    result: torch.Tensor = x + (op(norm(x), cache) if takes_cache else op(norm(x)))
    return result


def build_branch(kind: str, part: Part, hidden: int, settings: ModelSettings) -> Branch:
    """A fresh (norm, op) for `part` in a mixer or FFN slot."""
    op = build_mixer(part, hidden, settings) if kind == "mixer" else build_ffn(part, hidden, settings)
    return None if op is None else (RMSNorm(hidden, settings.rms_norm_eps), op)


@dataclass(frozen=True)
class Slot:
    """One residual branch `x + op(norm(x))`: the unit Puzzle replaces."""

    index: int  # position in Decoder.slots()
    layer: int
    kind: str  # "mixer" (attention, Mamba) or "ffn" (MLP, MoE)
    part: Part


class Layer(nn.Module):
    """A Llama decoder layer whose attention and FFN are each optional."""

    def __init__(self, block: Block, hidden: int, settings: ModelSettings) -> None:
        super().__init__()
        assert block.mixer is not None and block.ffn is not None
        self.self_attn = build_mixer(block.mixer, hidden, settings)
        self.input_layernorm = RMSNorm(hidden, settings.rms_norm_eps) if self.self_attn is not None else None
        self.mlp = build_ffn(block.ffn, hidden, settings)
        self.post_attention_layernorm = RMSNorm(hidden, settings.rms_norm_eps) if self.mlp is not None else None

    @staticmethod
    def branch_names(kind: str) -> tuple[str, str]:
        """The attributes (and state-dict names) of the mixer or FFN branch's norm and op."""
        return ("input_layernorm", "self_attn") if kind == "mixer" else ("post_attention_layernorm", "mlp")

    def branch(self, kind: str) -> Branch:
        """(norm, op) of the mixer or FFN branch; None where it was removed."""
        norm, op = (getattr(self, name) for name in self.branch_names(kind))
        return None if op is None or norm is None else (norm, op)

    def run_branch(self, kind: str, x: torch.Tensor, cache: Cache = None) -> torch.Tensor:
        return residual(self.branch(kind), x, cache)

    def forward(self, x: torch.Tensor, cache: Cache = None) -> torch.Tensor:
        return self.run_branch("ffn", self.run_branch("mixer", x, cache))


class HybridLayer(nn.Module):
    """A NemotronH block: one branch `x + mixer(norm(x))`, a token mixer or a feed-forward part."""

    def __init__(self, block: Block, hidden: int, settings: ModelSettings) -> None:
        super().__init__()
        if (block.mixer is None) == (block.ffn is None):
            raise ValueError(f"a NemotronH block holds exactly one part, got {block.code!r}")
        self.kind = "mixer" if block.mixer is not None else "ffn"
        part = block.mixer if block.mixer is not None else block.ffn
        assert part is not None
        branch = build_branch(self.kind, part, hidden, settings)
        self.norm: nn.Module | None = branch[0] if branch is not None else None
        self.mixer: nn.Module | None = branch[1] if branch is not None else None

    @staticmethod
    def branch_names(kind: str) -> tuple[str, str]:
        """The attributes (and state-dict names) of the branch's norm and op, whatever its kind."""
        return "norm", "mixer"

    def branch(self, kind: str) -> Branch:
        assert kind == self.kind, f"this layer's branch is a {self.kind}, not a {kind}"
        return None if self.norm is None or self.mixer is None else (self.norm, self.mixer)

    def run_branch(self, kind: str, x: torch.Tensor, cache: Cache = None) -> torch.Tensor:
        return residual(self.branch(kind), x, cache)

    def forward(self, x: torch.Tensor, cache: Cache = None) -> torch.Tensor:
        return self.run_branch(self.kind, x, cache)


class LlamaBody(nn.Module):
    def __init__(self, arch: Architecture, settings: ModelSettings) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(Layer(block, arch.hidden_size, settings) for block in arch.blocks)
        self.norm = RMSNorm(arch.hidden_size, settings.rms_norm_eps)


class NemotronHBody(nn.Module):
    def __init__(self, arch: Architecture, settings: ModelSettings) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(HybridLayer(block, arch.hidden_size, settings) for block in arch.blocks)
        self.norm_f = RMSNorm(arch.hidden_size, settings.rms_norm_eps)


class Decoder(nn.Module):
    """A causal language model, one layer per block of its `Architecture`."""

    def __init__(self, arch: Architecture, settings: ModelSettings) -> None:
        super().__init__()
        self.arch, self.settings = arch, settings
        self._slots = self._list_slots(arch)
        if settings.family == "llama":
            self.model = LlamaBody(arch, settings)
        else:
            self.backbone = NemotronHBody(arch, settings)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embedding.weight

    @property
    def body(self) -> str:
        """The attribute holding the embedding, the layers and the final norm (the state-dict prefix)."""
        return "model" if self.settings.family == "llama" else "backbone"

    @property
    def embedding(self) -> nn.Embedding:
        return self.model.embed_tokens if self.settings.family == "llama" else self.backbone.embeddings

    @property
    def final_norm(self) -> RMSNorm:
        return self.model.norm if self.settings.family == "llama" else self.backbone.norm_f

    @property
    def layers(self) -> nn.ModuleList:
        """`Layer`s (Llama) or `HybridLayer`s (NemotronH), one per block."""
        layers: nn.ModuleList = self.model.layers if self.settings.family == "llama" else self.backbone.layers
        return layers

    def slots(self) -> list[Slot]:
        return self._slots

    @staticmethod
    def _list_slots(arch: Architecture) -> list[Slot]:
        out: list[Slot] = []
        for layer, block in enumerate(arch.blocks):
            for kind, part in (("mixer", block.mixer), ("ffn", block.ffn)):
                if part is not None:
                    out.append(Slot(len(out), layer, kind, part))
        return out

    def layer(self, slot: Slot) -> Layer | HybridLayer:
        layer = self.layers[slot.layer]
        assert isinstance(layer, Layer | HybridLayer)
        return layer

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.embedding(ids)
        return result

    def run_slots(self, x: torch.Tensor, start: int = 0, stop: int | None = None,
                  caches: list[Cache] | None = None) -> torch.Tensor:
        """The residual stream through slots [start, stop)."""
        for slot in self.slots()[start:stop]:
            cache = caches[slot.layer] if caches is not None else None
            x = self.layer(slot).run_branch(slot.kind, x, cache)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        result: torch.Tensor = self.lm_head(self.final_norm(x))
        return result

    def forward(self, ids: torch.Tensor, caches: list[Cache] | None = None,
                states: list[torch.Tensor] | None = None, recompute: bool = False,
                loss: Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor], torch.Tensor] | None = None,
                ) -> torch.Tensor:
        """The logits. Distillation's options: with `states`, the residual stream after every layer is appended
        to it; with `recompute`, each layer's activations are recomputed in backward instead of kept (only the
        layers' inputs stay); with `loss`, what `loss(head, last stream)` returns in place of the logits, computed
        here, where a sharded model holds its head gathered."""
        if states is None:
            return self.head(self.run_slots(self.embed(ids), caches=caches))
        x = self.embed(ids)
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False) if recompute else layer(x)
            states.append(x)
        return self.head(x) if loss is None else loss(self.head, x)

    def new_caches(self, batch: int, capacity: int) -> list[Cache]:
        """One cache per layer: keys and values for attention, conv window and SSM state for Mamba-2."""
        like = self.embedding.weight
        caches: list[Cache] = []
        for layer in self.layers:
            op = layer.self_attn if isinstance(layer, Layer) else layer.mixer
            cache: Cache = None
            if isinstance(op, SelfAttention):
                cache = op.new_cache(batch, capacity, like)
            elif isinstance(op, Mamba2):
                cache = op.new_cache(batch, like)
            caches.append(cache)
        return caches
