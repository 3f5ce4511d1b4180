"""Which engine serves a child on a GPU profile, and which checkpoint it loads (`serving/engines.py`)."""

from __future__ import annotations

from tailor.compressor.architecture import (
    Architecture,
    Attention,
    Block,
    Linear,
    Mamba,
    Mlp,
    Moe,
    NoOp,
    load_architecture,
)
from tailor.compressor.hardware import GpuCatalog, Precision
from tailor.compressor.serving.engines import Engine, choose, vllm_cannot_load

CATALOG = GpuCatalog.load()
ATTENTION = Attention(num_heads=4, num_kv_heads=2, head_dim=8)
MLP = Mlp(intermediate_size=64, gated=True)


def llama(*blocks: Block) -> Architecture:
    return Architecture(name="toy", hidden_size=32, vocab_size=100, tie_word_embeddings=True, blocks=list(blocks))


def test_gpu_pools_serve_the_quantized_child_with_vllm() -> None:
    super_child = load_architecture("nemotron-3-puzzle-75b-a9b")
    for gpu in ("H100-80GB", "B200"):
        assert choose(CATALOG.get(gpu), super_child, Precision.NVFP4).model_dump() == {
            "engine": Engine.VLLM, "quantized": True, "note": None}


def test_the_cpu_pool_serves_what_vllms_cpu_build_runs_and_says_so() -> None:
    cpu, dense = CATALOG.get("cpu"), llama(Block(mixer=ATTENTION, ffn=MLP), Block(mixer=NoOp(), ffn=MLP))
    assert choose(cpu, dense, Precision.BF16).engine is Engine.VLLM
    fp8 = choose(cpu, dense, Precision.FP8)
    assert (fp8.engine, fp8.quantized) == (Engine.VLLM, False) and "BF16 child" in str(fp8.note)
    hybrid = llama(Block(mixer=Mamba(num_heads=4, head_dim=8, state_size=16, n_groups=1, conv_kernel=4)),
                   Block(ffn=Moe(num_experts=4, top_k=2, expert_width=16, shared_width=16)))
    fallback = choose(cpu, hybrid, Precision.BF16)
    assert fallback.engine is Engine.PYTHON and "MoE" in str(fallback.note)
    dense_hybrid = llama(Block(mixer=Mamba(num_heads=4, head_dim=8, state_size=16, n_groups=1, conv_kernel=4)),
                         Block(ffn=MLP))
    assert "nemotron_h_puzzle" in str(choose(cpu, dense_hybrid, Precision.BF16).note)
    assert choose(CATALOG.get("H100-80GB"), hybrid, Precision.FP8).engine is Engine.VLLM  # CUDA runs MoE


def test_blocks_vllm_cannot_load_keep_a_child_off_vllm() -> None:
    linear = llama(Block(mixer=ATTENTION, ffn=Linear()), Block(mixer=ATTENTION, ffn=MLP))
    headless = llama(Block(mixer=NoOp(), ffn=MLP), Block(mixer=ATTENTION, ffn=MLP))
    assert vllm_cannot_load(linear) == ["blocks [0] are linear maps, which vLLM's loader does not read"]
    assert "first block has no attention" in vllm_cannot_load(headless)[0]
    for arch in (linear, headless):
        on_gpu = choose(CATALOG.get("H100-80GB"), arch, Precision.FP8)
        assert on_gpu.engine is None and "engine: vllm" in str(on_gpu.note)  # the pool is skipped, saying why
        assert choose(CATALOG.get("cpu"), arch, Precision.BF16).engine is Engine.PYTHON
