"""Every kind of checkpoint Tailor writes loads in the vLLM that serves it (serving.toml's version, whose engine
code is the CUDA build's byte for byte: tests/unit/test_serving_runtime.py): `vllm_load_check.py`, run in
`.venv-vllm`, has vLLM read each config and quantization config, resolve the architecture, build the model class
on the meta device and take every tensor of the checkpoint through the model's own `load_weights`. Also the kinds
vLLM's CPU build cannot run (NemotronH MoE, FP8 and NVFP4 kernels): built as an H100 would build them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from serving.vllm_load_check import safetensors_header

from tailor.compressor.serving.server import VLLM_CPU_ENV, vllm_environment
from tailor.devcluster.executor import free_port

from child_kinds import write_kinds

CHECK = Path(__file__).parent / "vllm_load_check.py"
FINDINGS = ("errors", "refused", "unmapped", "unfilled", "sizes", "dtypes")
pytestmark = pytest.mark.timeout(600)


def load_check(folders: list[Path]) -> dict[str, dict]:
    """vLLM's report on each folder, by folder name."""
    done = subprocess.run([str(vllm_environment() / "bin" / "python"), str(CHECK), *map(str, folders)],
                          capture_output=True, text=True, timeout=500, cwd=folders[0].parent,
                          env={**os.environ, **VLLM_CPU_ENV, "TAILOR_CHECK_PORT": str(free_port())})
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {Path(report["folder"]).name: report for report in reports}


@pytest.fixture(scope="module")
def kinds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_kinds(tmp_path_factory.mktemp("kinds"))


def test_vllm_loads_every_kind_of_checkpoint_tailor_writes(kinds: dict[str, Path]) -> None:
    assert sorted(kinds) == sorted(f"{kind}{suffix}" for kind in ("dense", "hybrid", "hybrid-moe")
                                   for suffix in ("", "-fp8", "-nvfp4", "-fp8-kv8"))
    reports = load_check(list(kinds.values()))
    assert {name: {k: report[k] for k in FINDINGS if report.get(k)} for name, report in reports.items()} == {
        name: {} for name in kinds}
    for name, report in reports.items():
        dense = name.startswith("dense")
        assert (report["architecture"], report["class"]) == (
            ("DeciLMForCausalLM", "DeciLMForCausalLM") if dense else
            ("NemotronHPuzzleForCausalLM", "NemotronHForCausalLM")), name
        assert report["quantization"] == {"": None, "fp8": "modelopt", "nvfp4": "modelopt_fp4"}[
            name.removeprefix("dense").removeprefix("hybrid-moe").removeprefix("hybrid").removesuffix(
                "-kv8").lstrip("-")], name
        assert report["parameters"] > 20


def _rename_tensor(folder: Path, old: str, new: str) -> None:
    """Rename one tensor in the safetensors header that holds it (same length, so the data offsets hold)."""
    assert len(old) == len(new)
    for path in folder.glob("*.safetensors"):
        length, header = safetensors_header(path)
        if old in header:
            data = path.read_bytes()
            renamed = data[8:8 + length].replace(f'"{old}"'.encode(), f'"{new}"'.encode())
            path.write_bytes(data[:8] + renamed + data[8 + length:])
            return
    raise AssertionError(f"no tensor {old} in {folder}")


def test_the_check_names_what_vllm_refuses_or_takes_in_part(kinds: dict[str, Path], tmp_path: Path) -> None:
    """A tensor no module has (vLLM's loader refuses it), and an FFN the config makes wider (refused: vLLM's
    loader cannot narrow) or narrower (taken in part, silently, by vLLM's loader: the sizes name it) than its
    weights, 96 wide."""
    renamed = tmp_path / "renamed"
    shutil.copytree(kinds["hybrid-moe-fp8"], renamed)
    _rename_tensor(renamed, "backbone.layers.4.mixer.up_proj.weight", "backbone.layers.4.mixer.up_xxxx.weight")
    for width in (128, 64):
        shutil.copytree(kinds["dense"], tmp_path / f"ffn{width}")
        config = json.loads((tmp_path / f"ffn{width}" / "config.json").read_text())
        config["block_configs"][0]["ffn"]["intermediate_size"] = width
        (tmp_path / f"ffn{width}" / "config.json").write_text(json.dumps(config))
    reports = load_check([renamed, tmp_path / "ffn128", tmp_path / "ffn64"])
    assert [line.split(": ")[:3] for line in reports["renamed"]["refused"]] == [[
        "backbone.layers.4.mixer.up_xxxx.weight [48, 64]", "ValueError",
        "There is no module or parameter named 'model.layers.4.mixer.up_xxxx' in NemotronHForCausalLM. The available "
        "parameters belonging to model.layers.4.mixer (NemotronHMLP) are"]]
    assert reports["renamed"]["unfilled"] == ["model.layers.4.mixer.up_proj.weight"]
    assert [line.split(" [")[0] for line in reports["ffn128"]["refused"]] == [
        f"model.layers.0.mlp.{name}_proj.weight" for name in ("down", "gate", "up")]
    assert reports["ffn64"]["refused"] == [] and reports["ffn64"]["sizes"] == [
        "model.layers.0.mlp.gate_up_proj.weight: 12288 values loaded, 8192 expected",
        "model.layers.0.mlp.down_proj.weight: 6144 values loaded, 4096 expected"]
