"""`tailor size`: how many concurrent requests a model holds per GPU, replica and node."""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

from tailor.compressor.model.architecture import Architecture, builtin_models, load_architecture
from tailor.compressor.sizing.concurrency import Sizing, size, smallest_tensor_parallel
from tailor.compressor.sizing.hardware import GpuCatalog, GpuProfile, Precision, resolve_precision
from tailor.compressor.sizing.memory import (
    GB,
    RECIPES,
    KvDtype,
    QuantRecipe,
    RuntimeReserve,
    recipe_for,
    resolve_kv_dtype,
)

EXAMPLES = """examples:
  tailor size --model nemotron-3-puzzle-75b-a9b --gpu H100-80GB --context 1M
  tailor size --model nemotron-3-super-120b-a12b --model nemotron-3-puzzle-75b-a9b \\
      --gpu H100 --gpu H200 --gpu B200 --context 1M --precision nvfp4 --kv-dtype fp8
  tailor size --model ./checkpoint/config.json --gpu L40S --context 32k --concurrency 100 --json

context lengths take k/M suffixes (1M = 1,000,000 tokens) or Ki/Mi (1Mi = 1,048,576).
built-in models: """

_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "ki": 2**10, "mi": 2**20}


def context_length(text: str) -> int:
    """Tokens from '1048576', '32k', '1M' or '1Mi'."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]i?)?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"context {text!r} is not a number of tokens like 32768, 32k, 1M or 1Mi")
    tokens = float(match.group(1)) * _SUFFIXES[(match.group(2) or "").lower()]
    if tokens < 1 or tokens != int(tokens):
        raise argparse.ArgumentTypeError(f"context {text!r} must be a positive whole number of tokens")
    return int(tokens)


def add_parser(nouns: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = nouns.add_parser(
        "size", help="concurrent requests a model holds per GPU, replica and node at a context length",
        epilog=EXAMPLES + ", ".join(builtin_models()), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", action="append", required=True,
                        help="config.json, a checkpoint folder, or a built-in name (repeat to compare)")
    parser.add_argument("--gpu", action="append", required=True, help="GPU profile name or alias (repeatable)")
    parser.add_argument("--context", type=context_length, required=True, help="tokens per request")
    parser.add_argument("--precision", default="auto", choices=["auto", *Precision],
                        help="weights: auto = nvfp4 where native (Blackwell), else fp8 where native, else bf16")
    parser.add_argument("--recipe", choices=sorted(RECIPES), help="an explicit quantization recipe")
    parser.add_argument("--kv-dtype", default="auto", choices=["auto", *KvDtype],
                        help="KV cache: auto = fp8 where the GPU has FP8, else bf16")
    parser.add_argument("--ssm-dtype", choices=["float32", "bfloat16", "float16"],
                        help="Mamba SSM state dtype (default: the config's mamba_ssm_cache_dtype, else float32)")
    parser.add_argument("--tp", default="auto", help="tensor-parallel GPUs per replica, or auto (smallest that fits)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    parser.add_argument("--concurrency", type=int, help="total concurrent requests to serve: prints replicas")
    parser.add_argument("--reserve-gib", type=float, default=RuntimeReserve().gib,
                        help="runtime reserve per GPU in GiB (default %(default)s; see docs in memory.py)")
    parser.add_argument("--profiles", type=Path, help="YAML file overriding or adding GPU profiles")
    parser.add_argument("--json", action="store_true", help="print a JSON list, one object per model and GPU")
    parser.set_defaults(run=run)


def _one(args: argparse.Namespace, arch: Architecture, gpu: GpuProfile) -> Sizing:
    precision = resolve_precision(args.precision, gpu)
    recipe: QuantRecipe = RECIPES[args.recipe] if args.recipe else recipe_for(precision, arch)
    kv = resolve_kv_dtype(args.kv_dtype, gpu)
    reserve = RuntimeReserve(gib=args.reserve_gib)
    if args.tp == "auto":
        tp = smallest_tensor_parallel(arch, gpu, args.context, recipe, kv, reserve, args.gpus_per_node,
                                      args.ssm_dtype)
    elif args.tp.isdigit() and int(args.tp) > 0:
        tp = int(args.tp)
    else:
        raise ValueError(f"--tp must be a positive integer or auto, got {args.tp!r}")
    return size(arch, gpu, args.context, recipe, kv, reserve=reserve, tp=tp, gpus_per_node=args.gpus_per_node,
                target_concurrency=args.concurrency, ssm_dtype=args.ssm_dtype)


def _gb(value: int) -> str:
    return f"{value / GB:.2f} GB"


ROWS: list[tuple[str, Callable[[Sizing], str]]] = [
    ("model", lambda s: s.model),
    ("params total / active", lambda s: f"{s.total_params / 1e9:.2f}B / {s.active_params / 1e9:.2f}B"),
    ("GPU", lambda s: s.gpu),
    ("recipe", lambda s: s.recipe),
    ("KV cache / SSM state dtype", lambda s: f"{s.kv_dtype} / {s.ssm_dtype}"),
    ("context (tokens)", lambda s: f"{s.context:,}"),
    ("tensor parallel", lambda s: str(s.tensor_parallel)),
    ("weights per GPU", lambda s: _gb(s.footprint.weights)),
    ("KV cache per request", lambda s: _gb(s.footprint.kv_per_request)),
    ("state per request", lambda s: _gb(s.footprint.state_per_request)),
    ("runtime reserve", lambda s: _gb(s.footprint.reserve)),
    ("usable after reserve", lambda s: _gb(s.footprint.usable)),
    ("max concurrency per GPU", lambda s: f"{s.concurrency_per_gpu:g}"),
    ("max concurrency per replica", lambda s: str(s.concurrency_per_replica)),
    ("max concurrency per node", lambda s: f"{s.concurrency_per_node} ({s.replicas_per_node} replicas)"),
    ("binding limit", lambda s: str(s.binding)),
]


def render_table(results: list[Sizing]) -> str:
    rows = list(ROWS)
    if any(s.target_concurrency for s in results):
        rows.append(("replicas for target", lambda s: f"{s.replicas_for_target} for {s.target_concurrency}"))
    cells = [[label, *(cell(s) for s in results)] for label, cell in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(value.ljust(width) for value, width in zip(row, widths, strict=True)).rstrip()
                     for row in cells)


def run(args: argparse.Namespace) -> int:
    catalog = GpuCatalog.load(args.profiles)
    gpus = [catalog.get(name) for name in args.gpu]
    results = [_one(args, load_architecture(model), gpu) for model in args.model for gpu in gpus]
    for warning in dict.fromkeys(w for s in results for w in s.warnings):
        print(f"tailor: warning: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps([s.model_dump(mode="json") for s in results], indent=2))
    else:
        print(render_table(results))
    return 0
