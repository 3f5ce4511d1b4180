"""Compression in bounded memory per rank, measured: `tailor compress` under `torchrun --nproc-per-node 2` (gloo)
on a randomly initialised Llama or NemotronH several times larger than the memory budget each rank is given,
then `tailor quantize` (FP8) on its child, in a process of its own.

Each rank's peak resident set (RSS, Linux VmHWM reset per stage) is recorded per stage by the pipeline itself
(`out/memory.rank{r}.json`) and printed beside the budget and beside the dry run's prediction for the same plan
(`compressor/puzzle/footprint.py`). The parent is random (no model of this size can be fetched here), so the
child's quality figures say only that the run completed, not how good Puzzle is.

    .venv/bin/python bench/compress_memory.py            # ~8 min on 2 cores: a 2.6B-parameter parent, 1.6 GiB
    .venv/bin/python bench/compress_memory.py --layers 4 --hidden 512 --intermediate 2048 --params 0.7  # a quick check
    .venv/bin/python bench/compress_memory.py --layers 8 --hidden 512 --intermediate 2048 --scale 10  # 10x the data
"""

from __future__ import annotations

import argparse
import json
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
VOCAB = 49152  # SmolLM2's tokenizer


def llama_config(hidden: int, layers: int, intermediate: int) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
            "intermediate_size": intermediate, "num_hidden_layers": layers, "num_attention_heads": hidden // 128,
            "num_key_value_heads": max(1, hidden // 512), "vocab_size": VOCAB, "rms_norm_eps": 1e-5,
            "rope_theta": 100000.0, "tie_word_embeddings": True, "max_position_embeddings": 8192,
            "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}


def nemotron_h_config(hidden: int, layers: int, intermediate: int) -> dict[str, Any]:
    """NemotronH's layout at a smaller size: Mamba-2 and latent-MoE layers alternating, one attention layer in
    eight (Nemotron-3-Super's 88 layers hold 8), 16 routed experts of `intermediate` / 4, top-4."""
    pattern = "".join("*" if i % 8 == 3 else "M" if i % 2 == 0 else "E" for i in range(layers))
    return {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": VOCAB,
            "hidden_size": hidden, "hybrid_override_pattern": pattern, "tie_word_embeddings": False,
            "layer_norm_epsilon": 1e-5, "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2,
            "num_attention_heads": hidden // 128, "num_key_value_heads": 2, "head_dim": 128,
            "attention_bias": False, "mamba_num_heads": hidden // 32, "mamba_head_dim": 64, "n_groups": 8,
            "ssm_state_size": 128, "conv_kernel": 4, "chunk_size": 128, "mamba_hidden_act": "silu",
            "use_conv_bias": True, "use_bias": False, "time_step_min": 0.001, "time_step_max": 0.1,
            "mamba_ssm_cache_dtype": "float32", "n_routed_experts": 16, "num_experts_per_tok": 4,
            "moe_intermediate_size": intermediate // 4, "moe_shared_expert_intermediate_size": intermediate // 2,
            "n_shared_experts": 1, "moe_latent_size": hidden // 2, "routed_scaling_factor": 1.0, "n_group": 1,
            "topk_group": 1, "norm_topk_prob": True, "intermediate_size": intermediate, "mlp_hidden_act": "relu2",
            "mlp_bias": False}


FAMILIES = {"llama": llama_config, "nemotron-h": nemotron_h_config}


def write_parent(folder: Path, config: dict[str, Any], tokenizer: Path) -> int:
    """A random model of `config` in BF16 (std 0.02 matrices, unit norms), written one layer per shard, with
    `tokenizer`'s files (SmolLM2's: 49,152 tokens); its parameter count."""
    from tailor.compressor.model.architecture import architecture_from_config
    from tailor.compressor.model.checkpoint import settings_from_config
    from tailor.compressor.model.lazy import LazyDecoder, sharded_checkpoint
    from tailor.compressor.model.modeling import Decoder

    arch = architecture_from_config(config, "bench parent")
    with torch.device("meta"):
        skeleton = Decoder(arch, settings_from_config(config, "bench parent"))
    tied = arch.tie_word_embeddings
    shapes = {name: tuple(t.shape) for name, t in skeleton.state_dict().items()
              if not (tied and name == "lm_head.weight")}
    generator = torch.Generator().manual_seed(0)

    def tensor(name: str) -> torch.Tensor:
        if name.endswith("norm.weight") or name.endswith("norm_f.weight"):
            return torch.ones(shapes[name], dtype=torch.bfloat16)
        if name.endswith("e_score_correction_bias"):
            return torch.zeros(shapes[name])
        return (torch.randn(shapes[name], generator=generator) * 0.02).to(torch.bfloat16)

    layers = f"{skeleton.body}.layers."
    groups = [[n for n in shapes if n.startswith(f"{layers}{i}.")] for i in range(len(arch.blocks))]
    groups.append([n for n in shapes if not n.startswith(layers)])
    with sharded_checkpoint(folder, config, tokenizer, len(groups)) as writer:
        for names in groups:
            writer.add({name: tensor(name) for name in names}, as_stored=True)
    LazyDecoder(folder)  # reads back: every tensor the config needs is there
    return arch.total_params


def plan_for(parent: Path, family: str, budget_gib: float, params: float, device: str, text: str,
             scale: int = 1) -> dict[str, Any]:
    """The bench's plan; `scale` multiplies its sequence length and every token budget."""
    library = ({"ffnWidths": [0.5], "kvHeads": [], "noOp": True} if family == "llama" else
               {"ffnWidths": [0.5], "mambaHeads": [0.5], "mambaHeadDims": [], "ssmStates": [0.75],
                "expertWidths": [0.5], "expertsKept": [], "topK": [], "noOp": True})
    return {"parent": str(parent), "data": {"seqLen": 64 * scale, "text": text}, "device": device,
            "target": {"gpu": "cpu", "params": params, "context": 128, "costs": "roofline"},
            "library": library,
            "bld": {"tokens": 512 * scale, "lr": 0.001, "batch": 4}, "bldActivationTokens": 512 * scale,
            "scoringTokens": 64 * scale, "evalTokens": 128 * scale,
            "gkd": {"tokens": 256 * scale, "lr": 0.0001, "batch": 4}, "measureTokens": 4, "budgetGiB": budget_gib}


def predicted(plan: Path, ranks: int, budget_gib: float, gpu: str) -> dict[str, int]:
    """The dry run's peak per stage for this plan on `ranks` ranks of the `gpu` profile."""
    result = subprocess.run([sys.executable, "-m", "tailor.cli.main", "compress", "--config", str(plan), "--dry-run",
                             "--gpu", gpu, "--gpus", str(ranks), "--memory-budget", str(budget_gib), "--json"],
                            capture_output=True, text=True, check=False)
    return {need["stage"]: need["peak_bytes"] for need in json.loads(result.stdout)["stages"]}


def quantize(child: Path, parent: Path, work: Path, device: str) -> dict[str, dict[str, float]]:
    """`tailor quantize` (FP8, KL to the parent too) on the child, in a process of its own: its peaks per stage.
    The quality gate (`tailor evaluate`) streams two models through the same code as quantization's evaluation,
    which streams three; it is not run here because it refuses a random parent (no held-out token predicted)."""
    quantized = work / "child-fp8"
    subprocess.run([sys.executable, "-m", "tailor.cli.main", "quantize", "--model", str(child), "--out",
                    str(quantized), "--format", "fp8", "--parent", str(parent), "--device", device], check=True,
                   stdout=subprocess.DEVNULL)
    report = json.loads((quantized / "quantization.json").read_text())
    return {f"quantize.{stage}": {**peaks, "seconds": report["stage_seconds"][stage]}
            for stage, peaks in report["peak_memory_bytes"].items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    parser.add_argument("--hidden", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=72)
    parser.add_argument("--intermediate", type=int, default=6144)
    parser.add_argument("--budget-gib", type=float, default=1.6)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--params", type=float, default=0.4, help="the child's share of the parent's parameters")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (one rank per GPU)")
    parser.add_argument("--tokenizer", type=Path, help="a folder with tokenizer.json (default: SmolLM2's, fetched)")
    parser.add_argument("--text", default="shakespeare", help="data.text of the plan: 'shakespeare' or a folder")
    parser.add_argument("--scale", type=int, default=1, help="multiplies the plan's sequence length (64) and every "
                                                             "token budget")
    parser.add_argument("--work", type=Path, default=ROOT / "build" / "bench-compress-memory")
    parser.add_argument("--keep-work", action="store_true", help="keep the work folder (parent, stages, children: "
                                                                 "some 20 GB at the default size)")
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "compress_memory.json")
    args = parser.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    parent = args.work / "parent"
    print(f"[bench] writing a random {args.family} ({args.layers} layers, hidden {args.hidden})", file=sys.stderr)
    if args.tokenizer is None:
        from tailor.compressor import sources

        args.tokenizer = sources.fetch_parent()
    params = write_parent(parent, FAMILIES[args.family](args.hidden, args.layers, args.intermediate), args.tokenizer)
    parent_bytes = sum(f.stat().st_size for f in parent.glob("*.safetensors"))
    plan = args.work / "plan.yaml"
    plan.write_text(yaml.safe_dump(plan_for(parent, args.family, args.budget_gib, args.params, args.device,
                                            args.text, args.scale)))
    gpu = "cpu" if args.device == "cpu" else "H200-141GB"
    expected = predicted(plan, args.ranks, args.budget_gib, gpu)
    out = args.work / "out"
    started = time.monotonic()
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.ranks)] \
        if args.ranks > 1 else [sys.executable]
    subprocess.run([*launcher, "-m", "tailor.cli.main", "compress", "--config", str(plan), "--out", str(out)],
                   check=True)
    wall = time.monotonic() - started
    after = quantize(out / "child", parent, args.work, args.device)
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
    result = {"family": args.family, "scale": args.scale, "parent_params": params, "parent_bytes_bf16": parent_bytes,
              "parent_bytes_fp32": 4 * params,
              "budget_bytes": budget, "ranks": args.ranks, "device": args.device, "wall_seconds": wall,
              "child_params": report["child"]["params"], "child_perplexity": report["child"]["quality"]["perplexity"],
              "parent_perplexity": report["parent"]["quality"]["perplexity"], "kl_to_parent": report["kl_to_parent"],
              "stages": rows}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=2) + "\n")
    if not args.keep_work:
        shutil.rmtree(args.work)
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
