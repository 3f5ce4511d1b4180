"""A compressed and quantized SmolLM2 packaged for Triton, and real tritonservers serving it.

The model is made the way a user makes one: `tailor compress` with a small Puzzle plan (roofline costs on
the cpu profile, a small library and budgets, about a minute), `tailor quantize` to FP8, `tailor package`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tailor.compressor.puzzle.pipeline import compress
from tailor.compressor.puzzle.plan import Plan
from tailor.compressor.quantize.pipeline import QuantizeJob, run
from tailor.compressor.quantize.recipes import QuantFormat
from tailor.compressor.serving.repository import package
from tailor.compressor.serving.server import RunningServer, triton_server
from tailor.compressor.sizing.engines import Engine
from tailor.compressor.sizing.hardware import GpuCatalog

from served import CONTEXT, MAX_BATCH, NAME, PLAN


@pytest.fixture(scope="session")
def quantized_child(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("smollm2-served")
    (work / "plan.yaml").write_text(yaml.safe_dump(PLAN))
    compress(Plan.load(work / "plan.yaml"), work / "run")
    run(QuantizeJob(model=work / "run" / "child", out=work / "child-fp8", format=QuantFormat.FP8,
                    calibration_tokens=1024, eval_tokens=512), None)
    return work / "child-fp8"


@pytest.fixture(scope="session")
def packaged(quantized_child: Path) -> Path:
    out = quantized_child.parent / "package"
    package(quantized_child, out, NAME, GpuCatalog.load().get("cpu"), CONTEXT, engine=Engine.PYTHON,
            max_batch_size=MAX_BATCH)
    return out


@pytest.fixture(scope="session")
def streaming_package(quantized_child: Path) -> Path:
    out = quantized_child.parent / "package-stream"
    package(quantized_child, out, NAME, GpuCatalog.load().get("cpu"), CONTEXT, engine=Engine.PYTHON,
            max_batch_size=MAX_BATCH, decoupled=True)
    return out


@pytest.fixture(scope="session")
def server(packaged: Path) -> Iterator[RunningServer]:
    with triton_server(packaged / "repository") as running:
        yield running
