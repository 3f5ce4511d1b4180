"""`tailor compress --dry-run`: the built-in Nemotron-3-Super built on the meta device, its table, and refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tailor.cli.main import main

REPO = Path(__file__).resolve().parents[3]
STAGES = ["capture", "bld", "scoring", "assembly", "gkd", "evaluation"]


def published(tmp_path: Path, **fields: object) -> Path:
    """The published example plan with a GKD budget whose teacher states fit (see test_footprint.py)."""
    plan = yaml.safe_load((REPO / "examples" / "plans" / "nemotron-super-b200.yaml").read_text())
    plan["gkd"]["tokens"] = 100_000
    plan.update(fields)
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan))
    return path


def test_the_published_case_on_two_nodes_of_8_b200_prints_a_table_that_fits(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compress", "--dry-run", "--config", str(published(tmp_path)), "--gpus", "8", "--nodes", "2",
                 "--gpu", "B200-180GB"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert "120.67B parameters, built on the meta device" in lines[0]
    assert lines[1] == "placement: 2 node(s) x 8 B200-180GB = 16 rank(s), 179.1 GiB per rank"
    assert lines[2].split()[:4] == ["stage", "ranks", "peak", "GiB/rank"]
    rows = lines[3:9]
    assert [row.split()[0] for row in rows] == STAGES and all(" yes " in row for row in rows)
    assert "not measured" in out and not err


def test_one_h100_refuses_naming_the_stage(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compress", "--dry-run", "--config", str(published(tmp_path)), "--gpu", "H100", "--json"]) == 2
    out, err = capsys.readouterr()
    fp = json.loads(out)
    assert [need["stage"] for need in fp["stages"]] == STAGES and fp["fitting_nodes"] == 22
    assert err.startswith("tailor: does not fit: stage gkd needs ") and "try --nodes 22" in err


def test_settings_offload_the_published_recipe_onto_one_node_of_8_b200(capsys: pytest.CaptureFixture[str]) -> None:
    recipe = str(REPO / "examples" / "plans" / "nemotron-super-published-recipe.yaml")
    assert main(["compress", "--dry-run", "--config", recipe, "--gpus", "8", "--gpu", "B200-180GB"]) == 2
    assert "try --nodes 2" in capsys.readouterr().err
    assert main(["compress", "--dry-run", "--config", recipe, "--gpus", "8", "--gpu", "B200-180GB",
                 "--set", "gkd.offload=true", "gkd.microBatch=8"]) == 0
    out, err = capsys.readouterr()
    assert ("host memory per node: 1,122 GiB of GKD's offloaded child state, fits a node's 2,048 GiB "
            "(hostMemoryGiB)") in out and not err


@pytest.mark.parametrize(("setting", "named"), [
    ("gkd.offlaod=true", "--set gkd.offlaod=true: expected FIELD=VALUE with FIELD a plan field (e.g. "
                         "gkd.microBatch=4); the plan has no field 'gkd.offlaod'"),
    ("gkd.microBatch=0", "--set gkd.microBatch=0: gkd.microBatch: Input should be greater than 0"),
    ("gkd.offload", "--set gkd.offload: expected FIELD=VALUE")])
def test_a_setting_that_is_no_plan_field_or_no_valid_value_is_refused_by_name(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], setting: str, named: str) -> None:
    assert main(["compress", "--dry-run", "--config", str(published(tmp_path)), "--set", setting]) == 1
    assert named in capsys.readouterr().err


def test_an_hf_parent_must_be_cached(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TAILOR_CACHE_DIR", str(tmp_path / "cache"))
    plan = published(tmp_path, parent="hf://example-org/not-cached")
    assert main(["compress", "--dry-run", "--config", str(plan)]) == 1
    assert "its config.json is not in the local Hugging Face cache" in capsys.readouterr().err
