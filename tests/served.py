"""The model the serving tests and the serving benchmark package: its name, sizing and the small Puzzle plan
that makes it from SmolLM2-135M; greedy decoding by vLLM and by the project's decoder, to compare them; the
series the chart's prometheus-adapter rules read."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import yaml

from tailor.compressor.serving.generation import GenerationRequest, Generator
from tailor.compressor.serving.server import VLLM_CPU_ENV, vllm_environment

REPO = Path(__file__).resolve().parents[1]
PROBE = Path(__file__).parent / "serving" / "vllm_probe.py"

NAME = "smollm2"
CONTEXT = 256
MAX_BATCH = 4
PLAN = {
    "parent": "smollm2-135m", "data": {"text": "shakespeare", "seqLen": 64},
    "target": {"gpu": "cpu", "precision": "bf16", "batch": 1, "context": 512, "throughput": 1.15,
               "costs": "roofline"},
    "library": {"ffnWidths": [0.5], "kvHeads": [1], "linear": False, "noOp": True},
    "bld": {"tokens": 2048, "lr": 0.0005, "batch": 8}, "bldActivationTokens": 1024, "scoringTokens": 128,
    "evalTokens": 512, "gkd": {"tokens": 1024, "lr": 0.0001, "batch": 8}, "measureTokens": 4, "solutions": 1,
}


def vllm_greedy(models: list[Path], prompts: list[list[int]], tokens: int, context: int,
                work: Path) -> list[list[list[int]]]:
    """vLLM's greedy continuations (fp32, its offline engine in its own environment) of each prompt, per model."""
    request = [{"model": str(folder), "max_model_len": context, "max_num_seqs": 4,
                "kv_cache_memory_bytes": 64 * 2**20, "prompts": prompts, "tokens": tokens} for folder in models]
    (work / "request.json").write_text(json.dumps(request))
    done = subprocess.run([str(vllm_environment() / "bin" / "python"), str(PROBE), str(work / "request.json")],
                          capture_output=True, text=True, env={**os.environ, **VLLM_CPU_ENV}, cwd=work, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line)["tokens"] for line in done.stdout.splitlines() if line.startswith("{")]


def decoder_greedy(generator: Generator, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """The project's Decoder's greedy continuation of each prompt, one prompt at a time."""
    found: list[list[int]] = []
    for ids in prompts:
        found.append([])
        generator.generate([GenerationRequest(ids=ids, max_tokens=tokens, ignore_eos=True)],
                           lambda _, token, __: found[-1].append(token))
    return found


def adapter_series(metrics: set[str]) -> dict[str, set[str]]:
    """The Prometheus series each of `metrics` (as the custom metrics API names them) is computed from, by the
    chart's prometheus-adapter rules: the series the rule selects and those its query names."""
    rules = yaml.safe_load((REPO / "charts" / "tailor" / "prometheus-adapter-values.yaml").read_text())
    found: dict[str, set[str]] = {}
    for rule in rules["rules"]["custom"]:
        name = rule["name"]["as"]
        if name in metrics:
            selected = re.search(r'__name__="([^"]+)"|^([a-z_:]+)\{', rule["seriesQuery"])
            assert selected is not None, rule["seriesQuery"]
            queried = set(re.findall(r"([a-z_]+:[a-z_]+)\{", rule["metricsQuery"]))
            found[name] = {selected.group(1) or selected.group(2)} | queried
    return found
