"""The commands the documentation shows: every `tailor` command line in a shell block of the README and the site
parses (its subcommand and flags exist), and every transcript (`$ tailor ...` followed by what it prints) prints
what the page says when run now. A transcript line `$ ... ARGS` repeats the page's previous command with its
placement flags (from `--gpus` on) replaced by ARGS."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tailor.cli.main import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
SHELL = ("", "bash", "sh", "shell", "console")  # fenced blocks whose lines may be commands
TAILOR = re.compile(r"^(?:\$ )?(?:\.venv/bin/)?tailor (.*)$")


def _blocks(page: Path) -> list[str]:
    """The page's fenced blocks of shell (or no language), each as its text."""
    blocks: list[str] = []
    fence: str | None = None  # the open block's language
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            if fence is None:
                fence = line[3:].strip()
                blocks.append("")
            else:
                if fence not in SHELL:
                    blocks.pop()
                fence = None
        elif fence is not None:
            blocks[-1] += line + "\n"
    return blocks


def _lines(block: str) -> list[str]:
    """The block's lines with continuation lines (a trailing backslash) joined."""
    joined: list[str] = []
    for line in block.splitlines():
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1].rstrip() + " " + line.strip()
        else:
            joined.append(line)
    return joined


def _argv(command: str) -> list[str]:
    """A command line's arguments, without a trailing comment or `&`."""
    words = shlex.split(command, comments=True)
    return words[:-1] if words and words[-1] == "&" else words


def _commands() -> list[tuple[str, str]]:
    return [(f"{page.relative_to(ROOT)}: tailor {shlex.join(_argv(match[1]))}", match[1])
            for page in PAGES for block in _blocks(page)
            for line in _lines(block) if (match := TAILOR.match(line.strip()))]


def _transcripts() -> list[tuple[str, list[str], list[str]]]:
    """(where, argv, the lines the page shows it printing) for each `$ tailor` or `$ ...` line of a block."""
    found: list[tuple[str, list[str], list[str]]] = []
    for page in PAGES:
        previous: list[str] = []
        for block in _blocks(page):
            for line in _lines(block):
                if line.startswith("$ tailor ") or line.startswith("$ ... "):
                    args = _argv(line[len("$ "):])[1:]
                    if line.startswith("$ ... "):
                        args = previous[:previous.index("--gpus")] + args
                    previous = args
                    found.append((f"{page.relative_to(ROOT)}: tailor {shlex.join(args)}", args, []))
                elif line.startswith("$ "):
                    previous = []  # another program's transcript (kubectl): not run here
                elif found and line.strip() and found[-1][1] is previous:
                    found[-1][2].append(line)
    return found


def test_the_pages_show_commands_and_transcripts() -> None:
    """The collection below finds what it checks (a changed fence or prompt would otherwise check nothing)."""
    assert len(_commands()) >= 15
    assert len(_transcripts()) >= 10


@pytest.mark.parametrize(("where", "command"), _commands(), ids=[where for where, _ in _commands()])
def test_every_tailor_command_line_parses(where: str, command: str) -> None:
    try:
        build_parser().parse_args(_argv(command))
    except SystemExit as error:
        pytest.fail(f"{where}: the CLI refuses it (exit {error.code})")


@pytest.mark.parametrize(("where", "argv", "shown"), _transcripts(), ids=[where for where, _, _ in _transcripts()])
def test_every_transcript_prints_what_the_page_shows(where: str, argv: list[str], shown: list[str],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Each line the page shows is a line of the output, in the same order (the page may leave lines out)."""
    assert shown, f"{where}: the page shows no output"
    main(argv)
    captured = capsys.readouterr()
    printed = (captured.out + captured.err).splitlines()
    at = 0
    for line in shown:
        assert line in printed[at:], f"{where}: the page shows\n  {line}\nbut the command printed\n" + "\n".join(
            printed)
        at = printed.index(line, at) + 1
