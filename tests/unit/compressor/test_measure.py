"""Timing real block variants with torch on this device, and the per-device cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tailor.compressor import measure
from tailor.compressor.architecture import Attention, Linear, Mamba, Mlp, Moe, NoOp, Part
from tailor.compressor.costs import Phase, Workload

HIDDEN = 64
DECODE = Workload(phase=Phase.DECODE, batch=2, context=32)
PREFILL = Workload(phase=Phase.PREFILL, batch=1, context=16)
PARTS: list[Part] = [
    Attention(num_heads=4, num_kv_heads=2, head_dim=16), Linear(), NoOp(), Mlp(intermediate_size=96, gated=True),
    Mlp(intermediate_size=96, gated=False),
    Moe(num_experts=4, top_k=2, expert_width=32, shared_width=48, latent_size=32),
    Mamba(num_heads=4, head_dim=8, state_size=8, n_groups=2, conv_kernel=4),
]


@pytest.mark.parametrize("part", PARTS, ids=lambda part: part.kind)
def test_every_part_runs_and_keeps_the_hidden_shape(part: Part) -> None:
    for work in (DECODE, PREFILL):
        run = measure._runner(part, HIDDEN, work, torch.device("cpu"))
        with torch.inference_mode():
            out = run()
        tokens = 1 if work.phase is Phase.DECODE else work.context
        assert isinstance(out, torch.Tensor) and out.shape == (work.batch, tokens, HIDDEN)
        assert torch.isfinite(out).all()


def test_a_mamba_decode_step_costs_the_same_at_any_context() -> None:
    """The recurrent step reads a fixed state: timing it after 32 or 4096 tokens differs by noise only."""
    short, long = (measure.time_call(measure._runner(PARTS[-1], HIDDEN, Workload(phase=Phase.DECODE, batch=2,
                                                                                  context=context),
                                                     torch.device("cpu")), torch.device("cpu"))
                   for context in (32, 4096))
    attention = [measure.time_call(measure._runner(PARTS[0], HIDDEN, Workload(phase=Phase.DECODE, batch=2,
                                                                              context=context),
                                                   torch.device("cpu")), torch.device("cpu"))
                 for context in (32, 4096)]
    assert long < 2 * short and attention[1] > 2 * attention[0]


def test_measurements_are_cached_per_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cpu.json"
    first = measure.MeasuredCosts(cache_file=cache)
    seconds = first.seconds(PARTS[3], HIDDEN, DECODE)
    assert seconds > 0 and cache.exists() and not cache.with_suffix(".partial").exists()

    def must_not_run(*_: object, **__: object) -> float:
        raise AssertionError("a cached measurement was taken again")

    monkeypatch.setattr(measure, "time_call", must_not_run)
    assert measure.MeasuredCosts(cache_file=cache).seconds(PARTS[3], HIDDEN, DECODE) == seconds
    other = Mlp(intermediate_size=128, gated=True)
    assert first.key(other, HIDDEN, DECODE) != first.key(PARTS[3], HIDDEN, DECODE)
    with pytest.raises(AssertionError, match="taken again"):
        measure.MeasuredCosts(cache_file=cache).seconds(other, HIDDEN, DECODE)


def test_calibration_reports_positive_peaks() -> None:
    figures = measure.calibrate()
    assert figures["tflops_bf16"] > 0 and figures["bandwidth_gbps"] > 0


def test_the_fixed_cost_is_what_a_whole_step_takes_beyond_its_blocks(tmp_path: Path) -> None:
    """The pipeline calibrates its fixed decode cost as (whole parent step - its blocks timed alone), never below
    the LM head's own timing."""
    from tailor.compressor.architecture import Architecture, Block
    from tailor.compressor.modeling import Decoder, ModelSettings
    from tailor.compressor.puzzle.plan import Target
    from tailor.compressor.puzzle.pricing import Pricer

    block = Block(mixer=PARTS[0], ffn=PARTS[3])
    arch = Architecture(name="tiny", hidden_size=HIDDEN, vocab_size=500, tie_word_embeddings=True, blocks=[block] * 3)
    whole = measure.decode_step_seconds(Decoder(arch, ModelSettings()).eval(), batch=2, context=32)
    assert 0 < whole < 1
    pricer = Pricer(arch, Target(gpu="cpu", batch=2, context=32, throughput=1.1),
                    measure.MeasuredCosts(cache_file=tmp_path / "cpu.json"))
    head = pricer.fixed.decode_s
    assert head > 0
    pricer.calibrate_decode(parent_step_s=head + 0.010, parent_blocks_s=0.004)
    assert pricer.fixed.decode_s == pytest.approx(head + 0.006)
    pricer.calibrate_decode(parent_step_s=0.001, parent_blocks_s=0.004)  # noise: blocks alone above the step
    assert pricer.fixed.decode_s == pytest.approx(head + 0.006)
