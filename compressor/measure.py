"""Time block variants with torch on this machine's device, as Puzzle measures costs on the target.

Each part of a block (attention with its KV cache, Mamba-2 decode step with its state, dense MLP,
mixture of experts, linear replacement) is built at its real shapes with random BF16 weights and timed
on the current device (CUDA where present, else CPU). Results are cached per device in a JSON file,
so a search run re-measures nothing it has seen. Importing this module imports torch: the operator
never does.
"""

from __future__ import annotations

import hashlib
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tailor.compressor import sources
from tailor.compressor.architecture import Attention, Linear, Mamba, Mlp, Moe, Part
from tailor.compressor.costs import Phase, Workload
from tailor.compressor.modeling import GatedMlp, SelfAttention

DTYPE = torch.bfloat16
KEY_VERSION = 2  # bump when the timed modules change, so cached timings are not reused


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def device_name(dev: torch.device) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


class _MambaStep(nn.Module):
    """One Mamba-2 decode step: projections, convolution window shift, SSM state update."""

    def __init__(self, part: Mamba, hidden: int) -> None:
        super().__init__()
        self.part = part
        self.in_proj = nn.Linear(hidden, part.inner + part.conv_dim + part.num_heads, bias=False)
        self.conv = nn.Parameter(torch.randn(part.conv_dim, part.conv_kernel))
        self.a = nn.Parameter(-torch.rand(part.num_heads))
        self.out_proj = nn.Linear(part.inner, hidden, bias=False)

    def forward(self, x: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor) -> torch.Tensor:
        p = self.part
        batch = x.shape[0]
        z, xbc, dt = self.in_proj(x[:, 0]).split([p.inner, p.conv_dim, p.num_heads], dim=-1)
        window = torch.cat([conv_state[:, :, 1:], xbc.unsqueeze(-1)], dim=-1)
        conv_state.copy_(window)
        xbc = F.silu((window * self.conv).sum(-1))
        xs, b, c = torch.split(xbc, [p.inner, p.n_groups * p.state_size, p.n_groups * p.state_size], dim=-1)
        heads_per_group = p.num_heads // p.n_groups
        b = b.view(batch, p.n_groups, 1, p.state_size).repeat_interleave(heads_per_group, 1)
        c = c.view(batch, p.n_groups, 1, p.state_size).repeat_interleave(heads_per_group, 1)
        dt = F.softplus(dt).view(batch, p.num_heads, 1, 1)
        xs = xs.view(batch, p.num_heads, p.head_dim, 1)
        ssm_state.mul_(torch.exp(dt * self.a.view(1, -1, 1, 1)).float()).add_((dt * xs * b).float())
        y = (ssm_state @ c.float().transpose(-1, -2)).to(x.dtype).view(batch, p.inner)
        result: torch.Tensor = self.out_proj(y * F.silu(z))
        return result.unsqueeze(1)


class _Mlp(nn.Module):
    def __init__(self, hidden: int, width: int, gated: bool) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, width * (2 if gated else 1), bias=False)
        self.down = nn.Linear(width, hidden, bias=False)
        self.gated = gated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden: torch.Tensor = self.up(x)
        if self.gated:
            gate, up = hidden.chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        else:
            hidden = F.relu(hidden).square()
        result: torch.Tensor = self.down(hidden)
        return result


class _Moe(nn.Module):
    """Router, top-k, experts run on the tokens routed to them, shared expert, latent projections."""

    def __init__(self, part: Moe, hidden: int) -> None:
        super().__init__()
        self.part = part
        inner = part.latent_size or hidden
        self.router = nn.Linear(hidden, part.num_experts, bias=False)
        self.experts = nn.ModuleList(_Mlp(inner, part.expert_width, part.gated) for _ in range(part.num_experts))
        self.shared = _Mlp(hidden, part.shared_width, gated=False) if part.shared_width else None
        self.down_latent = nn.Linear(hidden, inner, bias=False) if part.latent_size else nn.Identity()
        self.up_latent = nn.Linear(inner, hidden, bias=False) if part.latent_size else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(flat).sigmoid().topk(self.part.top_k, dim=-1)
        latent = self.down_latent(flat)
        routed = torch.zeros_like(latent)
        for expert in chosen.unique().tolist():
            rows, slot = (chosen == expert).nonzero(as_tuple=True)
            routed.index_add_(0, rows, self.experts[expert](latent[rows]) * weights[rows, slot, None])
        out: torch.Tensor = self.up_latent(routed)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view_as(x)


