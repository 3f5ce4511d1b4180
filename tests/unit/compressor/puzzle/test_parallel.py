"""Rank 0's work alone under torchrun: a failure there reaches every rank with its reason."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

RANKS = """
import torch
from tailor.compressor.puzzle import parallel

def fail() -> None:
    raise OSError(28, "No space left on device")

parallel.init(torch.device("cpu"))
try:
    parallel.on_main(fail, "the checkpoint swap")
except RuntimeError as error:
    print(f"rank {parallel.rank_world()[0]}: {error}", flush=True)
parallel.on_main(lambda: None, "a step that works")
print(f"rank {parallel.rank_world()[0]}: done", flush=True)
parallel.finish()
"""


def test_a_failure_on_rank_0_is_raised_on_every_rank(tmp_path: Path) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for rank in (0, 1):
        assert (f"rank {rank}: the checkpoint swap failed on rank 0: [Errno 28] No space left on device"
                in run.stdout), run.stdout
        assert f"rank {rank}: done" in run.stdout
