"""`tailor compress --dry-run`: build the parent on the meta device and print what every stage needs per rank.

Nothing is downloaded, trained or loaded: the parent's config.json comes from a folder, a built-in model
(`compressor/model/models`) or the local Hugging Face cache. Exit 0 when every stage fits, 2 when one does not
(the shortfalls on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tailor.cli.compress import config_plan
from tailor.compressor.buildplan import BuildPlan
from tailor.compressor.model.architecture import MODELS_DIR, Architecture, architecture_from_config, builtin_models
from tailor.compressor.puzzle.footprint import GIB, Footprint, footprint
from tailor.compressor.sizing.hardware import GpuCatalog

DOES_NOT_FIT = 2  # the exit status when a stage needs more than a rank has
SHOWN_PARTS = 3  # the largest parts of each stage's peak in the table


def parent_config(parent: str) -> tuple[dict[str, Any], str]:
    """The parent's config.json and where it was read, without downloading or training anything."""
    from tailor.compressor import sources
    from tailor.compressor.model.checkpoint import read_config

    if Path(parent).is_dir():
        return read_config(Path(parent)), f"{parent}/config.json"
    if parent in builtin_models():
        path = MODELS_DIR / f"{parent}.json"
        return json.loads(path.read_text()), str(path)
    if (sources.model_dir(parent) / "config.json").is_file():  # a fetched or trained parent (tiny-nemotron-h)
        return read_config(sources.model_dir(parent)), str(sources.model_dir(parent) / "config.json")
    if parent.startswith(sources.HUB_PREFIX):
        from huggingface_hub import try_to_load_from_cache

        repo, _, revision = parent.removeprefix(sources.HUB_PREFIX).partition("@")
        cached = try_to_load_from_cache(repo, "config.json", cache_dir=sources.cache_dir() / "hub",
                                        revision=revision or "main")
        if not isinstance(cached, str):
            raise ValueError(f"plan field 'parent': {parent}: its config.json is not in the local Hugging Face "
                             f"cache ({sources.cache_dir() / 'hub'}) and a dry run downloads nothing; fetch it "
                             "first or name a folder holding it")
        return json.loads(Path(cached).read_text()), cached
    raise ValueError(f"plan field 'parent': {parent!r} is not a model folder, a built-in model "
                     f"({', '.join(builtin_models())}), a fetched parent or a cached hf:// model")


def built_on_meta(config: dict[str, Any], source: str) -> Architecture:
    """The parent's architecture, after building the model itself on the meta device with as many parameters."""
    import torch

    from tailor.compressor.model.checkpoint import settings_from_config
    from tailor.compressor.model.modeling import Decoder

    arch = architecture_from_config(config, source)
    with torch.device("meta"):
        built = sum(p.numel() for p in Decoder(arch, settings_from_config(config, source)).parameters())
    if built != arch.total_params:
        raise ValueError(f"{source}: the model built on the meta device has {built:,} parameters, its architecture "
                         f"counts {arch.total_params:,}")
    return arch


def _duration(seconds: float) -> str:
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} d"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def _budget_note(fp: Footprint) -> str:
    if fp.budget_stated:
        return " (stated: --memory-budget, else the plan's budgetGiB)"
    return " (the cpu profile's memory shared by a node's ranks; --memory-budget states one)" if fp.on_cpu \
        else ""


def render(fp: Footprint, arch: Architecture, source: str) -> str:
    """The table: one row per stage, then the assumptions."""
    head = (f"parent {arch.name} ({source}): {arch.total_params / 1e9:.2f}B parameters, built on the meta device\n"
            f"placement: {fp.nodes} node(s) x {fp.gpus_per_node} {fp.gpu} = {fp.ranks} rank(s), "
            f"{fp.budget_bytes / GIB:.1f} GiB per rank{_budget_note(fp)}\n")
    rows = [["stage", "ranks", "peak GiB/rank", "budget GiB", "fits", "est. time", "largest parts (GiB)"]]
    for need in fp.stages:
        largest = sorted(need.parts.items(), key=lambda item: -item[1])[:SHOWN_PARTS]
        rows.append([need.stage, need.ranks, f"{need.peak_bytes / GIB:.1f}", f"{fp.budget_bytes / GIB:.1f}",
                     "yes" if need.peak_bytes <= fp.budget_bytes else "NO", _duration(need.seconds),
                     ", ".join(f"{name} {size / GIB:.1f}" for name, size in largest)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    table = "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
                      for row in rows)
    files = ", ".join(f"{name} {size / GIB:,.0f}" for name, size in fp.stage_files.items())
    notes = "\n".join(f"note: {text}" for text in fp.assumptions)
    total = sum(fp.stage_files.values()) / GIB
    return f"{head}{table}\nstage files on the claim: {total:,.0f} GiB at most ({files})\n{_host(fp)}{notes}"


def _host(fp: Footprint) -> str:
    """The line for what the ranks keep in host memory (GKD's offloaded child), if anything."""
    if not fp.offloaded_bytes_per_node:
        return ""
    held = f"host memory per node: {fp.offloaded_bytes_per_node / GIB:,.0f} GiB of GKD's offloaded child state"
    if fp.host_budget_bytes is None:
        return f"{held} (the {fp.gpu} profile states no hostMemoryGiB: not checked)\n"
    verdict = "fits" if fp.host_fits else "does NOT fit"
    return f"{held}, {verdict} a node's {fp.host_budget_bytes / GIB:,.0f} GiB (hostMemoryGiB)\n"


def dry_run(args: argparse.Namespace) -> int:
    build = BuildPlan.load(args.plan) if args.plan else None
    plan = build.puzzle if build is not None else config_plan(args)
    catalog = build.catalog() if build is not None else GpuCatalog.load()
    gpu = catalog.get(args.gpu or plan.target.gpu)
    for flag, value in (("--gpus", args.gpus), ("--nodes", args.nodes)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if args.memory_budget is not None and args.memory_budget <= 0:
        raise ValueError(f"--memory-budget must be a positive number of GiB, got {args.memory_budget}")
    config, source = parent_config(plan.parent)
    arch = built_on_meta(config, source)
    fp = footprint(arch, plan, gpu, args.gpus, args.nodes, args.memory_budget)
    print(fp.model_dump_json(indent=2) if args.json else render(fp, arch, source))
    for message in fp.shortfalls():
        print(f"tailor: does not fit: {message}", file=sys.stderr)
    return 0 if fp.fits else DOES_NOT_FIT
