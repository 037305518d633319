"""Tensor-sharded execution of a span, with the residual stream itself sharded.

A group of n ranks runs layers [start, end) together. Rank r holds columns
[r H/n, (r+1) H/n) of the hidden state — its *slice* — and never more: the stage's
input and output are slices, and inside the span no rank holds (receives or
computes) the full hidden state. Per layer, for rank r with hidden slice x_r [T, H/n]:

    attn_norm   ss = all_reduce_scalar(sum(x_r²))            one number per token
                s = rsqrt(ss / H + eps)                         the norm's scale, per token
    q/k/v       partial = (x_r * w_norm[slice r]) @ Wqkv[:, slice r]ᵀ      [T, (A + 2K) D],
                                                                one term of the sum
                qkv_r = s * reduce_scatter(partial)             the heads rank r owns
    attention   on rank r's A/n query heads and K/n KV heads (its KV cache holds only those)
    o_proj      partial = attn_r @ Wo[:, heads r]ᵀ             [T, H], one term of the sum
                x_r += reduce_scatter(partial)                  back to hidden slice r
    mlp_norm    as attn_norm
    gate/up     gu_r = reduce_scatter(n_r @ Wgu[:, slice r]ᵀ)  intermediate slice r (gate and up)
                h_r = silu(gate_r) * up_r
    down        x_r += reduce_scatter(h_r @ Wdown[:, I-slice r]ᵀ)

The norm's scale is one number per token, so it commutes with the projection after
it: it is applied to the reduced chunk, and the sum of squares travels in the same
round as the reduce-scatter (`Collectives.norm_reduce_scatter`) — 4 rounds of
exchange per layer, not 6. The MLP's norm works the same way before gate/up.

A partial of hidden width is one rank's term of a sum; only the reduce-scatter
turns terms into values, and it hands each rank only its own slice. So each rank
holds exactly 1/n of every weight matrix: the *columns* of Wqkv and Wgu for its
hidden slice (their rows reordered rank-major, so that rank r's heads — q, k, v —
and its intermediate slice — gate, up — are contiguous chunk r of the product),
and the columns of Wo and Wdown for the heads and intermediate slice it owns.

Compared with the unsharded `Stage`, only the order of summation differs (and the
sums are taken in rank order on every rank, so a run is reproducible): float32
logits agree to well under 5e-4. n must divide the KV heads (and so the query
heads), the hidden size and the MLP width: SmolLM2 (9 heads / 3 KV, hidden 576, MLP
1536) runs as a group of 3.

Families: any whose layers are all grouped-query attention with a dense SwiGLU — the Llama
block and Qwen3 (its per-head q/k norms are local to the heads a rank owns; an output bias is
added to the reduced slice it belongs to), sliding windows included. A sparse (MoE) layer is
refused by `check_shardable`: its experts would be split by expert across ranks, with the
router's picks exchanged, which this module does not do; a peer refuses `--shard` for such a
model at start. So are Gated DeltaNet layers (Qwen3-Next, Qwen3.5): their heads are independent
(each its own recurrent state, its own convolution channels) and would split as attention heads
do, but a rank's share of the state, the gated norm and the output gate are not written here.

`gather_full=True` builds a deliberately BROKEN variant, for the audit's tests only:
before the MLP norm it all-gathers the residual, so every rank holds the full hidden
state. Its output is still right; only the audit can tell.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Hashable

import torch
import torch.nn.functional as F

from tessera.stages.engine.sessions import SessionState, SessionTable
from tessera.stages.errors import SpanError, StageError
from tessera.stages.families.catalog import tensors_of_layer
from tessera.stages.families.spec.attention import AttentionSpec, CacheSpec
from tessera.stages.families.spec.layer import LayerSpec
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.layers.attention import StepContext, attend, rotate_heads
from tessera.stages.layers.cache import KeyValues
from tessera.stages.layers.norm import RMSNorm
from tessera.stages.layers.rope import RopeTables
from tessera.stages.shards.collectives import Collectives
from tessera.stages.shards.layout import HIDDEN
from tessera.stages.weights.folder import WeightFolder


# the token mixers with a recurrent state, in the words a refusal names them with
RECURRENT_MIXERS = {"gated_deltanet": "Gated DeltaNet linear attention", "kda": "Kimi Delta Attention linear attention",
                    "mamba2": "a Mamba2 state-space mixer"}


class ShardError(StageError):
    """A group size that does not divide the model's heads or widths, or a bad shard index."""


