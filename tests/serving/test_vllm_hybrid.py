"""A NemotronH Puzzle child served by Triton with vLLM (its CPU build), the way GPU pools serve the reference case:
`tailor compress` makes it from the dense tiny hybrid (Mamba-2, attention and MLP blocks: vLLM's CPU build runs
no MoE), with a library that offers every variant, so the options vLLM cannot load must be left out; the child's
config class (`configuration_nemotron_h_puzzle.py`, named in `auto_map`) is how vLLM reads its per-block sizes.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tailor.compressor.model.architecture import Attention, Mamba, Mlp, load_architecture
from tailor.compressor.puzzle.pipeline import compress
from tailor.compressor.puzzle.plan import Plan
from tailor.compressor.serving import client
from tailor.compressor.serving.generation import Generator
from tailor.compressor.serving.repository import VLLM_BACKEND, PackageSettings, package
from tailor.compressor.serving.server import RunningServer, triton_server
from tailor.compressor.sizing.engines import Engine, choose, vllm_cannot_load
from tailor.compressor.sizing.hardware import GpuCatalog, Precision
from tailor.compressor.tiny_hybrid import fetch_tiny_hybrid

from plans import tiny_plan
from served import decoder_greedy, vllm_greedy

CONTEXT = 512
BATCH = 4
NAME = "hybrid"
PROMPTS = ["ROMEO: But soft, what light through yonder window breaks?", "HAMLET: To be, or not to be,"]
# every kind of variant, including those vLLM cannot load (removed blocks, Mamba heads and head dims)
LIBRARY = {"mambaHeads": [0.5], "mambaHeadDims": [0.5], "ssmStates": [0.5], "ffnWidths": [0.5], "kvHeads": [1],
           "keepAttention": False, "noOp": True}
pytestmark = pytest.mark.timeout(900)  # `tailor compress` of the tiny hybrid, then a vLLM engine on two cores


@pytest.fixture(scope="module")
def child(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("hybrid-child") / "out"
    plan = tiny_plan(fetch_tiny_hybrid(dense=True), library=LIBRARY, engine="vllm", measureContext=64,
                     target={"gpu": "cpu", "throughput": None, "params": 0.995, "context": CONTEXT,
                             "costs": "roofline"})
    compress(Plan.model_validate(plan), out)
    return out / "child"


@pytest.fixture(scope="module")
def packaged(child: Path, tmp_path_factory: pytest.TempPathFactory) -> PackageSettings:
    return package(child, tmp_path_factory.mktemp("hybrid-package"), NAME, GpuCatalog.load().get("cpu"), CONTEXT,
                   max_batch_size=BATCH)


@pytest.fixture(scope="module")
def server(packaged: PackageSettings) -> Iterator[RunningServer]:
    repository = Path(packaged.engine_args["model"]).parents[2]  # type: ignore[index]
    with triton_server(repository, timeout=600) as running:
        yield running


def test_the_child_is_smaller_and_loadable_by_vllm(child: Path) -> None:
    arch, parent = load_architecture(child), load_architecture(fetch_tiny_hybrid(dense=True))
    assert arch.blocks != parent.blocks and arch.total_params < parent.total_params
    assert vllm_cannot_load(arch) == []
    assert all(isinstance(block.mixer or block.ffn, Attention | Mamba | Mlp) for block in arch.blocks)
    assert choose(GpuCatalog.load().get("cpu"), arch, Precision.BF16).engine is Engine.VLLM
    config = json.loads((child / "config.json").read_text())
    assert config["auto_map"] == {"AutoConfig": "configuration_nemotron_h_puzzle.NemotronHPuzzleConfig"}
    assert (child / "configuration_nemotron_h_puzzle.py").exists()
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"


def test_vllm_decodes_what_the_projects_decoder_decodes(child: Path, tmp_path: Path) -> None:
    """Greedy tokens of vLLM (fp32, its offline engine) and of the project's decoder (fp32) agree."""
    generator = Generator(child, CONTEXT, torch.float32)
    prompts = [generator.encode(text) for text in PROMPTS]
    (answer,) = vllm_greedy([child], prompts, 16, CONTEXT, tmp_path)
    assert answer == decoder_greedy(generator, prompts, 16)


def test_triton_serves_it_with_tailors_backend(server: RunningServer, packaged: PackageSettings) -> None:
    version = Path(packaged.engine_args["model"]).parent  # type: ignore[index]
    assert (version / "model.py").read_bytes() == VLLM_BACKEND.read_bytes()
    served = client.generate(server.grpc_url, NAME, PROMPTS[0], {"max_tokens": 8, "temperature": 0,
                                                                 "ignore_eos": True})
    assert (served.finish_reason, served.output_tokens) == ("length", 8) and served.text


def test_the_engines_own_concurrency_is_the_sizings(server: RunningServer, packaged: PackageSettings) -> None:
    """vLLM's own count of the requests its cache holds (attention pages padded to the Mamba state's page, and each
    request's Mamba state) is the sizing's, within 5%."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    reported = sum(float(line.rsplit(" ", 1)[1]) for line in lines
                   if line.startswith("tailor_engine_max_concurrency{") and f'model="{NAME}"' in line)
    assert abs(reported - packaged.max_batch_size) <= 0.05 * packaged.max_batch_size, reported
