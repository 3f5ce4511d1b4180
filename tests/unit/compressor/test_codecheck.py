"""The code a served model runs is checked against what its package Job wrote: the digests `tailor package`
hands back, and the image's shell and sha256sum running the check before the server starts (here: this
machine's, as in the Debian and Ubuntu images)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from pydantic import ValidationError

from tailor.compressor.results import MAX_CODE_FILES, PackageResult
from tailor.compressor.serving.codecheck import CODE_ENV, checked, digests
from tailor.compressor.serving.repository import package
from tailor.compressor.sizing.hardware import GpuCatalog


@pytest.fixture(scope="module")
def packaged(tiny_parent: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A claim's root holding a real vLLM package of the tiny parent, with a config class beside its config."""
    root = tmp_path_factory.mktemp("claim")
    parent = root / "parent"
    shutil.copytree(tiny_parent, parent)
    (parent / "configuration_tiny.py").write_text("class TinyConfig: ...\n")
    package(parent, root / "tailor" / "g1" / "package-h100", "m", GpuCatalog.load().get("H100"), 2048)
    return root


def serve(root: Path, code: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """The container's command as the operator writes it, with `echo` in place of tritonserver."""
    command, args, lines = checked(str(root), code, ["echo", "served"])
    return subprocess.run([*command, *args], env={**os.environ, CODE_ENV: lines}, capture_output=True, text=True,
                          timeout=30)


def test_the_digests_cover_the_code_a_served_model_runs_and_the_files_that_choose_it(packaged: Path) -> None:
    code = digests(packaged, [packaged / "tailor" / "g1" / "package-h100" / "repository"])
    model = "tailor/g1/package-h100/repository/m"
    assert sorted(code) == [f"{model}/1/checkpoint/config.json", f"{model}/1/checkpoint/configuration_tiny.py",
                            f"{model}/1/model.json", f"{model}/1/model.py", f"{model}/config.pbtxt"]
    assert PackageResult.model_validate_json(PackageResult(code=code).message()).code == code  # fits its message


def test_intact_code_is_served_and_changed_or_missing_code_is_not(packaged: Path) -> None:
    code = digests(packaged, [packaged / "tailor" / "g1" / "package-h100" / "repository"])
    intact = serve(packaged, code)
    assert (intact.returncode, intact.stdout) == (0, "served\n")
    model_py = packaged / "tailor" / "g1" / "package-h100" / "repository" / "m" / "1" / "model.py"
    original = model_py.read_bytes()
    try:
        model_py.write_bytes(original + b"\nimport os; os.system('curl evil')\n")
        changed = serve(packaged, code)
        assert changed.returncode == 3 and "served" not in changed.stdout
        assert "repository/m/1/model.py: FAILED" in changed.stderr and "not served" in changed.stderr
        model_py.unlink()
        missing = serve(packaged, code)
        assert missing.returncode == 3 and "model.py" in missing.stderr and "served" not in missing.stdout
    finally:
        model_py.write_bytes(original)
    assert serve(packaged, {}).returncode == 3, "no digests at all must not pass"


def test_a_package_result_is_bounded_and_stays_on_the_claim() -> None:
    digest = "0" * 64
    with pytest.raises(ValidationError, match="leaves the claim"):
        PackageResult(code={"tailor/../../etc/passwd": digest})
    with pytest.raises(ValidationError):
        PackageResult(code={"/etc/passwd": digest})
    with pytest.raises(ValidationError):
        PackageResult(code={"m/1/model.py\n0000  other": digest})  # one line per file, as sha256sum reads them
    with pytest.raises(ValidationError):
        PackageResult(code={"m/1/model.py": "not hex"})
    with pytest.raises(ValidationError, match="no code digests"):
        PackageResult(code={})
    with pytest.raises(ValidationError):
        PackageResult(code={f"m/{i}.py": digest for i in range(MAX_CODE_FILES + 1)})
    assert PackageResult(code={}, simulated="kwok").under("tailor/g1/package-h100") is None
    found = PackageResult(code={"a/x/m.py": digest, "ab/m.py": digest})
    assert found.under("a") == {"a/x/m.py": digest}
