"""GKD's loss, forward and backward, measured against the dry run's terms for it: the peak resident set above the
step's start for one and two rows of a Llama (the 10x bench's shape by default), whose slope per row is what a row
costs: the activations saved for backward (`footprint.saved_bytes_per_token`, measured per part) and the KL's
[tokens, vocab] float32 temporaries, as many as the slope leaves room for (`footprint.GKD_KL_LOGITS`).

    .venv/bin/python bench/gkd_memory.py                 # ~1 min: hidden 1024, 8 layers, 640-token rows
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30


def one(rows: int, args: argparse.Namespace) -> dict[str, float]:
    """One loss in a fresh process (so no earlier step's heap is reused): its peak above the step's start."""
    import torch
    from compress_memory import llama_config  # type: ignore[import-not-found]

    from tailor.compressor import peaks
    from tailor.compressor.model.architecture import architecture_from_config
    from tailor.compressor.model.checkpoint import settings_from_config
    from tailor.compressor.model.modeling import Decoder
    from tailor.compressor.puzzle import gkd
    from tailor.compressor.puzzle.footprint import saved_bytes_per_token

    peaks.map_large_allocations()
    config = llama_config(args.hidden, args.layers, args.intermediate)
    arch = architecture_from_config(config, "bench")
    model = Decoder(arch, settings_from_config(config, "bench"))
    ids = torch.randint(0, arch.vocab_size, (rows, args.seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        states: list[torch.Tensor] = []
        logits = model(ids, states=states)
    peaks.release_freed_memory()
    peaks.reset()
    start = peaks.read()["rss"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = gkd.gkd_loss(model, ids, states, logits, 1.0)
    loss.backward()  # type: ignore[no-untyped-call]
    tokens = rows * args.seq
    return {"rows": rows, "peak_above_start": peaks.read()["rss"] - start,
            "saved_activations": tokens * saved_bytes_per_token(arch, args.seq),
            "logits_tensor": tokens * arch.vocab_size * 4}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=640)
    parser.add_argument("--rows", type=int, help=argparse.SUPPRESS)  # one measurement, in a process of its own
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results" / "gkd_memory.json")
    args = parser.parse_args()
    if args.rows is not None:
        print(json.dumps(one(args.rows, args)))
        return 0
    runs = [json.loads(subprocess.run([sys.executable, __file__, "--rows", str(rows), "--hidden", str(args.hidden),
                                       "--layers", str(args.layers), "--intermediate", str(args.intermediate),
                                       "--seq", str(args.seq)], capture_output=True, text=True,
                                      check=True).stdout.splitlines()[-1]) for rows in (1, 2)]
    per_row = runs[1]["peak_above_start"] - runs[0]["peak_above_start"]
    logits = (per_row - runs[0]["saved_activations"]) / runs[0]["logits_tensor"]
    result = {"runs": runs, "per_row_bytes": per_row, "kl_logits_tensors_per_row": logits,
              "shape": {k: getattr(args, k) for k in ("hidden", "layers", "intermediate", "seq")}}
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(result, indent=2) + "\n")
    for run in runs:
        print(f"{run['rows']} row(s) of {args.seq}: {run['peak_above_start'] / GIB:.3f} GiB above the step's start")
    print(f"a row costs {per_row / GIB:.3f} GiB: saved activations {runs[0]['saved_activations'] / GIB:.3f} "
          f"(modelled per part) + {logits:.1f} float32 [tokens, vocab] tensors of {runs[0]['logits_tensor'] / GIB:.3f}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())
