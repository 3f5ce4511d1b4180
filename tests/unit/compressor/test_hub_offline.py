"""A stage after compress reads an hf:// parent from the cache compress filled, with the hub offline
(HF_HUB_OFFLINE=1, as the operator starts it) and no token: the cache is laid out as huggingface_hub's
snapshot_download leaves it, and offline it sends no request anywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _cached(cache: Path, repo: str) -> Path:
    """The cache snapshot_download leaves for `repo` at revision main."""
    folder = cache / "hub" / f"models--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(COMMIT)
    snapshot = folder / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return snapshot


def _fetch(cache: Path, uri: str, **env: str) -> subprocess.CompletedProcess[str]:
    code = "import sys; from tailor.compressor import sources; print(sources.fetch_hub(sys.argv[1]))"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    return subprocess.run([sys.executable, "-c", code, uri], capture_output=True, text=True, timeout=120,
                          env={**clean, "TAILOR_CACHE_DIR": str(cache), **env})


def test_a_later_stage_reads_the_parent_from_the_cache_offline(tmp_path: Path) -> None:
    snapshot = _cached(tmp_path, "example-org/private-parent")
    found = _fetch(tmp_path, "hf://example-org/private-parent", HF_HUB_OFFLINE="1")
    assert found.returncode == 0, found.stderr
    assert Path(found.stdout.strip()) == snapshot


def test_offline_a_parent_the_cache_lacks_says_so_naming_it(tmp_path: Path) -> None:
    found = _fetch(tmp_path, "hf://example-org/not-cached", HF_HUB_OFFLINE="1")
    assert found.returncode != 0
    assert "hf://example-org/not-cached: cannot download the parent" in found.stderr
