"""How steady the measured-cost calibration is on this machine: SmolLM2-135M's decode step against its blocks,
calibrated `--repeats` times in a row (each with a cost cache of its own, so every timing is fresh), as
`tailor compress` does before a search on measured costs (`compressor/puzzle/calibration.py`).

    .venv/bin/python bench/calibration.py            # about 15 s on 2 cores

Prints each calibration (step, blocks, the rest, the fixed cost and what each block adds, spread, whether it was
refused) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from tailor.compressor import sources
from tailor.compressor.model.checkpoint import load_decoder
from tailor.compressor.puzzle.calibration import CalibrationError, calibrate
from tailor.compressor.puzzle.measure import MeasuredCosts
from tailor.compressor.sizing.costs import Phase, Workload

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "calibration.json")
    args = parser.parse_args()
    model = load_decoder(sources.fetch_parent()).eval()
    work = Workload(phase=Phase.DECODE, batch=args.batch, context=args.context)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for attempt in range(args.repeats):
            timer = MeasuredCosts(cache_file=Path(scratch) / f"costs{attempt}.json")
            started = time.monotonic()
            try:
                found = calibrate(model, timer, work, lambda line: print(line, file=sys.stderr))
                rows.append({**found.model_dump(), "refused": None, "seconds": time.monotonic() - started})
            except CalibrationError as error:
                rows.append({"refused": str(error), "seconds": time.monotonic() - started})
    print(f"{'step ms':>8} {'blocks ms':>10} {'rest ms':>8} {'fixed ms':>9} {'per block ms':>13} {'head ms':>8} "
          f"{'spread':>7} {'pairs':>6}  refused")
    for row in rows:
        if row["refused"]:
            print(f"{'-':>8} {'-':>10} {'-':>8} {'-':>9} {'-':>13} {'-':>8} {'-':>7} {'-':>6}  {row['refused']}")
            continue
        print(f"{row['step_s'] * 1e3:>8.2f} {row['blocks_s'] * 1e3:>10.2f} {row['rest_s'] * 1e3:>8.2f} "
              f"{row['fixed_s'] * 1e3:>9.2f} {row['per_block_s'] * 1e3:>13.3f} {row['head_s'] * 1e3:>8.2f} "
              f"{row['spread']:>7.1%} {row['rounds']:>6}  no")
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps({"batch": args.batch, "context": args.context, "calibrations": rows},
                                       indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
