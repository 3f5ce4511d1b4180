"""The block library's options for one slot: the current part first, then every smaller part the library's
lists allow and the serving engine loads. No torch here: `library.py` turns them into trained variants, and the
dry run (`footprint.py`) counts them.

Sizes are shares of the parent's, so a later Iterative Puzzle round offers the same sizes again. Widths are
rounded to `WIDTH_MULTIPLE` channels, wide routed experts (`EXPERT_MULTIPLE` and more) to `EXPERT_MULTIPLE`,
as engines' kernels tile them. For a hybrid parent, attention is kept whole unless `library.keepAttention` is
false (the published Nemotron-3 Puzzle child kept all of its attention layers).
"""

from __future__ import annotations

import itertools

from tailor.compressor.model.architecture import Architecture, Attention, Linear, Mamba, Mlp, Moe, NoOp, Part
from tailor.compressor.puzzle.plan import Library
from tailor.compressor.sizing.engines import Engine

WIDTH_MULTIPLE = 16
EXPERT_MULTIPLE = 128


def _sizes(parent: int, shares: list[float], current: int, multiple: int = 1,
           values: list[int] | None = None) -> list[int]:
    """Sizes from shares of the parent's (and explicit `values`), rounded to `multiple`, at most the current size,
    largest first."""
    sizes = {max(multiple, round(share * parent / multiple) * multiple) for share in [1.0, *shares]}
    sizes |= set(values or [])
    return sorted({min(size, current) for size in sizes}, reverse=True)


def _mamba_options(current: Mamba, parent: Mamba, library: Library, one_shape: bool) -> list[Part]:
    """Smaller heads, head dims and states; with `one_shape` (vLLM reads one Mamba shape) only the state, which
    the search keeps the same in every block."""
    heads = [current.num_heads] if one_shape else _sizes(parent.num_heads, library.mamba_heads, current.num_heads,
                                                         parent.n_groups)
    dims = [current.head_dim] if one_shape else _sizes(parent.head_dim, library.mamba_head_dims, current.head_dim)
    states = _sizes(parent.state_size, library.ssm_states, current.state_size)
    return [current.model_copy(update={"num_heads": h, "head_dim": d, "state_size": n})
            for h, d, n in itertools.product(heads, dims, states)]


def _moe_options(current: Moe, parent: Moe, library: Library) -> list[Part]:
    experts = _sizes(parent.num_experts, library.experts_kept, current.num_experts)
    top_k = _sizes(parent.top_k, library.top_k, current.top_k, values=library.top_k_values)
    multiple = EXPERT_MULTIPLE if parent.expert_width >= 4 * EXPERT_MULTIPLE else WIDTH_MULTIPLE
    widths = _sizes(parent.expert_width, library.expert_widths, current.expert_width, multiple)
    shared = _sizes(parent.shared_width, library.shared_widths, current.shared_width, WIDTH_MULTIPLE) \
        if current.shared_width else [0]
    return [current.model_copy(update={"num_experts": e, "top_k": min(k, e), "expert_width": w, "shared_width": s})
            for e, k, w, s in itertools.product(experts, top_k, widths, shared)]


def is_hybrid(arch: Architecture) -> bool:
    """A hybrid parent (Mamba blocks beside a few attention ones), whose attention the library keeps by default."""
    return bool(arch.mamba_layers())


def part_options(current: Part, parent: Part, layer: int, library: Library, engine: Engine = Engine.VLLM,
                 hybrid: bool = False) -> list[Part]:
    """The current part first, then every smaller option the library allows from it that `engine` loads
    (vLLM: no linear maps, the first block keeps its attention, a hybrid keeps every block and one Mamba shape;
    `sizing/engines.py`); no duplicates."""
    options: list[Part] = [current]
    keep_attention = library.keep_attention if library.keep_attention is not None else hybrid
    if isinstance(current, Attention) and keep_attention:
        return options
    if isinstance(current, Attention):
        counts = library.kv_heads if library.kv_heads is not None else [
            n for n in range(1, current.num_kv_heads) if current.num_heads % n == 0]
        options += [current.model_copy(update={"num_kv_heads": n}) for n in sorted(set(counts), reverse=True)
                    if n < current.num_kv_heads and current.num_kv_heads % n == 0]
    elif isinstance(current, Mlp):
        assert isinstance(parent, Mlp)
        widths = _sizes(parent.intermediate_size, library.ffn_widths, current.intermediate_size, WIDTH_MULTIPLE)
        options += [Mlp(intermediate_size=w, gated=current.gated) for w in widths if w < current.intermediate_size]
    elif isinstance(current, Mamba):
        assert isinstance(parent, Mamba)
        options += _mamba_options(current, parent, library, engine is Engine.VLLM)
    elif isinstance(current, Moe):
        assert isinstance(parent, Moe)
        options += _moe_options(current, parent, library)
    vllm = engine is Engine.VLLM
    if library.linear and not vllm and not isinstance(current, Linear | NoOp):
        options.append(Linear())
    keeps_first_attention = vllm and layer == 0 and isinstance(current, Attention)
    keeps_every_block = vllm and hybrid  # vLLM's NemotronH model builds every block of its pattern
    if library.no_op and not keeps_first_attention and not keeps_every_block and not isinstance(current, NoOp):
        options.append(NoOp())
    return list(dict.fromkeys(options))  # drops options equal to the current part
