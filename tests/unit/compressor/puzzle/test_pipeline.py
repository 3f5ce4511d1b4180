"""`tailor compress` end to end on a tiny parent: outputs, resume after a kill, bad input, torchrun, rounds."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tailor.compressor.model.architecture import load_architecture
from tailor.compressor.model.checkpoint import CheckpointError, load_decoder
from tailor.compressor.puzzle.pipeline import compress, resolve_parent
from tailor.compressor.puzzle.plan import Plan

from plans import tiny_plan, write_plan

TAILOR = [sys.executable, "-m", "tailor.cli.main"]


def run_cli(plan: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*TAILOR, "compress", "--config", str(plan), "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def finished(tiny_parent: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run") / "out"
    compress(Plan.model_validate(tiny_plan(tiny_parent)), out)
    return out


def test_a_run_writes_a_loadable_child_that_meets_the_target(finished: Path, tiny_parent: Path) -> None:
    report = json.loads((finished / "report.json").read_text())
    assert report["predicted_speedup"] >= 1.04 - 1e-9
    assert report["child"]["params"] < report["parent"]["params"]
    assert report["rounds"][0]["achieved"]["target.throughput"].endswith("x")
    assert set(report["stage_seconds"]) >= {"round1.bld", "round1.scoring", "round1.search", "round1.gkd"}
    assert report["child"]["quality"]["kl"] > 0 and report["measured_speedup"] > 0
    child = load_decoder(finished / "child")
    arch = load_architecture(finished / "child")
    assert arch.total_params == report["child"]["params"] == sum(p.numel() for p in child.parameters())
    assert arch.blocks != load_architecture(tiny_parent).blocks
    assert (finished / "report.md").read_text().startswith("# Compression report")
    assert len(json.loads((finished / "pareto.json").read_text())) == 12
    assert (finished / "pareto.png").stat().st_size > 10_000
    solutions = json.loads((finished / "stages" / "round1" / "search.json").read_text())
    assert len(solutions) == 3 and len({tuple(s["labels"]) for s in solutions}) == 3


def test_a_killed_run_looks_unfinished_and_resumes(tiny_parent: Path, tmp_path: Path) -> None:
    plan = write_plan(tmp_path, tiny_plan(tiny_parent, bld={"tokens": 4096}))
    out = tmp_path / "out"
    process = subprocess.Popen([*TAILOR, "compress", "--config", str(plan), "--out", str(out)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    bld = out / "stages" / "round1" / "bld"
    deadline = time.monotonic() + 120
    while len(list(bld.glob("*.safetensors"))) < 3:
        assert process.poll() is None and time.monotonic() < deadline, "no BLD checkpoint appeared"
        time.sleep(0.05)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert not (out / "report.json").exists() and not (out / "child").exists()
    kept = {p.name: p.stat().st_mtime_ns for p in bld.glob("*.safetensors")}
    result = run_cli(plan, out)
    assert result.returncode == 0, result.stderr
    assert (out / "report.json").exists()
    assert all((bld / name).stat().st_mtime_ns == mtime for name, mtime in kept.items())  # not retrained
    assert not list(out.rglob(".*partial*"))


def test_a_corrupt_checkpoint_on_resume_is_named(finished: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    round1 = out / "stages" / "round1"
    shutil.rmtree(round1 / "child")
    victim = sorted((round1 / "bld").glob("*.safetensors"))[0]
    victim.write_bytes(b"not a safetensors file")
    plan = Plan.model_validate(json.loads((finished / "report.json").read_text())["plan"])
    with pytest.raises(CheckpointError, match=rf"{victim.name}: cannot resume from this BLD checkpoint"):
        compress(plan, out)


def test_a_resume_with_another_plan_is_refused(finished: Path, tiny_parent: Path, tmp_path: Path) -> None:
    plan = write_plan(tmp_path, tiny_plan(tiny_parent, seed=7))
    result = run_cli(plan, finished)
    assert result.returncode == 1
    assert "were made by a different parent or library" in result.stderr and "Traceback" not in result.stderr


def test_a_new_target_reuses_bld_and_scores(finished: Path, tiny_parent: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shutil.copytree(finished, out)
    round1 = out / "stages" / "round1"
    kept = {p.name: p.stat().st_mtime_ns for p in [*(round1 / "bld").glob("*"), round1 / "scores.json"]}
    report = compress(Plan.model_validate(tiny_plan(tiny_parent, target={"throughput": 1.06})), out)
    assert report is not None
    assert report.predicted_speedup >= 1.06 - 1e-9
    assert {p.name: p.stat().st_mtime_ns for p in [*(round1 / "bld").glob("*"), round1 / "scores.json"]} == kept
    assert json.loads((round1 / "round.json").read_text())["target"]["throughput"] == 1.06


def test_an_unreachable_target_is_a_clear_error_and_no_report(tiny_parent: Path, tmp_path: Path) -> None:
    plan = write_plan(tmp_path, tiny_plan(tiny_parent, target={"throughput": 9.0}))
    result = run_cli(plan, tmp_path / "out")
    assert result.returncode == 1
    assert "tailor: error: target.throughput cannot be met: the best child in the library reaches" in result.stderr
    assert not (tmp_path / "out" / "report.json").exists()


def test_a_missing_parent_folder_is_a_clear_error(tmp_path: Path) -> None:
    plan = write_plan(tmp_path, tiny_plan(tmp_path / "no-model"))
    result = run_cli(plan, tmp_path / "out")
    assert result.returncode == 1 and "no-model: no such model folder" in result.stderr


def test_two_gloo_ranks_choose_the_child_one_process_chooses(finished: Path, tiny_parent: Path,
                                                            tmp_path: Path) -> None:
    """BLD and scoring split by slot, GKD sharded with FSDP2: the same child as the single process, its scores
    equal to float rounding and its quality within 2% (GKD's reductions run in another order)."""
    plan = write_plan(tmp_path, tiny_plan(tiny_parent))
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "-m", "tailor.cli.main", "compress", "--config", str(plan),
                             "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "rank 0 round1.bld: " in result.stderr and "rank 1 round1.bld: " in result.stderr
    single, sharded = (json.loads((folder / "report.json").read_text()) for folder in (finished, out))
    assert sharded["blocks"] == single["blocks"]
    scores = [json.loads((folder / "stages" / "round1" / "scores.json").read_text()) for folder in (finished, out)]
    assert scores[0].keys() == scores[1].keys()
    for key, score in scores[0].items():
        assert scores[1][key]["kl"] == pytest.approx(score["kl"], rel=1e-4, abs=1e-6), key
    assert sharded["rounds"][0]["gkd_loss_last"] == pytest.approx(single["rounds"][0]["gkd_loss_last"], rel=0.02)
    assert sharded["kl_to_parent"] == pytest.approx(single["kl_to_parent"], rel=0.02)


def test_iterative_puzzle_runs_rounds_towards_the_target(tiny_parent: Path, tmp_path: Path) -> None:
    report = compress(Plan.model_validate(tiny_plan(tiny_parent, rounds=2, target={"throughput": 1.06})),
                      tmp_path / "out")
    assert report is not None
    assert [r.round for r in report.rounds] == [1, 2]
    assert report.rounds[0].target["throughput"] == pytest.approx(1.06**0.5)
    assert report.predicted_speedup >= 1.06 - 1e-9
    assert (tmp_path / "out" / "stages" / "round2" / "child" / "config.json").exists()


def test_an_hf_parent_that_cannot_be_downloaded_names_the_uri(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TAILOR_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match=r"hf://tailor-tests/no-such-model@v0: cannot download the parent"):
        resolve_parent("hf://tailor-tests/no-such-model@v0")
    with pytest.raises(ValueError, match="s3:// parents are not supported"):
        resolve_parent("s3://bucket/model")
