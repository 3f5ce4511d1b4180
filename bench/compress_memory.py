"""Compression in bounded memory per rank, measured: `tailor compress` under `torchrun --nproc-per-node 2` (gloo)
on a randomly initialised Llama several times larger than the memory budget each rank is given, then
`tailor quantize` (FP8) and `tailor evaluate` (the quality gate) on its child, one process each.

Each rank's peak resident set (RSS, Linux VmHWM reset per stage) is recorded per stage by the pipeline itself
(`out/memory.rank{r}.json`) and printed beside the budget and beside the dry run's prediction for the same plan
(`compressor/puzzle/footprint.py`). The parent is random (no model of this size can be fetched here), so the
child's quality figures say only that the run completed, not how good Puzzle is.

    .venv/bin/python bench/compress_memory.py            # ~8 min on 2 cores: a 2.6B-parameter parent, 1.6 GiB
    .venv/bin/python bench/compress_memory.py --layers 4 --hidden 512 --intermediate 2048 --params 0.7  # a quick check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30


def write_parent(folder: Path, hidden: int, layers: int, intermediate: int, heads: int, kv_heads: int,
                 tokenizer: Path) -> int:
    """A random Llama in BF16 (std 0.02 weights, unit norms), written one layer per shard, with `tokenizer`'s
    files (SmolLM2's: 49,152 tokens); its parameter count."""
    from tailor.compressor.lazy import LazyDecoder, sharded_checkpoint

    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "vocab_size": 49152, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
              "tie_word_embeddings": True, "max_position_embeddings": 8192, "hidden_act": "silu",
              "bos_token_id": 1, "eos_token_id": 2}
    staging = folder.with_name(folder.name + ".config")
    staging.mkdir(parents=True, exist_ok=True)
    (staging / "config.json").write_text(json.dumps(config))
    from tailor.compressor.architecture import architecture_from_config
    from tailor.compressor.checkpoint import settings_from_config
    from tailor.compressor.modeling import Decoder

    arch = architecture_from_config(config, "bench parent")
    with torch.device("meta"):
        skeleton = Decoder(arch, settings_from_config(config, "bench parent"))
    shapes = {name: tuple(t.shape) for name, t in skeleton.state_dict().items() if name != "lm_head.weight"}
    generator = torch.Generator().manual_seed(0)

    def tensor(name: str) -> torch.Tensor:
        if name.endswith("norm.weight"):
            return torch.ones(shapes[name], dtype=torch.bfloat16)
        return (torch.randn(shapes[name], generator=generator) * 0.02).to(torch.bfloat16)

    groups = [[n for n in shapes if n.startswith(f"model.layers.{i}.")] for i in range(layers)]
    groups.append([n for n in shapes if not n.startswith("model.layers.")])
    with sharded_checkpoint(folder, config, tokenizer, len(groups)) as writer:
        for names in groups:
            writer.add({name: tensor(name) for name in names})
    shutil.rmtree(staging)
    LazyDecoder(folder)  # reads back: every tensor the config needs is there
    return arch.total_params


def plan_for(parent: Path, budget_gib: float, params: float, device: str, text: str) -> dict[str, Any]:
    return {"parent": str(parent), "data": {"seqLen": 64, "text": text}, "device": device,
            "target": {"gpu": "cpu", "params": params, "context": 128, "costs": "roofline"},
            "library": {"ffnWidths": [0.5], "kvHeads": [], "noOp": True},
            "bld": {"tokens": 512, "lr": 0.001, "batch": 4}, "bldActivationTokens": 512,
            "scoringTokens": 64, "evalTokens": 128, "gkd": {"tokens": 256, "lr": 0.0001, "batch": 4},
            "measureTokens": 4, "budgetGiB": budget_gib}


def predicted(plan: Path, ranks: int, budget_gib: float, gpu: str) -> dict[str, int]:
    """The dry run's peak per stage for this plan on `ranks` ranks of the `gpu` profile."""
    result = subprocess.run([sys.executable, "-m", "tailor.cli.main", "compress", "--config", str(plan), "--dry-run",
                             "--gpu", gpu, "--gpus", str(ranks), "--memory-budget", str(budget_gib), "--json"],
                            capture_output=True, text=True, check=False)
    return {need["stage"]: need["peak_bytes"] for need in json.loads(result.stdout)["stages"]}


def run_measured(command: list[str]) -> int:
    """Run `command` and return its peak resident set in bytes (the process's own, from wait4)."""
    process = subprocess.Popen(command)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise subprocess.CalledProcessError(process.returncode, command)
    return usage.ru_maxrss * 1024


