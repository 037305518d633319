"""DeepSeek sparse attention (DSA: DeepSeek-V3.2, GLM-5): MLA over the positions an indexer picks.

Shapes as in layers/mla.py, plus Hi = indexer heads, Di = their dims, k = `index_topk`.

Float32 reference semantics (transformers' `GlmMoeDsaIndexer` and `GlmMoeDsaAttention`):

    q_lat = rms_norm(x Wq_a)                      the MLA query latent          [T, q_lora_rank]
    q_i = q_lat Wq_iᵀ                                                            [T, Hi, Di]
    k_i = layer_norm(x Wkᵀ)  (weight, bias, eps 1e-6): one key for all heads    [T, Di], cached
    RoPE on the first Dr dims of q_i and k_i, in interleaved pairs (MLA's tables)
    score[t, j] = Σ_h w[t, h] relu(q_i[t, h] · k_i[j] / √Di),  w = x Ww_hᵀ / √Hi   (float32)
    selected(t) = the k best-scoring positions j <= start + t (all of them while there are <= k;
                  among scores tied at the k-th place, torch.topk's pick on the query's own
                  causal row, as transformers picks for a one-token step: `select`)
    out = MLA (layers/mla.py) with each query reading only selected(t)

A layer whose indexer is "shared" (`DsaSpec.shared`, GLM-5.2's cross-layer sharing) computes
no selection: it reads the one the last indexer layer before it left in the step's
`StepContext.selection`. The selection never leaves a stage — a span starts only where a
layer computes its own (`ModelSpec.span_starts`) — so a stacked step's segments, which all
run the same layers, each carry theirs from layer to layer.

The indexer's keys are cached beside the latent rows (`IndexedLatentRows`), written at the
same positions and rolled back with the same pointer. A one-token step with more than k
positions reads only its k picked rows (layers/mla.py `attend_absorbed`); longer steps mask.
The indexer's weights stay float parameters whatever the span's quantization, as a router's
do: they choose what is read.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tessera.stages.errors import SpanError
from tessera.stages.families.spec.mla import DsaSpec
from tessera.stages.layers.attention import Segment, StepContext
from tessera.stages.layers.cache import IndexedLatentRows
from tessera.stages.layers.mla import LatentAttention, LatentCache, deinterleave, step_stores
from tessera.stages.layers.rope import apply_rope

INDEX_KEY_NORM_EPS = 1e-6  # the reference's LayerNorm over index keys (not the model's rms_norm_eps)


def select(scores: torch.Tensor, start: int, top_k: int) -> torch.Tensor | None:
    """Index scores [T, S] of queries at [start, start + T) -> the positions each reads [T, S]
    (bool), or None when every query may read all its causal positions (S <= k).

    A query reads the k best-scoring of its causal positions. Where the k-th and the (k+1)-th
    scores are equal (every head's relu is 0 at many positions when the indexer has few heads,
    so ties at exactly 0 are common), which of the tied positions are read is what `torch.topk`
    picks on the query's own causal row [0, start + t] on the CPU: what transformers picks for the
    query as a one-token step. It depends on that row alone, not on how a step is cut or stacked
    (transformers' own whole-prompt prefill runs topk over rows padded with the masked future,
    and picks among ties otherwise: its prefill and its token-by-token run disagree there)."""
    counts = torch.arange(start + 1, start + scores.shape[0] + 1, device=scores.device)
    return pick_top_k(scores, counts, top_k)


def pick_top_k(scores: torch.Tensor, counts: torch.Tensor, top_k: int) -> torch.Tensor | None:
    """Index scores [T, S] of T queries, query i reading only the first counts[i] (long [T]) of the S
    positions -> the positions each reads [T, S] (bool): the `top_k` best of its own, all of them while
    it has at most k; None when no query has more than k. Ties at the k-th place are broken by
    `torch.topk` on the query's own row [0, counts[i]) on the CPU (`select`); DeepSeek-V4's indexer
    picks the same way over compressed entries (layers/compressed.py)."""
    t, s = scores.shape
    if int(counts.max()) <= top_k:
        return None
    allowed = torch.arange(s, device=scores.device)[None, :] < counts[:, None]
    ranked = scores.masked_fill(~allowed, float("-inf")).sort(dim=-1, descending=True, stable=True)
    picked = torch.zeros_like(allowed).scatter_(1, ranked.indices[:, :top_k], True)
    # a tie at the k-th place, among allowed positions (past them the row is -inf: nothing to choose)
    tied = (ranked.values[:, top_k - 1] == ranked.values[:, top_k]) & (ranked.values[:, top_k] > float("-inf"))
    for row in tied.nonzero()[:, 0].tolist():
        own = scores[row, : int(counts[row])].detach().cpu()  # the query's own row, as a one-token step has it
        picked[row] = False
        picked[row, own.topk(top_k).indices.to(picked.device)] = True
    return picked & allowed  # a query with <= k positions picked some it may not read too: not read


class Indexer(nn.Module):
    """DSA's "lightning indexer" (module docstring): scores every cached position per query."""

    def __init__(self, hidden: int, spec: DsaSpec) -> None:
        super().__init__()
        assert spec.mla.q_lora_rank is not None, "DsaSpec checks it"
        self.spec = spec
        hi, di = spec.index_heads, spec.index_head_dim
        self.wq = nn.Parameter(torch.empty(hi * di, spec.mla.q_lora_rank))
        self.wk = nn.Parameter(torch.empty(di, hidden))
        self.k_norm = nn.LayerNorm(di, eps=INDEX_KEY_NORM_EPS)
        self.w_heads = nn.Parameter(torch.empty(hi, hidden))

    def project(self, x: torch.Tensor, q_latent: torch.Tensor, ctx: StepContext
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H], q_latent [T, q_lora_rank] -> (queries [T, Hi, Di], keys [T, Di], both rotated;
        head weights [T, Hi], float32)."""
        spec, t = self.spec, x.shape[0]
        hi, dr = spec.index_heads, spec.mla.qk_rope_head_dim
        q = F.linear(q_latent, self.wq).view(t, hi, spec.index_head_dim)
        k = self.k_norm.forward(F.linear(x, self.wk))[:, None]  # [T, 1, Di]
        cos, sin = ctx.rope(spec)
        rotated = apply_rope(deinterleave(torch.cat((q[..., :dr], k[..., :dr]), dim=1)), cos, sin)  # [T, Hi + 1, Dr]
        q = torch.cat((rotated[:, :hi], q[..., dr:]), dim=-1)
        k = torch.cat((rotated[:, hi:], k[..., dr:]), dim=-1)[:, 0]
        weights = F.linear(x.float(), self.w_heads.float()) * hi ** -0.5  # float32, as the reference
        return q, k, weights

    def scores(self, q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """q [T, Hi, Di], cached keys [S, Di], head weights [T, Hi] -> index scores [T, S] (float32)."""
        per_head = torch.matmul(q.float(), keys.float().T).mul_(self.spec.index_head_dim ** -0.5).relu_()  # [T, Hi, S]
        return torch.matmul(weights[:, None], per_head)[:, 0]


class SparseLatentAttention(LatentAttention):
    """Kind "dsa" (module docstring): MLA, with an `Indexer` unless the layer reuses a selection."""

    def __init__(self, hidden: int, spec: DsaSpec, eps: float) -> None:
        super().__init__(hidden, spec.mla, eps)
        self.dsa = spec
        self.indexer = None if spec.shared else Indexer(hidden, spec)

    def forward(self, x: torch.Tensor, ctx: StepContext, cache: LatentCache) -> torch.Tensor:
        q_latent = self.query_latent(x)
        q, rows = self.project(x, ctx, q_latent)
        segments, stores = step_stores(ctx, cache, x.shape[0])
        cached = [store.write_and_read(rows[s.lo : s.hi], s.start) for s, store in zip(segments, stores)]
        if self.indexer is not None:
            ctx.selection = self.selection(x, q_latent, ctx, segments, stores)
        elif ctx.selection is None:
            raise SpanError("a sparse-attention layer that reuses a selection ran before any layer made one")
        return self.attend(q, segments, cached, ctx.selection)

    def selection(self, x: torch.Tensor, q_latent: torch.Tensor, ctx: StepContext, segments: Sequence[Segment],
                  stores: Sequence[IndexedLatentRows]) -> tuple[torch.Tensor | None, ...]:
        """Write the step's index keys into each segment's store; each segment's picks (`select`)."""
        assert self.indexer is not None
        q, keys, weights = self.indexer.project(x, q_latent, ctx)
        picks = []
        for s, store in zip(segments, stores):
            cached = store.write_and_read_keys(keys[s.lo : s.hi], s.start)  # [S, Di]
            scores = self.indexer.scores(q[s.lo : s.hi], cached, weights[s.lo : s.hi])
            picks.append(select(scores, s.start, self.dsa.index_topk))
        return tuple(picks)
