"""Time the operator's compression fit check (`preflight.check_fits`, run before every build starts) on the H100
example (Nemotron-3-Super on 6 x 8 H100), for this checkout and, with `--baseline REV`, for that commit's, in turns.

    .venv/bin/python bench/fit_check.py [--baseline 48388fb] [--rounds 3] [--out bench/results/fit_check.json]

Each round times both (each in a fresh interpreter, the median of 7 calls after one warm-up), so the machine's
noise falls on both alike; prints and writes the milliseconds per round, their medians, the ratio, and the fit
summary of each (which must agree).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from baseline import REPO, baseline_path, remove_worktree

EXAMPLE = REPO / "examples" / "nemotron-super-h100.yaml"
TIMER = """
import statistics, sys, time
import yaml
from tailor.compressor.sizing.hardware import GpuCatalog
from tailor.operator import preflight
from tailor.operator.api import CompressedModelSpec
from tailor.operator.resolve import resolve

body = yaml.safe_load(open(sys.argv[1]))
body["metadata"].update(uid="bench", namespace="bench")
spec = CompressedModelSpec.model_validate(body["spec"])
plan = resolve(spec, body, 1, GpuCatalog.load(), 8, None)
preflight.check_fits(spec, plan)
times = []
for _ in range(7):
    started = time.perf_counter()
    fits = preflight.check_fits(spec, plan)
    times.append(time.perf_counter() - started)
print(statistics.median(times) * 1000)
print(preflight.summary(fits))
"""


def timed(pythonpath: Path | None) -> tuple[float, str]:
    env_path = [str(pythonpath)] if pythonpath else []
    command = [sys.executable, "-c", f"import sys; sys.path[:0] = {env_path!r}\n{TIMER}", str(EXAMPLE)]
    milliseconds, summary = subprocess.run(command, check=True, capture_output=True, text=True).stdout.split("\n", 1)
    return float(milliseconds), summary.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", help="a commit whose fit check is timed in turn with this checkout's")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "fit_check.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="tailor-bench-fit-") as scratch:
        before = baseline_path(args.baseline, Path(scratch)) if args.baseline else None
        try:
            runs: dict[str, list[float]] = {"current": [], **({"baseline": []} if before else {})}
            summaries: dict[str, str] = {}
            for round_ in range(args.rounds):
                for label, path in (("baseline", before), ("current", None)):
                    if label in runs:
                        milliseconds, summaries[label] = timed(path)
                        runs[label].append(round(milliseconds, 2))
                        print(f"round {round_ + 1}: {label} {milliseconds:.1f} ms", file=sys.stderr)
        finally:
            if before is not None:
                remove_worktree(Path(scratch))
    medians = {label: statistics.median(values) for label, values in runs.items()}
    report = {"example": EXAMPLE.name, "millisecondsPerRound": runs, "medianMilliseconds": medians,
              "summaries": summaries, "baselineCommit": args.baseline,
              "speedup": round(medians["baseline"] / medians["current"], 2) if before else None}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0 if len(set(summaries.values())) == 1 else 1  # the fit must not change with the speed


if __name__ == "__main__":
    sys.exit(main())
