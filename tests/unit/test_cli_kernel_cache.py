"""Every `tailor` command caps oneDNN's kernel cache (`cli/main.py`), unless the user set it."""

from __future__ import annotations

import os

import pytest

from tailor.cli.main import KERNEL_CACHE, main

VARIABLE, CAP = KERNEL_CACHE


def test_a_command_sets_the_cap(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(VARIABLE, "unset")  # records the variable's state, restored after the test
    monkeypatch.delenv(VARIABLE)
    assert main(["size", "--model", "smollm2-135m", "--gpu", "H100", "--context", "4096"]) == 0
    assert os.environ[VARIABLE] == CAP


def test_the_users_setting_wins(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(VARIABLE, "512")
    assert main(["size", "--model", "smollm2-135m", "--gpu", "H100", "--context", "4096"]) == 0
    assert os.environ[VARIABLE] == "512"
