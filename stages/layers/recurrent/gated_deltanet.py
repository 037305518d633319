"""Gated DeltaNet: linear attention with a fixed-size recurrent state (Qwen3-Next, Qwen3.5).

Shapes: T = tokens in this step, H = hidden size, Hk / Hv = key / value heads, dk / dv = their
dims, C = 2 Hk dk + Hv dv (the convolution's channels: q, k, v), Kc = the convolution's kernel.
The math is families/spec/recurrent.py's `GatedDeltaNetSpec`; float32 reference semantics are
transformers' `Qwen3NextGatedDeltaNet` / `Qwen3_5GatedDeltaNet` with its torch kernels
(`torch_chunk_gated_delta_rule` for a step of many tokens, `torch_recurrent_gated_delta_rule`
for one): the same algorithm in the same order, so logits agree to ~1e-6.

Per session, a step runs its own rows through the convolution (over the session's window of
the last Kc - 1 inputs, then its rows) and the recurrence (from the session's state), and
hands the store NEW state tensors (layers/state.py keeps the old ones as checkpoints, so the
state is never written in place). A stacked step of several sessions runs the projections
once over every row and the recurrence per session, each from its own state (as attention
runs per session over its own cache). Before its new rows, a session folds in the inputs a
rollback left pending (`RecurrentState.take_pending`): the recurrence's work for those tokens
again, no projection.

The recurrence over T tokens, per value head (S [dk, dv], q, k [dk], v [dv], scalars g <= 0, beta),
token by token delta_rule.py's `recurrent_delta_rule` (KDA's too, its g one number per key channel):

    S = exp(g_t) S;   S = S + k_t ((v_t - k_tᵀ S) beta_t)ᵀ;   o_t = q_tᵀ S

`chunked_delta_rule` computes the same in chunks of 64 tokens: within a chunk, the UT transform
(a unit lower-triangular solve) turns the T sequential updates into matmuls; across chunks,
the state carries. No compiled form yet: a decode step runs this module eagerly (the compiled
runner falls back per layer kind, stages/engine/compiled/inductor.py).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tessera.stages.families.spec.recurrent import GatedDeltaNetSpec
from tessera.stages.layers.attention import StepRows
from tessera.stages.layers.norm import GatedRMSNorm
from tessera.stages.layers.recurrent.delta_rule import CHUNK, L2_EPS, recurrent_delta_rule
from tessera.stages.layers.recurrent.short_conv import causal_conv
from tessera.stages.layers.state import RecurrentState, fold_sessions


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the reference's form: times rsqrt)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule in chunks of `chunk` tokens (same arguments and result as delta_rule.py's
    `recurrent_delta_rule`, g [Hv, T, 1]: a decay per head; the reference's algorithm, step for step).
    A step shorter than a chunk is one chunk of its own length: the reference pads it to 64 with rows
    that change nothing (beta and g 0, after every real row of a lower-triangular system), and the
    padding cost a 5-token draft block 8x the work (bench/rollback.py's shape: 36 ms against 4.6)."""
    hv, t, dk = k.shape
    g = g[..., 0]  # [Hv, T]: one decay per head, the same for every key channel
    chunk = min(chunk, t)
    pad = (-t) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // chunk
    v_beta = v * beta[..., None]
    k_beta = k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(hv, n, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    decay = g.reshape(hv, n, chunk).cumsum(-1)  # [Hv, n, c]: log of the decay from the chunk's start
    above = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pairs = (decay[..., :, None] - decay[..., None, :]).masked_fill(above, float("-inf")).exp()  # [Hv, n, c, c]
    system = (k_beta @ k.transpose(-1, -2)) * pairs
    intra = (q @ k.transpose(-1, -2)) * pairs
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False,
                                              unitriangular=True)
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]  # [Hv, n, 1, 1]
    out = torch.empty_like(new_values)  # [Hv, n, c, dv]
    for i in range(n):
        v_new = new_values[:, i] - k_decayed[:, i] @ state
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(hv, n * chunk, -1)[:, :t], state


