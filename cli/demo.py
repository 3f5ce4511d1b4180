"""`tailor demo`: the devcluster, the Helm chart, a real compression of SmolLM2-135M served by Triton, and the
Nemotron-3 references sized on the simulated GPU pools (see tailor.devcluster.demo)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def _demo(args: argparse.Namespace) -> int:
    from tailor.devcluster.demo import Demo, render, summary
    from tailor.devcluster.log import log

    demo = Demo(out=args.out, preset=args.preset, timeout_s=args.timeout)
    demo.install()
    demo.stage_parent()
    names = demo.apply()
    bodies = demo.follow(names)
    answer = demo.ask(bodies[names[0]], "local")
    autoscaling = demo.autoscaling(bodies[names[0]], "local")
    served = demo.served_speedup(names[0])
    report = summary(bodies, demo.artifacts(bodies[names[0]]), answer, autoscaling, served,
                     time.monotonic() - demo.started)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(report, indent=2) + "\n")
    print(render(report))
    log(f"wrote {args.out / 'summary.json'} and {args.out / 'pareto.png'} in {report['seconds']:.0f}s")
    return 0


def add_parser(nouns: Any) -> None:
    parser = nouns.add_parser("demo", help="Tailor end to end on this machine: devcluster, chart, a real "
                                           "compression served by Triton, the Nemotron-3 references sized")
    parser.add_argument("--preset", choices=["fast", "example"], default="fast",
                        help="fast: half the example's token budgets (minutes on 2 cores, a child that keeps less "
                             "of the parent); example: the example's own budgets")
    parser.add_argument("--out", type=Path, default=Path("runs/demo"), help="where summary.json and pareto.png go")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds to wait for every model to be Ready")
    parser.set_defaults(run=_demo)
