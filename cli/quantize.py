"""`tailor quantize` (modelopt PTQ, exported as a standard checkpoint), `tailor checkpoint repair` (fix and check
such an export) and `tailor evaluate` (the quality gate)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

EXAMPLES = """examples:
  tailor quantize --model runs/smollm2/child --out runs/smollm2/child-fp8 --gpu H100      # auto: FP8 on Hopper
  tailor quantize --model runs/smollm2/child --out runs/smollm2/child-nvfp4 --gpu B200    # auto: NVFP4
  tailor quantize --model DIR --out DIR --format nvfp4-w4a16 --parent PARENT_DIR --json
  tailor quantize --model DIR --out DIR --gpu H100 --kv-cache fp8                 # FP8 weights and KV cache
  tailor quantize --model DIR --out DIR --gpu H100 --text corpus/ --heldout eval.jsonl   # your own text

The folder appears only when complete: weights, config.json with quantization_config,
hf_quant_config.json, the tokenizer and quantization.json (the report). NVFP4 layers are evaluated on CPU
by computing from the exported packed weights (`tailor.compressor.model.nvfp4`).
"""


def _quantize(args: argparse.Namespace) -> int:
    from tailor.cli.plans import corpus, needs, one_process, write_results
    from tailor.compressor import peaks
    from tailor.compressor.buildplan import BuildPlan
    from tailor.compressor.puzzle.pipeline import resolve_parent
    from tailor.compressor.quantize.pipeline import QuantizeJob, run
    from tailor.compressor.quantize.recipes import QuantFormat
    from tailor.compressor.sizing.hardware import GpuCatalog, GpuProfile

    one_process("quantize")
    peaks.map_large_allocations()  # this process streams models and trains nothing
    plan = BuildPlan.load(args.plan) if args.plan else None
    text = corpus(args, plan)
    gpu: GpuProfile | None
    if plan is not None:
        if plan.quantize is None:
            raise ValueError(f"{args.plan}: the build plan has no quantize step (precision {plan.precision.value})")
        gpu = plan.catalog().get(plan.target_gpu)
        job = QuantizeJob(model=Path(plan.layout.child), out=Path(plan.layout.quantized),
                          format=QuantFormat(plan.quantize.format), kv_cache=plan.kv_cache_dtype,
                          parent=resolve_parent(plan.parent), corpus=text,
                          calibration_tokens=plan.quantize.calibration_tokens, eval_tokens=plan.quantize.eval_tokens,
                          device=args.device)
    else:
        needs(args, "model", "out")
        gpu = GpuCatalog.load(args.profiles).get(args.gpu) if args.gpu else None
        job = QuantizeJob(model=resolve_parent(args.model), out=args.out, format=args.format, kv_cache=args.kv_cache,
                          parent=resolve_parent(args.parent) if args.parent else None, corpus=text,
                          calibration_tokens=args.calibration_tokens, eval_tokens=args.eval_tokens,
                          device=args.device)
    report = run(job, gpu)
    write_results(report.result(), args.result_file, plan, "quantize")
    print(report.model_dump_json(indent=2) if args.json else report.markdown())
    return 0


def _checkpoint(args: argparse.Namespace) -> int:
    from tailor.compressor.model.checkpoint import load_decoder
    from tailor.compressor.model.fp8 import Fp8Linear
    from tailor.compressor.model.nvfp4 import Nvfp4Linear
    from tailor.compressor.quantize.ptq import repair_export

    for repair in repair_export(args.folder):
        print(f"repaired: {repair}", file=sys.stderr)
    model = load_decoder(args.folder)  # raises, naming the file, if tensors and config still disagree
    print(json.dumps({"folder": str(args.folder), "parameters": sum(p.numel() for p in model.parameters()),
                      "quantized_layers": sum(isinstance(m, Fp8Linear | Nvfp4Linear) for m in model.modules())}))
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from tailor.cli.plans import corpus, needs, one_process, write_results
    from tailor.compressor import peaks
    from tailor.compressor.buildplan import BuildPlan
    from tailor.compressor.evaluation import evaluate
    from tailor.compressor.puzzle.pipeline import resolve_parent

    one_process("evaluate")
    peaks.map_large_allocations()  # this process streams models and trains nothing
    plan = BuildPlan.load(args.plan) if args.plan else None
    if plan is not None:
        model, parent = plan.checkpoint, plan.parent
        min_retention, eval_tokens = plan.evaluate.min_retention, plan.evaluate.eval_tokens
    else:
        needs(args, "model", "parent")
        model, parent, min_retention, eval_tokens = args.model, args.parent, args.min_retention, args.eval_tokens
    result = evaluate(resolve_parent(model), resolve_parent(parent), min_retention, corpus(args, plan),
                      eval_tokens=eval_tokens)
    write_results(result, args.result_file, plan, "evaluate")
    print(result.model_dump_json(indent=2))
    verdict = "passed" if result.passed else "FAILED"
    print(f"quality gate {verdict}: retention {result.retention:.4f} (floor {result.min_retention})", file=sys.stderr)
    return 0


def add_parser(nouns: Any) -> None:
    from tailor.cli.plans import add_corpus_flags
    from tailor.compressor.quantize.recipes import QuantFormat
    from tailor.compressor.sizing.memory import KvDtype

    parser = nouns.add_parser("quantize", help="quantize a model (NVFP4, FP8) with modelopt and export it",
                              epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", type=Path, help="a build plan (what the operator's Jobs read); it sets the "
                                                  "model, output, format, KV cache, GPU, parent, text and token "
                                                  "budgets")
    parser.add_argument("--model", help="model folder, or smollm2-135m / tiny-nemotron-h")
    parser.add_argument("--out", type=Path, help="the quantized checkpoint folder to write")
    parser.add_argument("--format", type=QuantFormat, choices=list(QuantFormat), default=QuantFormat.AUTO,
                        help="auto picks nvfp4 where the --gpu computes in it (Blackwell), else fp8")
    parser.add_argument("--kv-cache", type=KvDtype, choices=[KvDtype.BF16, KvDtype.FP8], default=KvDtype.BF16,
                        help="fp8: also calibrate and export FP8 KV-cache scales")
    parser.add_argument("--gpu", help="target GPU profile (e.g. H100, B200); needed by --format auto")
    parser.add_argument("--profiles", type=Path, help="YAML file overriding or adding GPU profiles")
    parser.add_argument("--parent", help="the parent's folder, to report KL to it too")
    parser.add_argument("--calibration-tokens", type=int, default=4096)
    parser.add_argument("--eval-tokens", type=int, default=4096)
    parser.add_argument("--device", default="auto", help="auto (the GPU where there is one), cpu, cuda or cuda:N: "
                                                         "the model is read and quantized a layer at a time on it")
    add_corpus_flags(parser)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--result-file", type=Path, help="also write a short JSON result here (a Job's "
                                                         "termination log)")
    parser.set_defaults(run=_quantize)

    checkpoint = nouns.add_parser("checkpoint", help="check quantized checkpoint folders")
    verbs = checkpoint.add_subparsers(dest="verb", required=True)
    check = verbs.add_parser("repair", help="repair a modelopt export's exclude_modules (e.g. the NemotronH "
                                            "sentinel), then load it to check every tensor")
    check.add_argument("folder", type=Path)
    checkpoint.set_defaults(run=_checkpoint)

    gate = nouns.add_parser("evaluate", help="the quality gate: a child's next-token accuracy against its parent's")
    gate.add_argument("--plan", type=Path, help="a build plan (what the operator's Jobs read): model, parent, "
                                                "floor, text and tokens from it")
    gate.add_argument("--model", help="the child (a Puzzle child, quantized or not)")
    gate.add_argument("--parent", help="the parent folder, or smollm2-135m / tiny-nemotron-h")
    gate.add_argument("--min-retention", type=float, default=0.97, help="share of the parent's accuracy to keep")
    gate.add_argument("--eval-tokens", type=int, default=4096)
    add_corpus_flags(gate)
    gate.add_argument("--result-file", type=Path, help="also write the JSON result here (a Job's termination log)")
    gate.set_defaults(run=_evaluate)