class GatedDeltaNet(nn.Module):
    """Kind "gated_deltanet" (module docstring). Engine names: w_in, conv, A_log, dt_bias, out_norm, w_out."""

    def __init__(self, hidden: int, spec: GatedDeltaNetSpec, eps: float) -> None:
        super().__init__()
        self.spec = spec
        self.w_in = nn.Linear(hidden, spec.in_size, bias=False)
        self.conv = nn.Parameter(torch.empty(spec.conv_channels, 1, spec.conv_kernel))
        self.A_log = nn.Parameter(torch.empty(spec.num_value_heads))
        self.dt_bias = nn.Parameter(torch.empty(spec.num_value_heads))
        self.out_norm = GatedRMSNorm(spec.value_dim, eps)
        self.w_out = nn.Linear(spec.value_size, hidden, bias=False)

    def split(self, proj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """W_in's output [T, in_size] -> (the recurrence's inputs [T, C + 2 Hv]: q, k, v, b, a; z [T, Hv dv])."""
        s, t = self.spec, proj.shape[0]
        c, vs, hv = s.conv_channels, s.value_size, s.num_value_heads
        if s.layout == "split":
            return torch.cat((proj[:, :c], proj[:, c + vs :]), dim=-1), proj[:, c : c + vs]
        # grouped (Qwen3-Next): per key head [q dk, k dk, r v heads, r z heads], then per key head [r b, r a]
        hk = s.num_key_heads
        r = hv // hk
        qkvz = proj[:, : c + vs].view(t, hk, 2 * s.key_dim + 2 * r * s.value_dim)
        q, k, v, z = qkvz.split([s.key_dim, s.key_dim, r * s.value_dim, r * s.value_dim], dim=-1)
        b, a = proj[:, c + vs :].view(t, hk, 2 * r).split([r, r], dim=-1)
        inputs = torch.cat([x.reshape(t, -1) for x in (q, k, v, b, a)], dim=-1)
        return inputs, z.reshape(t, vs)

    def fold(self, inputs: torch.Tensor, state: torch.Tensor, window: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One session's rows through the convolution and the recurrence: inputs [T, C + 2 Hv] from
        `state` and `window` -> (o [T, Hv, dv] in the inputs' dtype, the new state, the new window)."""
        s, t = self.spec, inputs.shape[0]
        hv, hk = s.num_value_heads, s.num_key_heads
        mixed, ba = inputs[:, : s.conv_channels], inputs[:, s.conv_channels :]
        mixed, window = causal_conv(window, mixed, self.conv)
        q, k, v = mixed.split([s.key_size, s.key_size, s.value_size], dim=-1)
        # [Hv, T, d] in float32 (the reference computes the recurrence so); each q/k head serves Hv/Hk v heads
        q, k = (x.float().view(t, hk, s.key_dim).transpose(0, 1).repeat_interleave(hv // hk, dim=0) for x in (q, k))
        v = v.float().view(t, hv, s.value_dim).transpose(0, 1)
        b, a = ba[:, :hv].float(), ba[:, hv:].float()
        beta = b.sigmoid().t()  # [Hv, T]
        g = (-self.A_log.float().exp() * F.softplus(a + self.dt_bias.float())).t()[..., None]  # [Hv, T, 1]
        q, k = l2norm(q) * s.key_dim ** -0.5, l2norm(k)
        rule = recurrent_delta_rule if t == 1 else chunked_delta_rule
        out, state = rule(q, k, v, g, beta, state)
        return out.transpose(0, 1).to(inputs.dtype), state, window  # [T, Hv, dv]

    def step(self, inputs: torch.Tensor, store: RecurrentState) -> torch.Tensor:
        """One session's rows [T, C + 2 Hv] folded into its store (after what a rollback left pending)."""
        return store.step(inputs, self.fold)

    def forward(self, x: torch.Tensor, ctx: StepRows, cache: RecurrentState | Sequence[RecurrentState]) -> torch.Tensor:
        """x [T, H] -> [T, H]. cache: the session's store, or one per segment of a stacked step."""
        inputs, z = self.split(self.w_in.forward(x))
        # a StepContext's segments; a compiled step's rows never run this layer
        out = fold_sessions(inputs, getattr(ctx, "segments", ()), cache, self.fold)
        s = self.spec
        out = self.out_norm.forward(out, z.view(-1, s.num_value_heads, s.value_dim))  # [T, Hv, dv]
        return self.w_out.forward(out.reshape(x.shape[0], s.value_size))
