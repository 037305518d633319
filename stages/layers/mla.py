"""Multi-head latent attention (MLA: DeepSeek-V2/V3; GLM-5 builds its sparse attention on it).

Shapes: T = tokens in this step, S = positions attended, H = hidden size, A = heads,
C = kv_lora_rank (the latent), Dn / Dr = each head's unrotated / rotated query-key dims,
Dv = value dims. As in layers/attention.py there is no batch dimension, and a stacked step
names each session's rows in a `Segment`.

Float32 reference semantics (transformers' `DeepseekV3Attention`):

    q = x Wq,  or  rms_norm(x Wq_a (+ b)) Wq_b                    [T, A, Dn + Dr]
    c, k_rope = split(x Wkv_a (+ b), [C, Dr]);  c = rms_norm(c)   [T, C], [T, Dr]
    RoPE on q's Dr dims and on k_rope (interleaved pairs when `rope_interleave`)
    k_nope, v = split((c Wkv_bᵀ) per head, [Dn, Dv])             [S, A, Dn], [S, A, Dv]
    key = [k_nope, k_rope]  (one k_rope shared by every head)
    out = softmax(q keyᵀ · scale + causal mask) v, then Wo (+ b)

The cache keeps [c, k_rope] per position (C + Dr values: `LatentRows`), not the keys and
values it expands to (A (Dn + Dr + Dv) values).

Two ways to attend, equal in exact arithmetic:

- expanded (`attend_expanded`, the reference's own order of operations): expand every
  attended position's keys and values through Wkv_b, then SDPA. The expansion costs
  S C A (Dn + Dv) multiply-adds a step whatever T is, so it pays when many queries share it
  (a prefill).
- absorbed (`attend_latent`): Wkv_b's key half folded into the queries,
  q_lat = q_nope W_UK ([A, T, C]), and its value half applied after attention,
  out = (p c) W_UVᵀ. Scores are [q_lat, q_rope] · [c, k_rope]ᵀ over the cache rows as they
  lie, so a decode step reads C + Dr values a position and expands nothing.

`LatentAttention` picks per session by `absorbs` (counted multiply-adds, and a bound on the
bytes an expansion would allocate); its `path` forces one way (the tests hold each to
transformers). Wkv_b is read as a matrix by the absorbed form, so it is a plain parameter
kept in the stage's dtype, not a linear that quantization replaces (families/spec/mla.py's
`MlaSpec.kv_b_shape`). The absorptions of a stacked step run once over the rows of every
session that absorbs, reading Wkv_b once.

Both forms take the positions each query may read (`allowed`, [T, S]) in place of the causal
mask: DSA (layers/dsa.py) attends through `attend` over the rows its indexer picked, and a
one-token step absorbs over those rows only.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tessera.stages.families.spec.mla import MlaSpec
from tessera.stages.layers.attention import Segment, StepContext
from tessera.stages.layers.cache import LatentRows
from tessera.stages.layers.norm import RMSNorm
from tessera.stages.layers.rope import apply_rope, yarn_mscale

# An MLA layer's cache as a step sees it: one session's rows, or one per segment of a stacked step.
LatentCache = LatentRows | Sequence[LatentRows]
PATHS = ("expanded", "absorbed")
# The expanded form allocates each attended position's keys and values for every head; past this
# many bytes a step absorbs instead, whatever the multiply-adds say (a long context's prefill chunk).
EXPANDED_LIMIT_BYTES = 256 * 2**20


def softmax_scale(spec: MlaSpec) -> float:
    """(Dn + Dr)^-1/2, times yarn_mscale(factor, mscale_all_dim)^2 when the RoPE scales context with
    `mscale_all_dim` set (transformers' `yarn_apply_mscale`: DeepSeek's softmax correction)."""
    scale = spec.qk_head_dim ** -0.5
    mscale_all_dim = spec.rope.optional("mscale_all_dim") if spec.rope.kind != "default" else None
    if mscale_all_dim:
        mscale = yarn_mscale(spec.rope.param("factor"), mscale_all_dim)
        scale = scale * mscale * mscale
    return scale


def absorbs(spec: MlaSpec, n_tokens: int, n_positions: int, itemsize: int = 4) -> bool:
    """Whether attending `n_tokens` queries over `n_positions` cached ones costs fewer multiply-adds
    in latent space than expanded (or the expansion would pass EXPANDED_LIMIT_BYTES)."""
    t, s, a = n_tokens, n_positions, spec.num_heads
    c, dn, dr, dv = spec.kv_lora_rank, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
    expanded = s * c * a * (dn + dv) + t * s * a * (dn + dr + dv)
    absorbed = t * a * c * (dn + dv) + t * s * a * (2 * c + dr)
    return absorbed < expanded or s * a * (2 * dn + dr + dv) * itemsize > EXPANDED_LIMIT_BYTES


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved rope pairs (x0, x1), (x2, x3)... -> (x0, x2, ..., x1, x3, ...): the
    half-split layout `apply_rope` turns, which is also the layout the reference's rotation writes."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def causal_allowed(start: int, n_tokens: int, device: torch.device) -> torch.Tensor:
    """[T, S] True where query start + i may read key j (j <= start + i)."""
    query = torch.arange(start, start + n_tokens, device=device)[:, None]
    return torch.arange(start + n_tokens, device=device)[None, :] <= query


def attend_expanded(q: torch.Tensor, cached: torch.Tensor, wkv_b: torch.Tensor, spec: MlaSpec, start: int,
                    scale: float, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """The reference's way: q [T, A, Dn + Dr] (rope dims rotated); cached [S, C + Dr]; -> [T, A, Dv].
    `allowed` [T, S]: the positions each query reads (a sparse selection, within the causal ones), or
    None for every causal one."""
    t, a, s = q.shape[0], spec.num_heads, cached.shape[0]
    c, dn, dr = spec.kv_lora_rank, spec.qk_nope_head_dim, spec.qk_rope_head_dim
    kv = F.linear(cached[:, :c], wkv_b).view(s, a, dn + spec.v_head_dim)  # [S, A, Dn + Dv]
    keys = torch.cat((kv[..., :dn], cached[:, None, c:].expand(s, a, dr)), dim=-1)  # [S, A, Dn + Dr]
    mask = allowed if allowed is not None else causal_allowed(start, t, q.device) if t > 1 and start > 0 else None
    return F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None], kv[..., dn:].transpose(0, 1)[None],  # [1, A, ., .]
        attn_mask=mask, is_causal=mask is None and t > 1, scale=scale,
    )[0].transpose(0, 1)  # [T, A, Dv]


def attend_latent(q_cat: torch.Tensor, cached: torch.Tensor, latent_dim: int, start: int, scale: float,
                  allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Attention in latent space: q_cat [A, T, C + Dr] (absorbed q_nope, rotated q_rope) against the
    cache rows [S, C + Dr] as they are; -> the latent mix [A, T, C], for W_UV to expand. `allowed`
    as `attend_expanded`'s."""
    t = q_cat.shape[1]
    scores = torch.matmul(q_cat, cached.T).mul_(scale)  # [A, T, S]
    if allowed is not None:
        scores.masked_fill_(~allowed, float("-inf"))
    elif t > 1:
        scores.masked_fill_(~causal_allowed(start, t, q_cat.device), float("-inf"))
    probs = scores.softmax(-1, dtype=torch.float32).to(cached.dtype)  # float32 whatever the dtype, as the reference
    return torch.matmul(probs, cached[:, :latent_dim])  # [A, T, C]


