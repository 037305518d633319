"""A GGUF matrix as a span holds it (`GgmlLinear`), multiplied fast on a CPU: the codes widened in
"split" order, the activations permuted.

A k-quant block interleaves its nibbles (per 64 weights of Q4_K, the low nibbles are the first
32 and the high ones the next 32), so widening it in the weights' order means short strided
runs, which torch's elementwise kernels do slowly (measured: ~1 ns a weight for one masking op).
Instead, per chunk of rows, the code bytes of every block are copied out contiguously, their
low nibbles taken for the whole row at once and then their high nibbles (a few whole-word
operations over a contiguous buffer), giving each row's weights in a fixed permuted order —
the same for every row of the matrix. So the matmul permutes the activations instead:
x W^T = x[:, perm] (W[:, perm])^T, one gather of T x K values per call. The block scales
(`header`, the whole matrix's once per call) are permuted alike, and each weight is the
reference's value to the bit (same arithmetic, same order: stages/kernels/ggml.py);
only the matmul's order of summation differs.

    type  code bytes per block    split order within a row                      scale groups
    Q4_0  16 (after d)            block b's lows, ..., then every block's highs    16 (d, twice)
    Q4_1  16 (after d, m)         as Q4_0                                          16 (d, m twice)
    Q4_K  128 (after the header)  lows then highs; + nothing                      32
    Q5_K  128 + 32 bytes of 5th bits   as Q4_K, each code's fifth bit or-ed in    32
    Q6_K  128 low nibbles + 64 bytes of 2-bit highs   as Q4_K, highs or-ed in     16
    Q8_0  32 int8 (after d)       the weights' own order (no permutation)          32

Under torch.compile, the types `TILED` names are held as row tiles (kernels/row_tiles.py) and
multiplied along the tiles' lanes (`TILE_PRODUCTS`): Q4_K, Q2_K and Q5_K by their own products
(ggml/k_lanes.py), the types of two 4-bit codes a byte (Q4_0, Q4_1, IQ4_NL, IQ4_XS, MXFP4, NVFP4)
by theirs (ggml/pair_lanes.py), the others in their scaled-codes form (ggml/scaled.py): each
group's codes times the inputs summed, then times its scale. Eagerly, the tiled types with a
split order (above) copy their rows out of the tiles a chunk at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Callable

import torch

from tessera.stages.families.shipped import GgmlType
from tessera.stages.kernels.chunked import SCRATCH, chunked_matmul
from tessera.stages.kernels.ggml.blocks import SCALED_TYPES, ggml_rows
from tessera.stages.kernels.ggml.k_lanes import LANE_TYPES, lane_tile_rows, q5_k_rows
from tessera.stages.kernels.ggml.pair_lanes import PAIR_TYPES, pair_tile_rows
from tessera.stages.kernels.ggml.scaled import scaled_rows, scaled_tile_rows, scaled_weight
from tessera.stages.kernels.linear import ShippedLinear
from tessera.stages.kernels.row_tiles import rows_of, tile_rows, tiles_of

NIBBLES = 0x0F0F0F0F  # every byte's low nibble, a word at a time
# weights dequantized at once by a type without a split order (its eager rows): glibc keeps a freed
# transient's pages, and the reference's arithmetic holds ~16 bytes a weight in temporaries at its peak
# (measured: gguf MXFP4 SmolLM2 layers [0, 15) held 1.14x their bytes at 1 MiB-float32 chunks)
SCALED_ROWS_WEIGHTS = 1 << 16


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte `at` of each block -> float32 [r, nb]. Every block size and offset here is
    even, and `rows_of` hands over rows at an even byte (a span's rows may start at an odd one)."""
    return blocks.view(torch.int16)[..., at // 2].view(torch.float16).float()


def _split(blocks: torch.Tensor, at: int, width: int) -> torch.Tensor:
    """Code bytes [at, at + width) of each block of `blocks` [r, nb, nbytes] -> uint8 [r, 2, nb width]:
    per row, every block's low nibbles, then every block's high nibbles (this thread's scratch)."""
    r, nb, _ = blocks.shape
    flat = SCRATCH.take(r * nb * width, torch.uint8, "flat").view(r, nb, width)
    flat.copy_(blocks[..., at : at + width])
    codes = SCRATCH.take(2 * r * nb * width, torch.uint8, "codes").view(r, 2, nb * width)
    words, into = flat.view(r, -1).view(torch.int32), codes.view(torch.int32)
    torch.bitwise_and(words, NIBBLES, out=into[:, 0])
    torch.bitwise_right_shift(words, 4, out=into[:, 1]).bitwise_and_(NIBBLES)
    return codes


# -- per type: the permutation, the scales in its order, the codes ---------------------------------------

@dataclass(frozen=True)
class Split:
    """One block type's fast path. `order(nb)`: original column of each permuted position of a row of
    nb blocks (None: no permutation); `header(blocks)`: (scale, offset or None) [N, groups] in that
    order, w = code * scale - offset; `codes(blocks, out)`: the permuted codes into `out` [r, K] as float32."""

    group: int
    order: Callable[[int], torch.Tensor | None]
    header: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]
    codes: Callable[[torch.Tensor, torch.Tensor], None]


