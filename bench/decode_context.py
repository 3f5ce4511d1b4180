"""How one decode step's time grows with the context: a Mamba-2 mixer (a fixed recurrent state) against an
attention mixer (a KV cache that grows with every token), both at a built-in model's shapes, timed with torch on
this machine's device.

    .venv/bin/python bench/decode_context.py [--model nemotron-3-nano-30b-a3b] [--batch 1]
        [--contexts 256 4096 32768] [--out bench/results/decode_context.json]

Each mixer is timed as the Puzzle search times it (`tailor.compressor.puzzle.measure`, fresh measurements in a
temporary cache). The timings move with the machine's load; the figure is each step's time over its time at the
shortest context: near 1x for Mamba-2, growing with the context for attention. The unit tests check the rule
itself by counting what a step reads, not by timing it (tests/unit/compressor/puzzle/test_measure.py).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from tailor.compressor.model.architecture import Part, load_architecture
from tailor.compressor.puzzle import measure
from tailor.compressor.sizing.costs import Phase, Workload


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="nemotron-3-nano-30b-a3b", help="a built-in hybrid model")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 4096, 32768])
    parser.add_argument("--out", type=Path, default=Path("bench/results/decode_context.json"))
    args = parser.parse_args()

    arch = load_architecture(args.model)
    mixers: dict[str, Part] = {"mamba-2": arch.mamba_layers()[0], "attention": arch.attention_layers()[0]}
    contexts = sorted(args.contexts)
    dev = measure.device()
    name = measure.device_name(dev)
    print(f"device: {name}; {args.model} mixers, batch {args.batch}\n")
    print(f"{'mixer':<10} {'context':>8} {'decode ms':>10} {'x shortest':>10}")
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        timer = measure.MeasuredCosts(cache_file=Path(scratch) / "costs.json", dev=dev)
        for mixer, part in mixers.items():
            times = [timer.seconds(part, arch.hidden_size, Workload(phase=Phase.DECODE, batch=args.batch,
                                                                    context=context)) for context in contexts]
            for context, seconds in zip(contexts, times, strict=True):
                ratio = seconds / times[0]
                rows.append({"mixer": mixer, "context": context, "decode_s": seconds, "over_shortest": ratio})
                print(f"{mixer:<10} {context:>8} {seconds * 1e3:>10.4f} {ratio:>10.2f}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": name, "model": args.model, "batch": args.batch, "rows": rows},
                                   indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
