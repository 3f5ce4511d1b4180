"""The `tailor devcluster` command against the running devcluster."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tailor.devcluster import build, cluster


def tailor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tailor.cli.main", *args], capture_output=True, text=True,
                          timeout=300)


def status() -> dict[str, Any]:
    result = tailor("devcluster", "status", "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)  # type: ignore[no-any-return]


def test_status_reports_every_component_and_the_nodes(devcluster: cluster.Layout) -> None:
    report = status()
    assert set(report["components"]) == set(cluster.COMPONENTS)
    # every component `up` started runs; only the optional ones (metrics, Kueue) may not have been asked for
    assert all(component["running"] for component in report["components"].values() if component["expected"])
    assert {name for name, c in report["components"].items() if not c["expected"]} <= set(cluster.OPTIONAL_COMPONENTS)
    assert report["serverVersion"] == build.kubernetes_version()
    assert report["nodes"]["ready"] == report["nodes"]["total"] > 0


def test_up_again_keeps_the_running_components(devcluster: cluster.Layout) -> None:
    before = {name: c["pid"] for name, c in status()["components"].items()}
    result = tailor("devcluster", "up")
    assert result.returncode == 0, result.stderr
    assert "already running" in result.stderr
    assert {name: c["pid"] for name, c in status()["components"].items()} == before


def test_kubeconfig_and_env_point_at_the_cluster(devcluster: cluster.Layout) -> None:
    path = Path(tailor("devcluster", "kubeconfig").stdout.strip())
    assert path == devcluster.kubeconfig and path.is_file()
    exports = tailor("devcluster", "env").stdout
    assert f"export KUBECONFIG={path}" in exports
    assert str(build.ensure_binaries()) in exports
