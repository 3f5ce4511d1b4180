"""`tailor size` as a user runs it: table, JSON, warnings on stderr, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tailor.cli.main import main
from tailor.cli.size import context_length


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["size", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_published_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--model", "nemotron-3-super-120b-a12b", "--model", "nemotron-3-puzzle-75b-a9b",
                         "--gpu", "H100", "--gpu", "B200", "--context", "1M", "--precision", "nvfp4",
                         "--kv-dtype", "fp8")
    assert code == 0
    rows = {line.split("  ")[0]: line.split() for line in out.splitlines()}
    assert rows["max concurrency per replica"][-4:] == ["1", "26", "8", "33"]
    assert "binding limit" in rows and "runtime reserve" in rows and "state per request" in rows
    assert "H100-80GB (hopper) has no native nvfp4 math" in err  # once, though two models ask
    assert err.count("H100-80GB (hopper)") == 1


def test_json_and_auto_choices(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--model", "smollm2-135m", "--gpu", "A100-40GB", "--gpu", "L40S", "--context", "8Ki",
                       "--concurrency", "100", "--json")
    assert code == 0
    a100, l40s = json.loads(out)
    assert (a100["recipe"], a100["kv_dtype"]) == ("bf16", "bf16")  # Ampere: no FP8
    assert (l40s["recipe"], l40s["kv_dtype"]) == ("fp8", "fp8")  # Ada: FP8, no NVFP4
    assert a100["context"] == 8192 and a100["replicas_for_target"] == 1


def test_a_config_file_with_a_missing_field(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}))
    code, _, err = run(capsys, "--model", str(config), "--gpu", "H100", "--context", "4096")
    assert code == 1
    assert f"{config}: field 'num_attention_heads' is required" in err


def test_unknown_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "--model", "smollm2-135m", "--gpu", "H300", "--context", "4096")
    assert code == 1
    assert "unknown GPU 'H300'; known profiles: H100-80GB" in err


@pytest.mark.parametrize("context", ["0", "-5", "1.5", "lots"])
def test_bad_context_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str], context: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["size", "--model", "smollm2-135m", "--gpu", "H100", f"--context={context}"])
    assert exit_info.value.code == 2
    assert "context" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "tokens"), [("4096", 4096), ("32k", 32_000), ("1M", 10**6), ("1Mi", 2**20),
                                              ("0.5M", 500_000), ("8Ki", 8192)])
def test_context_suffixes(text: str, tokens: int) -> None:
    assert context_length(text) == tokens


def test_the_cli_does_not_load_torch() -> None:
    code = ("import sys; from tailor.cli.main import main; main(['size', '--model', 'smollm2-135m', '--gpu', 'L4', "
            "'--context', '4096']); assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


@pytest.mark.parametrize(("args", "expected"), [
    (["--tp", "0"], "--tp must be a positive integer or auto, got '0'"),
    (["--tp", "16"], "tensor parallelism 16 needs more GPUs than a node has (8)"),
    (["--concurrency", "0"], "target concurrency must be positive"),
])
def test_bad_options_name_what_was_expected(capsys: pytest.CaptureFixture[str], args: list[str],
                                            expected: str) -> None:
    code, _, err = run(capsys, "--model", "smollm2-135m", "--gpu", "H100", "--context", "4096", *args)
    assert code == 1 and expected in err


def test_auto_tensor_parallel_finds_the_smallest_group(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--model", "nemotron-3-super-120b-a12b", "--gpu", "H100", "--context", "8k",
                       "--precision", "bf16", "--json")
    assert code == 0 and json.loads(out)[0]["tensor_parallel"] == 4  # 241 GB of BF16 weights
