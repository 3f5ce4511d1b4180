"""A commit's `tailor` package beside this checkout's, for benchmarks that compare the two side by side."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def baseline_path(commit: str, scratch: Path) -> Path:
    """A PYTHONPATH entry whose `tailor` package is commit `commit`'s (a worktree at `scratch`/worktree, linked
    like the installed package maps the top-level folders); remove it with `remove_worktree(scratch)`."""
    worktree = scratch / "worktree"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(worktree), commit], check=True,
                   capture_output=True)
    package = scratch / "baseline-path" / "tailor"
    package.mkdir(parents=True)
    for folder in ("cli", "operator", "compressor", "devcluster"):
        (package / folder).symlink_to(worktree / folder)
    return package.parent


def remove_worktree(scratch: Path) -> None:
    subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(scratch / "worktree")],
                   check=False, capture_output=True)
