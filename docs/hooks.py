"""MkDocs hooks: the site's home page is the README, and the benchmark plots come from `bench/results/`, so
neither is copied into `docs/`. Pages link to the plots by their path in the repository (which GitHub shows);
the site serves them under `bench/results/`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
PLOTS = "bench/results/"


def on_files(files: Files, config: Any) -> Files:
    readme = (ROOT / "README.md").read_text().replace("](docs/", "](")
    files.append(File.generated(config, "index.md", content=readme))
    for plot in sorted((ROOT / PLOTS).glob("*.png")):
        files.append(File.generated(config, PLOTS + plot.name, abs_src_path=str(plot)))
    return files


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """A page's link to a plot by its repository path (`../../bench/results/x.png` from `docs/benchmarks/`)
    becomes its path in the site."""
    depth = page.file.src_uri.count("/")
    return markdown.replace("](" + "../" * (depth + 1) + PLOTS, "](" + "../" * depth + PLOTS)
