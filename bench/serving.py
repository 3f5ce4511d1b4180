"""Parent vs Puzzle child through Triton + vLLM (its CPU build here) and through the project's Python fallback
engine, measured interleaved on this machine so that the ratios can be trusted.

    .venv/bin/python bench/serving.py [--child DIR] [--child-fp8 DIR] [--concurrency 1 4 16 64] [--rounds 2]
        [--engines vllm tailor-python] [--new-tokens 64] [--results bench/results/serving.json]
        [--work build/bench-serving]

Models: `parent` (SmolLM2-135M), `child` (a Puzzle child, by default bench/puzzle.py's 1.5x one) and, on the
Python engine only, `child-fp8` (the child quantized to FP8; vLLM's CPU build cannot run FP8 weights: its CPU FP8
kernels need AMX). Each engine runs in a tritonserver of its own with all of its models loaded, packaged for the
`cpu` profile with a context of 512 and max_batch_size the largest concurrency: the same engine arguments.

At each concurrency, max(8, 2 x concurrency) requests of a 64-token window of held-out Shakespeare each ask for
exactly `--new-tokens` tokens (greedy, ignore_eos), streamed: vLLM gets the window decoded to text (which it
tokenizes again), the Python engine its token ids. The models are measured interleaved
(`tailor.compressor.serving.speed`): round after round in alternating order, each row with the CPU that other
processes used meanwhile (`other_cores`), taken again while that was above 0.25 cores and flagged `contended`
if it stayed so. Per (engine, model, concurrency, round): output tokens/s, time to first token (TTFT) and
inter-token latency (ITL) at p50/p99, measured from the client. Ratios: child/parent per engine and concurrency,
the median over rounds of the same-round ratios, beside the speedup the Puzzle search predicted
(`<child>/../report.json`). Every figure is measured on this machine. Writes bench/results/serving.{json,png}.
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
from tailor.compressor.quantize.pipeline import REPORT_FILE, QuantizeJob, run
from tailor.compressor.quantize.recipes import QuantFormat
from tailor.compressor.serving import client
from tailor.compressor.serving.repository import package
from tailor.compressor.serving.server import triton_server
from tailor.compressor.serving.speed import Row, Sample, interleaved, ratios, vllm_request
from tailor.compressor.sizing.engines import Engine
from tailor.compressor.sizing.hardware import GpuCatalog
from tailor.compressor.text import split_texts, text_files, token_windows

ROOT = Path(__file__).resolve().parent.parent
CONTEXT = 512
PROMPT_TOKENS = 64
FP8_NOTE = ("child-fp8 runs on the Python engine only: vLLM's CPU build cannot run FP8 weights (its CPU FP8 kernels "
            "need AMX)")


@dataclass
class Prompt:
    ids: list[int]  # what the Python engine gets
    text: str  # what vLLM gets: the same window, decoded


def machine() -> str:
    """This machine in words: its CPU model and core count (every figure here is measured on it)."""
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
             if line.startswith("model name")] if cpuinfo.exists() else []
    return f"{names[0] if names else platform.processor() or 'CPU'}, {os.cpu_count()} cores, no GPU"


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


def sender(engine: Engine, url: str, model: str, prompts: list[Prompt], new_tokens: int) -> Callable[[int], Sample]:
    """What sends the i-th request to `model`: greedy, exactly `new_tokens` tokens, streamed."""
    def send(index: int) -> Sample:
        prompt = prompts[index % len(prompts)]
        if engine is Engine.VLLM:
            return vllm_request(url, model, prompt.text, new_tokens)
        arrivals: list[float] = []
        started = time.perf_counter()
        tokens = len(client.stream(url, model, lambda _: arrivals.append(time.perf_counter() - started),
                                   ids=prompt.ids, max_tokens=new_tokens, temperature=0.0, ignore_eos=True).ids)
        if tokens != new_tokens or not arrivals:
            raise RuntimeError(f"{engine.value}/{model}: {tokens} tokens in {len(arrivals)} pieces")
        return Sample(tokens, arrivals)

    return send


def serve(engine: Engine, models: dict[str, Path], prompts: list[Prompt], concurrencies: list[int], rounds: int,
          new_tokens: int, work: Path, log: Callable[[Row], None]) -> tuple[list[Row], list[Row]]:
    """One tritonserver for `engine` with its models loaded together, measured interleaved. The rows, and the
    models that did not load (the others are measured all the same)."""
    failures = []
    with triton_server(repository(engine, models, work, max(concurrencies)), explicit=True) as server:
        control = grpcclient.InferenceServerClient(server.grpc_url)
        loaded = []
        for label in models:
            try:
                control.load_model(label)
                loaded.append(label)
            except InferenceServerException as error:
                failures.append({"engine": engine.value, "model": label,
                                 "error": f"{error.message().splitlines()[0]} (the server's log: {server.log})"})
                print(f"{engine.value}/{label} did not load: {failures[-1]['error']}", file=sys.stderr, flush=True)
        for label in loaded:
            sender(engine, server.grpc_url, label, prompts, 4)(0)  # warm-up
        rows = interleaved(loaded, lambda label: sender(engine, server.grpc_url, label, prompts, new_tokens),
                           concurrencies, rounds, server.process.pid,
                           lambda row: log({"engine": engine.value, **row}))
        control.close()
    return [{"engine": engine.value, **row} for row in rows], failures


def engine_ratios(rows: list[Row]) -> list[Row]:
    """child/parent (and child-fp8/parent) tokens/s within each engine: per round, and their median."""
    return [{"engine": engine, **ratio} for engine in dict.fromkeys(r["engine"] for r in rows)
            for ratio in ratios([r for r in rows if r["engine"] == engine], "parent")]


def print_row(row: Row) -> None:
    itl = f"ITL p50 {row['itl_p50_s'] * 1e3:7.1f} ms" if row["itl_p50_s"] is not None else "ITL -"
    print(f"{row['engine']:<14} {row['model']:<10} c={row['concurrency']:<3} round {row['round']}"
          f" {row['tokens_per_second']:8.1f} tok/s  TTFT p50 {row['ttft_p50_s']:6.2f} s  {itl}  other CPU "
          f"{row['other_cores']:.2f} cores" + (" CONTENDED" if row["contended"] else ""), file=sys.stderr, flush=True)


def markdown(rows: list[Row], found: list[Row], where: str, predicted: float | None) -> str:
    def cell(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
        return "-" if value is None else f"{value * scale:.{digits}f}"

    lines = [f"Measured on this machine ({where}), interleaved.", "",
             "| engine | model | concurrency | round | tok/s | TTFT p50 s | TTFT p99 s | ITL p50 ms | ITL p99 ms "
             "| other CPU (cores) |", "|---" * 10 + "|"]
    lines += [f"| {r['engine']} | {r['model']} | {r['concurrency']} | {r['round']} | {r['tokens_per_second']:.1f} | "
              f"{cell(r['ttft_p50_s'])} | {cell(r['ttft_p99_s'])} | {cell(r['itl_p50_s'], 1e3, 1)} | "
              f"{cell(r['itl_p99_s'], 1e3, 1)} | {r['other_cores']:.2f}{' contended' if r['contended'] else ''} |"
              for r in rows]
    lines += ["", "| engine | model / parent | concurrency | median | per round | contended |", "|---" * 6 + "|"]
    lines += [f"| {f['engine']} | {f['model']} | {f['concurrency']} | {f['ratio']:.2f}x | "
              f"{', '.join(f'{v:.2f}' for v in f['per_round'])} | {'yes' if f['contended'] else 'no'} |"
              for f in found]
    lines += ["", "Puzzle predicted " + (f"{predicted:.2f}x" if predicted is not None else
                                         "nothing (no report.json beside the child)")]
    return "\n".join(lines)


def plot(rows: list[Row], where: str, out: Path) -> None:
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for engine, model in dict.fromkeys((r["engine"], r["model"]) for r in rows):
        points = [r for r in rows if (r["engine"], r["model"]) == (engine, model)]
        levels = sorted({r["concurrency"] for r in points})
        medians = [statistics.median(r["tokens_per_second"] for r in points if r["concurrency"] == c) for c in levels]
        axes.plot(levels, medians, marker="o", linestyle="-" if engine == Engine.VLLM.value else "--",
                  label=f"{engine} / {model} (median of rounds)")
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
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per model (alternating order)")
    parser.add_argument("--engines", nargs="+", choices=[e.value for e in Engine], default=[e.value for e in Engine])
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
    engines = {Engine.VLLM: models, Engine.PYTHON: {**models, "child-fp8": fp8_child(child, args.child_fp8, args.work)}
               if Engine.PYTHON.value in args.engines else {}}
    engines = {engine: served for engine, served in engines.items() if engine.value in args.engines}
    prompts = held_out_prompts(AutoTokenizer.from_pretrained(parent))
    where = machine()
    print(f"measured on this machine: {where}\n{FP8_NOTE}", file=sys.stderr, flush=True)

    rows: list[Row] = []
    failures: list[Row] = []
    for engine, served in engines.items():
        measured, failed = serve(engine, served, prompts, concurrencies, args.rounds, args.new_tokens, args.work,
                                 print_row)
        rows += measured
        failures += failed
    found = engine_ratios(rows)
    predicted = predicted_speedup(child)
    print(markdown(rows, found, where, predicted))
    print(f"\n{FP8_NOTE}")
    for failure in failures:
        print(f"\n{failure['engine']}/{failure['model']} did not load: {failure['error']}")

    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps({
        "measured_on": f"this machine: {where}", "context": CONTEXT, "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": args.new_tokens, "rounds": args.rounds, "note": FP8_NOTE, "predicted_speedup": predicted,
        "ratios": found,
        "models": {engine.value: {k: str(v) for k, v in served.items()} for engine, served in engines.items()},
        "failures": failures, "rows": rows}, indent=2) + "\n")
    plot(rows, where, args.results.with_suffix(".png"))
    print(f"\nwrote {args.results} and {args.results.with_suffix('.png')}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