def after_compression(child: Path, parent: Path, work: Path, device: str) -> dict[str, dict[str, float]]:
    """`tailor quantize` (FP8, KL to the parent too) and `tailor evaluate` (the gate) on the child, one process
    each: the quantizer's own peaks per stage, and the gate's whole-process peak."""
    cli = [sys.executable, "-m", "tailor.cli.main"]
    quantized = work / "child-fp8"
    run_measured([*cli, "quantize", "--model", str(child), "--out", str(quantized), "--format", "fp8",
                  "--parent", str(parent), "--json"])
    report = json.loads((quantized / "quantization.json").read_text())
    figures: dict[str, dict[str, float]] = {
        f"quantize.{stage}": {**peaks, "seconds": report["stage_seconds"][stage]}
        for stage, peaks in report["peak_memory_bytes"].items()}
    started = time.monotonic()
    gate = run_measured([*cli, "evaluate", "--model", str(quantized), "--parent", str(parent), "--min-retention",
                         "0.01"])
    figures["gate (whole process)"] = {"rss": gate, "seconds": time.monotonic() - started}
    if device != "cpu":
        figures = {k: v for k, v in figures.items() if "cuda" in v}
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=72)
    parser.add_argument("--intermediate", type=int, default=6144)
    parser.add_argument("--budget-gib", type=float, default=1.6)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--params", type=float, default=0.4, help="the child's share of the parent's parameters")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (one rank per GPU)")
    parser.add_argument("--tokenizer", type=Path, help="a folder with tokenizer.json (default: SmolLM2's, fetched)")
    parser.add_argument("--text", default="shakespeare", help="data.text of the plan: 'shakespeare' or a folder")
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "bench-compress-memory")
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "compress_memory.json")
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    parent = args.work / "parent"
    print(f"[bench] writing a random Llama ({args.layers} layers, hidden {args.hidden})", file=sys.stderr)
    if args.tokenizer is None:
        from tailor.compressor import sources

        args.tokenizer = sources.fetch_parent()
    params = write_parent(parent, args.hidden, args.layers, args.intermediate, heads=args.hidden // 128,
                          kv_heads=max(1, args.hidden // 512), tokenizer=args.tokenizer)
    parent_bytes = sum(f.stat().st_size for f in parent.glob("*.safetensors"))
    plan = args.work / "plan.yaml"
    plan.write_text(yaml.safe_dump(plan_for(parent, args.budget_gib, args.params, args.device, args.text)))
    gpu = "cpu" if args.device == "cpu" else "H200-141GB"
    expected = predicted(plan, args.ranks, args.budget_gib, gpu)
    out = args.work / "out"
    started = time.monotonic()
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks)] \
        if args.ranks > 1 else [sys.executable]
    subprocess.run([*launcher, "-m", "tailor.cli.main", "compress", "--config", str(plan), "--out", str(out)],
                   check=True)
    wall = time.monotonic() - started
    after = after_compression(out / "child", parent, args.work, args.device)
    kind = "rss" if args.device == "cpu" else "cuda"
    peaks = [json.loads((out / f"memory.rank{r}.json").read_text()) for r in range(args.ranks)]
    report = json.loads((out / "report.json").read_text())
    budget = args.budget_gib * GIB
    stages = list(peaks[0])
    rows = [{"stage": stage, "memory": kind, "per_rank": [p.get(stage, {}).get(kind) for p in peaks],
             "at_start": [p.get(stage, {}).get(f"{kind}_at_start") for p in peaks],
             "predicted": expected.get(stage.split(".")[-1]), "seconds": report["stage_seconds"].get(stage)}
            for stage in stages]
    rows += [{"stage": stage, "memory": kind, "per_rank": [figures[kind]] + [None] * (args.ranks - 1),
              "at_start": [figures.get(f"{kind}_at_start")], "predicted": None, "seconds": figures.get("seconds")}
             for stage, figures in after.items()]
    result = {"parent_params": params, "parent_bytes_bf16": parent_bytes, "parent_bytes_fp32": 4 * params,
              "budget_bytes": budget, "ranks": args.ranks, "device": args.device, "wall_seconds": wall,
              "child_params": report["child"]["params"], "child_perplexity": report["child"]["quality"]["perplexity"],
              "parent_perplexity": report["parent"]["quality"]["perplexity"], "kl_to_parent": report["kl_to_parent"],
              "stages": rows}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=2) + "\n")
    print(f"parent: {params / 1e9:.2f}B parameters, {parent_bytes / GIB:.2f} GiB in BF16 "
          f"({4 * params / GIB:.2f} GiB in float32); budget {args.budget_gib:.2f} GiB per rank "
          f"(parent / budget = {parent_bytes / budget:.1f}x); {args.ranks} ranks; wall {wall:.0f} s")
    print(f"peak {'resident set (RSS)' if kind == 'rss' else 'CUDA allocator memory'} per rank and stage, GiB")
    print(f"{'stage':<22}" + "".join(f"{f'rank {r}':>12}" for r in range(args.ranks))
          + f"{'predicted':>11}{'budget':>8}  under budget")
    for row in rows:
        measured = [r for r in row["per_rank"] if r is not None]
        cells = "".join(f"{r / GIB:>12.2f}" if r is not None else f"{'-':>12}" for r in row["per_rank"])
        guess = f"{row['predicted'] / GIB:>11.2f}" if row["predicted"] else f"{'-':>11}"
        print(f"{row['stage']:<22}{cells}{guess}{args.budget_gib:>8.2f}  "
              f"{'yes' if all(r <= budget for r in measured) else 'NO'}")
    print(f"child: {result['child_params'] / 1e9:.2f}B parameters, KL to parent {result['kl_to_parent']:.4f} "
          "(random weights: a completed run, not a quality figure)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
