"""Timing real block variants with torch on this device, and the per-device cache."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tailor.compressor.model.architecture import Architecture, Attention, Block, Linear, Mamba, Mlp, Moe, NoOp, Part
from tailor.compressor.model.modeling import Decoder, ModelSettings
from tailor.compressor.puzzle import measure
from tailor.compressor.puzzle.plan import Target
from tailor.compressor.puzzle.pricing import Pricer
from tailor.compressor.sizing.costs import Phase, Workload

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
        run = measure._runner(part, HIDDEN, work, torch.device("cpu"), torch.float32)
        with torch.inference_mode():
            out = run()
        tokens = 1 if work.phase is Phase.DECODE else work.context
        assert isinstance(out, torch.Tensor) and out.shape == (work.batch, tokens, HIDDEN)
        assert torch.isfinite(out).all()


class _ElementsRead(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's private API is untyped
    """Counts the elements of the tensors that torch's ops read (views, which read nothing, left out): the work
    of a call, counted where a timing on a shared machine would only estimate it."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.elements = 0

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: object, args: tuple[object, ...] = (),
                           kwargs: dict[str, object] | None = None) -> object:
        if not func.is_view:
            self.elements += sum(leaf.numel() for leaf in tree_leaves((args, kwargs or {}))
                                 if isinstance(leaf, torch.Tensor))
        return func(*args, **(kwargs or {}))


def _decode_step_reads(part: Part, context: int) -> int:
    """Elements one timed decode step of `part` reads after `context` cached tokens."""
    run = measure._runner(part, HIDDEN, DECODE.model_copy(update={"context": context}), torch.device("cpu"),
                          torch.float32)
    counter = _ElementsRead()
    with torch.inference_mode(), counter:
        run()
    return counter.elements


def test_a_mamba_decode_step_does_the_same_work_at_any_context() -> None:
    """The recurrent step reads a fixed state: after 32 or 4096 tokens it reads the same. An attention step reads
    its whole KV cache, which grows with every token. Counted, not timed: bench/decode_context.py times both."""
    mamba, attention = PARTS[-1], PARTS[0]
    assert isinstance(mamba, Mamba) and isinstance(attention, Attention)
    assert _decode_step_reads(mamba, 4096) == _decode_step_reads(mamba, 32)
    kv_cache_growth = (4096 - 32) * DECODE.batch * attention.kv_elements_per_token()
    assert _decode_step_reads(attention, 4096) - _decode_step_reads(attention, 32) >= kv_cache_growth


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
    figures = measure.calibrate(dtype=torch.float32)
    assert figures["tflops"] > 0 and figures["bandwidth_gbps"] > 0


def _tiny_decoder() -> Decoder:
    block = Block(mixer=PARTS[0], ffn=PARTS[3])
    arch = Architecture(name="tiny", hidden_size=HIDDEN, vocab_size=500, tie_word_embeddings=True, blocks=[block] * 3)
    return Decoder(arch, ModelSettings()).eval()


def test_a_whole_decode_step_is_timed_after_the_same_context_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """`decode_step_seconds` hands `time_call` a step that appends one token after `context` cached ones, the
    same work every call, and returns what `time_call` measured. The timing itself is given, not taken."""
    model = _tiny_decoder()
    attention = model.arch.attention_layers()
    reads: dict[int, list[int]] = {}

    def timed(run: Callable[[], object], dev: torch.device, *_: object, **__: object) -> float:
        assert dev == torch.device("cpu")
        counts = reads.setdefault(len(reads), [])
        for _call in range(3):
            counter = _ElementsRead()
            with counter:
                token = run()
            assert isinstance(token, torch.Tensor) and token.shape == (2, 1)
            counts.append(counter.elements)
        return 0.0125

    monkeypatch.setattr(measure, "time_call", timed)
    assert measure.decode_step_seconds(model, batch=2, context=32, dtype=torch.float32) == 0.0125
    assert measure.decode_step_seconds(model, batch=2, context=288, dtype=torch.float32) == 0.0125
    short, long = reads[0], reads[1]
    assert len(set(short)) == 1 and len(set(long)) == 1  # every call after the same context, not one more each
    kv_cache_growth = (288 - 32) * 2 * sum(part.kv_elements_per_token() for part in attention)
    assert long[0] - short[0] >= kv_cache_growth  # the step reads the `context` cached tokens of every layer


def test_the_fixed_cost_is_never_below_the_head_and_a_block_adds_its_share(tmp_path: Path) -> None:
    """The pipeline calibrates its fixed decode cost (the parent's step with every block removed), never below
    the LM head's own timing, and adds what a block costs in a whole step beyond its timing alone to every kept
    block's price, never to a removed one's; a later calibration replaces an earlier one."""
    arch = _tiny_decoder().arch
    pricer = Pricer(arch, Target(gpu="cpu", batch=2, context=32, throughput=1.1),
                    measure.MeasuredCosts(cache_file=tmp_path / "cpu.json"))
    head = pricer.fixed.decode_s
    assert head > 0
    pricer.calibrate_decode(fixed_s=head + 0.006)
    assert pricer.fixed.decode_s == pytest.approx(head + 0.006)
    pricer.calibrate_decode(fixed_s=-0.003)  # noise: blocks alone above the step
    assert pricer.fixed.decode_s == pytest.approx(head)
    part = arch.blocks[0].ffn
    assert part is not None
    alone = pricer.price(part, "ffn").decode_s
    pricer.calibrate_decode(fixed_s=head, per_block_s=0.001)
    assert pricer.price(part, "ffn").decode_s == pytest.approx(alone + 0.001)
    assert pricer.price(NoOp(), "ffn").decode_s < 0.001
