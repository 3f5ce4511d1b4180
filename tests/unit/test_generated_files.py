"""Files generated from one source stay equal to it: the chart's CRD, the reference pages, and the metric names
the prometheus-adapter rules serve."""

from __future__ import annotations

import json
from typing import Any

import yaml

from tailor.cli import generated
from tailor.operator import crd
from tailor.operator.deployment import POD_METRICS


def test_the_chart_ships_the_same_crd_as_crds() -> None:
    assert crd.CHART_CRD_FILE.read_bytes() == crd.CRD_FILE.read_bytes()
    assert generated.stale(crd.generated()) == [], "run `tailor crd generate`"


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
    assert served == {name for by_setting in POD_METRICS.values() for name in by_setting.values()}


def test_one_version_everywhere() -> None:
    """pyproject.toml's version is the package's; the chart and its default images say the same (a release bumps
    pyproject.toml, Chart.yaml and values.yaml together; this test names any it missed). The CRD's default Triton
    image is Tailor's serving image of that version, and the chart allows it."""
    from tailor.operator.api import RUNTIME_IMAGE, SERVING_IMAGE, VERSION_OF_TAILOR

    chart = yaml.safe_load((crd.ROOT / "charts" / "tailor" / "Chart.yaml").read_text())
    values = yaml.safe_load((crd.ROOT / "charts" / "tailor" / "values.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == VERSION_OF_TAILOR
    assert values["jobs"]["image"] == RUNTIME_IMAGE
    assert RUNTIME_IMAGE.endswith(f":{VERSION_OF_TAILOR}") and SERVING_IMAGE.endswith(f":{VERSION_OF_TAILOR}")
    assert SERVING_IMAGE in crd.CRD_FILE.read_text()
    assert any(SERVING_IMAGE.startswith(prefix) for prefix in values["tenancy"]["allowedImagePrefixes"])


def test_the_cli_chart_values_and_permissions_pages_are_generated_from_their_sources() -> None:
    from tailor.cli.main import build_parser

    assert generated.stale(generated.docs(build_parser())) == [], "run `tailor docs generate`"


def test_the_values_page_gives_each_value_its_comment_and_check() -> None:
    """Each value of values.schema.json has a row; a value's comment in values.yaml (the lines above its key)
    and a section's `# -- ` comment land in its row, and so does what the schema checks."""
    page = generated.render_values()
    schema = json.loads((generated.CHART / "values.schema.json").read_text())

    def leaves(node: dict[str, Any], prefix: str) -> list[str]:
        children = node.get("properties") or {}
        return [leaf for name, child in children.items()
                for leaf in (leaves(child, f"{prefix}{name}.") or [f"{prefix}{name}"])]

    for path in leaves(schema, ""):
        assert f"| `{path}` |" in page, path
    claim = next(row for row in page.splitlines() if row.startswith("| `jobs.claimSize` |"))
    assert "Size of the artifacts claim" in claim and "matches `^[0-9]+" in claim
    jobs = next(row for row in page.splitlines() if row.startswith("| `jobs` |"))
    assert "The stage Jobs (compress, quantize, evaluate, package)." in jobs


def test_the_cli_page_has_every_command_with_its_help() -> None:
    from tailor.cli.main import build_parser

    page = generated.render_cli(build_parser())
    for command in ("tailor compress", "tailor devcluster up", "tailor docs generate", "tailor operator-release"):
        assert f"\n## {command}\n" in page, command
    assert "--dry-run" in page.split("\n## tailor compress\n")[1].split("\n## ")[0]


def test_the_permissions_page_gives_every_right_the_chart_grants_its_reason() -> None:
    """Each rule of templates/rbac.yaml has a row naming where it holds and why (the comment above it)."""
    text = (generated.CHART / "templates" / "rbac.yaml").read_text()
    rows = list(generated.rbac_rules(text))
    assert len(rows) == text.count("- apiGroups:")
    assert all(where and why for where, _, _, _, why in rows), "a right without its place or reason"
    cluster = [(resources, verbs) for where, _, resources, verbs, _ in rows if where == "the cluster"]
    assert cluster == [("nodes", "list"), ("pods", "list")]  # the only cluster-scoped rights
    assert ("each of `serving.heldGpuNamespaces`", "core", "pods", "list") in [row[:4] for row in rows]
