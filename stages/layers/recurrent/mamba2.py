"""Mamba2: a selective state-space mixer with a fixed state per head (Nemotron-H).

Shapes: T = tokens in this step, H = hidden size, Hm = heads, P = head dim, N = state size, G =
groups (B and C are shared by the Hm / G heads of a group), I = Hm P, C = I + 2 G N (the
convolution's channels: x, B, C), Kc = the convolution's kernel. The math is families/spec/recurrent.py's
`Mamba2Spec`; float32 reference semantics are transformers' `NemotronHMamba2Mixer` with its
torch paths (`mamba2_chunk_scan` for a step of many tokens, `mamba2_selective_state_update` for
one): per head, with a = exp(dt A) (a number: A is a scalar per head),

    S = a_t S + dt_t x_t B_tᵀ;   y_t = S C_t + D x_t                S [P, N]

`chunked_scan` computes the same a chunk at a time (the config's chunk_size): within a chunk the
quadratic form (C_l · B_s, decayed by exp(A_l + ... + A_{s+1})), across chunks the state carried
(the reference combines every earlier chunk's state at once; carried one chunk to the next here,
which sums the same terms in another order: logits agree to ~1e-6, and a long prefill holds one
chunk's matrices, not every chunk's).

dt's lower clamp. The reference's chunked path clamps dt = softplus(dt + dt_bias) below at the
config's `time_step_min` (transformers sets its `time_step_limit` so), and its one-token path does
not clamp at all: the two forms of one model disagree wherever dt falls under it. A session must
be one computation however its steps are cut (a replacement replays in chunks what was decoded a
token at a time), so this module clamps in both forms at `Mamba2Spec.dt_min`, the lower bound of
the config's `time_step_limit` (0: none), as the published model's own code and mamba_ssm's
kernels do; families/models/nemotron_h.py says what that means against transformers.

The session's state and its rollback are Gated DeltaNet's (layers/state.py): a step hands its
store NEW state tensors through `fold`, whose inputs per token (the convolution's inputs and dt,
`Mamba2Spec.cache.replay_width`) are what a rollback folds in again. No compiled form: a decode
step runs this module eagerly (the compiled runner falls back per layer kind).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tessera.stages.families.spec.recurrent import Mamba2Spec
from tessera.stages.layers.attention import StepRows
from tessera.stages.layers.norm import GroupGatedRMSNorm
from tessera.stages.layers.recurrent.short_conv import causal_conv
from tessera.stages.layers.state import RecurrentState, fold_sessions


def recurrent_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan token by token. x [T, Hm, P], dt [T, Hm] (softplus'd, clamped), a [Hm] (A, < 0), b, c
    [T, Hm, N] (each head's group's); state [Hm, P, N]. Returns (y [T, Hm, P] without D's skip, the
    final state, a new tensor)."""
    outs = []
    for t in range(x.shape[0]):
        decay = torch.exp(dt[t] * a)[:, None, None]  # [Hm, 1, 1]
        state = state * decay + (dt[t, :, None] * b[t])[:, None, :] * x[t, :, :, None]  # [Hm, P, N]
        outs.append(torch.bmm(state, c[t, :, :, None])[..., 0])  # [Hm, P]
    return torch.stack(outs), state


def segment_sum(x: torch.Tensor) -> torch.Tensor:
    """[..., c] -> [..., c, c]: entry (i, j) the sum of x over (j, i] for j <= i, -inf above (the
    reference's `segment_sum`: cumulative sums of a masked copy, steadier than differences)."""
    c = x.shape[-1]
    x = x[..., None].expand(*x.shape, c)
    below = torch.ones(c, c, dtype=torch.bool, device=x.device).tril(-1)
    sums = x.masked_fill(~below, 0).cumsum(dim=-2)
    return sums.masked_fill(~torch.ones(c, c, dtype=torch.bool, device=x.device).tril(), float("-inf"))


