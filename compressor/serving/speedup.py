"""The served speed-up: the Puzzle child's tokens/s over its parent's through the serving engine.

Both are packaged side by side in one model repository with the same engine arguments (context, max_num_seqs,
the pool's compute dtype; each with the KV-cache bytes of its own sizing) and measured interleaved through one
tritonserver (`speed.interleaved`, which flags rows taken while other processes used the CPU). The operator's
package Job writes the pair for the pool it measures on (`package_pair`, from `tailor package --plan`); its speed
Job runs Triton on it beside `tailor speed --plan` (`measure`), whose result goes into the object's status.
"""

from __future__ import annotations

import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from tailor.compressor.buildplan import REPOSITORY
from tailor.compressor.compute import ComputeDtype
from tailor.compressor.files import staged_folder, write_text
from tailor.compressor.results import SpeedRatio, SpeedResult
from tailor.compressor.serving.repository import package
from tailor.compressor.serving.speed import Row, Sample, interleaved, ratios, vllm_request
from tailor.compressor.sizing.hardware import GpuProfile

CONCURRENCY = (1, 16)  # the goal is stated at these
ROUNDS = 2
NEW_TOKENS = 64
PROMPT = "The capital of France is"
CHILD, PARENT = "child", "parent"
PAIR = (CHILD, PARENT)  # the models one Triton serves side by side, on the same GPUs
SKIPPED_FILE = "skipped.txt"  # beside an empty repository: why the pair was not packaged


def package_pair(child: Path, parent: Path, out: Path, gpu: GpuProfile, context: int, tensor_parallel: int,
                 mount: str, dtype: ComputeDtype) -> str | None:
    """The child and the parent in one repository, `out/repository` (found by the server at `mount`), each at
    max_num_seqs max(CONCURRENCY) and each in half of every GPU's memory (one Triton loads both engines on the
    same GPUs: neither may ask for memory the other holds); None, or why not (written to `out/skipped.txt` beside
    an empty repository, so that the server beside `tailor speed` starts either way)."""
    with staged_folder(out) as staging:
        repository = staging / REPOSITORY
        repository.mkdir()
        try:
            for label, folder in zip(PAIR, (child, parent), strict=True):
                package(folder, staging / label, label, gpu, context, max_batch_size=max(CONCURRENCY),
                        tensor_parallel=tensor_parallel, mount=mount, dtype=dtype, share=1 / len(PAIR))
                (staging / label / REPOSITORY / label).rename(repository / label)
                shutil.rmtree(staging / label)
        except ValueError as error:  # one of them does not fit the pool's GPUs at that batch
            for entry in repository.iterdir():
                shutil.rmtree(entry)
            reason = f"not measured: {error}"
            write_text(staging / SKIPPED_FILE, reason + "\n")
            return reason
    return None


def skipped(folder: Path) -> str | None:
    """Why the pair in `folder` was not packaged, or None."""
    path = folder / SKIPPED_FILE
    return path.read_text().strip() if path.exists() else None


def server_pid(repository: str) -> int | None:
    """The tritonserver serving `repository` (a path or its tail), where this process sees it (the pod shares
    its process namespace)."""
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and Path(argv[0].decode(errors="replace")).name == "tritonserver" and any(
                arg.rstrip(b"/").endswith(repository.rstrip("/").encode()) for arg in argv):
            return int(cmdline.parent.name)
    return None


def wait_ready(http_url: str, timeout_s: float) -> None:
    """Until Triton says it is ready (every model loaded); a TimeoutError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{http_url}/v2/health/ready", timeout=5) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{http_url} was not ready after {timeout_s:.0f} s")
        time.sleep(2)


def measure(grpc_url: str, pid: int, log: Callable[[Row], None] = lambda _: None,
            concurrency: tuple[int, ...] = CONCURRENCY, rounds: int = ROUNDS, new_tokens: int = NEW_TOKENS
            ) -> tuple[list[Row], list[SpeedRatio]]:
    """Every row (`speed.interleaved`) and the child's ratios over the parent, after one warm-up request each."""

    def sender(label: str) -> Callable[[int], Sample]:
        return lambda _: vllm_request(grpc_url, label, PROMPT, new_tokens)

    for label in PAIR:
        sender(label)(0)
    rows = interleaved(list(PAIR), sender, list(concurrency), rounds, pid, log)
    found = [SpeedRatio(concurrency=r["concurrency"], ratio=round(r["ratio"], 4), per_round=r["per_round"],
                        contended=r["contended"]) for r in ratios(rows, PARENT)]
    return rows, found


def result(gpu: str, context: int, dtype: ComputeDtype, found: list[SpeedRatio] | None = None,
           reason: str | None = None, rounds: int = ROUNDS) -> SpeedResult:
    return SpeedResult(gpu=gpu, context=context, dtype=dtype.value, max_num_seqs=max(CONCURRENCY),
                       new_tokens=NEW_TOKENS,
                       rounds=0 if reason else rounds, ratios=found or [], skipped=reason)
