"""DeepSeek-V4's attention: one key-value head over a sliding window and over compressed entries.

Shapes: T = tokens in this step, H = hidden size, A = heads, D = head dim (keys are values),
Dr = the rope dims (the last Dr of D), m = positions per compressed entry (`ratio`), W = the
window, Hi / Di = the indexer's heads and dims, k = `index_topk`. No batch dimension: a stacked
step names each session's rows in a `Segment` (layers/attention.py), projections run once over
the stack and each session attends over its own state (`CompressedRows`, layers/cache.py).

Float32 reference semantics (transformers' `DeepseekV4Attention`, `...CSACompressor`,
`...HCACompressor`, `...Indexer`; families/spec/compressed.py `CompressedAttentionSpec` says it in words):

    q_lat = rms_norm(x Wq_aᵀ)                                          [T, q_lora_rank]
    q = rms(q_lat Wq_bᵀ per head, no weight); kv = rms_norm(x Wkvᵀ)    [T, A, D], [T, D]
    RoPE on the last Dr dims of q and kv, interleaved pairs, at each row's position
    an entry of window w (positions [w m, (w + 1) m)):
        c, z = x Wcᵀ, x Wzᵀ over the window's rows, z + B (a bias per position in the window)
        with overlap (an indexer's layer): the window's rows' second halves (D each) and the
        window before's first halves, 2 m slots; window 0 has no window before (its slots weigh 0)
        entry = rope(rms_norm(sum_slots softmax_slots(z) * c), at position w m)
    a query at t reads: the rows of (t - W, t], and entries w with (w + 1) m <= t + 1 (the
        window closed) — with an indexer only its k best of them (layers/dsa.py `pick_top_k`,
        ties as transformers' one-token step picks them); the indexer's entries are its own
        compression of the same windows (Di, with overlap); a query's index score of entry j is
        sum_h w_h relu(q_i[h] . e_j) / sqrt(Di), q_i = q_lat Wq_iᵀ rotated at the query's
        position, w = x Wwᵀ / sqrt(Hi)
    out = softmax(q keysᵀ / sqrt(D) + mask, and each head's sink logit) keys   (keys are values)
    out: its last Dr dims turned back by the query's angle; then the grouped output projection,
        per group of A / g heads [A D / g] -> o_lora_rank, then all g of those Wo_b -> H

A window-only layer (m = 0) is the first and last lines without entries. RoPE is the layer's
(`spec.rope`: the "main" one of a window-only layer, the "compress" one of the others, which
its entries and its indexer turn by too).

The entries are computed once, when their window closes, from the projections its positions
left in the store, so a prompt prefilled whole, in chunks, or token by token makes the same
ones. Which positions a session keeps, and how far back it can go, is the store's
(`CompressedRows`); the arithmetic here never depends on it.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tessera.stages.families.spec.compressed import CompressedAttentionSpec
from tessera.stages.layers.attention import Segment, StepContext
from tessera.stages.layers.cache import CompressedRows
from tessera.stages.layers.dsa import pick_top_k
from tessera.stages.layers.hyper import unweighted_rms
from tessera.stages.layers.norm import RMSNorm

# A layer's state as a step sees it: one session's store, or one per segment of a stacked step.
CompressedCache = CompressedRows | Sequence[CompressedRows]


def turn_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the last Dr dims of x [..., D] in interleaved pairs (x0, x1), (x2, x3)..., the rest as is.
    cos, sin: `Rotary.cos_sin`'s half-split tables [T, 1, Dr] (their halves hold each pair's angle),
    broadcast over x's middle dims (x [T, D] or [T, heads, D]). Computed in float32, as the reference."""
    dr = cos.shape[-1]
    c, s = cos[..., : dr // 2].float(), sin[..., dr // 2 :].float()  # [T, 1, Dr/2]: each pair's cos and sin
    if x.dim() == 2:
        c, s = c[:, 0], s[:, 0]
    tail = x[..., -dr:].float()
    even, odd = tail[..., 0::2], tail[..., 1::2]
    turned = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((x[..., :-dr], turned), dim=-1)


class Compressor(nn.Module):
    """The projections and the pooling of one series of compressed entries (the attention's at D, an
    indexer's at Di): module docstring. wkv, wgate [c dim, H] (c = 2 with overlap), position_bias
    [m, c dim], norm [dim]; float parameters, as DeepSeek ships them."""

    def __init__(self, hidden: int, dim: int, ratio: int, overlap: bool, eps: float) -> None:
        super().__init__()
        self.dim, self.ratio, self.overlap = dim, ratio, overlap
        width = (2 if overlap else 1) * dim
        self.wkv = nn.Parameter(torch.empty(width, hidden))
        self.wgate = nn.Parameter(torch.empty(width, hidden))
        self.position_bias = nn.Parameter(torch.empty(ratio, width))
        self.norm = RMSNorm(dim, eps)

    @property
    def raw_width(self) -> int:
        """Values a position keeps until its window closes: its projection, then its gate logits."""
        return 2 * self.wkv.shape[0]

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> what each position keeps [T, raw_width]: x Wcᵀ then x Wzᵀ."""
        return torch.cat((F.linear(x, self.wkv), F.linear(x, self.wgate)), dim=-1)

    def pool(self, raw: torch.Tensor, first: int, windows: range, cos: torch.Tensor, sin: torch.Tensor
             ) -> torch.Tensor:
        """The entries of `windows` [n, dim] from the kept projections `raw` of positions [first, ...)
        (every position they read: their own windows', and with overlap the window before each);
        cos, sin: the RoPE tables at the windows' first positions."""
        m, d, n = self.ratio, self.dim, len(windows)
        width = raw.shape[1] // 2
        lo = windows.start * m - first
        rows = raw[lo : lo + n * m].reshape(n, m, 2, width)
        kv, gate = rows[:, :, 0], rows[:, :, 1] + self.position_bias  # [n, m, c dim] each
        if self.overlap:  # slots: the window before's first halves (Ca), then this window's second halves (Cb)
            before_kv = kv.new_zeros((n, m, d))
            before_gate = gate.new_full((n, m, d), float("-inf"))  # window 0: nothing before, weight 0
            if windows.start > 0:  # the window before the first one here, from the kept rows
                prior = raw[lo - m : lo].reshape(m, 2, width)
                before_kv[0], before_gate[0] = prior[:, 0, :d], prior[:, 1, :d] + self.position_bias[:, :d]
            before_kv[1:], before_gate[1:] = kv[:-1, :, :d], gate[:-1, :, :d]
            kv = torch.cat((before_kv, kv[..., d:]), dim=1)  # [n, 2m, d]
            gate = torch.cat((before_gate, gate[..., d:]), dim=1)
        pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)  # [n, d]
        return turn_tail(self.norm.forward(pooled), cos, sin)


class Indexer(nn.Module):
    """The lightning indexer of a compressed sparse attention layer (module docstring): its own
    compressor at Di (with overlap), the query projection wq [Hi Di, q_lora_rank] and the head
    weights w_heads [Hi, H]."""

    def __init__(self, hidden: int, spec: CompressedAttentionSpec) -> None:
        super().__init__()
        self.spec = spec
        self.compressor = Compressor(hidden, spec.index_head_dim, spec.ratio, True, spec.norm_eps)
        self.wq = nn.Parameter(torch.empty(spec.index_heads * spec.index_head_dim, spec.q_lora_rank))
        self.w_heads = nn.Parameter(torch.empty(spec.index_heads, hidden))

    def queries(self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries [T, Hi, Di], rotated at the rows' positions; head weights [T, Hi], float32)."""
        spec = self.spec
        q = F.linear(q_latent, self.wq).view(x.shape[0], spec.index_heads, spec.index_head_dim)
        return turn_tail(q, cos, sin), F.linear(x, self.w_heads).float() * spec.index_heads ** -0.5

    def scores(self, q: torch.Tensor, entries: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """q [T, Hi, Di], entries [S, Di], head weights [T, Hi] -> index scores [T, S] (float32)."""
        per_head = torch.matmul(q.float(), entries.float().T).relu_() * self.spec.index_head_dim ** -0.5  # [T, Hi, S]
        return (per_head * weights[:, :, None]).sum(dim=1)


class CompressedAttention(nn.Module):
    """Kind "compressed" (module docstring). The query, key-value and second output projections are
    called as modules (a quantized span holds its own linears there); the grouped first output
    projection `wo_a` [g r, A D / g], the compressor and the indexer are float parameters."""

    def __init__(self, hidden: int, spec: CompressedAttentionSpec, eps: float) -> None:
        super().__init__()
        del eps  # the spec carries it (`norm_eps`), for its norms and the compressors'
        self.spec = spec
        a, d = spec.num_heads, spec.head_dim
        self.wq_a = nn.Linear(hidden, spec.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(spec.q_lora_rank, spec.norm_eps)
        self.wq_b = nn.Linear(spec.q_lora_rank, a * d, bias=False)
        self.wkv = nn.Linear(hidden, d, bias=False)
        self.kv_norm = RMSNorm(d, spec.norm_eps)
        self.wo_a = nn.Parameter(torch.empty(spec.o_groups * spec.o_lora_rank, spec.group_width))
        self.wo_b = nn.Linear(spec.o_groups * spec.o_lora_rank, hidden, bias=False)
        self.sinks = nn.Parameter(torch.empty(a))
        self.compressor = Compressor(hidden, d, spec.ratio, spec.indexed, spec.norm_eps) if spec.ratio else None
        self.indexer = Indexer(hidden, spec) if spec.indexed else None
        self.scale = d ** -0.5

    def forward(self, x: torch.Tensor, ctx: StepContext, cache: CompressedCache) -> torch.Tensor:
        """x [T, H] -> [T, H]. cache: the layer's store — or, for a stacked step, one per segment."""
        spec, t = self.spec, x.shape[0]
        cos, sin = ctx.rope(spec)
        q_latent = self.q_norm.forward(self.wq_a.forward(x))
        q = self.wq_b.forward(q_latent).view(t, spec.num_heads, spec.head_dim)
        q = turn_tail(unweighted_rms(q, spec.norm_eps), cos, sin)  # [T, A, D]
        kv = turn_tail(self.kv_norm.forward(self.wkv.forward(x)), cos, sin)  # [T, D]
        raw = None
        if self.compressor is not None:
            parts = [self.compressor.project(x)] + ([self.indexer.compressor.project(x)] if self.indexer else [])
            raw = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]  # [T, raw_width]
        index_q = self.indexer.queries(x, q_latent, cos, sin) if self.indexer is not None else None
        segments, stores = self._segments(ctx, cache, t)
        out = q.new_empty(q.shape)
        for s, store in zip(segments, stores):
            rows = slice(s.lo, s.hi)
            keys, allowed = self._keys(ctx, store, s, kv[rows], raw[rows] if raw is not None else None,
                                       None if index_q is None else (index_q[0][rows], index_q[1][rows]))
            out[rows] = self._attend(q[rows], keys, allowed)
        out = turn_tail(out, cos, -sin)  # each value's own turn undone by its query's angle
        return self.wo_b.forward(self._grouped(out))

    def _segments(self, ctx: StepContext, cache: CompressedCache, n_tokens: int
                  ) -> tuple[Sequence[Segment], list[CompressedRows]]:
        if ctx.segments:
            assert not isinstance(cache, CompressedRows) and len(cache) == len(ctx.segments), "one store per segment"
            return ctx.segments, list(cache)
        assert isinstance(cache, CompressedRows), "one session: one store"
        return (Segment(0, n_tokens, ctx.start),), [cache]

    def _keys(self, ctx: StepContext, store: CompressedRows, s: Segment, kv: torch.Tensor, raw: torch.Tensor | None,
              index_q: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One session's step: write its rows into its store; return what its queries read (the window's
        rows, then the entries) [S, D] and which of them each query reads [T, S]."""
        spec, n, start = self.spec, s.hi - s.lo, s.start
        window, first = store.write_window(kv, start)
        queries = torch.arange(start, start + n, device=kv.device)
        keys = torch.arange(first, start + n, device=kv.device)
        allowed = (keys[None, :] <= queries[:, None]) & (keys[None, :] > queries[:, None] - spec.window)
        if self.compressor is None:
            store.advance(n)
            return window, allowed
        assert raw is not None
        m = spec.ratio
        kept, raw_first = store.write_raw(raw, start)
        closed = range(start // m, (start + n) // m)  # the windows this step's positions close
        if len(closed):
            cos, sin = ctx.rope_at(spec, torch.arange(closed.start, closed.stop, device=kv.device) * m, kv.dtype)
            d = self.compressor.raw_width
            entries = self.compressor.pool(kept[:, :d], raw_first, closed, cos, sin)
            index_entries = self.indexer.compressor.pool(kept[:, d:], raw_first, closed, cos, sin) \
                if self.indexer is not None else None
            store.write_entries(entries, index_entries, closed.start)
        store.advance(n)
        total = closed.stop
        counts = (queries + 1) // m  # the entries whose window a query's position has closed
        readable = torch.arange(total, device=kv.device)[None, :] < counts[:, None]  # [T, entries]
        if self.indexer is not None and index_q is not None and total:
            scores = self.indexer.scores(index_q[0], store.index_entries[:total], index_q[1])
            picked = pick_top_k(scores, counts, spec.index_topk)
            readable = readable if picked is None else picked
        return torch.cat((window, store.entries[:total])), torch.cat((allowed, readable), dim=1)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """q [T, A, D] over keys (= values) [S, D], each query the keys `allowed` [T, S] lets it read, each
        head's sink logit in its softmax's denominator (the reference's eager order) -> [T, A, D]."""
        t, a = q.shape[0], q.shape[1]
        scores = torch.matmul(q.transpose(0, 1), keys.T) * self.scale  # [A, T, S]
        scores = scores.masked_fill(~allowed, float("-inf"))
        sink = self.sinks.to(scores.dtype).view(a, 1, 1).expand(a, t, 1)
        logits = torch.cat((scores, sink), dim=-1)
        probs = (logits - logits.amax(dim=-1, keepdim=True)).softmax(dim=-1)[..., :-1]
        return torch.matmul(probs, keys).transpose(0, 1)  # [T, A, D]

    def _grouped(self, out: torch.Tensor) -> torch.Tensor:
        """[T, A, D] -> [T, g r]: each group of A / g heads' A D / g values through its own block of wo_a."""
        spec, t = self.spec, out.shape[0]
        g = spec.o_groups
        groups = out.reshape(t, g, spec.group_width).transpose(0, 1)  # [g, T, A D / g]
        weight = self.wo_a.view(g, spec.o_lora_rank, spec.group_width).transpose(1, 2)  # [g, A D / g, r]
        return torch.bmm(groups, weight).transpose(0, 1).reshape(t, g * spec.o_lora_rank)
