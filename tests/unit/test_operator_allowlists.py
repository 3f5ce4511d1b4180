"""The tenancy allowlists have one definition: the chart's values block is what the operator's model holds, key
for key and default for default, and an empty list allows nothing in the operator as at admission (the
admission side runs on the real API server in tests/cluster/test_chart.py)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tailor.operator.allowlists import TenancyLimits

CHART = Path(__file__).resolve().parents[2] / "charts" / "tailor"


def test_the_charts_tenancy_values_are_the_operators_defaults() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())["tenancy"]
    assert values == TenancyLimits().model_dump(by_alias=True)
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["tenancy"]["properties"]
    assert set(schema) == set(values)


def test_an_empty_list_allows_nothing() -> None:
    nothing = TenancyLimits.model_validate({key: [] for key, value in TenancyLimits().model_dump(by_alias=True)
                                            .items() if isinstance(value, list)})
    assert not nothing.image_allowed("ghcr.io/tailor-dev/tailor-runtime:0.1.0")
    assert not nothing.annotation_allowed("prometheus.io/scrape")
    assert not nothing.pod_label_allowed("team")
    assert not nothing.toleration_allowed("cloud.google.com/gke-spot")
    assert not nothing.priority_class_allowed("gpu-batch")
    assert not nothing.resource_allowed("vpc.amazonaws.com/efa") and nothing.resource_allowed("memory")


def test_the_defaults_keep_a_tenant_off_the_control_plane_and_the_host() -> None:
    limits = TenancyLimits()
    assert not limits.toleration_allowed("node-role.kubernetes.io/control-plane")
    assert not limits.priority_class_allowed("system-node-critical")
    assert not limits.pod_label_allowed("sidecar.istio.io/inject") and not limits.pod_label_allowed("app")
    assert not limits.resource_allowed("devices.kubevirt.io/kvm") and not limits.resource_allowed("squat.ai/tun")
    assert limits.toleration_allowed("cloud.google.com/gke-spot") and limits.resource_allowed("vpc.amazonaws.com/efa")
