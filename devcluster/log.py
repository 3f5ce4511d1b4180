"""Stage logs on stderr, so stdout stays free for data."""

from __future__ import annotations

import sys
import time

_STARTED = time.monotonic()


def log(message: str) -> None:
    """Print one stage line with the seconds since the command started."""
    print(f"[{time.monotonic() - _STARTED:6.1f}s] {message}", file=sys.stderr, flush=True)
