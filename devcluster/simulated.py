"""Stage results for the devcluster's simulated GPU pools, where kwok (not a GPU) finishes the stage Jobs.

No GPU runs here, so a CompressedModel aimed at an H100 or B200 pool cannot really be compressed on this
machine. kwok ends its Job pods with the termination message named by a pod annotation (the
`devcluster.tailor.dev/result-<stage>` stages of kwok-stages.yaml); these are the messages of the published
case: Nemotron-3-Super (120.7B / 12.8B active) compressed to the Puzzle-75B child (75.3B / 9.3B) and
quantized to NVFP4; a package Job's has no code digests to check (kwok runs the pods); a speed Job's says it
measured nothing. The operator then sizes and deploys that child on
every pool for real, from the child's config.json, as it would after real Jobs.
"""

from __future__ import annotations

import json

from tailor.compressor.model.architecture import MODELS_DIR
from tailor.compressor.results import (
    CompressResult,
    GateResult,
    PackageResult,
    QuantizeResult,
    SpeedResult,
    pack_config,
)

PUBLISHED_CHILD = MODELS_DIR / "nemotron-3-puzzle-75b-a9b.json"
RESULT_ANNOTATION = "devcluster.tailor.dev/result-{stage}"
SIMULATED = ("devcluster canned figures of the published Puzzle-75B case (devcluster/simulated.py); kwok ended "
             "the pod, no GPU ran this stage")


def published_results(passed: bool = True) -> dict[str, str]:
    """Pod annotations carrying each stage's result: the Puzzle-75B child, NVFP4, a gate verdict (`passed`
    False: retention 0.83, below a 0.97 floor)."""
    child = json.loads(PUBLISHED_CHILD.read_text())
    compress = CompressResult(child="/artifacts/published/g1/compress/child", params=75_350_000_000,
                              active_params=9_310_000_000, parent_params=120_670_000_000,
                              parent_active_params=12_770_000_000, pattern="M" * 88, predicted_speedup=2.0,
                              kl_to_parent=0.1, config=pack_config(child), simulated=SIMULATED)
    quantize = QuantizeResult(checkpoint="/artifacts/published/g1/quantized", recipe="nvfp4-mamba-moe",
                              quant_algo="NVFP4", kv_cache_quant_algo="FP8", weight_bytes=44_950_000_000,
                              kl_to_unquantized=0.01, simulated=SIMULATED)
    gate = GateResult(parent_score=0.60, child_score=0.59 if passed else 0.50,
                      retention=0.59 / 0.60 if passed else 0.50 / 0.60, min_retention=0.97, passed=passed,
                      parent_perplexity=5.0, child_perplexity=5.2, kl_to_parent=0.1, tokens=4096,
                      simulated=SIMULATED)
    speed = SpeedResult(gpu="simulated", context=1, max_num_seqs=1, new_tokens=1, rounds=0,
                        skipped="not measured: a simulated pool (kwok ended the speed Job's pod; no GPU or engine ran)",
                        simulated=SIMULATED)
    package = PackageResult(code={}, simulated=SIMULATED)  # kwok runs the pool's pods: no code to check
    return {RESULT_ANNOTATION.format(stage=r.stage): r.message() for r in (compress, quantize, gate, package, speed)}
