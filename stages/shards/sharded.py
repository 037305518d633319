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
from safetensors import SafetensorError, safe_open

from tessera.stages.shards.layout import HIDDEN
from tessera.stages.shards.collectives import Collectives
from tessera.stages.errors import ModelFormatError, SpanError, StageError
from tessera.stages.layers.model import Rotary, StepContext, apply_rope, attention_mask, grouped_decode_attention
from tessera.stages.families.spec import ModelSpec
from tessera.stages.engine.sessions import SessionState, SessionTable
from tessera.stages.weights.folder import WeightFolder, layer_tensor_names



class ShardError(StageError):
    """A group size that does not divide the model's heads or widths, or a bad shard index."""


def check_shardable(spec: ModelSpec, count: int, index: int = 0) -> None:
    """Raise ShardError unless `count` ranks can split `spec` (and `index` is one of them)."""
    if count < 1 or not 0 <= index < count:
        raise ShardError(f"shard {index!r} of {count!r}: need 0 <= index < count")
    for name, value in (
        ("key/value heads", spec.num_kv_heads),
        ("hidden size", spec.hidden_size),
        ("MLP width", spec.intermediate_size),
    ):
        if value % count:
            raise ShardError(f"a group of {count} cannot split this model: its {name} ({value}) is not divisible by {count}")


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

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in vars(self).values() if t is not None]


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
        # this rank's heads: its own attention shape, and its KV cache's
        self.local_spec = replace(spec, num_heads=spec.num_heads // count, num_kv_heads=spec.num_kv_heads // count)
        self.cache_spec = self.local_spec  # the KV cache holds this rank's KV heads only
        self.rotary = Rotary(spec, self.device)
        self.scale = 1.0 / math.sqrt(spec.head_dim)
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
        reader = _SliceReader(weights, dtype)
        layers = [_load_layer(reader, spec, layer, index, count) for layer in range(start, end)]
        layers = [ShardLayer(**{k: (v.to(device) if v is not None else None) for k, v in vars(l).items()}) for l in layers]
        return ShardedStage(spec, start, layers, index=index, count=count, device=device, dtype=dtype,
                            gather_full=gather_full)

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for layer in self.layers for t in layer.tensors())

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
        cos, sin = self.rotary.cos_sin(positions, self.dtype)
        ctx = StepContext(start_pos, cos, sin, attention_mask(start_pos, t, self.spec.sliding_window, self.device))
        x = hidden.to(device=self.device, dtype=self.dtype)
        cache = state.cache
        first = state.start - self.start
        for i in range(first, state.end - self.start):
            group.layer = self.start + i
            x = self._layer(self.layers[i], x, ctx, cache.keys[i - first], cache.values[i - first], group)
        return x

    def _layer(
        self, w: ShardLayer, x: torch.Tensor, ctx: StepContext, keys: torch.Tensor, values: torch.Tensor,
        group: Collectives,
    ) -> torch.Tensor:
        spec, t, h = self.spec, x.shape[0], self.spec.hidden_size
        group.held("residual_in", HIDDEN, self.cols, h, t)
        qkv = self._norm_project(x, w.attn_norm, w.w_qkv, group, "attn_norm", "qkv", "qkv")  # [T, (a + 2k) D]
        if w.b_qkv is not None:
            qkv = qkv + w.b_qkv
        heads = self._attend(qkv, ctx, keys, values)  # [T, a D]
        a = self.local_spec.num_heads * spec.head_dim
        group.held("attn", "heads", (self.index * a, (self.index + 1) * a), spec.q_size, t)
        x = x + group.reduce_scatter(F.linear(heads, w.w_o), op="o_proj", space=HIDDEN)  # [T, H/n]
        group.held("residual_mid", HIDDEN, self.cols, h, t)
        if self.gather_full:
            normed = self._broken_norm(x, w.mlp_norm, group)
            gate_up = group.reduce_scatter(F.linear(normed, w.w_gate_up), op="gate_up", space="mlp")
        else:
            gate_up = self._norm_project(x, w.mlp_norm, w.w_gate_up, group, "mlp_norm", "gate_up", "mlp")
        i = spec.intermediate_size // self.count
        gate, up = gate_up.split(i, dim=-1)  # [T, I/n] each
        inner = F.silu(gate) * up
        group.held("swiglu", "ffn", (self.index * i, (self.index + 1) * i), spec.intermediate_size, t)
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

    def _attend(self, qkv: torch.Tensor, ctx: StepContext, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """Attention over this rank's heads; the same kernels as `tessera.stages.layers.model.Attention`."""
        spec = self.local_spec
        t = qkv.shape[0]
        a, k, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        qk = apply_rope(qkv[:, : (a + k) * d].reshape(t, a + k, d), ctx.cos, ctx.sin)  # [T, a + k, D]
        end = ctx.start + t
        keys[:, ctx.start : end] = qk[:, a:].transpose(0, 1)  # cache [k, S, D]
        values[:, ctx.start : end] = qkv[:, (a + k) * d :].reshape(t, k, d).transpose(0, 1)
        if t == 1:
            lo = 0 if spec.sliding_window is None else max(0, end - spec.sliding_window)
            return grouped_decode_attention(qk[:, :a], keys[:, lo:end], values[:, lo:end], self.scale)
        g = a // k
        q = qk[None, :, :a].transpose(1, 2)  # [1, a, T, D]
        return F.scaled_dot_product_attention(
            q,
            keys[None, :, :end].repeat_interleave(g, dim=1),  # [1, a, S, D]
            values[None, :, :end].repeat_interleave(g, dim=1),
            attn_mask=ctx.mask,
            is_causal=ctx.mask is None,
        )[0].transpose(0, 1).reshape(t, a * d)  # [T, a D]


# -- loading only a rank's slices ------------------------------------------------------------


class _SliceReader:
    """Reads row/column ranges of named tensors straight from the safetensors files."""

    def __init__(self, weights: WeightFolder, dtype: torch.dtype) -> None:
        self.weights = weights
        self.dtype = dtype

    def read(self, name: str, shape: tuple[int, ...], rows: tuple[int, int] | None = None,
             cols: tuple[int, int] | None = None) -> torch.Tensor:
        if not self.weights.has(name):
            raise ModelFormatError(f"tensor {name!r} is missing from {str(self.weights.folder)!r}")
        path = self.weights._where[name]  # the folder's own index (name -> file)
        try:
            with safe_open(path, framework="pt") as f:
                sl = f.get_slice(name)
                if tuple(sl.get_shape()) != shape:
                    raise ModelFormatError(f"tensor {name!r} has shape {tuple(sl.get_shape())!r}, expected {shape!r}")
                r0, r1 = rows if rows is not None else (0, shape[0])
                if len(shape) == 1:
                    tensor = sl[r0:r1]
                else:
                    c0, c1 = cols if cols is not None else (0, shape[1])
                    tensor = sl[r0:r1, c0:c1]
        except (SafetensorError, OSError) as bad:
            raise ModelFormatError(f"cannot read {str(path)!r}: {bad}") from None
        return tensor.to(self.dtype).contiguous()


def _load_layer(reader: _SliceReader, spec: ModelSpec, layer: int, r: int, n: int) -> ShardLayer:
    """Rank r's slices of one layer (module docstring): 1/n of every matrix."""
    shapes = layer_tensor_names(spec, layer)
    p = f"model.layers.{layer}."
    d, hs, i = spec.head_dim, spec.hidden_size // n, spec.intermediate_size // n
    qh, kh = spec.num_heads // n * d, spec.num_kv_heads // n * d  # rows of q (and of k, v) per rank
    cols = (r * hs, (r + 1) * hs)

    def read(name: str, **where: tuple[int, int]) -> torch.Tensor:
        return reader.read(p + name, shapes[p + name], **where)

    q, k, v = (read(f"self_attn.{x}_proj.weight", cols=cols) for x in "qkv")  # [rows, H/n]
    w_qkv = torch.cat([part for s in range(n) for part in (q[s * qh : (s + 1) * qh], k[s * kh : (s + 1) * kh],
                                                            v[s * kh : (s + 1) * kh])])
    b_qkv = None
    if spec.attention_bias:
        b_qkv = torch.cat([
            read("self_attn.q_proj.bias", rows=(r * qh, (r + 1) * qh)),
            read("self_attn.k_proj.bias", rows=(r * kh, (r + 1) * kh)),
            read("self_attn.v_proj.bias", rows=(r * kh, (r + 1) * kh)),
        ])
    gate, up = (read(f"mlp.{x}_proj.weight", cols=cols) for x in ("gate", "up"))  # [I, H/n]
    w_gate_up = torch.cat([part for s in range(n) for part in (gate[s * i : (s + 1) * i], up[s * i : (s + 1) * i])])
    return ShardLayer(
        attn_norm=read("input_layernorm.weight", rows=cols),
        w_qkv=w_qkv,
        b_qkv=b_qkv,
        w_o=read("self_attn.o_proj.weight", cols=(r * qh, (r + 1) * qh)),
        mlp_norm=read("post_attention_layernorm.weight", rows=cols),
        w_gate_up=w_gate_up,
        w_down=read("mlp.down_proj.weight", cols=(r * i, (r + 1) * i)),
    )
