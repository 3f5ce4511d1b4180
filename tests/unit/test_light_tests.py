"""The operator's tests run without the compressor stack: collecting them, with the shared conftest and test
helpers they load, imports none of torch, transformers or modelopt (`pytest -m "not cluster"` in an operator-only
environment)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

UNIT = Path(__file__).resolve().parent
LIGHT = sorted(str(path) for path in UNIT.glob("test_*.py")
               if path.name.startswith(("test_operator_", "test_api", "test_generated_files")))
HEAVY = ("torch", "transformers", "modelopt")

PROBE = """
import sys
import pytest

code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]])
print("heavy:", sorted(name for name in sys.modules if name.split(".")[0] in {heavy!r}))
raise SystemExit(code)
"""


def test_collecting_the_operator_tests_imports_no_torch() -> None:
    assert len(LIGHT) >= 2
    probe = subprocess.run([sys.executable, "-c", PROBE.format(heavy=set(HEAVY)), *LIGHT], capture_output=True,
                           text=True, timeout=120, cwd=UNIT.parent.parent)
    assert probe.returncode == 0, probe.stdout[-3000:] + probe.stderr[-3000:]
    assert probe.stdout.splitlines()[-1] == "heavy: []"
