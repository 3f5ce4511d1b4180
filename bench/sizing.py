"""The seed table: parameters, NVFP4 weight bytes and 1M-token concurrency for Nemotron-3-Super and its
Puzzle-75B child on H100, H200 and B200, plus the runtime-reserve window the published H100 pair allows.

    .venv/bin/python bench/sizing.py [--out bench/results/sizing.json]

Pure arithmetic (no timing): the figures depend only on the configs, the recipe and the reserve.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tailor.compressor.model.architecture import load_architecture
from tailor.compressor.sizing.concurrency import Published, reserve_window, size
from tailor.compressor.sizing.costs import CostModel
from tailor.compressor.sizing.hardware import GpuCatalog, Precision
from tailor.compressor.sizing.memory import GB, GIB, KvDtype, RuntimeReserve, recipe_for, weight_bytes

PUBLISHED = {  # model: (total params, active params, NVFP4 weights GB, concurrent 1M requests on one H100)
    "nemotron-3-super-120b-a12b": (120.7e9, 12.8e9, 70.0, 1),
    "nemotron-3-puzzle-75b-a9b": (75.3e9, 9.3e9, 44.5, 8),
}
GPUS = ("H100-80GB", "H200-141GB", "B200-180GB")
CONTEXTS = {"1M = 10^6": 10**6, "1Mi = 2^20": 2**20}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results/sizing.json"))
    args = parser.parse_args()
    catalog, reserve = GpuCatalog.load(), RuntimeReserve()
    h100 = catalog.get("H100-80GB")
    published = []
    rows = []
    print(f"runtime reserve {reserve.gib} GiB per GPU; NVFP4 weights, FP8 KV cache, SSM state from the config\n")
    print(f"{'model':<28} {'params':>9} {'active':>8} {'NVFP4 GB':>9} {'published':>9}  "
          + "  ".join(f"{gpu + ' @' + label:>24}" for label in CONTEXTS for gpu in GPUS))
    for name, (total, active, weights_gb, h100_count) in PUBLISHED.items():
        arch = load_architecture(name)
        recipe = recipe_for(Precision.NVFP4, arch)
        concurrency = {label: {gpu: size(arch, catalog.get(gpu), tokens, recipe, KvDtype.FP8).concurrency_per_replica
                               for gpu in GPUS} for label, tokens in CONTEXTS.items()}
        published.append(Published(arch=arch, gpu=h100, context=10**6, recipe=recipe, kv_dtype=KvDtype.FP8,
                                   count=h100_count))
        row = {
            "model": name, "total_params": arch.total_params, "active_params": arch.active_param_count,
            "total_error": arch.total_params / total - 1, "active_error": arch.active_param_count / active - 1,
            "nvfp4_weight_gb": weight_bytes(arch, recipe) / GB, "published_weight_gb": weights_gb,
            "recipe": recipe.name, "published_h100_concurrency": h100_count, "concurrency": concurrency,
        }
        rows.append(row)
        print(f"{name:<28} {arch.total_params / 1e9:>8.2f}B {arch.active_param_count / 1e9:>7.2f}B "
              f"{row['nvfp4_weight_gb']:>9.2f} {weights_gb:>9.1f}  "
              + "  ".join(f"{concurrency[label][gpu]:>24}" for label in CONTEXTS for gpu in GPUS))
    low, high = reserve_window(published)
    window = {"low_gb": low / GB, "high_gb": high / GB, "low_gib": low / GIB, "high_gib": high / GIB,
              "default_gib": reserve.gib, "default_inside": low < reserve.bytes <= high}
    print(f"\nH100 reserve window for 1 and 8 at 10^6 tokens: ({window['low_gb']:.3f}, {window['high_gb']:.3f}] GB = "
          f"({window['low_gib']:.3f}, {window['high_gib']:.3f}] GiB; default {reserve.gib} GiB inside: "
          f"{window['default_inside']}")
    b200 = catalog.get("B200-180GB")
    speed = {}
    for name in PUBLISHED:
        arch = load_architecture(name)
        speed[name] = CostModel(b200, recipe_for(Precision.NVFP4, arch), KvDtype.FP8).decode_tokens_per_second(
            arch, batch=64, context=8192 + 32768)
    ratio = speed["nemotron-3-puzzle-75b-a9b"] / speed["nemotron-3-super-120b-a12b"]
    print(f"roofline decode throughput on one B200 (batch 64, 40K context): child / parent = {ratio:.2f}x "
          "(published on 8xB200: 2.03x)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"models": rows, "reserve_window": window,
                                    "b200_roofline_decode_ratio": ratio}, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0 if window["default_inside"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
