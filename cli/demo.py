"""`tailor demo`: the devcluster, the Helm chart, a real compression of SmolLM2-135M served by Triton, and the
Nemotron-3 references sized on the simulated GPU pools (see tailor.devcluster.demo)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def _demo(args: argparse.Namespace) -> int:
    from tailor.devcluster.demo import Demo, summary
    from tailor.devcluster.log import log

    demo = Demo(out=args.out, preset=args.preset, timeout_s=args.timeout)
    demo.install()
    demo.stage_parent()
    names = demo.apply()
    bodies = demo.follow(names)
    answer = demo.ask(names[0], "local")
    report = summary(bodies, demo.artifacts(names[0]), answer, time.monotonic() - demo.started)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(report, indent=2) + "\n")
    print(render(report))
    log(f"wrote {args.out / 'summary.json'} and {args.out / 'pareto.png'} in {report['seconds']:.0f}s")
    return 0


def render(report: dict[str, Any]) -> str:
    """The summary as a person reads it."""
    parent, child, quant = report["parent"] or {}, report["child"] or {}, report["quantization"]
    quality = report["quality"] or {}
    lines = ["", f"== {report['model']}: compressed, quantized and served on this CPU ==",
             f"  parameters       {parent.get('params', 0) / 1e6:.1f}M -> {child.get('params', 0) / 1e6:.1f}M",
             f"  weight bytes     {json.dumps(quant)}",
             f"  quality retained {quality.get('retention', 0):.3f} ({quality.get('metric')}: parent "
             f"{quality.get('parentScore', 0):.4f}, child {quality.get('childScore', 0):.4f})",
             f"  answer           {report['answer']['prompt']}{report['answer']['answer']!r}",
             "", "== sizing per GPU pool ==",
             f"  {'model':<22} {'pool':<8} {'GPU':<24} {'GPUs/replica':>12} {'per GPU':>8} {'replicas':>8}"]
    for pool in report["pools"]:
        if pool.get("skipped"):
            lines.append(f"  {pool['model']:<22} {pool['name']:<8} skipped: {pool['skipped']}")
        else:
            lines.append(f"  {pool['model']:<22} {pool['name']:<8} {pool.get('gpuProduct', ''):<24} "
                         f"{pool.get('gpusPerReplica', 0):>12} {pool.get('concurrencyPerGpu', 0):>8} "
                         f"{pool.get('replicas', 0):>8}")
    return "\n".join(lines)


def add_parser(nouns: Any) -> None:
    parser = nouns.add_parser("demo", help="Tailor end to end on this machine: devcluster, chart, a real "
                                           "compression served by Triton, the Nemotron-3 references sized")
    parser.add_argument("--preset", choices=["default", "fast"], default="default",
                        help="fast: half the token budgets (a shorter wait, a lower-quality child)")
    parser.add_argument("--out", type=Path, default=Path("runs/demo"), help="where summary.json and pareto.png go")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for every model to be Ready")
    parser.set_defaults(run=_demo)