def check_shardable(spec: ModelSpec, count: int, index: int = 0) -> None:
    """Raise ShardError unless `count` ranks can split `spec` (and `index` is one of them)."""
    if count < 1 or not 0 <= index < count:
        raise ShardError(f"shard {index!r} of {count!r}: need 0 <= index < count")
    for i, layer in enumerate(spec.layers):
        if layer.attention_kind in RECURRENT_MIXERS:
            raise ShardError(f"tensor shards of {spec.family} are not supported: layer {i} is "
                             f"{RECURRENT_MIXERS[layer.attention_kind]}, whose heads' recurrent states and convolution "
                             "the ranks do not split (serve it as layer spans)")
        if layer.attention is None or layer.mlp is None:
            alone = "an MLP" if layer.attention is None else "a token mixer"
            raise ShardError(f"tensor shards of {spec.family} are not supported: layer {i} is {alone} alone, and "
                             "a rank's layer step runs attention and an MLP (serve it as layer spans)")
        if getattr(layer.attention, "output_gate", False):
            raise ShardError(f"tensor shards of {spec.family} are not supported: layer {i}'s attention gates its "
                             "output per head, which the ranks do not compute (serve it as layer spans)")
        if layer.mlp.kind != "dense" or layer.attention.kind != "gqa":
            kind = layer.mlp.kind if layer.mlp.kind != "dense" else layer.attention.kind
            raise ShardError(f"tensor shards of {spec.family} are not supported: layer {i} is {kind!r}, and only "
                             "grouped-query attention with a dense MLP is split across ranks (serve it as layer spans)")
        if getattr(layer.attention, "qk_norm_whole", False):
            raise ShardError(f"tensor shards of {spec.family} are not supported: layer {i} norms q and k over all "
                             "of its heads at once, which needs every rank's heads (serve it as layer spans)")
        if getattr(layer.attention, "rotary_dim", None) is not None:
            raise ShardError(f"tensor shards of {spec.family} are not supported: layer {i} turns only "
                             f"{layer.attention.rope_dim} of its {layer.attention.head_dim} head dims (partial rotary), "
                             "which the ranks do not compute (serve it as layer spans)")
        what = unsharded_part(layer)
        if what is not None:
            raise ShardError(f"tensor shards of {spec.family} are not supported: layer {i} has {what}, which the "
                             "ranks do not compute (serve it as layer spans)")
    for name, value in (
        ("key/value heads", spec.layers[0].attention.num_kv_heads),
        ("hidden size", spec.hidden_size),
        ("MLP width", spec.layers[0].mlp.width),
    ):
        if value % count:
            raise ShardError(f"a group of {count} cannot split this model: its {name} ({value}) is not divisible by {count}")
    if len({(l.attention.num_kv_heads, l.mlp.width) for l in spec.layers}) != 1:
        raise ShardError(f"tensor shards of {spec.family} are not supported: its layers differ in heads or widths")


def unsharded_part(layer: LayerSpec) -> str | None:
    """What of a grouped-query layer with a dense MLP the ranks do not compute (None: nothing)."""
    at = layer.attention
    parts = (
        (at.sinks, "attention sinks"), (at.value_dim is not None, "values of another width than its keys"),
        (at.value_scale != 1.0, "scaled values"), (at.scale is not None, "a scores' scale of its own"),
        (at.v_norm, "normed values"), (at.k_eq_v, "values from its key projection"),
        (at.kv_source is not None, "another layer's keys and values"), (layer.sandwich, "norms after each half"),
        (layer.per_layer_input > 0, "a per-layer input"), (layer.scalar, "a layer scalar"),
        (layer.mlp.glu.kind != "silu", f"a {layer.mlp.glu.kind} MLP"),
    )
    return next((what for present, what in parts if present), None)


