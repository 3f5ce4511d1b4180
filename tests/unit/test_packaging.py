"""What `pip install tailor` (not editable: the images' install) holds: every module and data file of the four
folders. An editable install finds them all whatever pyproject.toml lists, so only this catches one left out."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"cli": "tailor/cli", "operator": "tailor/operator", "compressor": "tailor/compressor",
           "devcluster": "tailor/devcluster"}


def test_the_wheel_holds_every_module_and_data_file(tmp_path: Path) -> None:
    source = tmp_path / "source"  # a copy: setuptools' build folder in the checkout may hold an earlier build
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    "--wheel-dir", str(tmp_path), str(source)], check=True, cwd=tmp_path)
    (wheel,) = tmp_path.glob("tailor-*.whl")
    held = set(zipfile.ZipFile(wheel).namelist())
    wanted = {f"{FOLDERS[path.relative_to(ROOT).parts[0]]}/{Path(*path.relative_to(ROOT).parts[1:])}"
              for folder in FOLDERS for path in (ROOT / folder).rglob("*")
              if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"}
    assert sorted(wanted - held) == []
