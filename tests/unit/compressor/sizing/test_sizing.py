"""The memory model and sizing: the published H100 result, properties, and bad input."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tailor.compressor.model.architecture import Architecture, load_architecture
from tailor.compressor.sizing.concurrency import (
    Binding,
    Published,
    footprint,
    max_requests,
    reserve_window,
    size,
    smallest_tensor_parallel,
)
from tailor.compressor.sizing.hardware import GpuCatalog, GpuProfile, Precision
from tailor.compressor.sizing.memory import (
    GB,
    RECIPES,
    KvDtype,
    RuntimeReserve,
    block_weight_bytes,
    kv_bytes_per_token,
    recipe_for,
    state_bytes_per_request,
    weight_bytes,
)

SUPER = load_architecture("nemotron-3-super-120b-a12b")
PUZZLE = load_architecture("nemotron-3-puzzle-75b-a9b")
SMOL = load_architecture("smollm2-135m")
CATALOG = GpuCatalog.load()
H100 = CATALOG.get("H100-80GB")
ONE_M = 10**6


@pytest.mark.parametrize(("arch", "published_gb"), [(SUPER, 70.0), (PUZZLE, 44.5)])
def test_nvfp4_weights_within_five_percent_of_the_published_checkpoints(arch: Architecture,
                                                                        published_gb: float) -> None:
    recipe = recipe_for(Precision.NVFP4, arch)
    assert recipe.modelopt_config == "MAMBA_MOE_NVFP4_AGGRESSIVE_CFG"
    assert abs(weight_bytes(arch, recipe) / GB / published_gb - 1) <= 0.05


def test_recipes_order_and_defaults() -> None:
    bf16, fp8, nvfp4 = (weight_bytes(SUPER, recipe_for(p, SUPER)) for p in Precision)
    assert bf16 == 2 * SUPER.total_params
    assert bf16 > fp8 > nvfp4 > SUPER.total_params * 4.5 / 8
    conservative = weight_bytes(SUPER, RECIPES["nvfp4-mamba-moe-conservative"])
    assert conservative > nvfp4  # keeps the Mamba projections in BF16 as well
    assert recipe_for(Precision.NVFP4, SMOL).modelopt_config == "NVFP4_DEFAULT_CFG"  # dense: every linear
    assert weight_bytes(SMOL, RECIPES["nvfp4"]) < weight_bytes(SMOL, RECIPES["nvfp4-mamba-moe"])


def test_kv_and_state_bytes_follow_the_reference_arithmetic() -> None:
    assert kv_bytes_per_token(SUPER, KvDtype.BF16) == 8 * 2 * 2 * 128 * 2  # 8 KiB
    assert kv_bytes_per_token(SUPER, KvDtype.FP8) == 4096
    state = state_bytes_per_request(SUPER)  # float32, from the config's mamba_ssm_cache_dtype
    assert state.ssm == 40 * 128 * 64 * 128 * 4  # 160 MiB
    assert state.conv == 40 * (8192 + 2 * 8 * 128) * 3 * 2
    assert state_bytes_per_request(PUZZLE).ssm == 40 * 128 * 64 * 96 * 4  # 120 MiB
    assert state_bytes_per_request(SUPER, "bfloat16").ssm == state.ssm // 2
    assert state_bytes_per_request(SMOL).total == 0


def _h100_1m(arch: Architecture, reserve: RuntimeReserve | None = None) -> int:
    result = size(arch, H100, ONE_M, recipe_for(Precision.NVFP4, arch), KvDtype.FP8, reserve=reserve)
    return result.concurrency_per_replica


def test_published_h100_result_one_versus_eight_with_one_reserve() -> None:
    """Nemotron-3-Super 1 -> Puzzle-75B 8 concurrent 1M-token requests on one H100, default reserve."""
    assert (_h100_1m(SUPER), _h100_1m(PUZZLE)) == (1, 8)


def test_the_default_reserve_lies_inside_the_window_the_published_pair_allows() -> None:
    low, high = reserve_window([
        Published(arch=arch, gpu=H100, context=ONE_M, recipe=recipe_for(Precision.NVFP4, arch),
                  kv_dtype=KvDtype.FP8, count=count) for arch, count in ((SUPER, 1), (PUZZLE, 8))])
    assert low < RuntimeReserve().bytes <= high
    assert _h100_1m(SUPER, RuntimeReserve(gib=low / 1024**3 - 0.01)) == 2  # just below: Super fits 2
    assert _h100_1m(PUZZLE, RuntimeReserve(gib=high / 1024**3 + 0.01)) == 7  # just above: Puzzle fits 7


def test_no_reserve_reproduces_the_pair_at_two_to_the_twenty_tokens() -> None:
    low, high = reserve_window([
        Published(arch=arch, gpu=H100, context=2**20, recipe=recipe_for(Precision.NVFP4, arch),
                  kv_dtype=KvDtype.FP8, count=count) for arch, count in ((SUPER, 1), (PUZZLE, 8))])
    assert low >= high


def test_bigger_gpus_hold_more() -> None:
    for arch in (SUPER, PUZZLE):
        counts = [size(arch, CATALOG.get(g), ONE_M, recipe_for(Precision.NVFP4, arch), KvDtype.FP8)
                  .concurrency_per_replica for g in ("H100", "H200", "B200")]
        assert counts == sorted(counts) and counts[0] < counts[-1]


def test_weights_that_do_not_fit_bind_and_tensor_parallel_fixes_it() -> None:
    bf16 = recipe_for(Precision.BF16, SUPER)
    alone = size(SUPER, H100, 8192, bf16, KvDtype.BF16)
    assert (alone.concurrency_per_replica, alone.binding) == (0, Binding.WEIGHTS)
    assert "use a larger tensor-parallel group" in alone.warnings[-1]
    tp = smallest_tensor_parallel(SUPER, H100, 8192, bf16, KvDtype.BF16, RuntimeReserve(), 8)
    assert tp == 4
    grouped = size(SUPER, H100, 8192, bf16, KvDtype.BF16, tp=tp, target_concurrency=1000)
    assert grouped.concurrency_per_replica > 0 and grouped.binding is Binding.SSM_STATE  # 8K tokens: state rules
    assert grouped.replicas_per_node == 2
    assert grouped.replicas_for_target == -(-1000 // grouped.concurrency_per_replica)


def test_long_context_on_a_hybrid_is_bound_by_kv_and_short_by_state() -> None:
    def binding(context: int) -> Binding:
        return size(SUPER, CATALOG.get("B200"), context, recipe_for(Precision.NVFP4, SUPER), KvDtype.FP8).binding

    assert (binding(1024), binding(ONE_M)) == (Binding.SSM_STATE, Binding.KV_CACHE)


def test_precision_fallbacks_warn() -> None:
    h100 = size(PUZZLE, H100, ONE_M, recipe_for(Precision.NVFP4, PUZZLE), KvDtype.FP8)
    assert any("no native nvfp4 math" in w for w in h100.warnings)
    a100 = size(SMOL, CATALOG.get("A100-40GB"), 4096, recipe_for(Precision.FP8, SMOL), KvDtype.FP8)
    assert any("weight-only FP8" in w for w in a100.warnings)
    assert any("FP8 KV cache is stored in FP8 and converted" in w for w in a100.warnings)
    b200 = size(PUZZLE, CATALOG.get("B200"), ONE_M, recipe_for(Precision.NVFP4, PUZZLE), KvDtype.FP8)
    assert b200.warnings == []
    beyond = size(SMOL, H100, 16384, RECIPES["bf16"], KvDtype.BF16)
    assert any("beyond the model's max_position_embeddings (8192)" in w for w in beyond.warnings)


@pytest.mark.parametrize("context", [0, -5])
def test_context_must_be_positive(context: int) -> None:
    with pytest.raises(ValueError, match=f"context must be a positive number of tokens, got {context}"):
        size(SMOL, H100, context, RECIPES["bf16"], KvDtype.BF16)


def test_bad_tensor_parallel_and_target() -> None:
    with pytest.raises(ValueError, match="tensor parallelism 16 needs more GPUs than a node has"):
        size(SMOL, H100, 1024, RECIPES["bf16"], KvDtype.BF16, tp=16)
    with pytest.raises(ValueError, match="target concurrency must be positive"):
        size(SMOL, H100, 1024, RECIPES["bf16"], KvDtype.BF16, target_concurrency=0)


# --- properties ------------------------------------------------------------------------------------------

models = st.sampled_from([SUPER, PUZZLE, SMOL, load_architecture("nemotron-3-nano-30b-a3b")])
precisions = st.sampled_from(list(Precision))
kv_dtypes = st.sampled_from(list(KvDtype))
contexts = st.integers(min_value=1, max_value=4 * 2**20)
memories = st.integers(min_value=1024, max_value=512 * 1024)
reserves = st.floats(min_value=0, max_value=16)


def _gpu(memory_mib: int) -> GpuProfile:
    return H100.model_copy(update={"memory_mib": memory_mib})


@settings(max_examples=150, deadline=None)
@given(models, precisions, kv_dtypes, contexts, memories, memories, reserves, st.sampled_from([1, 2, 4, 8]))
def test_more_memory_never_lowers_concurrency(arch: Architecture, precision: Precision, kv: KvDtype, context: int,
                                              mem_a: int, mem_b: int, reserve: float, tp: int) -> None:
    small, large = sorted((mem_a, mem_b))
    recipe, held = recipe_for(precision, arch), RuntimeReserve(gib=reserve)
    fewer = max_requests(footprint(arch, _gpu(small), context, recipe, kv, held, tp))
    more = max_requests(footprint(arch, _gpu(large), context, recipe, kv, held, tp))
    assert 0 <= fewer <= more


@settings(max_examples=150, deadline=None)
@given(models, precisions, kv_dtypes, contexts, contexts, memories, reserves)
def test_longer_context_never_raises_concurrency(arch: Architecture, precision: Precision, kv: KvDtype, ctx_a: int,
                                                 ctx_b: int, memory: int, reserve: float) -> None:
    short, long = sorted((ctx_a, ctx_b))
    recipe, held = recipe_for(precision, arch), RuntimeReserve(gib=reserve)
    at_short = size(arch, _gpu(memory), short, recipe, kv, reserve=held)
    at_long = size(arch, _gpu(memory), long, recipe, kv, reserve=held)
    assert at_long.concurrency_per_replica <= at_short.concurrency_per_replica
    for result in (at_short, at_long):
        fp = result.footprint
        assert min(fp.weights, fp.kv_per_request, fp.state_per_request, fp.reserve) >= 0
        assert result.concurrency_per_node == result.concurrency_per_replica * result.replicas_per_node >= 0
        fits = result.concurrency_per_replica
        assert fp.weights + fits * fp.per_request <= fp.usable or fits == 0  # what it says fits, fits
        assert fp.weights + (fits + 1) * fp.per_request > fp.usable  # and one more would not


@settings(max_examples=50, deadline=None)
@given(models, st.sampled_from(sorted(RECIPES)))
def test_weight_bytes_add_up_across_blocks(arch: Architecture, recipe_name: str) -> None:
    recipe = RECIPES[recipe_name]
    blocks = sum(block_weight_bytes(block, arch.hidden_size, recipe) for block in arch.blocks)
    outer = (arch.vocab_size * arch.hidden_size * (1 if arch.tie_word_embeddings else 2) + arch.hidden_size) * 2
    assert weight_bytes(arch, recipe) == round(blocks + outer)
