"""How far a running stage is, read from the end of its pod's log.

Design: the stages already log their steps (`round1.bld: 412/1536 ... eta 11400s`, `round1.scoring: 40/96
variants, eta 300s`, `round1.gkd: step 120/400, ... eta 3000s`: a Puzzle round's lines name it, and
`roundN.<step>: start` begins each part of it; older logs named the round only there). The operator
reads the last lines of the running stage's rank-0 pod through the API server (`pods/log`, the operator's right;
the kubelet serves it), on each pass while the stage runs (every 10 s), and turns the last step line into
the stage's progress and message. The stage pods get no API rights at all, as before, and nothing is written
anywhere but the log they already write. A log that says nothing parseable (another image, a pod on a node without
a kubelet endpoint) leaves the stage at "N pod(s) running".
"""

from __future__ import annotations

import re

from pydantic import BaseModel

LOG_TAIL_LINES = 60
# `[  12.3s] rank 0 round2.bld: 3/12 ...` (the rank appears when there are several, the round within a Puzzle
# round); a word may come first (`step`, `slot`)
STEP = re.compile(r"^\[\s*[\d.]+s\](?: rank \d+)? (?:round(?P<round>\d+)\.)?(?P<step>[a-z][\w-]*): (?:[a-z]+ )?"
                  r"(?P<done>\d+)/(?P<total>\d+)\b(?P<unit> variants)?.*?(?:eta (?P<eta>\d+)s)?$")
ROUND = re.compile(r"^\[\s*[\d.]+s\](?: rank \d+)? round(?P<round>\d+)\.")


class StepProgress(BaseModel):
    """The last step a stage's log reported."""

    step: str
    done: int
    total: int
    unit: str = ""
    eta_s: int | None = None
    round: int | None = None

    @property
    def share(self) -> float:
        return min(1.0, self.done / self.total) if self.total else 0.0

    def describe(self, rounds: int | None = None) -> str:
        """e.g. `round 2/3: bld 412/1,536, eta 3h10m`."""
        where = f"round {self.round}/{rounds}: " if self.round is not None and rounds else ""
        eta = f", eta {duration(self.eta_s)}" if self.eta_s is not None else ""
        return f"{where}{self.step} {self.done:,}/{self.total:,}{self.unit}{eta}"


def duration(seconds: int) -> str:
    """3h10m, 12m, 45s."""
    hours, rest = divmod(seconds, 3600)
    if hours:
        return f"{hours}h{rest // 60:02d}m"
    return f"{rest // 60}m" if rest >= 60 else f"{rest}s"


def parse(log: str) -> StepProgress | None:
    """The last step line of `log` with the round it belongs to; None when there is none."""
    lines = log.splitlines()
    for index in range(len(lines) - 1, -1, -1):
        match = STEP.match(lines[index])
        if match is None or int(match["done"]) > int(match["total"]):  # not a count of steps (e.g. token splits)
            continue
        round_number = int(match["round"]) if match["round"] else next(
            (int(found["round"]) for line in reversed(lines[:index]) if (found := ROUND.match(line)) is not None),
            None)
        return StepProgress(step=match["step"], done=int(match["done"]), total=int(match["total"]),
                            unit=match["unit"] or "", eta_s=int(match["eta"]) if match["eta"] else None,
                            round=round_number)
    return None
