"""What the compute dtype costs on this machine: one GKD step and the served tokens/s, in float32 and in BF16.

    .venv/bin/python bench/precision.py [--rows 2] [--rounds 2] [--concurrency 1 16] [--new-tokens 32]
        [--skip-serving] [--results bench/results/precision.json] [--work build/bench-precision]

`compute.resolve` picks BF16 only where the device has BF16 math (`torch.backends.cpu.get_cpu_capability()` and
AVX512_BF16 or AMX on a CPU); this measures both on SmolLM2-135M to show what the choice is worth here:
- GKD: one step as `gkd.distill` takes it (the frozen teacher's states and logits in the dtype, the float32
  child's forward and backward under `device.autocast` of it, `gkd.gkd_loss`) on `--rows` x 128 tokens; the two
  dtypes alternate for `--rounds` rounds and each reports its median;
- serving: SmolLM2-135M packaged twice for the `cpu` profile (`package(..., dtype=...)`: vLLM's engine arguments
  and sizing in each dtype), both in one tritonserver with vLLM's CPU build, measured interleaved
  (`speed.interleaved`, rows taken while other processes used the CPU are taken again) at each concurrency.
Every figure is measured on this machine; the JSON names its CPU and what `compute.resolve` chose for it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tailor.compressor import sources
from tailor.compressor.buildplan import REPOSITORY
from tailor.compressor.compute import ComputeDtype
from tailor.compressor.model.checkpoint import load_decoder
from tailor.compressor.model.device import autocast, compute_for, detect, torch_dtype
from tailor.compressor.puzzle.gkd import gkd_loss
from tailor.compressor.serving.repository import package
from tailor.compressor.serving.server import triton_server
from tailor.compressor.serving.speed import Row, Sample, interleaved, vllm_request
from tailor.compressor.sizing.hardware import GpuCatalog

ROOT = Path(__file__).resolve().parent.parent
DTYPES = (ComputeDtype.FLOAT32, ComputeDtype.BFLOAT16)
SEQ_LEN, CONTEXT = 128, 512
PROMPT = "The capital of France is"
# what makes a CPU with BF16 math act as one without (`model/device.py`); the JSON records those set
DISPATCH_CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def gkd_step(parent: Path, rows: int, dtype: ComputeDtype) -> Callable[[], float]:
    """One GKD step of SmolLM2 distilling from itself, computing in `dtype`; returns its loss."""
    wanted = torch_dtype(dtype)
    teacher, child = load_decoder(parent, wanted).eval(), load_decoder(parent).train()
    ids = torch.randint(0, child.arch.vocab_size, (rows, SEQ_LEN), generator=torch.Generator().manual_seed(0))

    def step() -> float:
        with torch.no_grad():
            states: list[torch.Tensor] = []
            logits = teacher(ids, states=states)
        with autocast(torch.device("cpu"), wanted):
            loss = gkd_loss(child, ids, states, logits, 1 / rows)
        loss.backward()  # type: ignore[no-untyped-call]
        child.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def time_gkd(parent: Path, rows: int, rounds: int) -> dict[str, Any]:
    steps = {dtype: gkd_step(parent, rows, dtype) for dtype in DTYPES}
    seconds: dict[ComputeDtype, list[float]] = {dtype: [] for dtype in DTYPES}
    for round_ in range(rounds):
        for dtype in DTYPES if round_ % 2 == 0 else DTYPES[::-1]:
            started = time.perf_counter()
            steps[dtype]()
            seconds[dtype].append(time.perf_counter() - started)
            log(f"gkd step, {rows} x {SEQ_LEN} tokens, {dtype.value}: {seconds[dtype][-1]:.2f} s")
    median = {dtype.value: statistics.median(values) for dtype, values in seconds.items()}
    return {"rows": rows, "seq_len": SEQ_LEN, "seconds": {d.value: v for d, v in seconds.items()},
            "median_s": median, "bf16_over_float32": median["bfloat16"] / median["float32"]}


def time_serving(parent: Path, work: Path, concurrency: list[int], rounds: int, new_tokens: int) -> dict[str, Any]:
    cpu = GpuCatalog.load().get("cpu")
    shutil.rmtree(work, ignore_errors=True)
    repository = work / REPOSITORY
    repository.mkdir(parents=True)
    for dtype in DTYPES:
        name = f"smollm2-{dtype.value}"
        package(parent, work / name, name, cpu, CONTEXT, max_batch_size=max(concurrency), dtype=dtype,
                mount=str(repository.resolve()))
        (work / name / REPOSITORY / name).rename(repository / name)
    models = [f"smollm2-{dtype.value}" for dtype in DTYPES]
    with triton_server(repository, timeout=900) as server:
        url = server.grpc_url

        def sender(model: str) -> Callable[[int], Sample]:
            return lambda _: vllm_request(url, model, PROMPT, new_tokens)

        for model in models:
            sender(model)(0)  # warm-up
        rows: list[Row] = interleaved(models, sender, concurrency, rounds, server.process.pid, lambda row: log(
            f"{row['model']} c={row['concurrency']} round {row['round']}: {row['tokens_per_second']:.1f} tok/s"))
    per = {model: {c: statistics.median(r["tokens_per_second"] for r in rows
                                        if r["model"] == model and r["concurrency"] == c) for c in concurrency}
           for model in models}
    return {"new_tokens": new_tokens, "context": CONTEXT, "rows": rows,
            "tokens_per_second": {m.removeprefix("smollm2-"): v for m, v in per.items()},
            "float32_over_bf16": {c: per[models[0]][c] / per[models[1]][c] for c in concurrency}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=2, help="sequences of 128 tokens in the GKD step")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--skip-serving", action="store_true", help="time the GKD step only")
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "precision.json")
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "bench-precision")
    args = parser.parse_args()

    device = torch.device("cpu")
    chosen = compute_for(device)
    log(f"this machine: {detect(device).describe()}; compute.resolve chooses {chosen.describe()}")
    parent = sources.fetch_parent()
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads", "processor": detect(device).model_dump(mode="json"),
        "chosen": chosen.model_dump(mode="json"), "measured": True,
        "dispatch_caps": {name: os.environ[name] for name in DISPATCH_CAPS if name in os.environ},
        "gkd": time_gkd(parent, args.rows, args.rounds)}
    if not args.skip_serving:
        result["serving"] = time_serving(parent, args.work, args.concurrency, args.rounds, args.new_tokens)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=1) + "\n")
    gkd = result["gkd"]
    print(f"GKD step ({args.rows} x {SEQ_LEN} tokens): float32 {gkd['median_s']['float32']:.2f} s, BF16 "
          f"{gkd['median_s']['bfloat16']:.2f} s ({gkd['bf16_over_float32']:.1f}x float32's time)")
    for c, ratio in result.get("serving", {}).get("float32_over_bf16", {}).items():
        speeds = result["serving"]["tokens_per_second"]
        print(f"served at concurrency {c}: float32 {speeds['float32'][c]:.1f} tok/s, BF16 "
              f"{speeds['bfloat16'][c]:.1f} tok/s ({ratio:.2f}x)")
    print(f"wrote {args.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
