"""Which engine serves a child on a GPU profile, and which checkpoint it loads (`sizing/engines.py`)."""

from __future__ import annotations

from tailor.compressor.model.architecture import (
    Architecture,
    Attention,
    Block,
    Linear,
    Mamba,
    Mlp,
    Moe,
    NoOp,
    architecture_from_config,
    load_architecture,
)
from tailor.compressor.puzzle.options import part_options
from tailor.compressor.puzzle.plan import Library
from tailor.compressor.sizing.engines import Engine, choose, reads_own_config_class, vllm_cannot_load
from tailor.compressor.sizing.hardware import GpuCatalog, Precision
from tailor.compressor.tiny_hybrid import DENSE_PATTERN, PATTERN, config

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
    assert choose(cpu, dense_hybrid, Precision.BF16).engine is Engine.VLLM  # through its config class
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


# every variant the library can make
EVERYTHING = Library(ffn_widths=[0.5], kv_heads=[1], linear=True, no_op=True, mamba_heads=[0.5],
                     mamba_head_dims=[0.5], ssm_states=[0.5], expert_widths=[0.5], experts_kept=[0.5], top_k=[0.5],
                     shared_widths=[0.5], keep_attention=False)


def with_part(arch: Architecture, index: int, part: object) -> Architecture:
    """`arch` with block `index`'s part replaced by `part`; a Mamba part replaces every Mamba block's (for vLLM
    Puzzle varies only the SSM state, and the search keeps one state size for every block)."""
    blocks = []
    for i, block in enumerate(arch.blocks):
        if i == index or (isinstance(part, Mamba) and isinstance(block.mixer, Mamba)):
            slot = "mixer" if block.mixer is not None else "ffn"
            block = block.model_copy(update={slot: part})
        blocks.append(block)
    return arch.model_copy(update={"blocks": blocks})


def parents() -> dict[str, Architecture]:
    return {"llama": load_architecture("smollm2-135m"),
            "nemotron_h": architecture_from_config(config(1000, 1, 2), PATTERN),
            "nemotron_h dense": architecture_from_config(config(1000, 1, 2, dense=True), DENSE_PATTERN)}


def test_every_block_puzzle_offers_for_vllm_is_one_vllm_loads() -> None:
    """For each kind of parent, every option of every slot (engine vllm) gives a child that vLLM loads, and
    `choose` sends GPU pools to vLLM; with engine tailor-python the options vLLM cannot load are offered, and
    `choose` keeps GPU pools off vLLM for each of them."""
    gpu, refused = CATALOG.get("H100-80GB"), set()
    for family, parent in parents().items():
        hybrid = bool(parent.mamba_layers())
        for index, block in enumerate(parent.blocks[:8]):
            current = block.mixer if block.mixer is not None else block.ffn
            assert current is not None
            for engine in Engine:
                for part in part_options(current, current, index, EVERYTHING, engine, hybrid):
                    if engine is Engine.VLLM and isinstance(part, Mamba):  # the search keeps one state size
                        assert part.model_copy(update={"state_size": current.state_size}) == current  # type: ignore[union-attr]
                    child = with_part(parent, index, part)
                    reasons = vllm_cannot_load(child)
                    assert engine is not Engine.VLLM or reasons == [], (family, index, part)
                    expected = Engine.VLLM if not reasons else None
                    assert choose(gpu, child, Precision.FP8).engine is expected, (family, index, part)
                    refused |= {reason.split(" ", 2)[-1] for reason in reasons}
    assert any("linear maps" in r for r in refused) and any("removed" in r for r in refused)


def test_hybrid_blocks_vllm_cannot_load_keep_a_child_off_vllm() -> None:
    hybrid = parents()["nemotron_h dense"]
    removed = with_part(hybrid, 1, NoOp())
    assert "blocks [1] are removed" in vllm_cannot_load(removed)[0]
    mamba = hybrid.blocks[0].mixer
    assert isinstance(mamba, Mamba)
    blocks = list(hybrid.blocks)
    blocks[0] = blocks[0].model_copy(update={"mixer": mamba.model_copy(update={"num_heads": 4})})
    mixed = hybrid.model_copy(update={"blocks": blocks})
    assert "one Mamba shape" in vllm_cannot_load(mixed)[0]
    for arch in (removed, mixed):
        assert choose(CATALOG.get("B200"), arch, Precision.NVFP4).engine is None


def test_only_tailors_own_config_classes_are_trusted() -> None:
    """`trust_remote_code` is on only for a Puzzle child read through tailor's config class; a parent's auto_map
    (a hub repository's code) or a foreign class under a child's type is never followed."""
    decilm = {"AutoConfig": "configuration_decilm.DeciLMConfig"}
    assert reads_own_config_class({"model_type": "nemotron-nas", "auto_map": decilm})
    assert reads_own_config_class({"model_type": "nemotron_h_puzzle", "auto_map": {
        "AutoConfig": "configuration_nemotron_h_puzzle.NemotronHPuzzleConfig"}})
    assert reads_own_config_class({"model_type": "nemotron_h_puzzle"})  # a compress result, before its auto_map
    assert not reads_own_config_class({"model_type": "llama"})
    assert not reads_own_config_class({"model_type": "nemotron_h", "auto_map": {
        "AutoConfig": "nvidia/NVIDIA-Nemotron-3--configuration_nemotron_h.NemotronHConfig"}})
    assert not reads_own_config_class({"model_type": "nemotron-nas", "auto_map": {
        "AutoConfig": "evil/repo--configuration_decilm.DeciLMConfig"}})
    assert not reads_own_config_class({"model_type": "nemotron-nas", "auto_map": {
        **decilm, "AutoModelForCausalLM": "modeling_decilm.DeciLMForCausalLM"}})
