"""Roofline vs measured per-block latency of a model's block kinds, and of smaller variants of each, on this
machine's device.

    .venv/bin/python bench/costs.py                               # SmolLM2-135M's dense variants
    .venv/bin/python bench/costs.py --model small-nemotron-h \
        --out bench/results/costs_nemotron_h.json --plot bench/results/costs_nemotron_h.png
    bench/device/block_costs.sh                                    # on the device's GPU (see its README)

Calibrates the device first (BF16 GEMM peak and copy bandwidth), then times each variant with torch
(`tailor.compressor.puzzle.measure`, fresh measurements in a temporary cache) and prints, per variant and
workload, the roofline from the built-in profile (`cpu` here, the matching GPU profile on CUDA), the
roofline from the calibrated peaks, the measurement, and measured / roofline, then the median ratio per block
kind and phase. The ratios are the figure: the absolute times move with the machine's load. `--model` takes a
built-in model, a config.json, or `small-nemotron-h` (NemotronH's layout at hidden 1024: Mamba-2, attention,
a latent MoE of 16 experts top-4, as `bench/compress_memory.py` builds it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from tailor.compressor.model.architecture import (
    Architecture,
    Attention,
    Linear,
    Mamba,
    Mlp,
    Moe,
    NoOp,
    Part,
    architecture_from_config,
    load_architecture,
)
from tailor.compressor.model.device import compute_for, torch_dtype
from tailor.compressor.puzzle import measure
from tailor.compressor.sizing.costs import CostModel, Phase, Workload
from tailor.compressor.sizing.hardware import GpuCatalog, Precision
from tailor.compressor.sizing.memory import RECIPES

WORKLOADS = [Workload(phase=Phase.DECODE, batch=1, context=512), Workload(phase=Phase.DECODE, batch=8, context=512),
             Workload(phase=Phase.PREFILL, batch=1, context=512)]


def variants(arch: Architecture) -> dict[str, tuple[str, Part]]:
    """The first block part of each kind in `arch`, and smaller variants of it from Puzzle's search space:
    {label: (kind, part)}."""
    found: dict[str, tuple[str, Part]] = {}
    for block in arch.blocks:
        for part in block.parts():
            kind = type(part).__name__.lower()
            if any(k == kind for k, _ in found.values()) or isinstance(part, NoOp):
                continue
            smaller: dict[str, Part] = {"": part}
            if isinstance(part, Attention) and part.num_kv_heads > 1:
                smaller["kv=1"] = part.model_copy(update={"num_kv_heads": 1})
            elif isinstance(part, Mlp):
                smaller |= {f"{share:.0%}": part.model_copy(update={"intermediate_size": int(
                    part.intermediate_size * share) // 16 * 16}) for share in (0.75, 0.5, 0.25)}
            elif isinstance(part, Mamba):
                smaller["state/2"] = part.model_copy(update={"state_size": part.state_size // 2})
            elif isinstance(part, Moe):
                smaller["top-k/2"] = part.model_copy(update={"top_k": max(1, part.top_k // 2)})
                smaller["width/2"] = part.model_copy(update={"expert_width": part.expert_width // 2 // 16 * 16})
            found |= {f"{kind} {label}".strip(): (kind, variant) for label, variant in smaller.items()}
    found["linear"] = ("linear", Linear())  # the same hidden x hidden map replaces a mixer or an FFN
    return found


def model(name: str) -> tuple[str, Architecture]:
    if name == "small-nemotron-h":
        from compress_memory import nemotron_h_config  # type: ignore[import-not-found]
        return "NemotronH at hidden 1024", architecture_from_config(nemotron_h_config(1024, 8, 4096), name)
    arch = load_architecture(name)
    return Path(name).stem, arch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m",
                        help="a built-in model, a config.json, or small-nemotron-h (default: smollm2-135m)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/costs.json"))
    parser.add_argument("--plot", type=Path, help="a PNG of measured against roofline (none without it)")
    args = parser.parse_args()

    title, arch = model(args.model)
    dev = measure.device()
    name = measure.device_name(dev)
    catalog = GpuCatalog.load()
    builtin = catalog.get("cpu") if dev.type == "cpu" else catalog.get("H200" if "H200" in name else "H100")
    print(f"device: {name}; calibrating ...", flush=True)
    compute = compute_for(dev)  # the dtype the measured costs are timed in: BF16 only where it has math here
    peaks = measure.calibrate(dev, torch_dtype(compute))
    calibrated = builtin.model_copy(update={"bandwidth_gbps": peaks["bandwidth_gbps"],
                                            "tflops": {Precision.BF16: peaks["tflops"]}})
    print(f"calibrated: {peaks['tflops']:.3f} TFLOPS in {compute.describe()}, {peaks['bandwidth_gbps']:.1f} GB/s "
          f"(profile {builtin.name}: {builtin.tflops[Precision.BF16]} TFLOPS, {builtin.bandwidth_gbps} GB/s)\n")
    models = {"profile": CostModel(builtin, RECIPES["bf16"]), "calibrated": CostModel(calibrated, RECIPES["bf16"])}
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        timer = measure.MeasuredCosts(cache_file=Path(scratch) / "costs.json", dev=dev)
        print(f"{'variant':<18} {'workload':<22} {'profile ms':>10} {'calib. ms':>10} {'measured ms':>11} "
              f"{'meas/prof':>9} {'meas/calib':>10} bound")
        for work in WORKLOADS:
            label = f"{work.phase} b={work.batch} L={work.context}"
            for variant, (kind, part) in variants(arch).items():
                roof = {key: model.part_cost(part, arch.hidden_size, work) for key, model in models.items()}
                seconds = timer.seconds(part, arch.hidden_size, work)
                row = {"variant": variant, "kind": kind, "workload": label, "phase": work.phase.value,
                       "measured_s": seconds, "profile_s": roof["profile"].seconds,
                       "calibrated_s": roof["calibrated"].seconds, "bound": roof["calibrated"].bound}
                rows.append(row)
                profile_s, calibrated_s = roof["profile"].seconds, roof["calibrated"].seconds
                print(f"{variant:<18} {label:<22} {profile_s * 1e3:>10.4f} {calibrated_s * 1e3:>10.4f} "
                      f"{seconds * 1e3:>11.4f} {seconds / profile_s:>9.2f} {seconds / calibrated_s:>10.2f} "
                      f"{row['bound']}", flush=True)
    summary: dict[str, dict[str, float]] = {}
    print(f"\n{'kind':<10} {'phase':<8} {'measured / calibrated roofline':>30} "
          f"{'variant / full, measured / roofline':>36}")
    for kind in dict.fromkeys(r["kind"] for r in rows):
        for phase in Phase:
            mine = [r for r in rows if r["phase"] == phase.value and r["kind"] == kind]
            ratios = [r["measured_s"] / r["calibrated_s"] for r in mine]
            # what the search compares: a smaller variant's cost relative to the full part, by each reckoning
            relative = [(r["measured_s"] / first["measured_s"]) / (r["calibrated_s"] / first["calibrated_s"])
                        for r in mine for first in [next(f for f in mine if f["workload"] == r["workload"])]
                        if r is not first]
            summary[f"{kind} {phase.value}"] = {
                "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                **({"variant_over_full_median": statistics.median(relative)} if relative else {})}
            shown = f"{statistics.median(relative):.2f}x median ({min(relative):.2f}-{max(relative):.2f})" \
                if relative else "-"
            print(f"{kind:<10} {phase.value:<8} {statistics.median(ratios):>21.2f}x median ({min(ratios):.2f}-"
                  f"{max(ratios):.2f}) {shown:>36}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": title, "device": name, "calibration": peaks, "profile": builtin.name,
                                    "measured": "medians of single calls (measure.time_call)", "rows": rows,
                                    "summary": summary}, indent=2) + "\n")
    print(f"wrote {args.out}")
    if args.plot:
        _plot(rows, args.plot, f"{title}\n{name}")
        print(f"wrote {args.plot}")
    return 0


def _plot(rows: list[dict[str, object]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.5, 5.5))
    for phase, marker in (("decode", "o"), ("prefill", "s")):
        picked = [r for r in rows if r["phase"] == phase]
        axes.scatter([float(r["calibrated_s"]) * 1e3 for r in picked],  # type: ignore[arg-type]
                     [float(r["measured_s"]) * 1e3 for r in picked], marker=marker, label=phase)  # type: ignore[arg-type]
    values = [float(r[key]) * 1e3 for r in rows for key in ("calibrated_s", "measured_s")]  # type: ignore[arg-type]
    line = [min(values) / 2, max(values) * 2]
    axes.plot(line, line, "k--", linewidth=0.8, label="measured = roofline")
    axes.set(xscale="log", yscale="log", xlabel="roofline (calibrated) ms", ylabel="measured ms",
             title=title)
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
