"""`tailor package`: a Triton repository sized for the checkpoint as it was exported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tailor.compressor.compute import ComputeDtype
from tailor.compressor.quantize.pipeline import QuantizeJob, run
from tailor.compressor.quantize.recipes import QuantFormat
from tailor.compressor.serving.repository import VLLM_BACKEND, package
from tailor.compressor.serving.server import backend_folder
from tailor.compressor.serving.speedup import package_pair, skipped
from tailor.compressor.sizing.engines import ENGINE_ARGS_FILE, MAX_BATCH_CAP, Engine
from tailor.compressor.sizing.hardware import GpuCatalog
from tailor.compressor.sizing.memory import KvDtype

BF16 = ComputeDtype.BFLOAT16


@pytest.fixture(scope="module")
def fp8_with_fp8_kv(tiny_parent: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("quantized") / "fp8-kv"
    run(QuantizeJob(model=tiny_parent, out=out, format=QuantFormat.FP8, kv_cache=KvDtype.FP8, seq_len=32,
                    calibration_tokens=256, eval_tokens=128), None)
    return out


def test_the_repository_is_sized_for_the_exported_precision_and_kv_cache(fp8_with_fp8_kv: Path,
                                                                         tmp_path: Path) -> None:
    h100 = GpuCatalog.load().get("H100")
    settings = package(fp8_with_fp8_kv, tmp_path / "pkg", "tiny", h100, 2048, mount="/models/pkg/repository")
    assert (settings.recipe, settings.sizing.kv_dtype, settings.kind) == ("fp8", KvDtype.FP8, "KIND_GPU")
    assert settings.max_batch_size == MAX_BATCH_CAP < settings.sizing.concurrency_per_replica
    model = tmp_path / "pkg" / "repository" / "tiny"
    assert 'backend: "python"' in (model / "config.pbtxt").read_text()
    assert (model / "1" / "model.py").read_bytes() == VLLM_BACKEND.read_bytes()
    assert f'ENGINE_ARGS_FILE = "{ENGINE_ARGS_FILE}"' in VLLM_BACKEND.read_text()  # where it reads model.json
    # the devcluster's tritonserver has the Python backend alone: it runs this same model.py
    assert [path.name for path in backend_folder(tmp_path / "backends").iterdir()] == ["python"]
    assert (model / "1" / "checkpoint" / "hf_quant_config.json").exists()  # vLLM reads the modelopt export as is
    vllm = json.loads((model / "1" / "model.json").read_text())
    assert vllm["model"] == "/models/pkg/repository/tiny/1/checkpoint" and vllm["kv_cache_dtype"] == "fp8"
    assert (vllm["max_num_seqs"], vllm["max_model_len"], vllm["block_size"]) == (MAX_BATCH_CAP, 2048, 16)
    given = {**vllm, "max_num_seqs": 8}  # a package Job's, from its build plan: written as they are
    planned = package(fp8_with_fp8_kv, tmp_path / "planned", "tiny", h100, 2048, max_batch_size=8,
                      sizing=settings.sizing, vllm_args=given)
    assert planned.engine_args == given == json.loads(
        (tmp_path / "planned" / "repository" / "tiny" / "1" / "model.json").read_text())
    fallback = package(fp8_with_fp8_kv, tmp_path / "fallback", "tiny", h100, 2048, engine=Engine.PYTHON)
    config = (tmp_path / "fallback" / "repository" / "tiny" / "config.pbtxt").read_text()
    assert fallback.engine_args is None and "kind: KIND_GPU" in config
    assert f"max_batch_size: {MAX_BATCH_CAP}" in config
    with pytest.raises(ValueError, match=r"--max-batch-size 1000 is above the \d+ requests of 1000000 tokens"):
        package(fp8_with_fp8_kv, tmp_path / "too-many", "tiny", h100, 1_000_000, max_batch_size=1000)
    assert not (tmp_path / "too-many").exists()


def test_the_speed_pair_is_two_models_with_the_same_engine_arguments(tiny_parent: Path, tmp_path: Path) -> None:
    """`tailor package --plan` for the measured pool: the child and the parent in one repository, each at
    max_num_seqs 16 and the pool's context; a Llama checkpoint is read without trust_remote_code. A pair that
    does not fit leaves an empty repository and says why, so the Triton beside `tailor speed` still starts."""
    h100 = GpuCatalog.load().get("H100")
    mount = "/models/m/g1/speed-h100/repository"
    assert package_pair(tiny_parent, tiny_parent, tmp_path / "pair", h100, 2048, 1, mount, BF16) is None
    repository = tmp_path / "pair" / "repository"
    assert sorted(p.name for p in repository.iterdir()) == ["child", "parent"] and skipped(tmp_path / "pair") is None
    args = {name: json.loads((repository / name / "1" / "model.json").read_text()) for name in ("child", "parent")}
    assert args["parent"]["model"] == f"{mount}/parent/1/checkpoint"
    for name, engine in args.items():
        assert (engine["max_num_seqs"], engine["max_model_len"], engine["trust_remote_code"]) == (16, 2048, False)
        assert (repository / name / "1" / "model.py").read_bytes() == VLLM_BACKEND.read_bytes()
    # one Triton loads both on the same GPU: together they never ask for more than it has (vLLM checks at start
    # that what each asks for is free), and each one's cache fits the half it asks for
    assert sum(engine["gpu_memory_utilization"] for engine in args.values()) <= 1
    alone = package(tiny_parent, tmp_path / "alone", "alone", h100, 2048, max_batch_size=16, mount=mount, dtype=BF16)
    assert alone.engine_args is not None
    assert all(engine["gpu_memory_utilization"] <= alone.engine_args["gpu_memory_utilization"] / 2
               and engine["kv_cache_memory_bytes"] <= h100.memory_bytes / 2 for engine in args.values())
    assert sorted(p.name for p in (tmp_path / "pair").iterdir()) == ["repository"]  # nothing half-written beside

    tiny = h100.model_copy(update={"memory_mib": 1})  # less than the weights
    reason = package_pair(tiny_parent, tiny_parent, tmp_path / "no-fit", tiny, 2048, 1, mount, BF16)
    assert reason is not None and reason.startswith("not measured: ") and "does not fit" in reason
    assert skipped(tmp_path / "no-fit") == reason and not any((tmp_path / "no-fit" / "repository").iterdir())