def _order_halves(nb: int, block: int, run: int, runs: int) -> torch.Tensor:
    """Split order for blocks whose code bytes cover `runs` runs of 2 x `run` weights each (the low
    nibbles of a run's bytes its first `run` weights, the high ones the next `run`)."""
    part, j = torch.arange(2)[:, None], torch.arange(nb * runs * run)[None, :]  # [2, nb runs run]
    b, within = j // (runs * run), j % (runs * run)
    return (b * block + (within // run) * 2 * run + part * run + within % run).reshape(-1)


def _q8_0_codes(blocks: torch.Tensor, out: torch.Tensor) -> None:
    r, nb, _ = blocks.shape
    out.view(r, nb, 32).copy_(blocks[..., 2:].view(torch.int8))


def _q4_codes(at: int, offset: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
    def codes(blocks: torch.Tensor, out: torch.Tensor) -> None:
        signed = _split(blocks, at, 16).view(torch.int8)
        if offset:
            signed.sub_(offset)
        out.copy_(signed.view(out.shape))
    return codes


def _q4_0_header(blocks: torch.Tensor) -> tuple[torch.Tensor, None]:
    d = _half(blocks, 0)
    return torch.cat((d, d), dim=1), None


def _q4_1_header(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d, m = _half(blocks, 0), _half(blocks, 2)
    return torch.cat((d, d), dim=1), torch.cat((m, m), dim=1).neg_()  # w = d q + m = d q - (-m), exactly


def _k_header(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: d * scale and dmin * min per sub-block, in split order (even sub-blocks, then odd).
    The 12 bytes of six-bit scales and mins are unpacked four at a time in int32 words (ggml.py
    `k_scales`' arithmetic; six-bit values widen through int8 as through uint8)."""
    words = blocks[..., 4:16].view(torch.int32)  # [N, nb, 3]: d, m, m_d as k_scales names them
    d, m, m_d = words[..., 0:1], words[..., 1:2], words[..., 2:3]
    sc = torch.cat((d & 0x3F3F3F3F, (m_d & 0x0F0F0F0F) | ((d >> 2) & 0x30303030)), dim=-1).view(torch.int8)
    mins = torch.cat((m & 0x3F3F3F3F, ((m_d >> 4) & 0x0F0F0F0F) | ((m >> 2) & 0x30303030)), dim=-1).view(torch.int8)
    scale = _half(blocks, 0)[..., None] * sc.float()  # [N, nb, 8]
    low = _half(blocks, 2)[..., None] * mins.float()
    n = blocks.shape[0]
    return (torch.cat((scale[..., 0::2].reshape(n, -1), scale[..., 1::2].reshape(n, -1)), dim=1),
            torch.cat((low[..., 0::2].reshape(n, -1), low[..., 1::2].reshape(n, -1)), dim=1))


def _q4_k_codes(blocks: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(_split(blocks, 16, 128).view(torch.int8).view(out.shape))


def _q5_k_codes(blocks: torch.Tensor, out: torch.Tensor) -> None:
    r, nb, _ = blocks.shape
    codes = _split(blocks, 48, 128).view(r, 2, nb, 4, 32)
    # bit s of qh's byte l is weight l of sub-block s = 2 i + part: shifted four bytes a word
    high = SCRATCH.take(r * nb * 8 * 8, torch.int32, "high").view(r, nb, 8, 8)
    torch.bitwise_right_shift(blocks[..., None, 16:48].view(torch.int32), _SHIFTS_8, out=high)
    high.bitwise_and_(0x01010101).bitwise_left_shift_(4)
    codes.bitwise_or_(high.view(torch.uint8).view(r, nb, 4, 2, 32).permute(0, 3, 1, 2, 4))
    out.copy_(codes.view(torch.int8).view(out.shape))


def _q6_k_header(blocks: torch.Tensor) -> tuple[torch.Tensor, None]:
    n, nb, _ = blocks.shape
    scale = _half(blocks, 208)[..., None] * blocks[..., 192:208].view(torch.int8).float()  # [N, nb, 16]
    # split group (k, b, h, q) of 16 weights is scale h 8 + k 4 + q of block b
    return scale.view(n, nb, 2, 2, 4).permute(0, 3, 1, 2, 4).reshape(n, -1), None


def _q6_k_order(nb: int) -> torch.Tensor:
    k, b = torch.arange(2)[:, None, None], torch.arange(nb)[None, :, None]
    j = torch.arange(128)[None, None, :]
    return (b * 256 + (j // 64) * 128 + k * 64 + j % 64).reshape(-1)


def _q6_k_codes(blocks: torch.Tensor, out: torch.Tensor) -> None:
    r, nb, _ = blocks.shape
    codes = _split(blocks, 0, 128).view(r, 2, nb, 2, 2, 32)  # (k, b, h, s2, l): low nibble k of byte h 64 + s2 32 + l
    # its two high bits: bits 2 (2 k + s2) of qh's byte h 32 + l, shifted two bytes a word (210-byte blocks)
    high = SCRATCH.take(r * nb * 4 * 2 * 16, torch.int16, "high").view(r, nb, 4, 2, 16)
    torch.bitwise_right_shift(blocks[..., 128:192].view(r, nb, 1, 2, 32).view(torch.int16), _SHIFTS_2, out=high)
    high.bitwise_and_(0x0303).bitwise_left_shift_(4)
    codes.bitwise_or_(high.view(torch.uint8).view(r, nb, 2, 2, 2, 32).permute(0, 2, 1, 4, 3, 5))
    signed = codes.view(torch.int8).sub_(32)
    out.copy_(signed.view(out.shape))


_SHIFTS_8 = torch.arange(8, dtype=torch.int32)[:, None]
_SHIFTS_2 = torch.arange(0, 8, 2, dtype=torch.int16)[:, None, None]

SPLITS = {
    "Q8_0": Split(32, lambda nb: None, lambda blocks: (_half(blocks, 0), None), _q8_0_codes),
    "Q4_0": Split(16, lambda nb: _order_halves(nb, 32, 16, 1), _q4_0_header, _q4_codes(2, 8)),
    "Q4_1": Split(16, lambda nb: _order_halves(nb, 32, 16, 1), _q4_1_header, _q4_codes(4, 0)),
    "Q4_K": Split(32, lambda nb: _order_halves(nb, 256, 32, 4), _k_header, _q4_k_codes),
    "Q5_K": Split(32, lambda nb: _order_halves(nb, 256, 32, 4), _k_header, _q5_k_codes),
    "Q6_K": Split(16, _q6_k_order, _q6_k_header, _q6_k_codes),
}


@lru_cache(maxsize=64)
def split_order(kind: str, nb: int) -> torch.Tensor | None:
    """The permutation of a row of nb blocks of `kind` (shared by every matrix of that width)."""
    return SPLITS[kind].order(nb)


def split_matmul(rows: torch.Tensor, raw_rows: Callable[[int, int], torch.Tensor], n: int,
                 kind: GgmlType) -> torch.Tensor:
    """rows [T, K] float32 @ W^T for W the ggml matrix of n rows whose rows [lo, hi) `raw_rows` gives as
    uint8 [hi - lo, row bytes] -> [T, N] (module docstring)."""
    split = SPLITS[kind.name]
    order = split_order(kind.name, rows.shape[1] // kind.block)
    x = rows if order is None else rows.index_select(1, order)

    def rows_of(lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
        blocks = raw_rows(lo, hi).view(hi - lo, -1, kind.nbytes)
        if blocks.storage_offset() % 2:  # rows at an odd byte of the file's mapping: the int16 views need an even one
            blocks = blocks.clone()
        scale, offset = split.header(blocks)  # [r, groups]
        split.codes(blocks, out)
        w = out.view(hi - lo, -1, split.group)
        w.mul_(scale[:, :, None])
        if offset is not None:
            w.sub_(offset[:, :, None])
        return out

    return chunked_matmul(x, n, rows_of)


def split_weight(raw: torch.Tensor, kind: GgmlType) -> torch.Tensor:
    """The whole matrix through the fast path, back in the weights' order (for the tests: the same values)."""
    split = SPLITS[kind.name]
    n = raw.shape[0]
    blocks = raw.view(n, -1, kind.nbytes)
    scale, offset = split.header(blocks)
    out = torch.empty(n, blocks.shape[1] * kind.block)
    split.codes(blocks, out)
    w = out.view(n, -1, split.group).mul_(scale[..., None])
    if offset is not None:
        w.sub_(offset[..., None])
    order = split_order(kind.name, blocks.shape[1])
    if order is None:
        return out
    dense = torch.empty_like(out)
    dense[:, order] = out
    return dense



# the scaled types held as row tiles (kernels/row_tiles.py): those whose compiled product is faster so
# (measured, a 2816 x 1024 matrix against its rows as stored, one thread: Q2_K 0.52 -> 0.92x float32's,
# Q3_K 0.48 -> 0.90, Q6_K 0.54 -> 0.93, IQ4_XS 0.51 -> 0.72, IQ4_NL 0.63 -> 0.87, MXFP4 0.66 -> 0.83,
# NVFP4 0.28 -> 0.79, Q8_0 0.19 (per weight) -> 1.5; Q4_K 0.78 -> 1.1 through its own product, lanes last
# (ggml/k_lanes.py: through scaled.py's it loses); the figures so far a loaded box's. The two-codes-a-byte
# types through theirs (ggml/pair_lanes.py; a quiet box, the kernel alone, the general tile product ->
# theirs: MXFP4 0.40 -> 0.68, NVFP4 0.40 -> 0.70, IQ4_NL 0.54 -> 0.60, IQ4_XS 0.47 -> 0.55; Q4_1 0.63
# (per weight, its rows as stored) -> 1.4-1.8);
# Q5_K through its nibbles and fifth bits as two products (ggml/k_lanes.py `q5_k_rows`; a synth-k span
# compiled 0.54 -> 0.78x float32's, eagerly 0.19 -> 0.17x: the eager rows are copied out of the tiles);
# Q6_K's low nibbles and high bits so, measured 0.59 -> 1.0x alone but 0.75x in a synth-k span against
# 0.77x through scaled.py's product: not kept; the IQ grid types gain nothing)
TILED = frozenset(("Q4_K", "Q8_0", "Q4_0", "Q4_1", "Q2_K", "Q3_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ4_NL", "MXFP4", "NVFP4"))
# the tiled types with a product of their own, (x, tiles) -> y (the others: ggml/scaled.py's general one)
TILE_PRODUCTS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    **{name: partial(lane_tile_rows, name) for name in LANE_TYPES},  # Q4_K, Q2_K: ggml/k_lanes.py
    "Q5_K": q5_k_rows,  # its nibbles and fifth bits apart: ggml/k_lanes.py
    **{name: partial(pair_tile_rows, name) for name in PAIR_TYPES},  # two codes a byte: ggml/pair_lanes.py
}


class GgmlLinear(ShippedLinear):
    """y = x W^T for W stored as ggml blocks of `kind`: uint8 [N, K / block * nbytes], as the GGUF held them;
    a type with a scaled-codes form (ggml/scaled.py) held as row tiles (kernels/row_tiles.py: `weight` and
    `weight_tail`, the same bytes), whose compiled product runs along the tiles' lanes."""

    def __init__(self, raw: torch.Tensor, kind: GgmlType, in_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        assert raw.shape[1] * kind.block == in_features * kind.nbytes, "a row is whole blocks"
        self.kind = kind
        self.out_features, self.in_features = raw.shape[0], in_features
        self.tiled = kind.name in TILED
        head, tail = tiles_of(raw) if self.tiled else (raw, None)
        self.register_buffer("weight", head)
        self.register_buffer("weight_tail", tail)
        self.register_buffer("bias", bias)

    def raw_rows(self, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi) of the blocks as the GGUF held them, uint8 [hi - lo, row bytes]."""
        return tile_rows(self.weight, self.weight_tail, lo, hi) if self.tiled else self.weight[lo:hi]

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [T, K] -> [T, N], without the bias (on a CPU: `split_matmul` where the type has a split
        order, else its reference rows a chunk at a time)."""
        if rows.device.type != "cpu" or self.kind.name not in SPLITS:
            return super().matmul(rows)
        return split_matmul(rows.float(), self.raw_rows, self.out_features, self.kind).to(rows.dtype)

    def rows_into(self, lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
        """Rows [lo, hi) of the weight into `out`, through the reference's arithmetic a few rows at a time
        (its temporaries, several times the rows' float32 size, are kept near SCALED_ROWS_WEIGHTS)."""
        step = max(1, SCALED_ROWS_WEIGHTS // self.in_features)
        for a in range(lo, hi, step):
            b = min(hi, a + step)
            out[a - lo : b - lo] = ggml_rows(self.raw_rows(a, b), self.kind)
        return out

    def dequantized(self) -> torch.Tensor:
        return ggml_rows(self.raw_rows(0, self.out_features).cpu(), self.kind)

    def dequantized_on(self, device: torch.device) -> torch.Tensor:
        return ggml_rows(self.raw_rows(0, self.out_features).to(device), self.kind)

    @property
    def stored_as(self) -> str:
        return f"GGUF {self.kind.name}"

    def fused_inputs(self) -> tuple[torch.Tensor, ...] | None:
        tail = () if self.weight_tail is None else (self.weight_tail,)  # tiled: the tiles, else the bytes as stored
        return self.weight, *tail, *SCALED_TYPES[self.kind.name].tables()  # and the type's tables (grids): graph inputs

    def _tiles(self, stored: tuple[torch.Tensor, ...]) -> tuple[list[torch.Tensor], tuple[torch.Tensor, ...]]:
        """A tiled type's `fused_inputs` -> (its tiles holding rows, its tables)."""
        count = 1 if self.weight_tail is None else 2
        return [t for t in stored[:count] if t.shape[0]], stored[count:]

    def fused_weight(self, raw: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        if self.tiled:
            tiles, tables = self._tiles((raw, *rest))
            raw = torch.cat([rows_of(t) for t in tiles])
            blocks = raw.view(raw.shape[0], -1, self.kind.nbytes)
            return scaled_weight(SCALED_TYPES[self.kind.name], blocks, *tables).reshape(self.out_features, -1)
        blocks = raw.view(raw.shape[0], -1, self.kind.nbytes)
        return scaled_weight(SCALED_TYPES[self.kind.name], blocks, *rest).reshape(self.out_features, -1)

    def fused_rows(self, x: torch.Tensor, raw: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        if self.tiled:
            tiles, tables = self._tiles((raw, *rest))
            own = TILE_PRODUCTS.get(self.kind.name)
            if own is not None:
                outs = [own(x, t) for t in tiles]
            else:
                kind = SCALED_TYPES[self.kind.name]
                outs = [scaled_tile_rows(kind, self.kind.nbytes, x, t, *tables) for t in tiles]
            return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        blocks = raw.view(raw.shape[0], -1, self.kind.nbytes)
        return scaled_rows(SCALED_TYPES[self.kind.name], x, blocks, *rest)