@dataclass
class ShardLayer:
    """Rank r's 1/n of one decoder layer (see the module docstring for which slices)."""

    attn_norm: torch.Tensor  # [H/n]
    w_qkv: torch.Tensor  # [(A + 2K) D, H/n], rows rank-major: q_s, k_s, v_s for s = 0..n-1
    b_qkv: torch.Tensor | None  # [(A + 2K) D / n], this rank's q, k, v bias
    w_o: torch.Tensor  # [H, A D / n]
    mlp_norm: torch.Tensor  # [H/n]
    w_gate_up: torch.Tensor  # [2 I, H/n], rows rank-major: gate_s, up_s for s = 0..n-1
    w_down: torch.Tensor  # [H, I / n]
    b_o: torch.Tensor | None = None  # [H/n], the output bias of this rank's hidden slice
    q_norm: RMSNorm | None = None  # over each head's D: every rank holds all of it (D values)
    k_norm: RMSNorm | None = None

    def tensors(self) -> list[torch.Tensor]:
        out = [t for t in vars(self).values() if isinstance(t, torch.Tensor)]
        return out + [n.weight for n in (self.q_norm, self.k_norm) if n is not None]

    def to(self, device: torch.device | str) -> "ShardLayer":
        moved = {k: v.to(device) if v is not None else None for k, v in vars(self).items()}
        return ShardLayer(**moved)


