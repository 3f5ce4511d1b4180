"""Time block variants with torch on this machine's device, as Puzzle measures costs on the target.

Each part of a block (attention with its KV cache, Mamba-2 with its state, dense MLP, mixture of
experts, linear replacement) is built with its norm at its real shapes with random weights in the compute dtype
(`compute.resolve`: BF16 where the device has BF16 math, else float32), and its residual branch `x + op(norm(x))`
is timed on the current device (CUDA where present, else CPU). Results are cached per device and dtype in a JSON
file, so a search run re-measures nothing it has seen. Importing this
module imports torch: the operator never does.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tailor.compressor import sources
from tailor.compressor.model.architecture import Attention, Mamba, Part
from tailor.compressor.model.device import compute_for, torch_dtype
from tailor.compressor.model.mamba import Mamba2
from tailor.compressor.model.modeling import Decoder, KVCache, ModelSettings, SelfAttention, build_branch, residual
from tailor.compressor.sizing.costs import Phase, Workload

COLD_BYTES = 64 * 2**20  # more than a CPU's last-level cache or a GPU's L2
MAX_COPIES = 64
KEY_VERSION = 6  # bump when the timed modules change, so cached timings are not reused


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def _runner(part: Part, hidden: int, work: Workload, dev: torch.device, dtype: torch.dtype) -> Callable[[], object]:
    """A closure that runs the part's residual branch once per call, each call on the next of enough copies
    (distinct weights and caches) that none is still in the cache when its turn comes again: in a whole model
    every block's weights come from memory, not from the cache, and timing one copy alone would miss that."""
    copies = max(1, min(MAX_COPIES, math.ceil(COLD_BYTES / _footprint(part, hidden, work, dtype.itemsize))))
    turns = itertools.cycle([_branch_runner(part, hidden, work, dev, dtype) for _ in range(copies)])
    return lambda: next(turns)()


def _footprint(part: Part, hidden: int, work: Workload, size: int) -> int:
    """Bytes one call reads: weights of `size` bytes each, and the KV cache or Mamba state of `batch` requests."""
    weights = size * int(sum(part.params(hidden).values()))
    if isinstance(part, Attention):
        return weights + size * work.batch * (work.context + 1) * part.kv_elements_per_token()
    if isinstance(part, Mamba):
        return weights + work.batch * (4 * part.ssm_elements() + size * part.conv_elements())
    return max(1, weights)


def _branch_runner(part: Part, hidden: int, work: Workload, dev: torch.device,
                   dtype: torch.dtype) -> Callable[[], object]:
    """A closure that runs the part's residual branch (norm, op, add) once on the workload, inputs and caches
    prepared beforehand. Every part is the project's own modeling module, as the models it compresses run it."""
    tokens = 1 if work.phase is Phase.DECODE else work.context
    x = torch.randn(work.batch, tokens, hidden, device=dev, dtype=dtype)
    branch = build_branch("mixer" if isinstance(part, Attention | Mamba) else "ffn", part, hidden, ModelSettings())
    if branch is None:
        return lambda: x
    norm, op = (module.to(dev, dtype).eval() for module in branch)
    branch = (norm, op)
    if work.phase is not Phase.DECODE or not isinstance(op, SelfAttention | Mamba2):
        return lambda: residual(branch, x)
    if isinstance(op, Mamba2):
        cache = op.new_cache(work.batch, x)
        cache.length = work.context  # a state after `context` tokens: decode is one recurrent step
        return lambda: residual(branch, x, cache)
    kv = op.new_cache(work.batch, work.context + 1, x)

    def step() -> torch.Tensor:
        kv.length = work.context  # the new token goes after `context` cached ones, every call
        return residual(branch, x, kv)

    return step


def time_call(run: Callable[[], object], dev: torch.device, min_seconds: float = 0.2,
              max_repeats: int = 200) -> float:
    """Median seconds of one call after warm-up, repeated for at least `min_seconds`."""

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    with torch.inference_mode():
        for _ in range(3):
            run()
        sync()
        samples: list[float] = []
        started = time.perf_counter()
        while len(samples) < max_repeats and (len(samples) < 5 or time.perf_counter() - started < min_seconds):
            begin = time.perf_counter()
            run()
            sync()
            samples.append(time.perf_counter() - begin)
    return statistics.median(samples)


