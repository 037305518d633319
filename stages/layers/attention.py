"""Attention: what one step shares (`StepContext`), and grouped-query attention (`Attention`).

Shapes: T = tokens in this step, S = positions attended, H = hidden size, A = query heads,
K = key/value heads, D = head dim. There is no batch dimension: the residual stream is
[T, H]. A step of several sessions stacks their rows (T = the sum of theirs) and names each
one's rows in a `Segment`: projections run once over the stack, attention per session over
its own cache, so every session keeps its own length and position pointer.

Float32 reference semantics (what `transformers` computes): q, k, v = x Wqkv (+ bias); with
`qk_norm`, an RMSNorm over each head's D of q and of k (with `qk_norm_whole`, over all of q's
heads at once and all of k's); RoPE on q and k; softmax(q kᵀ / √D
+ causal mask, limited to the last `window` positions for a sliding layer) v; then Wo (+ bias).
With `sinks` (gpt-oss), each head's learned sink logit joins the softmax's denominator. With
`output_gate` (Qwen3-Next, Qwen3.5), the output is multiplied by sigmoid(gate) before Wo, the
gate projected beside each head's query.
Prefill and multi-token steps use the same SDPA kernel as the reference, so logits agree
closely; a one-token step uses a grouped bmm that never repeats K/V.

The variants of the 2026 families, each a field of AttentionSpec: values narrower than keys and
scaled before they are cached (`value_dim`, `value_scale`: MiMo-V2-Flash); the scores' scale
(`scale`: 1 in Gemma 4); values RMSNormed without a weight (`v_norm`) or taken from the key
projection before its norm and RoPE (`k_eq_v`) (Gemma 4); and a layer that projects only
queries and attends over the keys and values another layer of the span cached (`kv_source`:
Gemma 4's KV-shared layers; its store is that layer's, layers/cache.py).

A new attention kind (as MLA and DSA are) is a module with the same `forward(x, ctx, cache)` over its
own cache store (layers/cache.py), registered in layers/block.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tessera.stages.families.spec.attention import AttentionSpec
from tessera.stages.families.spec.mla import MlaSpec
from tessera.stages.layers.cache import KeyValues
from tessera.stages.layers.norm import RMSNorm
from tessera.stages.layers.rope import RopeKey, Rotary, apply_rope

# A layer's cache as a step sees it: one session's store, or one per segment of a stacked step.
LayerCache = KeyValues | Sequence[KeyValues]


class StepRows(Protocol):
    """What a layer asks of the step it runs in: the RoPE tables of its rows, and each row's
    attention over its own session's cache. `StepContext` is the eager one (any rows: prefill,
    drafts, stacked sessions); engine/compiled/ has those of a compiled decode step, which meet
    the caches through one opaque op per row (torch.compile) or through static slots (CUDA
    graphs). An attention kind over another cache kind adds its cache access here and there."""

    def rope(self, spec: AttentionSpec) -> tuple[torch.Tensor, torch.Tensor]: ...

    def attend(self, qk: torch.Tensor, v: torch.Tensor | None, num_heads: int, cache: Any, window: int | None,
               scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor: ...


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


@dataclass
class StepContext:
    """What every layer of one forward step shares.

    start:    position of the step's first token (a solo step; a stacked step's are in
              `segments`).
    tables:   RoPE cos/sin [rows, 1, D] per (RopeSpec, dims turned), each row at its own position.
    segments: a stacked step's sessions, in row order; empty for one session's step.
    selection: the sparse-attention selection the last DSA layer with an indexer made in this step
              (layers/dsa.py): per segment (one for a solo step), the positions [T, S] each query
              reads, or None for every causal one; the layers after it that reuse it read it here.
              None until such a layer ran (a span never starts on a reusing layer).
    token_ids: each row's token id [T] (long), where the hop carries them (a layer that routes by
              token id: layers/hop.py), else None.
    rotaries: the stage's `Rotary` per RoPE key, for tables at other positions than the rows'
              (`rope_at`: DeepSeek-V4's compressed entries turn at their window's first position).
    """

    start: int
    tables: dict[RopeKey, tuple[torch.Tensor, torch.Tensor]]
    device: torch.device
    segments: tuple[Segment, ...] = ()
    selection: tuple[torch.Tensor | None, ...] | None = None
    token_ids: torch.Tensor | None = None
    rotaries: dict[RopeKey, Rotary] = field(default_factory=dict)
    _masks: dict[tuple[int, int, int | None], torch.Tensor | None] = field(default_factory=dict)

    def rope(self, spec: AttentionSpec | MlaSpec) -> tuple[torch.Tensor, torch.Tensor]:
        return self.tables[(spec.rope, spec.rope_dim)]

    def rope_at(self, spec: AttentionSpec | MlaSpec, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """`spec`'s RoPE tables [P, 1, D] at `positions` [P] (those of the rows are `rope`'s)."""
        return self.rotaries[(spec.rope, spec.rope_dim)].cos_sin(positions, dtype)

    def attend(self, qk: torch.Tensor, v: torch.Tensor | None, num_heads: int, cache: LayerCache,
               window: int | None, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Each session's rows of the step against its own store (`attend`): [T, A Dv]. `cache` is the
        layer's store, or one store per segment of a stacked step; `v` and `sinks` as `attend`'s."""
        if not self.segments:
            assert isinstance(cache, KeyValues), "one session: one store"
            return attend(qk, v, num_heads, cache, self.start, self.mask(self.start, qk.shape[0], window), scale,
                          sinks)
        assert not isinstance(cache, KeyValues) and len(cache) == len(self.segments), "one store per segment"
        return torch.cat([  # [T, A Dv], each session over its own cache
            attend(qk[s.lo : s.hi], None if v is None else v[s.lo : s.hi], num_heads, store, s.start,
                   self.mask(s.start, s.hi - s.lo, window), scale, sinks)
            for s, store in zip(self.segments, cache)
        ])

    def mask(self, start: int, n_tokens: int, window: int | None) -> torch.Tensor | None:
        """`attention_mask` for these rows, built once per step for all layers alike."""
        key = (start, n_tokens, window)
        if key not in self._masks:
            self._masks[key] = attention_mask(start, n_tokens, window, self.device)
        return self._masks[key]


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