def _runner(part: Part, hidden: int, work: Workload, dev: torch.device) -> Callable[[], object]:
    """A closure that runs the part once on the workload, inputs and caches prepared beforehand."""
    tokens = 1 if work.phase is Phase.DECODE else work.context
    x = torch.randn(work.batch, tokens, hidden, device=dev, dtype=DTYPE)
    if isinstance(part, Attention):  # the project's own attention, as the models it compresses run it
        attention = SelfAttention(part, hidden, rope_theta=10000.0).to(dev, DTYPE)
        if work.phase is not Phase.DECODE:
            return lambda: attention(x)
        cache = attention.new_cache(work.batch, work.context + 1, x)

        def step() -> torch.Tensor:
            cache.length = work.context  # the new token goes after `context` cached ones, every call
            result: torch.Tensor = attention(x, cache)
            return result

        return step
    if isinstance(part, Mamba):
        if work.phase is not Phase.DECODE:
            raise ValueError("Mamba prefill needs the chunked-scan kernels; only decode steps are timed here")
        mamba = _MambaStep(part, hidden).to(dev, DTYPE)
        conv_state = torch.zeros(work.batch, part.conv_dim, part.conv_kernel, device=dev, dtype=DTYPE)
        ssm_state = torch.zeros(work.batch, part.num_heads, part.head_dim, part.state_size, device=dev,
                                dtype=torch.float32)
        return lambda: mamba(x, conv_state, ssm_state)  # float32 state updated in place, as engines keep it
    module: nn.Module
    if isinstance(part, Mlp):
        module = GatedMlp(hidden, part.intermediate_size) if part.gated else _Mlp(hidden, part.intermediate_size, False)
    elif isinstance(part, Moe):
        module = _Moe(part, hidden)
    elif isinstance(part, Linear):
        module = nn.Linear(hidden, hidden, bias=False)
    else:
        return lambda: x
    module = module.to(dev, DTYPE)
    return lambda: module(x)


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


class MeasuredCosts:
    """Measured seconds per (part, hidden, workload) on this device, cached in a JSON file."""

    def __init__(self, cache_file: Path | None = None, dev: torch.device | None = None) -> None:
        self.device = dev or device()
        self.cache_file = cache_file or sources.cache_dir() / "costs" / f"{_slug(device_name(self.device))}.json"
        self.cache: dict[str, float] = json.loads(self.cache_file.read_text()) if self.cache_file.exists() else {}

    def key(self, part: Part, hidden: int, work: Workload) -> str:
        described = json.dumps([part.model_dump(mode="json"), hidden, work.model_dump(mode="json"),
                                str(DTYPE), torch.__version__, KEY_VERSION], sort_keys=True)
        return hashlib.sha256(described.encode()).hexdigest()[:24]

    def seconds(self, part: Part, hidden: int, work: Workload) -> float:
        key = self.key(part, hidden, work)
        if key not in self.cache:
            torch.manual_seed(0)
            self.cache[key] = time_call(_runner(part, hidden, work, self.device), self.device)
            self._save()
        return self.cache[key]

    def head_seconds(self, hidden: int, vocab: int, work: Workload) -> float:
        """The LM head on the last position of each of `batch` sequences (final norm and embedding lookups are
        negligible beside it)."""
        key = hashlib.sha256(json.dumps(["head", hidden, vocab, work.model_dump(mode="json"), str(DTYPE),
                                         torch.__version__, KEY_VERSION]).encode()).hexdigest()[:24]
        if key not in self.cache:
            x = torch.randn(work.batch, hidden, device=self.device, dtype=DTYPE)
            head = torch.randn(vocab, hidden, device=self.device, dtype=DTYPE)
            self.cache[key] = time_call(lambda: x @ head.T, self.device)
            self._save()
        return self.cache[key]

    def _save(self) -> None:
        self.cache_file.parent.mkdir(parents=True, exist_ok=True)
        partial = self.cache_file.with_suffix(".partial")
        partial.write_text(json.dumps(self.cache, indent=1, sort_keys=True))
        partial.replace(self.cache_file)


def calibrate(dev: torch.device | None = None) -> dict[str, float]:
    """Peak BF16 GEMM TFLOPS and copy bandwidth (GB/s) of a device, to compare the roofline against."""
    dev = dev or device()
    size = 4096 if dev.type == "cuda" else 1024
    a = torch.randn(size, size, device=dev, dtype=DTYPE)
    b = torch.randn(size, size, device=dev, dtype=DTYPE)
    gemm = time_call(lambda: a @ b, dev)
    source = torch.empty(64 * 1024**2, device=dev)  # 256 MiB of fp32: far beyond any cache
    target = torch.empty_like(source)
    copy = time_call(lambda: target.copy_(source), dev)
    return {"tflops_bf16": 2 * size**3 / gemm / 1e12, "bandwidth_gbps": 2 * source.numel() * 4 / copy / 1e9}


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in text).strip("-").lower() or "device"