def decode_step_runner(model: Decoder, batch: int, context: int, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    """One decode step of a whole model (a copy in `dtype`) for `batch` requests after `context` tokens, as a
    closure: every call appends its token after the same `context` cached ones, as the parts are timed."""
    runner = copy.deepcopy(model).to(dtype).eval()
    dev = runner.embedding.weight.device
    with torch.inference_mode():
        caches = runner.new_caches(batch, context + 1)
        prompt = torch.randint(0, model.arch.vocab_size, (batch, context), device=dev,
                               generator=torch.Generator(dev).manual_seed(0))
        token = runner(prompt, caches)[:, -1:].argmax(-1)

    def step() -> torch.Tensor:
        with torch.inference_mode():  # the caches are inference tensors
            for cache in caches:
                if isinstance(cache, KVCache):
                    cache.length = context
            result: torch.Tensor = runner(token, caches)[:, -1:].argmax(-1)
        return result

    return step


def decode_step_seconds(model: Decoder, batch: int, context: int, dtype: torch.dtype) -> float:
    """One decode step of a whole model in `dtype`, timed as the parts are: the median of single steps."""
    return time_call(decode_step_runner(model, batch, context, dtype), model.embedding.weight.device)


class MeasuredCosts:
    """Measured seconds per (part, hidden, workload) on this device in `dtype` (default: the device's compute
    dtype, `compute.resolve`), cached in a JSON file."""

    def __init__(self, cache_file: Path | None = None, dev: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        self.device = dev or device()
        self.dtype = dtype or torch_dtype(compute_for(self.device))
        self.cache_file = cache_file or sources.cache_dir() / "costs" / f"{_slug(device_name(self.device))}.json"
        self.cache: dict[str, float] = json.loads(self.cache_file.read_text()) if self.cache_file.exists() else {}

    def key(self, part: Part, hidden: int, work: Workload) -> str:
        described = json.dumps([part.model_dump(mode="json"), hidden, work.model_dump(mode="json"),
                                str(self.dtype), torch.__version__, KEY_VERSION], sort_keys=True)
        return hashlib.sha256(described.encode()).hexdigest()[:24]

    def fresh(self, part: Part, hidden: int, work: Workload) -> Callable[[], object]:
        """A runner for timing `part` now, whatever the cache holds."""
        torch.manual_seed(0)
        return _runner(part, hidden, work, self.device, self.dtype)

    def remember(self, seconds: dict[str, float], forget_the_rest: bool = False) -> None:
        """Store timings taken now; `forget_the_rest`: drop every other cached timing (taken under other
        conditions), so what this run needs is timed again."""
        self.cache = {**({} if forget_the_rest else self.cache), **seconds}
        self._save()

    def seconds(self, part: Part, hidden: int, work: Workload) -> float:
        key = self.key(part, hidden, work)
        if key not in self.cache:
            torch.manual_seed(0)
            self.cache[key] = time_call(_runner(part, hidden, work, self.device, self.dtype), self.device)
            self._save()
        return self.cache[key]

    def head_seconds(self, hidden: int, vocab: int, work: Workload) -> float:
        """The LM head on the last position of each of `batch` sequences (final norm and embedding lookups are
        negligible beside it)."""
        key = hashlib.sha256(json.dumps(["head", hidden, vocab, work.model_dump(mode="json"), str(self.dtype),
                                         torch.__version__, KEY_VERSION]).encode()).hexdigest()[:24]
        if key not in self.cache:
            x = torch.randn(work.batch, hidden, device=self.device, dtype=self.dtype)
            head = torch.randn(vocab, hidden, device=self.device, dtype=self.dtype)
            self.cache[key] = time_call(lambda: x @ head.T, self.device)
            self._save()
        return self.cache[key]

    def _save(self) -> None:
        self.cache_file.parent.mkdir(parents=True, exist_ok=True)
        partial = self.cache_file.with_suffix(f".{os.getpid()}.partial")  # one per process: ranks may share it
        partial.write_text(json.dumps(self.cache, indent=1, sort_keys=True))
        partial.replace(self.cache_file)


def calibrate(dev: torch.device | None = None, dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """Peak GEMM TFLOPS in `dtype` and copy bandwidth (GB/s) of a device, to compare the roofline against."""
    dev = dev or device()
    size = 4096 if dev.type == "cuda" else 1024
    a = torch.randn(size, size, device=dev, dtype=dtype)
    b = torch.randn(size, size, device=dev, dtype=dtype)
    gemm = time_call(lambda: a @ b, dev)
    source = torch.empty(64 * 1024**2, device=dev)  # 256 MiB of fp32: far beyond any cache
    target = torch.empty_like(source)
    copy = time_call(lambda: target.copy_(source), dev)
    return {"tflops": 2 * size**3 / gemm / 1e12, "bandwidth_gbps": 2 * source.numel() * 4 / copy / 1e9}


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in text).strip("-").lower() or "device"
