"""The quality gate: next-token accuracy of a child against its parent on held-out text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tailor.cli.main import main
from tailor.compressor.evaluation import evaluate
from tailor.compressor.model.checkpoint import load_decoder, read_config, write_checkpoint
from tailor.compressor.puzzle.plan import Corpus
from tailor.compressor.text import split_texts, text_files


@pytest.fixture(scope="module")
def degraded(tiny_hybrid: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The trained toy hybrid with its LM head's rows rolled by one token: every logit lands on the next token
    id, so the same model predicts what it should no better than chance. A margin no CPU's rounding blurs (noise
    on the weights left 0.985 of a weakly trained parent's accuracy on one machine and less on another)."""
    folder = tmp_path_factory.mktemp("degraded") / "model"
    model = load_decoder(tiny_hybrid)
    assert not model.arch.tie_word_embeddings  # the embedding stays as trained
    with torch.no_grad():
        model.lm_head.weight.copy_(model.lm_head.weight.roll(1, dims=0))
    write_checkpoint(model, folder, read_config(tiny_hybrid), tiny_hybrid)
    return folder


BOOKS = Corpus(text="books")  # held-out parts of Shakespeare (the toy hybrid's training text) and other books


def test_a_model_keeps_all_of_its_own_quality(tiny_hybrid: Path) -> None:
    result = evaluate(tiny_hybrid, tiny_hybrid, 0.97, BOOKS, seq_len=64, eval_tokens=512)
    assert result.retention == 1.0 and result.passed and result.kl_to_parent < 1e-6
    assert 0.05 < result.parent_score < 0.6  # a trained model predicts a real share of held-out tokens
    assert result.tokens == 512 and result.parent_perplexity == pytest.approx(result.child_perplexity)


def test_a_worse_child_loses_quality_and_fails_the_floor(tiny_hybrid: Path, degraded: Path, tmp_path: Path) -> None:
    result = evaluate(degraded, tiny_hybrid, 0.97, BOOKS, seq_len=64, eval_tokens=512)
    print(f"retention {result.retention:.3f}, KL {result.kl_to_parent:.3f}")
    assert result.retention < 0.97 and not result.passed and result.kl_to_parent > 0.1
    out = tmp_path / "termination-log"
    assert main(["evaluate", "--model", str(degraded), "--parent", str(tiny_hybrid), "--min-retention", "0.5",
                 "--text", "books", "--eval-tokens", "512", "--result-file", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["min_retention"] == 0.5 and written["passed"] == (written["retention"] >= 0.5)
    assert len(out.read_bytes()) < 4096


def test_bad_floors_untrained_parents_and_missing_text_are_refused(tiny_parent: Path, tiny_hybrid: Path) -> None:
    with pytest.raises(ValueError, match="--min-retention must be in"):
        evaluate(tiny_hybrid, tiny_hybrid, 1.5)
    with pytest.raises(ValueError, match="predicts none of the 512 held-out tokens"):
        evaluate(tiny_parent, tiny_parent, 0.9, Corpus(text="shakespeare"), seq_len=64,  # random weights
                 eval_tokens=512)
    assert main(["evaluate", "--model", str(tiny_hybrid), "--parent", str(tiny_hybrid), "--text",
                 "/nowhere/at/all"]) == 1


def test_the_gate_evaluates_on_the_stated_held_out_text(tiny_hybrid: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_hybrid)
    _, held_out = split_texts(text_files("shakespeare"), every=8)  # works the toy hybrid never trained on
    text = tokenizer.decode(tokenizer(held_out[0].text()[:20_000])["input_ids"][1000:1400])
    heldout = tmp_path / "eval.jsonl"
    heldout.write_text(json.dumps({"body": text}) + "\n")
    tokens = len(tokenizer(text)["input_ids"])
    assert 256 <= tokens < 512  # fewer than the 512 asked for: only this file is read
    result = evaluate(tiny_hybrid, tiny_hybrid, 0.97, Corpus(heldout=str(heldout), text_field="body"), seq_len=64,
                      eval_tokens=512)
    assert result.tokens == tokens // 64 * 64
    out = tmp_path / "termination-log"
    assert main(["evaluate", "--model", str(tiny_hybrid), "--parent", str(tiny_hybrid), "--heldout", str(heldout),
                 "--text-field", "body", "--eval-tokens", "512", "--result-file", str(out)]) == 0
    assert json.loads(out.read_text())["tokens"] == 256  # one window of the gate's 256 tokens


@pytest.mark.parametrize("stage", ["quantize", "evaluate"])
def test_a_one_process_stage_refuses_to_run_as_a_rank(stage: str, tiny_parent: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Started by torchrun as one of 8, quantization or evaluation would run 8 whole copies on one GPU: it refuses
    before reading anything, naming how it was started."""
    monkeypatch.setenv("WORLD_SIZE", "8")
    args = {"quantize": ["--model", str(tiny_parent), "--out", str(tmp_path / "q")],
            "evaluate": ["--model", str(tiny_parent), "--parent", str(tiny_parent)]}[stage]
    assert main([stage, *args]) == 1
    assert f"tailor {stage} runs as one process, but was started as one of 8" in capsys.readouterr().err
    assert not (tmp_path / "q").exists()
