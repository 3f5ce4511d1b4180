"""Atomic writes: a file or folder appears complete or not at all."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


@contextmanager
def staged_folder(final: Path) -> Iterator[Path]:
    """A temporary folder beside `final`, renamed to it when the block succeeds and removed when it fails."""
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    staging.chmod(0o755)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)


def write_text(path: Path, text: str) -> None:
    """Write through a temporary file in the same folder, then rename over `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(descriptor, "w") as handle:
        handle.write(text)
    os.replace(temporary, path)


def write_json(path: Path, data: Any) -> None:
    write_text(path, json.dumps(data, indent=2, sort_keys=False) + "\n")


def save_tensors(path: Path, tensors: dict[str, Any], metadata: dict[str, str] | None = None) -> None:
    """A safetensors file written under a temporary name, then renamed (tensors detached, on the CPU)."""
    from safetensors.torch import save_file  # torch: this module is also the operator's

    partial = path.with_name(f".{path.name}.partial")
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, partial, metadata=metadata)
    partial.replace(path)