def rotate_heads(
    qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
    q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """qkv [T, (A + 2K) D] -> (q and k, normed per head if asked and rotated [T, A + K, D]; v [T, K, D]).
    q and k rotate together: one RoPE over both."""
    t, a, k, d = qkv.shape[0], num_heads, num_kv_heads, head_dim
    return rotate_qk(qkv, a, k, d, cos, sin, q_norm, k_norm), qkv[:, (a + k) * d :].view(t, k, d)


def rotate_qk(
    rows: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
    q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None,
) -> torch.Tensor:
    """The first (A + K) D columns of `rows` [T, ...] as q and k heads, each normed per head where its
    norm is given, rotated: [T, A + K, D] (K = 0: queries alone)."""
    t, a, k, d = rows.shape[0], num_heads, num_kv_heads, head_dim
    qk = rows[:, : (a + k) * d].view(t, a + k, d)
    if q_norm is not None and k_norm is not None:  # an RMSNorm over each head's D (Qwen3)
        qk = torch.cat((q_norm.forward(qk[:, :a]), k_norm.forward(qk[:, a:])), dim=1)
    elif q_norm is not None and k == 0:  # queries alone (a layer reading another's keys)
        qk = q_norm.forward(qk)
    return apply_rope(qk, cos, sin)


def attend(
    qk: torch.Tensor, v: torch.Tensor | None, num_heads: int, store: KeyValues, start: int,
    mask: torch.Tensor | None, scale: float, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One session's rows: write k, v at [start, start + T) of its store, then attend.
    qk [T, A + K, D] (rotated), v [T, K, Dv]; or, with v None, qk the queries alone [T, A, D] over
    what the store holds already (a KV-shared layer). `mask` as `attention_mask`; `sinks` [A]: each
    head's sink logit (AttentionSpec.sinks), or None. Returns [T, A Dv]."""
    t, a = qk.shape[0], num_heads
    if v is None:
        keys, values, _ = store.read(start, t)  # [K, S, D], [K, S, Dv]
    else:
        keys, values, _ = store.write_and_read(qk[:, a:], v, start)
    if t == 1:
        return grouped_decode_attention(qk[:, :a], keys, values, scale, sinks)
    if sinks is not None:
        return sink_attention(qk[:, :a], keys, values, mask, scale, sinks)
    # prefill and multi-token steps: the same kernel the reference uses, so logits agree closely
    g = a // keys.shape[0]
    q = qk[None, :, :a].transpose(1, 2)  # [1, A, T, D]
    return F.scaled_dot_product_attention(
        q,
        keys[None].repeat_interleave(g, dim=1),  # [1, A, S, D]
        values[None].repeat_interleave(g, dim=1),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
    )[0].transpose(0, 1).reshape(t, -1)  # [T, A Dv]


def grouped_decode_attention(
    q_rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query position, grouped-query attention without repeating K/V.

    q_rows [1, A, D]; keys [K, S, D], values [K, S, Dv]. The G = A / K query heads that share a
    KV head are stacked as rows, so one bmm per KV head does the work. With `sinks` [A],
    each head's sink logit joins its softmax as one more column, then is dropped (it has
    no value). Returns [1, A Dv].
    """
    k, s, d = keys.shape
    a = q_rows.shape[1]
    q = q_rows.reshape(k, a // k, d)  # [K, G, D] (heads h = kv * G + g)
    scores = torch.bmm(q, keys.transpose(1, 2)).mul_(scale)  # [K, G, S]
    if sinks is None:
        probs = scores.softmax(-1)
    else:
        probs = torch.cat((scores, sinks.to(scores.dtype).view(k, a // k, 1)), -1).softmax(-1)[..., :s]
    return torch.bmm(probs, values).reshape(1, -1)  # [1, A Dv]


def sink_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """Attention with a sink logit per head (gpt-oss), for a step of T > 1 rows: the reference's
    eager form (transformers runs gpt-oss only so), softmax(cat(q kᵀ scale masked, sink)) without
    the sink's column, times v. q [T, A, D]; keys [K, S, D], values [K, S, Dv], the S = start + T
    positions up to the step's last; `mask` as `attention_mask` (None: plain causal). Returns [T, A Dv]."""
    t, a, _ = q.shape
    s = keys.shape[1]
    g = a // keys.shape[0]
    scores = torch.matmul(q.transpose(0, 1), keys.repeat_interleave(g, dim=0).transpose(1, 2)).mul_(scale)  # [A, T, S]
    allowed = mask if mask is not None else torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink = sinks.to(scores.dtype).view(a, 1, 1).expand(a, t, 1)
    probs = torch.cat((scores, sink), -1).softmax(-1)[..., :s]  # [A, T, S]
    out = torch.matmul(probs, values.repeat_interleave(g, dim=0))  # [A, T, Dv]
    return out.transpose(0, 1).reshape(t, -1)


class Attention(nn.Module):
    """Grouped-query attention (kind "gqa") with one stacked q/k/v projection.

    The projections are called as modules, so that a quantized span can hold
    `tessera.stages.kernels.quant` linears in their place (same call, integer weights)."""

    def __init__(self, hidden: int, spec: AttentionSpec, eps: float) -> None:
        super().__init__()
        self.spec = spec
        self.wqkv = nn.Linear(hidden, spec.q_rows + spec.kv_rows, bias=spec.qkv_bias)
        self.wo = nn.Linear(spec.num_heads * spec.value_width, hidden, bias=spec.o_bias)
        # over each head's D (Qwen3), or over all of q's and all of k's dims at once (MiniMax-M2); no
        # key norm where the layer reads another's keys (Gemma 4's KV-shared layers)
        own_keys = spec.kv_source is None
        self.q_norm = RMSNorm(spec.q_size if spec.qk_norm_whole else spec.head_dim, eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.kv_size if spec.qk_norm_whole else spec.head_dim, eps) \
            if spec.qk_norm and own_keys else None
        # each head's sink logit (gpt-oss), engine name `attn.sinks`
        self.sinks = nn.Parameter(torch.empty(spec.num_heads)) if spec.sinks else None
        self.scale = 1.0 / math.sqrt(spec.head_dim) if spec.scale is None else spec.scale
        self.eps = eps  # the value norm's (Gemma 4)

    def forward(self, x: torch.Tensor, ctx: StepRows, cache: LayerCache) -> torch.Tensor:
        """x [T, H] -> [T, H]. cache: the layer's store — or, for a stacked step, one store per
        session (the step's `attend` knows which rows are whose)."""
        spec = self.spec
        cos, sin = ctx.rope(spec)
        qkv = self.wqkv.forward(x)
        gate = None
        if spec.output_gate:  # each head's D query rows, then its D gate rows (Qwen3-Next)
            t, a, d = qkv.shape[0], spec.num_heads, spec.head_dim
            q_gate = qkv[:, : 2 * a * d].view(t, a, 2 * d)
            gate = q_gate[..., d:].reshape(t, a * d)
            qkv = torch.cat((q_gate[..., :d].reshape(t, a * d), qkv[:, 2 * a * d :]), dim=-1)  # [T, (A + 2K) D]
        if spec.kv_source is not None:  # queries alone, over the keys and values another layer cached
            q = rotate_qk(qkv, spec.num_heads, 0, spec.head_dim, cos, sin, self.q_norm)  # [T, A, D]
            return self.output(ctx.attend(q, None, spec.num_heads, cache, spec.window, self.scale, self.sinks), gate)
        per_head = (self.q_norm, self.k_norm)
        if spec.qk_norm_whole:  # normed here, over all heads of each: none left per head
            q, k, v = qkv.split((spec.q_size, spec.kv_size, spec.kv_size), dim=-1)
            qkv, per_head = torch.cat((self.q_norm.forward(q), self.k_norm.forward(k), v), dim=-1), (None, None)
        qk = rotate_qk(qkv, spec.num_heads, spec.num_kv_heads, spec.head_dim, cos, sin, *per_head)  # [T, A + K, D]
        v = self.values(qkv)  # [T, K, Dv]
        return self.output(ctx.attend(qk, v, spec.num_heads, cache, spec.window, self.scale, self.sinks), gate)

    def output(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """The attention's rows [T, A Dv] through Wo, gated first where the layer gates them."""
        return self.wo.forward(out if gate is None else out * torch.sigmoid(gate))

    def values(self, qkv: torch.Tensor) -> torch.Tensor:
        """The value heads [T, K, Dv] of the stacked projection's rows (queries ungated): its last K Dv
        columns, or the key columns before their norm and RoPE (`k_eq_v`); RMSNormed without a weight
        (`v_norm`), scaled (`value_scale`), as the layer's spec says."""
        spec = self.spec
        start = spec.q_size if spec.k_eq_v else spec.q_size + spec.kv_size
        v = qkv[:, start : start + spec.v_size].view(qkv.shape[0], spec.num_kv_heads, spec.value_width)
        if spec.v_norm:
            v = F.rms_norm(v, (spec.value_width,), eps=self.eps)
        return v * spec.value_scale if spec.value_scale != 1.0 else v
