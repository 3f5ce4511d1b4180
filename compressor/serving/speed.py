"""Served tokens/s of models compared so that their ratio can be trusted on a shared machine.

A model's speed through a server swings with whatever else the machine runs, so two models are never measured
one after the other: `interleaved` measures them in alternating order, round after round (A B, B A, ...), at each
concurrency, and records for every row the CPU that processes other than the server and this one used meanwhile
(`OutsideCpu`). A row taken while others used more than `max_other_cores` is measured again (up to `retries`
times) and flagged `contended` if it never ran quiet. `ratios` gives each model's tokens/s over the base model's,
per round and their median. Used by `bench/serving.py` and by `tailor demo` (the served speed-up in its summary).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tailor.compressor.serving import client

Row = dict[str, Any]
TICKS = os.sysconf("SC_CLK_TCK")
MAX_OTHER_CORES = 0.25  # a row measured while other processes used more than this many cores is taken again


@dataclass
class Sample:
    """One streamed request, times from its start in seconds."""

    tokens: int
    arrivals: list[float]  # when each streamed piece arrived

    @property
    def ttft(self) -> float:
        return self.arrivals[0]

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]


def vllm_request(url: str, model: str, text: str, new_tokens: int) -> Sample:
    """One greedy request for exactly `new_tokens` tokens through Triton's gRPC stream (tailor's vLLM backend)."""
    arrivals: list[float] = []
    started = time.perf_counter()
    sampling = {"max_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    tokens = client.generate(url, model, text, sampling, stream=True,
                             on_text=lambda _: arrivals.append(time.perf_counter() - started)).output_tokens
    if tokens != new_tokens or not arrivals:
        raise RuntimeError(f"{model}: {tokens} tokens in {len(arrivals)} pieces, asked for {new_tokens}")
    return Sample(tokens, arrivals)


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile `q` (0-1) of `values`."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def sweep(send: Callable[[int], Sample], concurrency: int) -> Row:
    """max(8, 2 x concurrency) requests (`send(i)` sends the i-th), `concurrency` at a time: output tokens/s over
    the run, time to first token and inter-token latency at p50/p99."""
    requests = max(8, 2 * concurrency)
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        samples = list(pool.map(send, range(requests)))
    wall = time.perf_counter() - started
    ttfts, gaps = [s.ttft for s in samples], [gap for s in samples for gap in s.gaps]
    return {"concurrency": concurrency, "requests": requests,
            "tokens_per_second": sum(s.tokens for s in samples) / wall, "wall_s": wall,
            "ttft_p50_s": percentile(ttfts, 0.5), "ttft_p99_s": percentile(ttfts, 0.99),
            "itl_p50_s": percentile(gaps, 0.5) if gaps else None,
            "itl_p99_s": percentile(gaps, 0.99) if gaps else None,
            "pieces_per_request": sum(len(s.arrivals) for s in samples) / requests}


def _busy_seconds() -> float:
    """CPU seconds this machine has spent busy (every state but idle and iowait) since boot."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / TICKS


def _tree_seconds(root: int) -> float:
    """CPU seconds used so far by `root` and its descendants (those alive now)."""
    parents: dict[int, int] = {}
    used: dict[int, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # gone meanwhile
            continue
        fields = text[text.rindex(")") + 2:].split()
        pid = int(stat.parent.name)
        parents[pid], used[pid] = int(fields[1]), (int(fields[11]) + int(fields[12])) / TICKS
    tree, frontier = {root}, [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier and pid not in tree]
        tree.update(children)
        frontier = children
    return sum(used.get(pid, 0.0) for pid in tree)


class OutsideCpu:
    """The cores that processes other than the server's tree (`server_pid`) and this process used while open."""

    def __init__(self, server_pid: int) -> None:
        self.server_pid, self.cores = server_pid, 0.0

    def __enter__(self) -> OutsideCpu:
        self.start = (time.perf_counter(), _busy_seconds(), _tree_seconds(self.server_pid), time.process_time())
        return self

    def __exit__(self, *_: object) -> None:
        wall, busy, server, own = (now - then for now, then in zip(
            (time.perf_counter(), _busy_seconds(), _tree_seconds(self.server_pid), time.process_time()), self.start,
            strict=True))
        self.cores = max(0.0, (busy - server - own) / wall) if wall > 0 else 0.0


def interleaved(models: list[str], send_for: Callable[[str], Callable[[int], Sample]], concurrencies: list[int],
                rounds: int, server_pid: int, log: Callable[[Row], None] = lambda _: None,
                max_other_cores: float = MAX_OTHER_CORES, retries: int = 2) -> list[Row]:
    """Every model at every concurrency, `rounds` times, the models' order reversed every round; each row with
    the cores used outside the server (`other_cores`), taken again while that is above `max_other_cores`."""
    rows = []
    for round_ in range(rounds):
        order = models if round_ % 2 == 0 else models[::-1]
        for concurrency in concurrencies:
            for model in order:
                for attempt in range(retries + 1):
                    with OutsideCpu(server_pid) as outside:
                        row = sweep(send_for(model), concurrency)
                    row.update(model=model, round=round_, attempt=attempt, other_cores=round(outside.cores, 3),
                               contended=outside.cores > max_other_cores)
                    if not row["contended"]:
                        break
                rows.append(row)
                log(row)
    return rows


def ratios(rows: list[Row], base: str) -> list[Row]:
    """Each model's tokens/s over `base`'s at the same concurrency and round; the median over rounds, and whether
    any row behind it was contended."""
    found = []
    keyed = {(r["model"], r["concurrency"], r["round"]): r for r in rows}
    for model in dict.fromkeys(r["model"] for r in rows if r["model"] != base):
        for concurrency in sorted({r["concurrency"] for r in rows}):
            pairs = [(keyed[(model, concurrency, n)], keyed[(base, concurrency, n)]) for n in sorted(
                {r["round"] for r in rows}) if (model, concurrency, n) in keyed and (base, concurrency, n) in keyed]
            if not pairs:
                continue
            per_round = [a["tokens_per_second"] / b["tokens_per_second"] for a, b in pairs]
            found.append({"model": model, "over": base, "concurrency": concurrency,
                          "ratio": statistics.median(per_round), "per_round": [round(r, 3) for r in per_round],
                          "contended": any(a["contended"] or b["contended"] for a, b in pairs)})
    return found