def chunked_scan(x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                 state: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan a chunk of `chunk` tokens at a time (same arguments and result as `recurrent_scan`).
    A step shorter than a chunk is one chunk of its own length; a longer one is padded to whole
    chunks with rows that change nothing (dt 0: no decay, no input)."""
    t = x.shape[0]
    chunk = min(chunk, t)
    pad = (-t) % chunk
    x_dt = F.pad(x * dt[..., None], (0, 0, 0, 0, 0, pad))  # [T', Hm, P]: the input, discretised
    a_dt = F.pad(a * dt, (0, 0, 0, pad))  # [T', Hm]: the log of each token's decay
    b, c = (F.pad(m, (0, 0, 0, 0, 0, pad)) for m in (b, c))
    out = torch.empty_like(x_dt)
    for lo in range(0, t + pad, chunk):
        hi = lo + chunk
        x_i, b_i, c_i = x_dt[lo:hi], b[lo:hi], c[lo:hi]
        log_decay = a_dt[lo:hi].t()  # [Hm, c]
        cum = log_decay.cumsum(-1)  # [Hm, c]
        mixing = torch.einsum("lhn,shn->hls", c_i, b_i) * segment_sum(log_decay).exp()  # [Hm, c, c]
        within = torch.einsum("hls,shp->lhp", mixing, x_i)
        carried = torch.einsum("lhn,hpn->lhp", c_i, state) * cum.exp().t()[..., None]
        out[lo:hi] = within + carried
        to_end = (cum[:, -1:] - cum).exp()  # [Hm, c]: decay from each token to the chunk's end
        state = state * cum[:, -1].exp()[:, None, None] + torch.einsum("lhn,hl,lhp->hpn", b_i, to_end, x_i)
    return out[:t], state


class Mamba2Mixer(nn.Module):
    """Kind "mamba2" (module docstring). Engine names: w_in (z, xBC, dt), conv, conv_bias, dt_bias, A_log,
    D, out_norm, w_out."""

    def __init__(self, hidden: int, spec: Mamba2Spec, eps: float) -> None:
        super().__init__()
        self.spec = spec
        self.w_in = nn.Linear(hidden, spec.in_size, bias=spec.proj_bias)
        self.conv = nn.Parameter(torch.empty(spec.conv_channels, 1, spec.conv_kernel))
        self.conv_bias = nn.Parameter(torch.empty(spec.conv_channels)) if spec.conv_bias else None
        self.dt_bias = nn.Parameter(torch.empty(spec.num_heads))
        self.A_log = nn.Parameter(torch.empty(spec.num_heads))
        self.D = nn.Parameter(torch.empty(spec.num_heads))
        self.out_norm = GroupGatedRMSNorm(spec.inner, spec.num_groups, eps)
        self.w_out = nn.Linear(spec.inner, hidden, bias=spec.proj_bias)

    def fold(self, inputs: torch.Tensor, state: torch.Tensor, window: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One session's rows through the convolution and the scan: inputs [T, C + Hm] (xBC before the
        convolution, dt) from `state` and `window` -> (y [T, I] in the inputs' dtype, D's skip
        included; the new state; the new window)."""
        s, t = self.spec, inputs.shape[0]
        hm, n = s.num_heads, s.state_size
        xbc, dt = inputs.split([s.conv_channels, hm], dim=-1)
        xbc, window = causal_conv(window, xbc, self.conv, self.conv_bias)
        x, b, c = xbc.float().split([s.inner, s.num_groups * n, s.num_groups * n], dim=-1)
        x = x.view(t, hm, s.head_dim)
        b, c = (m.view(t, s.num_groups, n).repeat_interleave(hm // s.num_groups, dim=1) for m in (b, c))  # [T, Hm, N]
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(min=s.dt_min)  # [T, Hm]
        a = -self.A_log.float().exp()  # [Hm]
        if t == 1:
            y, state = recurrent_scan(x, dt, a, b, c, state)
        else:
            y, state = chunked_scan(x, dt, a, b, c, state, s.chunk)
        y = y + self.D.float()[:, None] * x
        return y.reshape(t, s.inner).to(inputs.dtype), state, window

    def step(self, inputs: torch.Tensor, store: RecurrentState) -> torch.Tensor:
        """One session's rows [T, C + Hm] folded into its store (after what a rollback left pending)."""
        return store.step(inputs, self.fold)

    def forward(self, x: torch.Tensor, ctx: StepRows, cache: RecurrentState | Sequence[RecurrentState]) -> torch.Tensor:
        """x [T, H] -> [T, H]. cache: the session's store, or one per segment of a stacked step."""
        s = self.spec
        z, inputs = self.w_in.forward(x).split([s.inner, s.conv_channels + s.num_heads], dim=-1)
        # a StepContext's segments; a compiled step's rows never run this layer
        y = fold_sessions(inputs, getattr(ctx, "segments", ()), cache, self.fold)  # [T, I]
        return self.w_out.forward(self.out_norm.forward(y, z))
