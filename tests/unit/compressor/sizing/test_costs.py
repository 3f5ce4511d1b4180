"""The roofline cost model: what binds when, and that the model adds up block by block."""

from __future__ import annotations

import pytest

from tailor.compressor.model.architecture import Attention, Linear, Mlp, Moe, NoOp, load_architecture
from tailor.compressor.sizing.costs import CostModel, Phase, Workload, expected_experts_touched
from tailor.compressor.sizing.hardware import GpuCatalog, Precision
from tailor.compressor.sizing.memory import RECIPES, KvDtype, recipe_for

CATALOG = GpuCatalog.load()
H100 = CATALOG.get("H100")
BF16 = CostModel(H100, RECIPES["bf16"])
HIDDEN = 4096
MLP = Mlp(intermediate_size=14336, gated=True)


def decode(batch: int, context: int = 4096) -> Workload:
    return Workload(phase=Phase.DECODE, batch=batch, context=context)


def test_decode_is_memory_bound_and_long_prefill_compute_bound() -> None:
    assert BF16.part_cost(MLP, HIDDEN, decode(1)).bound == "memory"
    assert BF16.part_cost(MLP, HIDDEN, Workload(phase=Phase.PREFILL, batch=1, context=8192)).bound == "compute"


def test_decode_weights_are_read_once_per_step() -> None:
    one, many = BF16.part_cost(MLP, HIDDEN, decode(1)), BF16.part_cost(MLP, HIDDEN, decode(32))
    assert one.bytes_moved == many.bytes_moved == (3 * HIDDEN * 14336 + HIDDEN) * 2  # matrices and pre-norm
    assert many.flops == 32 * one.flops
    assert many.seconds == pytest.approx(one.seconds)  # still memory-bound: batching is free


def test_attention_decode_reads_the_whole_kv_cache() -> None:
    attention = Attention(num_heads=32, num_kv_heads=8, head_dim=128)
    short, long = BF16.part_cost(attention, HIDDEN, decode(8, 1024)), BF16.part_cost(attention, HIDDEN, decode(8, 8192))
    kv_per_token = 2 * 8 * 128 * 2
    assert long.bytes_moved - short.bytes_moved == 8 * (8192 - 1024) * kv_per_token
    fp8_kv = CostModel(H100, RECIPES["bf16"], KvDtype.FP8).part_cost(attention, HIDDEN, decode(8, 8192))
    assert fp8_kv.bytes_moved < long.bytes_moved


def test_fewer_bits_move_fewer_bytes_and_native_fp8_computes_faster() -> None:
    prefill = Workload(phase=Phase.PREFILL, batch=4, context=4096)
    costs = {name: CostModel(H100, RECIPES[name]).part_cost(MLP, HIDDEN, prefill) for name in ("bf16", "fp8", "nvfp4")}
    assert costs["bf16"].seconds > costs["fp8"].seconds  # H100 has FP8 tensor cores
    assert costs["nvfp4"].seconds == pytest.approx(costs["bf16"].seconds)  # no FP4 math on Hopper: BF16 speed
    b200 = CATALOG.get("B200")
    assert CostModel(b200, RECIPES["nvfp4"]).part_cost(MLP, HIDDEN, prefill).seconds < CostModel(
        b200, RECIPES["fp8"]).part_cost(MLP, HIDDEN, prefill).seconds


def test_moe_reads_only_the_experts_tokens_route_to() -> None:
    moe = Moe(num_experts=512, top_k=22, expert_width=2688, shared_width=5376, latent_size=1024)
    touched = [expected_experts_touched(moe, tokens) for tokens in (1, 8, 64, 4096)]
    assert touched[0] == pytest.approx(22)
    assert touched == sorted(touched) and touched[-1] == pytest.approx(512)
    assert BF16.part_cost(moe, HIDDEN, decode(1)).bytes_moved < BF16.part_cost(moe, HIDDEN, decode(64)).bytes_moved


def test_replacements_cost_less_than_the_parent_part() -> None:
    attention = Attention(num_heads=32, num_kv_heads=8, head_dim=128)
    parent = BF16.part_cost(attention, HIDDEN, decode(16))
    assert BF16.part_cost(Linear(), HIDDEN, decode(16)).seconds < parent.seconds
    assert BF16.part_cost(NoOp(), HIDDEN, decode(16)).seconds == 0


def test_model_cost_is_the_sum_of_blocks_plus_the_head() -> None:
    arch = load_architecture("nemotron-3-puzzle-75b-a9b")
    model = CostModel(CATALOG.get("B200"), recipe_for(Precision.NVFP4, arch), KvDtype.FP8)
    work = decode(16, 40_000)
    blocks = sum(model.block_cost(block, arch.hidden_size, work).seconds for block in arch.blocks)
    total = model.model_cost(arch, work).seconds
    head = arch.vocab_size * arch.hidden_size * 2 / (model.gpu.bandwidth_gbps * 1e9)
    assert total == pytest.approx(blocks + head)


def test_the_puzzle_child_decodes_faster_than_its_parent_on_b200() -> None:
    parent, child = load_architecture("nemotron-3-super-120b-a12b"), load_architecture("nemotron-3-puzzle-75b-a9b")
    speed = {arch.name: CostModel(CATALOG.get("B200"), recipe_for(Precision.NVFP4, arch), KvDtype.FP8)
             .decode_tokens_per_second(arch, batch=16, context=40_000) for arch in (parent, child)}
    assert 1.5 < speed[child.name] / speed[parent.name] < 2.5  # published: 2.03x on 8xB200
