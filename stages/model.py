"""The Llama-family decoder, as one short file: cache, rotary embedding, block.

Shapes use: T = tokens in this step, S = positions attended (cache length),
H = hidden size, A = query heads, K = key/value heads, D = head dim, I = MLP width.
There is no batch dimension: the residual stream is [T, H]. A step of several
sessions stacks their rows (T = the sum of theirs) and names each one's rows in a
`Segment`: projections and MLP run once over the stack, attention per session over
its own cache, so every session keeps its own length and position pointer.

Two fusions pay on a CPU, where a 135M model's decode is dominated by per-op
overhead rather than arithmetic: q, k and v come from ONE matmul against a
stacked weight, and so do the MLP's gate and up projections. The KV cache is
allocated per session in chunks as it fills and written in place at the positions given; its
`length` is the position pointer, so rolling back is moving that pointer and the
next write overwrites what lay beyond it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tessera.stages.errors import ContextOverflow, UnsupportedModel
from tessera.stages.spec import ModelSpec

# A layer's cache as a step sees it: [K, S, D] of one session, or one per session of a stacked step.
KVRows = torch.Tensor | Sequence[torch.Tensor]


KV_CHUNK = 256
"""Positions a session's cache grows by. A cache is not allocated for its whole capacity
up front: a session that stops after 40 tokens of a 4,096 capacity holds 256 positions,
not 4,096 (SmolLM2-135M, 30 layers: 11.8 MB, not 189 MB). Growing copies what the
cache holds, once per chunk: a 2,048-token answer copies 8 times, each at most its
current size (a memcpy of a few MB to a few dozen, against 256 decode steps)."""


def kv_positions(need: int, capacity: int) -> int:
    """Positions a cache that must hold `need` of them allocates: whole chunks, at most `capacity`
    (the one rule both the cache and a server's memory accounting follow)."""
    return min(capacity, -(-need // KV_CHUNK) * KV_CHUNK)


class KVCache:
    """Keys and values of one session for a run of consecutive layers.

    keys, values: [layers, K, allocated, D], grown in chunks of KV_CHUNK positions as
    writes reach them, up to `capacity` (what the session may ever hold). `length` is the
    position pointer: positions [0, length) are valid; a write at position p first moves
    the pointer to p (a rollback), then past what it wrote.
    """

    def __init__(
        self,
        num_layers: int,
        spec: ModelSpec,
        capacity: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.shape = (num_layers, spec.num_kv_heads, 0, spec.head_dim)
        self.keys = torch.zeros(self.shape, dtype=dtype, device=device)
        self.values = torch.zeros(self.shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.length = 0

    @property
    def allocated(self) -> int:
        """Positions the cache holds memory for now."""
        return self.keys.shape[2]

    def reserve(self, start: int, n_tokens: int) -> None:
        """Check that positions [start, start + n_tokens) can be written, grow the cache to hold
        them, and move the pointer there."""
        if start < 0 or start > self.length:
            raise ContextOverflow(
                f"write at position {start!r} but the cache holds positions [0, {self.length})"
            )
        if start + n_tokens > self.capacity:
            raise ContextOverflow(
                f"positions up to {start + n_tokens} exceed this session's capacity of {self.capacity}"
            )
        if start + n_tokens > self.allocated:
            self._grow(kv_positions(start + n_tokens, self.capacity), keep=start)
        self.length = start + n_tokens

    def _grow(self, positions: int, *, keep: int) -> None:
        """Reallocate for `positions`, copying the valid positions [0, keep)."""
        layers, heads, _, dim = self.shape
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = torch.zeros((layers, heads, positions, dim), dtype=old.dtype, device=old.device)
            new[:, :, :keep] = old[:, :, :keep]  # [layers, K, S, D]
            setattr(self, name, new)

    def rollback(self, position: int) -> None:
        """Forget every position >= `position` (a pointer move; nothing is erased)."""
        if not 0 <= position <= self.length:
            raise ContextOverflow(
                f"cannot roll back to {position!r}: the cache holds positions [0, {self.length})"
            )
        self.length = position

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class Rotary(nn.Module):
    """RoPE frequencies; `cos_sin(positions)` gives the tables every block of a step shares."""

    def __init__(self, spec: ModelSpec, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_frequencies(spec, device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables `apply_rope` takes, [T, 1, D]: (cos, cos) and (-sin, sin) per half.

        Computed in float32 whatever the model dtype, then cast to the activations' `dtype`,
        as the reference implementation does. Built once per step and shared by every
        layer, so that a layer's rotation is 4 kernels.
        """
        angles = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos, sin = angles.cos(), angles.sin()
        cos, sin = torch.cat((cos, cos), -1).to(dtype), torch.cat((-sin, sin), -1).to(dtype)
        return cos[:, None, :], sin[:, None, :]  # [T, 1, D]


def rope_frequencies(spec: ModelSpec, device: torch.device | str = "cpu") -> torch.Tensor:
    """Inverse frequencies [D/2], with Llama-3 or linear scaling when the config asks."""
    d = spec.head_dim
    inv_freq = 1.0 / (
        spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d)
    )
    scaling = spec.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_context = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_context / low, old_context / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind not in ("default", None):
        raise UnsupportedModel(f"rope_scaling type {kind!r} is not supported (linear, llama3)")
    return inv_freq


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [T, heads, D] by `Rotary.cos_sin`'s tables (the half-split layout Hugging Face uses):
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), the same products and sums as the reference."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # (x2, x1)
    return x * cos + swapped * sin


@dataclass
class StepContext:
    """What every block of one forward step shares."""

    start: int  # position of the step's first token
    cos: torch.Tensor  # [T, 1, D/2]
    sin: torch.Tensor
    mask: torch.Tensor | None  # [T, S] bool, True = may attend; None = attend to everything
    # A stacked step of several sessions (see `Segment`): the rows of each, in order. Empty: the
    # step is one session's, `start` and `mask` above are its own, and keys/values are its cache.
    segments: tuple[Segment, ...] = ()


@dataclass(frozen=True)
class Segment:
    """One session's rows [lo, hi) in a stacked step, at positions [start, start + hi - lo).

    Sessions at different positions and of different lengths share a step's weight passes
    (the projections and the MLP run once over all rows); attention stays per session,
    over its own cache (ragged: each attends to its own length), with the same kernel a
    solo step uses.
    """

    lo: int
    hi: int
    start: int
    mask: torch.Tensor | None  # as StepContext.mask, for this session's rows


def attention_mask(start: int, n_tokens: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Causal mask [T, S] for queries at [start, start + T) over keys [0, start + T).

    None when plain causal attention over the whole cache is right: a single query
    with no window in reach, or a prefill from position 0 without a window.
    """
    total = start + n_tokens
    if window is None or total <= window:
        if n_tokens == 1 or start == 0:
            return None
    query = torch.arange(start, total, device=device)[:, None]
    key = torch.arange(total, device=device)[None, :]
    allowed = key <= query
    if window is not None:
        allowed &= key > query - window
    return allowed


class Attention(nn.Module):
    """Grouped-query attention with one stacked q/k/v projection.

    The projections are called as modules, so that a quantized span can hold
    `tessera.stages.quant` linears in their place (same call, integer weights)."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.wqkv = nn.Linear(spec.hidden_size, spec.q_size + 2 * spec.kv_size, bias=spec.attention_bias)
        self.wo = nn.Linear(spec.q_size, spec.hidden_size, bias=False)
        self.scale = 1.0 / math.sqrt(spec.head_dim)

    def forward(
        self, x: torch.Tensor, ctx: StepContext, keys: KVRows, values: KVRows
    ) -> torch.Tensor:
        """x [T, H] -> [T, H]. keys, values: the layer's cache [K, S, D] — or, for a stacked
        step (`ctx.segments`), one such cache per segment."""
        spec = self.spec
        t = x.shape[0]
        a, k, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        qkv = self.wqkv.forward(x)  # [T, (A + 2K) D]
        qk = apply_rope(qkv[:, : (a + k) * d].view(t, a + k, d), ctx.cos, ctx.sin)  # [T, A + K, D]
        v = qkv[:, (a + k) * d :].view(t, k, d)  # [T, K, D]
        if not ctx.segments:
            assert isinstance(keys, torch.Tensor) and isinstance(values, torch.Tensor), "one session: one cache"
            out = self.attend(qk, v, ctx.start, ctx.mask, keys, values)
        else:
            assert len(keys) == len(values) == len(ctx.segments), "a stacked step: one cache per segment"
            out = torch.cat([  # [T, A D], each session over its own cache
                self.attend(qk[s.lo : s.hi], v[s.lo : s.hi], s.start, s.mask, keys_s, values_s)
                for s, keys_s, values_s in zip(ctx.segments, keys, values)
            ])
        return self.wo.forward(out)

    def attend(
        self, qk: torch.Tensor, v: torch.Tensor, start: int, mask: torch.Tensor | None,
        keys: torch.Tensor, values: torch.Tensor,
    ) -> torch.Tensor:
        """One session's rows: write k, v [T, K, D] at [start, start + T) of its cache, then
        attend. qk [T, A + K, D] (rotated). Returns [T, A D]."""
        spec = self.spec
        t = qk.shape[0]
        a, k, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        end = start + t
        keys[:, start:end] = qk[:, a:].transpose(0, 1)  # cache [K, S, D]
        values[:, start:end] = v.transpose(0, 1)
        if t == 1:
            lo = 0 if spec.sliding_window is None else max(0, end - spec.sliding_window)
            return grouped_decode_attention(qk[:, :a], keys[:, lo:end], values[:, lo:end], self.scale)
        # prefill and multi-token steps: the same kernel the reference uses, so logits agree closely
        g = a // k
        q = qk[None, :, :a].transpose(1, 2)  # [1, A, T, D]
        return F.scaled_dot_product_attention(
            q,
            keys[None, :, :end].repeat_interleave(g, dim=1),  # [1, A, S, D]
            values[None, :, :end].repeat_interleave(g, dim=1),
            attn_mask=mask,
            is_causal=mask is None,
        )[0].transpose(0, 1).reshape(t, a * d)  # [T, A D]


def grouped_decode_attention(
    q_rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query position, grouped-query attention without repeating K/V.

    q_rows [1, A, D]; keys, values [K, S, D]. The G = A / K query heads that share a
    KV head are stacked as rows, so one bmm per KV head does the work. Returns [1, A D].
    """
    k, _, d = keys.shape
    a = q_rows.shape[1]
    q = q_rows.reshape(k, a // k, d)  # [K, G, D] (heads h = kv * G + g)
    scores = torch.bmm(q, keys.transpose(1, 2)).mul_(scale)  # [K, G, S]
    return torch.bmm(scores.softmax(-1), values).reshape(1, a * d)  # [1, A D]


class MLP(nn.Module):
    """SwiGLU with one stacked gate/up projection."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.width = spec.intermediate_size
        self.w_gate_up = nn.Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False)
        self.w_down = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w_gate_up.forward(x).split(self.width, dim=-1)  # [T, I] each
        return self.w_down.forward(F.silu(gate).mul_(up))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class Block(nn.Module):
    """One pre-norm decoder layer: x + attn(norm(x)), then + mlp(norm(x))."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.attn = Attention(spec)
        self.mlp_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(
        self, x: torch.Tensor, ctx: StepContext, keys: KVRows, values: KVRows
    ) -> torch.Tensor:
        # `.forward` directly: nn.Module.__call__'s hook machinery costs more than the
        # small ops of a one-token step (no hooks are ever registered on these modules)
        x = x + self.attn.forward(self.attn_norm.forward(x), ctx, keys, values)
        return x + self.mlp.forward(self.mlp_norm.forward(x))
