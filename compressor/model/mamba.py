"""A Mamba-2 mixer (NemotronH's `M` blocks), in plain torch, with its decode state.

Parameter names and shapes follow Hugging Face NemotronH: `in_proj` (gate z, conv input xBC, time step
dt), a depthwise causal `conv1d` with bias, per-head `A_log`, `D` and `dt_bias`, a gated group RMS norm
`norm`, and `out_proj`. The state-space scan is computed in its quadratic (attention-like) form over the
sequence in chunks of `CHUNK` tokens (exact, and simple), each chunk starting from the state the previous
one left; a one-token call with a `MambaCache` is the recurrent step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tailor.compressor.model.architecture import Mamba

CHUNK = 256  # tokens per quadratic scan: memory grows with CHUNK^2, not with the sequence length^2


@dataclass
class MambaCache:
    """What a Mamba-2 layer keeps per request: the convolution window and the SSM state."""

    conv: torch.Tensor  # [batch, conv_dim, conv_kernel - 1], the last inputs of the convolution
    ssm: torch.Tensor  # [batch, heads, head_dim, state], float32 as serving engines keep it
    length: int = 0


class GatedRMSNorm(nn.Module):
    """RMS norm of `x * silu(gate)` over groups of `group_size` channels."""

    def __init__(self, width: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.group_size, self.eps = group_size, eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float() * F.silu(gate.float())
        grouped = x.view(*x.shape[:-1], -1, self.group_size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * grouped.view_as(x).to(dtype)


def scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
         initial: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The selective scan of a whole chunk, in float32.

    x [batch, T, heads, head_dim]; dt [batch, T, heads] (after softplus); a [heads] (negative);
    b, c [batch, T, heads, state]; initial [batch, heads, head_dim, state] or None. Returns the outputs
    y_t = sum_{s<=t} exp(A_t - A_s) dt_s (c_t . b_s) x_s + exp(A_t) c_t . initial, with A the cumulative sum
    of dt * a, and the state after the last token.
    """
    log_decay = torch.cumsum(dt * a, dim=1)  # [batch, T, heads]
    steps = x.shape[1]
    gaps = log_decay[:, :, None, :] - log_decay[:, None, :, :]  # [batch, t, s, heads]
    causal = torch.ones(steps, steps, dtype=torch.bool, device=x.device).tril()
    decay = gaps.masked_fill(~causal[None, :, :, None], float("-inf")).exp()
    weights = torch.einsum("bthn,bshn->btsh", c, b) * decay
    inputs = x * dt[..., None]
    y = torch.einsum("btsh,bshp->bthp", weights, inputs)
    to_end = (log_decay[:, -1:, :] - log_decay).exp()  # [batch, s, heads]
    state = torch.einsum("bsh,bshp,bshn->bhpn", to_end, inputs, b)
    if initial is not None:
        y = y + torch.einsum("bthn,bhpn->bthp", c, initial) * log_decay.exp()[..., None]
        state = state + initial * log_decay[:, -1, :, None, None].exp()
    return y, state


class Mamba2(nn.Module):
    """A Mamba-2 token mixer: projections, causal convolution, selective scan, gated norm."""

    def __init__(self, part: Mamba, hidden: int, eps: float, time_step_min: float) -> None:
        super().__init__()
        self.part, self.time_step_min = part, time_step_min
        self.in_proj = nn.Linear(hidden, part.inner + part.conv_dim + part.num_heads, bias=False)
        self.conv1d = nn.Conv1d(part.conv_dim, part.conv_dim, part.conv_kernel, groups=part.conv_dim,
                                padding=part.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(part.num_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, part.num_heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(part.num_heads))
        self.norm = GatedRMSNorm(part.inner, part.inner // part.n_groups, eps)
        self.out_proj = nn.Linear(part.inner, hidden, bias=False)

    def new_cache(self, batch: int, like: torch.Tensor) -> MambaCache:
        p = self.part
        return MambaCache(like.new_zeros(batch, p.conv_dim, p.conv_kernel - 1),
                          like.new_zeros(batch, p.num_heads, p.head_dim, p.state_size, dtype=torch.float32))

    def _convolve(self, xbc: torch.Tensor, cache: MambaCache | None) -> torch.Tensor:
        """Causal depthwise convolution + SiLU over [batch, T, conv_dim]; updates the cache's window."""
        tokens = xbc.shape[1]
        sequence = xbc.transpose(1, 2)
        if cache is not None and cache.length:
            sequence = torch.cat([cache.conv.to(sequence.dtype), sequence], -1)
            out = F.conv1d(sequence, self.conv1d.weight, self.conv1d.bias, groups=self.part.conv_dim)
        else:
            out = self.conv1d(sequence)[..., :tokens]
        if cache is not None:
            window = F.pad(sequence, (max(0, cache.conv.shape[-1] - sequence.shape[-1]), 0))
            cache.conv.copy_(window[..., -cache.conv.shape[-1]:])
        return F.silu(out).transpose(1, 2)

    def mix(self, x: torch.Tensor, cache: MambaCache | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                              torch.Tensor]:
        """The input of out_proj, and the scan's B and C per group ([batch, T, groups, state] each)."""
        p = self.part
        batch, tokens, _ = x.shape
        z, xbc, dt = self.in_proj(x).split([p.inner, p.conv_dim, p.num_heads], dim=-1)
        xs, b, c = torch.split(self._convolve(xbc, cache), [p.inner, p.n_groups * p.state_size,
                                                            p.n_groups * p.state_size], dim=-1)
        b, c = (t.float().view(batch, tokens, p.n_groups, p.state_size) for t in (b, c))
        per_group = p.num_heads // p.n_groups
        xs = xs.float().view(batch, tokens, p.num_heads, p.head_dim)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp_min(self.time_step_min)
        b, c = b.repeat_interleave(per_group, 2), c.repeat_interleave(per_group, 2)
        a = -self.A_log.float().exp()
        state: torch.Tensor | None = cache.ssm if cache is not None and cache.length else None
        outputs = []
        for start in range(0, tokens, CHUNK):  # chunk by chunk, each starting from the state the last one left
            part = slice(start, start + CHUNK)
            y, state = scan(xs[:, part], dt[:, part], a, b[:, part], c[:, part], state)
            outputs.append(y)
        y = torch.cat(outputs, 1)
        if cache is not None and state is not None:
            cache.ssm.copy_(state)
            cache.length += tokens
        y = y + xs * self.D.float()[:, None]
        return self.norm(y.reshape(batch, tokens, p.inner), z).to(x.dtype), b[:, :, ::per_group], c[:, :, ::per_group]

    def forward(self, x: torch.Tensor, cache: MambaCache | None = None) -> torch.Tensor:
        result: torch.Tensor = self.out_proj(self.mix(x, cache)[0])
        return result
