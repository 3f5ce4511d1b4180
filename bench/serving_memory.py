"""A Triton replica's host memory on the `cpu` profile, measured against what the operator asks and allows for it
(`compressor/sizing/hostmemory.py`: weights + the KV cache vLLM allots + the runtime term).

For each (context, batch): SmolLM2-135M packaged as a pool's package Job packages it, served by tritonserver with
vLLM's CPU build, `2 x batch` requests of 64 tokens sent `batch` at a time; the server's process tree is sampled
every 0.3 s (proportional set size, PSS, which counts a shared page once, as a memory cgroup charges it; and RSS).
Printed and written to `bench/results/serving_memory.json`: the peaks, the request and limit the operator would set,
and the runtime the measurement implies (peak PSS less weights and cache), which the runtime term must cover.

    .venv/bin/python bench/serving_memory.py          # ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psutil

from tailor.compressor.model.architecture import load_architecture
from tailor.compressor.puzzle.pipeline import resolve_parent
from tailor.compressor.serving.repository import package
from tailor.compressor.serving.server import triton_server
from tailor.compressor.sizing.concurrency import size
from tailor.compressor.sizing.hardware import GpuCatalog
from tailor.compressor.sizing.hostmemory import serving_need
from tailor.compressor.sizing.memory import GIB, RECIPES, KvDtype

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20


class Peaks:
    """The peak PSS and RSS of a process and its descendants, sampled in a thread."""

    def __init__(self, pid: int) -> None:
        self.pid, self.pss, self.rss = pid, 0, 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        while not self.stopped.wait(0.3):
            try:
                root = psutil.Process(self.pid)
                tree = [root, *root.children(recursive=True)]
            except psutil.Error:
                continue
            pss = rss = 0
            for process in tree:
                try:
                    info = process.memory_full_info()
                except psutil.Error:
                    continue
                pss, rss = pss + info.pss, rss + info.rss
            self.pss, self.rss = max(self.pss, pss), max(self.rss, rss)

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()


def generate(port: int, model: str) -> int:
    body = json.dumps({"text_input": "ROMEO: " * 20, "parameters": {"max_tokens": 64}}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v2/models/{model}/generate", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as reply:
        return int(reply.status)


def measure(context: int, batch: int, work: Path) -> dict[str, Any]:
    cpu = GpuCatalog.load().get("cpu")
    settings = package(resolve_parent("smollm2-135m"), work / f"package-{context}-{batch}", "smollm2", cpu, context,
                       max_batch_size=batch)
    engine: Any = settings.engine_args
    sizing = size(load_architecture("smollm2-135m"), cpu, context, RECIPES["bf16"], KvDtype.BF16, tp=1)
    need = serving_need(True, 1, sizing.footprint.weights, int(engine["kv_cache_memory_bytes"]))
    repository = work / f"repository-{context}-{batch}"
    repository.mkdir()
    (repository / "smollm2").symlink_to(Path(engine["model"]).parent.parent)
    with triton_server(repository, timeout=600) as server:
        peaks = Peaks(server.process.pid)
        with ThreadPoolExecutor(batch) as pool:
            statuses = list(pool.map(lambda _: generate(server.ports.http, "smollm2"), range(2 * batch)))
        time.sleep(1)
        peaks.stop()
    assert statuses == [200] * (2 * batch), statuses
    weights, cache = need.parts["weights"], need.parts["KV cache and state"]
    return {"context": context, "batch": batch, "weightsMiB": weights // MIB, "cacheMiB": cache // MIB,
            "peakPssMiB": peaks.pss // MIB, "peakRssMiB": peaks.rss // MIB,
            "impliedRuntimeGiB": round((peaks.pss - weights - cache) / GIB, 2),
            "runtimeTermGiB": need.parts["runtime"] / GIB,
            "requestMiB": int(need.request().removesuffix("Mi")), "limitMiB": int(need.limit().removesuffix("Mi"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "serving_memory.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for context, batch in ((1024, 8), (8192, 8)):
            row = measure(context, batch, Path(folder))
            rows.append(row)
            print(f"context {context:>5} x {batch} requests: weights {row['weightsMiB']} MiB, cache {row['cacheMiB']} "
                  f"MiB; peak PSS {row['peakPssMiB']} MiB (RSS {row['peakRssMiB']}): runtime "
                  f"{row['impliedRuntimeGiB']} GiB (term {row['runtimeTermGiB']:g}); request {row['requestMiB']} "
                  f"MiB, limit {row['limitMiB']} MiB", flush=True)
    args.out.write_text(json.dumps({"measured": "tritonserver + vLLM CPU, SmolLM2-135M, this machine",
                                    "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
