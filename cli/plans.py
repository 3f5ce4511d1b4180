"""How a stage command reads its build plan (`--plan`, what the operator's Jobs pass) and hands back its
result: as the termination message (`--result-file`) and as a file on the artifacts claim, which outlives
the pod."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from tailor.compressor.buildplan import BuildPlan, Stage
from tailor.compressor.puzzle.plan import Corpus
from tailor.compressor.results import StageResult, write_result

CORPUS_FLAGS = ("text", "heldout", "text_field", "heldout_every")


def write_results(result: StageResult, result_file: Path | None, plan: BuildPlan | None, stage: Stage) -> None:
    if plan is not None:
        write_result(result, Path(plan.layout.result(stage)))
    if result_file is not None:
        write_result(result, result_file)


def one_process(stage: str) -> None:
    """Refuse to run a one-process stage as one of several ranks: copies would each do the whole stage on one GPU
    and write the same folder."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise ValueError(f"tailor {stage} runs as one process, but was started as one of {world} (WORLD_SIZE, "
                         "torchrun): start it without torchrun")


def needs(args: object, *flags: str) -> None:
    """Without --plan, these flags are required."""
    missing = [f"--{flag.replace('_', '-')}" for flag in flags if getattr(args, flag) is None]
    if missing:
        raise ValueError(f"{', '.join(missing)} required without --plan")


def add_corpus_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("text", "what calibration and evaluation read, by the rule `tailor compress` "
                                              "follows (its plan's data); with --plan, the plan's")
    group.add_argument("--text", help="training text: a built-in corpus (broad, the default: books, news and "
                                      "python-docs together; books; shakespeare; news; python-docs; wikipedia; "
                                      "movie-reviews; python-code), a folder of .txt and "
                                      ".jsonl files, or one such file")
    group.add_argument("--heldout", help="held-out text (the same forms), e.g. another domain; default: every "
                                         "--heldout-every-th document of --text")
    group.add_argument("--text-field", help="the field of each JSONL object holding its text (default: text)")
    group.add_argument("--heldout-every", type=int, help="without --heldout: every n-th document is held out "
                                                         "(default 8)")


def corpus(args: argparse.Namespace, plan: BuildPlan | None) -> Corpus:
    """The text a stage reads: the build plan's data (what compression trained and scored on), else the flags."""
    given = {flag: getattr(args, flag) for flag in CORPUS_FLAGS if getattr(args, flag) is not None}
    if plan is None:
        return Corpus(**given)
    if given:
        raise ValueError(f"{', '.join('--' + flag.replace('_', '-') for flag in given)}: with --plan the text is "
                         "the plan's data")
    return plan.puzzle.data


def _result(args: argparse.Namespace) -> int:
    """`tailor result`: a stage's result, read back from the claim (when the stage's pod is gone)."""
    from pydantic import ValidationError

    from tailor.compressor.results import CompressResult, GateResult, QuantizeResult

    models: dict[str, type[StageResult]] = {"compress": CompressResult, "quantize": QuantizeResult,
                                            "evaluate": GateResult}
    path = Path(BuildPlan.load(args.plan).layout.result(args.stage))
    try:
        result = models[args.stage].model_validate_json(path.read_text())
    except OSError as error:
        raise ValueError(f"{path}: no {args.stage} result on the claim ({error.strerror})") from error
    except ValidationError as error:
        raise ValueError(f"{path}: not a {args.stage} result: {error}") from error
    write_results(result, args.result_file, None, args.stage)
    print(result.model_dump_json(indent=2))
    return 0


def add_parser(nouns: Any) -> None:
    parser = nouns.add_parser("result", help="print a build stage's result from the artifacts claim (what the "
                                             "operator reads when the stage's pod is gone)")
    parser.add_argument("--plan", type=Path, required=True, help="the build plan")
    parser.add_argument("--stage", choices=["compress", "quantize", "evaluate"], required=True)
    parser.add_argument("--result-file", type=Path, help="also write it here (a Job's termination log)")
    parser.set_defaults(run=_result)