class ShardedStage(SessionTable):
    """Shard `index` of `count` of layers [start, end): the `Stage` API, on hidden slices."""

    def __init__(
        self,
        spec: ModelSpec,
        start: int,
        layers: list[ShardLayer],
        *,
        index: int,
        count: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        gather_full: bool = False,
    ) -> None:
        check_shardable(spec, count, index)
        if not 0 <= start <= start + len(layers) <= spec.num_layers:
            raise SpanError(f"span [{start}, {start + len(layers)}) is outside [0, {spec.num_layers})")
        self.spec = spec
        self.start = start
        self.end = start + len(layers)
        self.layers = layers
        self.index = index
        self.count = count
        self.device = torch.device(device)
        self.dtype = dtype
        self.gather_full = gather_full
        self.width = spec.hidden_size // count
        self.cols = (index * self.width, (index + 1) * self.width)  # this rank's hidden slice
        # this rank's heads, per layer: its own attention shape, and its KV cache's
        self.local: list[AttentionSpec] = [
            replace(layer.attention, num_heads=layer.attention.num_heads // count,
                    num_kv_heads=layer.attention.num_kv_heads // count) for layer in spec.layers]
        self.rope = RopeTables(spec.layers[start : self.end], self.device)
        self.sessions: dict[Hashable, SessionState] = {}

    # -- construction -------------------------------------------------------------------

    @staticmethod
    def load(
        folder: Path,
        *,
        start: int,
        end: int,
        index: int,
        count: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        gather_full: bool = False,
    ) -> "ShardedStage":
        """Read rank `index`'s slices of layers [start, end) — and nothing else.

        Raises ModelFormatError, SpanError, ShardError.
        """
        weights = WeightFolder(folder)
        spec = weights.spec
        check_shardable(spec, count, index)
        if not 0 <= start < end <= spec.num_layers:
            raise SpanError(f"span [{start}, {end}) is outside the model's [0, {spec.num_layers})")
        layers = [_load_layer(weights, dtype, layer, index, count).to(device) for layer in range(start, end)]
        return ShardedStage(spec, start, layers, index=index, count=count, device=device, dtype=dtype,
                            gather_full=gather_full)

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for layer in self.layers for t in layer.tensors())

    def cache_specs(self, start: int, end: int) -> list[CacheSpec]:
        """The KV cache holds this rank's KV heads only."""
        return [self.local[i].cache for i in range(start, end)]

    # -- compute ------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, session: Hashable, hidden: torch.Tensor, start_pos: int, group: Collectives) -> torch.Tensor:
        """Run the session's layers on this rank's slice [T, H/n] at positions [start_pos, start_pos + T).

        Every other rank of the group runs the same step at the same time; `group` carries
        the collectives (and the audit sink). Returns this rank's output slice [T, H/n].
        Raises SpanError (shape), ContextOverflow, CollectiveError.
        """
        state = self._session(session)
        t = hidden.shape[0]
        if hidden.dim() != 2 or hidden.shape[1] != self.width:
            raise SpanError(f"hidden slice has shape {tuple(hidden.shape)!r}, expected [T, {self.width}]")
        if group.rank != self.index or group.count != self.count:
            raise ShardError(f"collectives of rank {group.rank}/{group.count} given to shard {self.index}/{self.count}")
        state.cache.reserve(start_pos, t)
        positions = torch.arange(start_pos, start_pos + t, device=self.device)
        ctx = StepContext(start_pos, self.rope.tables(positions, self.dtype), self.device)
        x = hidden.to(device=self.device, dtype=self.dtype)
        stores = state.cache.layers
        first = state.start - self.start
        for i in range(first, state.end - self.start):
            group.layer = self.start + i
            x = self._layer(i, x, ctx, stores[i - first], group)
        return x

    def _layer(self, i: int, x: torch.Tensor, ctx: StepContext, store: KeyValues, group: Collectives) -> torch.Tensor:
        w, local = self.layers[i], self.local[self.start + i]
        spec, t, h = self.spec, x.shape[0], self.spec.hidden_size
        group.held("residual_in", HIDDEN, self.cols, h, t)
        qkv = self._norm_project(x, w.attn_norm, w.w_qkv, group, "attn_norm", "qkv", "qkv")  # [T, (a + 2k) D]
        if w.b_qkv is not None:
            qkv = qkv + w.b_qkv
        # attention over this rank's heads: the same kernels as `tessera.stages.layers.attention.Attention`
        cos, sin = ctx.rope(local)
        qk, v = rotate_heads(qkv, local.num_heads, local.num_kv_heads, local.head_dim, cos, sin, w.q_norm, w.k_norm)
        heads = attend(qk, v, local.num_heads, store, ctx.start, ctx.mask(ctx.start, t, local.window),
                       1.0 / math.sqrt(local.head_dim))  # [T, a D]
        a = local.q_size
        group.held("attn", "heads", (self.index * a, (self.index + 1) * a), a * self.count, t)
        out = group.reduce_scatter(F.linear(heads, w.w_o), op="o_proj", space=HIDDEN)  # [T, H/n]
        x = x + (out if w.b_o is None else out + w.b_o)
        group.held("residual_mid", HIDDEN, self.cols, h, t)
        if self.gather_full:
            normed = self._broken_norm(x, w.mlp_norm, group)
            gate_up = group.reduce_scatter(F.linear(normed, w.w_gate_up), op="gate_up", space="mlp")
        else:
            gate_up = self._norm_project(x, w.mlp_norm, w.w_gate_up, group, "mlp_norm", "gate_up", "mlp")
        width = spec.layers[self.start + i].mlp.width
        part = width // self.count
        gate, up = gate_up.split(part, dim=-1)  # [T, I/n] each
        inner = F.silu(gate) * up
        group.held("swiglu", "ffn", (self.index * part, (self.index + 1) * part), width, t)
        x = x + group.reduce_scatter(F.linear(inner, w.w_down), op="down", space=HIDDEN)  # [T, H/n]
        group.held("residual_out", HIDDEN, self.cols, h, t)
        return x

    def _norm_project(
        self, x: torch.Tensor, norm: torch.Tensor, weight: torch.Tensor, group: Collectives, norm_op: str, op: str,
        space: str,
    ) -> torch.Tensor:
        """RMSNorm of the full hidden state, then a projection, reduce-scattered — from a slice.

        The norm's scale rsqrt(mean square + eps) is one number per token, so it commutes with
        the projection: ranks project their slice times the norm weight, and the sums of
        squares ride in the same round as the reduce-scatter (a scalar all-reduce); the scale
        is applied to the reduced chunk.
        """
        squares = x.float().square().sum(-1)  # [T], this slice's part of the sum of squares
        weighted = x * norm  # [T, H/n]
        group.held(norm_op, HIDDEN, self.cols, self.spec.hidden_size, x.shape[0])
        part, total = group.norm_reduce_scatter(F.linear(weighted, weight), squares, op=op, space=space, norm=norm_op)
        scale = torch.rsqrt(total.float() / self.spec.hidden_size + self.spec.rms_norm_eps)
        return part * scale[:, None].to(part.dtype)

    def _broken_norm(self, x: torch.Tensor, weight: torch.Tensor, group: Collectives) -> torch.Tensor:
        """The BROKEN variant (gather_full): gather the residual, norm the full state here."""
        full = group.all_gather(x, op="residual_mid", space=HIDDEN)  # [T, H] — the whole hidden state
        scale = torch.rsqrt(full.float().square().mean(-1) + self.spec.rms_norm_eps)
        return (x * scale[:, None].to(x.dtype)) * weight

# -- loading only a rank's slices ------------------------------------------------------------


def _load_layer(weights: WeightFolder, dtype: torch.dtype, layer: int, r: int, n: int) -> ShardLayer:
    """Rank r's slices of one layer (module docstring): 1/n of every matrix; the per-head q/k norms
    whole. The checkpoint's tensors are those the family maps (stages/families/tensors.py)."""
    spec = weights.spec
    at = spec.layers[layer].attention
    d, hs, i = at.head_dim, spec.hidden_size // n, spec.layers[layer].mlp.width // n
    qh, kh = at.num_heads // n * d, at.num_kv_heads // n * d  # rows of q (and of k, v) per rank
    cols = (r * hs, (r + 1) * hs)
    tensors = tensors_of_layer(spec, layer)

    def parts(name: str, **where: tuple[int, int]) -> list[torch.Tensor]:
        """Each checkpoint tensor stacked into engine tensor `name`, sliced as `where` says."""
        source = weights.choose(tensors[name])
        return [weights.read_part(part, source.shapes[j], source.index, dtype, **where)
                for j, part in enumerate(source.names)]

    q, k, v = parts("attn.wqkv.weight", cols=cols)  # [rows, H/n]
    w_qkv = torch.cat([part for s in range(n) for part in (q[s * qh : (s + 1) * qh], k[s * kh : (s + 1) * kh],
                                                            v[s * kh : (s + 1) * kh])])
    b_qkv = None
    if at.qkv_bias:
        q_b, k_b, v_b = parts("attn.wqkv.bias")
        b_qkv = torch.cat([q_b[r * qh : (r + 1) * qh], k_b[r * kh : (r + 1) * kh], v_b[r * kh : (r + 1) * kh]])
    gate, up = parts("mlp.w_gate_up.weight", cols=cols)  # [I, H/n]
    w_gate_up = torch.cat([part for s in range(n) for part in (gate[s * i : (s + 1) * i], up[s * i : (s + 1) * i])])
    norms = {}
    for which in ("q_norm", "k_norm") if at.qk_norm else ():
        norms[which] = RMSNorm(d, spec.rms_norm_eps).requires_grad_(False)
        norms[which].weight.data = parts(f"attn.{which}.weight")[0]
    return ShardLayer(
        attn_norm=parts("attn_norm.weight", rows=cols)[0],
        w_qkv=w_qkv,
        b_qkv=b_qkv,
        w_o=parts("attn.wo.weight", cols=(r * qh, (r + 1) * qh))[0],
        mlp_norm=parts("mlp_norm.weight", rows=cols)[0],
        w_gate_up=w_gate_up,
        w_down=parts("mlp.w_down.weight", cols=(r * i, (r + 1) * i))[0],
        b_o=parts("attn.wo.bias", rows=cols)[0] if at.o_bias else None,
        **norms,
    )
