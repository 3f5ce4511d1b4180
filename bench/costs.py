"""Roofline vs measured per-block latency for SmolLM2-135M block variants on this machine's device.

    .venv/bin/python bench/costs.py [--out bench/results/costs.json] [--plot bench/results/costs.png]

Calibrates the device first (BF16 GEMM peak and copy bandwidth), then times each variant with torch
(`tailor.compressor.measure`, fresh measurements in a temporary cache) and prints, per variant and
workload, the roofline from the built-in profile (`cpu` here, the matching GPU profile on CUDA), the
roofline from the calibrated peaks, the measurement, and measured / roofline. The ratios are the
figure: the absolute times move with the machine's load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from tailor.compressor import measure
from tailor.compressor.architecture import Attention, Linear, Mlp, NoOp, Part, load_architecture
from tailor.compressor.costs import CostModel, Phase, Workload
from tailor.compressor.hardware import GpuCatalog, Precision
from tailor.compressor.memory import RECIPES

WORKLOADS = [Workload(phase=Phase.DECODE, batch=1, context=512), Workload(phase=Phase.DECODE, batch=8, context=512),
             Workload(phase=Phase.PREFILL, batch=1, context=512)]


def variants(parent_attention: Attention, width: int) -> dict[str, Part]:
    """Puzzle's dense search space for one SmolLM2 layer (the parent first in each kind)."""
    found: dict[str, Part] = {}
    for kv in (3, 1):
        found[f"attention kv={kv}"] = parent_attention.model_copy(update={"num_kv_heads": kv})
    for share in (1.0, 0.75, 0.5, 0.25):
        found[f"ffn {share:.0%}"] = Mlp(intermediate_size=int(width * share), gated=True)
    found["linear"] = Linear()  # the same hidden x hidden map replaces attention or FFN
    found["no-op"] = NoOp()
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench/results/costs.json"))
    parser.add_argument("--plot", type=Path, default=Path("bench/results/costs.png"))
    args = parser.parse_args()

    arch = load_architecture("smollm2-135m")
    layer = arch.blocks[0]
    assert isinstance(layer.mixer, Attention) and isinstance(layer.ffn, Mlp)
    dev = measure.device()
    name = measure.device_name(dev)
    catalog = GpuCatalog.load()
    builtin = catalog.get("cpu") if dev.type == "cpu" else catalog.get("H200" if "H200" in name else "H100")
    print(f"device: {name}; calibrating ...", flush=True)
    peaks = measure.calibrate(dev)
    calibrated = builtin.model_copy(update={"bandwidth_gbps": peaks["bandwidth_gbps"],
                                            "tflops": {Precision.BF16: peaks["tflops_bf16"]}})
    print(f"calibrated: {peaks['tflops_bf16']:.3f} TFLOPS BF16, {peaks['bandwidth_gbps']:.1f} GB/s "
          f"(profile {builtin.name}: {builtin.tflops[Precision.BF16]} TFLOPS, {builtin.bandwidth_gbps} GB/s)\n")
    models = {"profile": CostModel(builtin, RECIPES["bf16"]), "calibrated": CostModel(calibrated, RECIPES["bf16"])}
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        timer = measure.MeasuredCosts(cache_file=Path(scratch) / "costs.json", dev=dev)
        print(f"{'variant':<18} {'workload':<22} {'profile ms':>10} {'calib. ms':>10} {'measured ms':>11} "
              f"{'meas/prof':>9} {'meas/calib':>10} bound")
        for work in WORKLOADS:
            label = f"{work.phase} b={work.batch} L={work.context}"
            for variant, part in variants(layer.mixer, layer.ffn.intermediate_size).items():
                if isinstance(part, NoOp):
                    continue
                roof = {key: model.part_cost(part, arch.hidden_size, work) for key, model in models.items()}
                seconds = timer.seconds(part, arch.hidden_size, work)
                row = {"variant": variant, "workload": label, "phase": work.phase.value, "measured_s": seconds,
                       "profile_s": roof["profile"].seconds, "calibrated_s": roof["calibrated"].seconds,
                       "bound": roof["calibrated"].bound}
                rows.append(row)
                profile_s, calibrated_s = roof["profile"].seconds, roof["calibrated"].seconds
                print(f"{variant:<18} {label:<22} {profile_s * 1e3:>10.4f} {calibrated_s * 1e3:>10.4f} "
                      f"{seconds * 1e3:>11.4f} {seconds / profile_s:>9.2f} {seconds / calibrated_s:>10.2f} "
                      f"{row['bound']}", flush=True)
    summary = {}
    for phase in Phase:
        ratios = [r["measured_s"] / r["calibrated_s"] for r in rows if r["phase"] == phase.value]
        summary[phase.value] = {"median_measured_over_calibrated": statistics.median(ratios),
                                "min": min(ratios), "max": max(ratios)}
        print(f"\n{phase.value}: measured / calibrated roofline median {statistics.median(ratios):.2f}x "
              f"(range {min(ratios):.2f}-{max(ratios):.2f})", end="")
    print()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": name, "calibration": peaks, "profile": builtin.name, "rows": rows,
                                    "summary": summary}, indent=2) + "\n")
    _plot(rows, args.plot, name)
    print(f"wrote {args.out} and {args.plot}")
    return 0


def _plot(rows: list[dict[str, object]], path: Path, device: str) -> None:
    figure, axes = plt.subplots(figsize=(6.5, 5.5))
    for phase, marker in (("decode", "o"), ("prefill", "s")):
        picked = [r for r in rows if r["phase"] == phase]
        axes.scatter([float(r["calibrated_s"]) * 1e3 for r in picked],  # type: ignore[arg-type]
                     [float(r["measured_s"]) * 1e3 for r in picked], marker=marker, label=phase)  # type: ignore[arg-type]
    values = [float(r[key]) * 1e3 for r in rows for key in ("calibrated_s", "measured_s")]  # type: ignore[arg-type]
    line = [min(values) / 2, max(values) * 2]
    axes.plot(line, line, "k--", linewidth=0.8, label="measured = roofline")
    axes.set(xscale="log", yscale="log", xlabel="roofline (calibrated) ms", ylabel="measured ms",
             title=f"SmolLM2-135M block variants\n{device}")
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