def step_stores(ctx: StepContext, cache: LatentCache, n_tokens: int) -> tuple[Sequence[Segment], list[LatentRows]]:
    """The step's segments and each one's store: a stacked step's own, or one for a solo step."""
    if ctx.segments:
        assert not isinstance(cache, LatentRows) and len(cache) == len(ctx.segments), "one store per segment"
        return ctx.segments, list(cache)
    assert isinstance(cache, LatentRows), "one session: one store"
    return (Segment(0, n_tokens, ctx.start),), [cache]


class LatentAttention(nn.Module):
    """Kind "mla" (module docstring). The projections are called as modules, so that a quantized
    span can hold `tessera.stages.kernels.quant` linears in their place; `wkv_b` is a parameter."""

    def __init__(self, hidden: int, spec: MlaSpec, eps: float) -> None:
        super().__init__()
        del eps  # the latent norms use transformers' default (spec.norm_eps), not the model's
        self.spec = spec
        q_size = spec.num_heads * spec.qk_head_dim
        if spec.q_lora_rank is None:
            self.wq = nn.Linear(hidden, q_size, bias=False)
        else:
            self.wq_a = nn.Linear(hidden, spec.q_lora_rank, bias=spec.bias)
            self.q_norm = RMSNorm(spec.q_lora_rank, spec.norm_eps)
            self.wq_b = nn.Linear(spec.q_lora_rank, q_size, bias=False)
        self.wkv_a = nn.Linear(hidden, spec.kv_lora_rank + spec.qk_rope_head_dim, bias=spec.bias)
        self.kv_norm = RMSNorm(spec.kv_lora_rank, spec.norm_eps)
        self.wkv_b = nn.Parameter(torch.empty(spec.kv_b_shape))
        self.wo = nn.Linear(spec.num_heads * spec.v_head_dim, hidden, bias=spec.bias)
        self.scale = softmax_scale(spec)
        self.path: str | None = None  # None: per step by `absorbs`; or one of PATHS

    def query_latent(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> the normed low-rank query [T, q_lora_rank] (what DSA's indexer also reads)."""
        return self.q_norm.forward(self.wq_a.forward(x))

    def project(self, x: torch.Tensor, ctx: StepContext, q_latent: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (q [T, A, Dn + Dr], its rope dims rotated; cache rows [T, C + Dr]).
        `q_latent`: `query_latent(x)` when the caller already has it."""
        spec, t = self.spec, x.shape[0]
        a, c, dn = spec.num_heads, spec.kv_lora_rank, spec.qk_nope_head_dim
        if spec.q_lora_rank is None:
            q = self.wq.forward(x)
        else:
            q = self.wq_b.forward(self.query_latent(x) if q_latent is None else q_latent)
        q = q.view(t, a, spec.qk_head_dim)
        kv = self.wkv_a.forward(x)  # [T, C + Dr]
        q_rope, k_rope = q[..., dn:], kv[:, None, c:]  # [T, A, Dr], [T, 1, Dr]
        if spec.rope_interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        cos, sin = ctx.rope(spec)
        rotated = apply_rope(torch.cat((q_rope, k_rope), dim=1), cos, sin)  # [T, A + 1, Dr]: one RoPE for both
        q = torch.cat((q[..., :dn], rotated[:, :a]), dim=-1)
        return q, torch.cat((self.kv_norm.forward(kv[:, :c]), rotated[:, a]), dim=-1)

    def forward(self, x: torch.Tensor, ctx: StepContext, cache: LatentCache) -> torch.Tensor:
        """x [T, H] -> [T, H]. cache: the layer's rows — or, for a stacked step (`ctx.segments`),
        one store per segment."""
        q, rows = self.project(x, ctx)
        segments, stores = step_stores(ctx, cache, x.shape[0])
        cached = [store.write_and_read(rows[s.lo : s.hi], s.start) for s, store in zip(segments, stores)]
        return self.attend(q, segments, cached, [None] * len(segments))

    def attend(self, q: torch.Tensor, segments: Sequence[Segment], cached: Sequence[torch.Tensor],
               allowed: Sequence[torch.Tensor | None]) -> torch.Tensor:
        """Each segment's queries over its cache rows [S, C + Dr] (the positions `allowed` [T, S] lets
        it read, every causal one where None), then Wo: -> [T, H]."""
        spec, t = self.spec, q.shape[0]
        latent = [self.absorbs(s.hi - s.lo, len(c)) for s, c in zip(segments, cached)]
        out = q.new_empty((t, spec.num_heads, spec.v_head_dim))  # [T, A, Dv]
        for s, rows_s, mask, absorbed in zip(segments, cached, allowed, latent):
            if not absorbed:
                out[s.lo : s.hi] = attend_expanded(q[s.lo : s.hi], rows_s, self.wkv_b, spec, s.start, self.scale, mask)
        if any(latent):
            chosen = [(s, rows_s, mask) for s, rows_s, mask, absorbed in zip(segments, cached, allowed, latent)
                      if absorbed]
            self.attend_absorbed(q, chosen, out)
        return self.wo.forward(out.view(t, spec.num_heads * spec.v_head_dim))

    def absorbs(self, n_tokens: int, n_positions: int) -> bool:
        return absorbs(self.spec, n_tokens, n_positions) if self.path is None else self.path == "absorbed"

    def attend_absorbed(self, q: torch.Tensor, chosen: list[tuple[Segment, torch.Tensor, torch.Tensor | None]],
                        out: torch.Tensor) -> None:
        """Attend the `chosen` segments in latent space into their rows of `out` [T, A, Dv]: W_UK
        folded into all their queries in one bmm, W_UV into all their outputs in another."""
        spec = self.spec
        a, c, dn = spec.num_heads, spec.kv_lora_rank, spec.qk_nope_head_dim
        w = self.wkv_b.view(a, dn + spec.v_head_dim, c)  # per head: W_UK [Dn, C] rows, then W_UV [Dv, C]
        rows = torch.cat([q[s.lo : s.hi] for s, _, _ in chosen]).transpose(0, 1)  # [A, R, Dn + Dr]
        q_lat = torch.bmm(rows[..., :dn], w[:, :dn])  # [A, R, Dn] @ [A, Dn, C] -> [A, R, C]
        q_cat = torch.cat((q_lat, rows[..., dn:]), dim=-1)  # [A, R, C + Dr]
        mixes, at = [], 0
        for s, cached, allowed in chosen:
            n = s.hi - s.lo
            if allowed is not None and n == 1:  # a sparse decode step reads only the rows it picked
                cached, allowed = cached[allowed[0].nonzero()[:, 0]], None
            mixes.append(attend_latent(q_cat[:, at : at + n], cached, c, s.start, self.scale, allowed))  # [A, n, C]
            at += n
        values = torch.bmm(torch.cat(mixes, dim=1), w[:, dn:].transpose(1, 2))  # [A, R, C] @ [A, C, Dv]
        at = 0
        for s, _, _ in chosen:
            out[s.lo : s.hi] = values[:, at : at + s.hi - s.lo].transpose(0, 1)  # [n, A, Dv]
            at += s.hi - s.lo
