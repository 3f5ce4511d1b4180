"""The README's main command, `tailor demo` (fast preset), end to end on the devcluster: the chart installed,
SmolLM2-135M really compressed, quantized, gated and served by Triton through the operator, and the Nemotron-3
references sized on the simulated GPU pools."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from tailor.devcluster import cluster, demo

from conftest import delete_models


@pytest.mark.timeout(1800)
def test_demo(devcluster: cluster.Layout, api: client.ApiClient, helm: Callable[..., Any], tmp_path: Path) -> None:
    out = tmp_path / "demo"
    try:
        done = subprocess.run([sys.executable, "-m", "tailor.cli.main", "demo", "--preset", "fast", "--out", str(out)],
                              capture_output=True, text=True, timeout=1700)
        assert done.returncode == 0, f"{done.stdout[-6000:]}\n{done.stderr[-3000:]}"
        assert "Triton answer" in done.stdout and "sizing per node pool" in done.stdout
        report = json.loads((out / "summary.json").read_text())
        parent, child, quantized = report["parent"], report["child"], report["quantized"]
        assert parent["params"] == 134_515_008 and child["params"] < parent["params"]
        assert quantized["recipe"] == "fp8" and quantized["bytes"] < 0.7 * child["bf16_bytes"]
        assert report["quality_gate"]["passed"] is True and report["quality_gate"]["retention"] >= 0.6
        assert report["speedup"]["predicted"] >= 1.2 * 0.99  # the search met the example's 1.2x target
        assert report["speedup"]["measured"] > 0  # timed on this shared machine: recorded, not compared
        answer = report["answer"]
        assert answer["tokens"] > 0 and answer["answer"].strip()
        # the local pool serves the BF16 child with vLLM's CPU build (it has no FP8 kernels here), and says so
        assert answer["engine"] == "vllm" and "BF16 child" in " ".join(answer["notes"])
        assert abs(answer["engine_concurrency"] - answer["predicted_concurrency"]) <= 0.05 * answer[
            "predicted_concurrency"]  # the engine's own KV-cache count agrees with the sizing
        assert set(report["stage_seconds"]) == {"Compress", "Quantize", "Evaluate", "Deploy"}
        pools = {(p["model"], p["name"]): p for p in report["pools"]}
        assert pools[("nemotron-super-h100", "h100")]["concurrencyPerGpu"] == 8  # the published 8 per H100
        assert pools[("nemotron-super-b200", "b200")]["gpuProduct"] == "NVIDIA-B200"
        assert pools[("smollm2-cpu", "local")]["readyReplicas"] == 1
        assert pools[("nemotron-super-h100", "h100")]["engine"] == "vllm"
        assert (out / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    finally:  # leave the devcluster as the other tests expect it: no demo models, no release
        delete_models(api, demo.NAMESPACE)
        helm("uninstall", demo.RELEASE, "-n", demo.SYSTEM, "--wait", check=False)
