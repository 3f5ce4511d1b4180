"""Files generated from one source stay equal to it: the chart's CRD, the field reference, and the metric names
the prometheus-adapter rules serve."""

from __future__ import annotations

import yaml

from tailor.operator import crd
from tailor.operator.deployment import POD_METRICS


def test_the_chart_ships_the_same_crd_as_crds() -> None:
    assert crd.CHART_CRD_FILE.read_bytes() == crd.CRD_FILE.read_bytes()
    assert crd.stale() == [], "run `tailor crd generate`"


def test_the_reference_documents_every_spec_field() -> None:
    reference = crd.REFERENCE_FILE.read_text()
    schema = yaml.safe_load(crd.CRD_FILE.read_text())["spec"]["versions"][0]["schema"]["openAPIV3Schema"]

    def paths(node: dict[str, object], prefix: str) -> list[str]:
        children = node.get("properties") or {}
        assert isinstance(children, dict)
        return [p for name, child in children.items() for p in [f"{prefix}.{name}", *paths(child, f"{prefix}.{name}")]]

    for path in paths(schema["properties"]["spec"], "spec"):
        assert f"| `{path}` |" in reference, path


def test_adapter_rules_serve_the_metrics_the_hpas_ask_for() -> None:
    values = yaml.safe_load((crd.ROOT / "charts" / "tailor" / "prometheus-adapter-values.yaml").read_text())
    served = {rule["name"]["as"] for rule in values["rules"]["custom"]}
    assert served == set(POD_METRICS.values())


def test_one_version_everywhere() -> None:
    """pyproject.toml's version is the package's; the chart, its default images and the CRD's default image say
    the same (a release bumps pyproject.toml, Chart.yaml and values.yaml together; this test names any it missed)."""
    from tailor.operator.api import RUNTIME_IMAGE, VERSION_OF_TAILOR

    chart = yaml.safe_load((crd.ROOT / "charts" / "tailor" / "Chart.yaml").read_text())
    values = yaml.safe_load((crd.ROOT / "charts" / "tailor" / "values.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == VERSION_OF_TAILOR
    assert values["jobs"]["image"] == RUNTIME_IMAGE
    assert RUNTIME_IMAGE.endswith(f":{VERSION_OF_TAILOR}") and RUNTIME_IMAGE in crd.CRD_FILE.read_text()
