"""GGUF (ggml) block types, dequantized from their bytes in torch: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K.

A GGUF matrix [N, K] is N rows of K / block blocks, each block `nbytes` bytes
(families/shipped.py GGML_TYPES); a row's blocks are contiguous, so the stored tensor is
uint8 [N, K / block * nbytes] and rows [lo, hi) are its rows [lo, hi). Each function below
turns such rows into float32 [r, K] with the arithmetic of llama.cpp's `dequantize_row_*`,
in the order the gguf package's numpy dequantizers compute it (so that the two agree bit
for bit; the tests hold them to that):

    Q8_0  (34 B / 32)   d f16, 32 int8 q               w = q * d
    Q4_0  (18 B / 32)   d f16, 16 B of nibbles         w = d * (q - 8)      low nibbles: the first 16
    Q4_1  (20 B / 32)   d, m f16, 16 B of nibbles      w = d * q + m
    Q4_K  (144 B / 256) d, dmin f16; 12 B of 6-bit scales and mins for 8 sub-blocks of 32;
                        128 B of nibbles (per 64 weights: the low nibbles the first 32)
                        w = (d * sc_j) * q - dmin * m_j
    Q5_K  (176 B / 256) as Q4_K plus 32 B of fifth bits (bit j of byte i: sub-block j, weight i)
    Q6_K  (210 B / 256) 128 B low nibbles, 64 B of 2-bit highs, 16 int8 scales (per 16), d f16
                        w = (d * sc_j) * (q - 32)

The span keeps the bytes; `GgmlLinear` widens rows of them a chunk at a time into scratch.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from tessera.stages.families.shipped import GGML_TYPES, GgmlType
from tessera.stages.weights.formats.linear import ShippedLinear
from tessera.stages.weights.quant import SCRATCH, chunked_matmul

K_SCALE_BYTES = 12  # Q4_K/Q5_K: 8 six-bit scales and 8 six-bit mins
QK_K = 256


def _f16(raw: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at bytes [at, at + 2) of each block of `raw` [r, nb, nbytes], as float32 [r, nb, 1]."""
    return raw[..., at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, span: int) -> torch.Tensor:
    """Bytes [..., n] -> codes [..., 2 n]: per run of `span` bytes, its low nibbles then its high ones."""
    *lead, n = qs.shape
    runs = qs.reshape(*lead, n // span, 1, span)
    return torch.cat((runs & 0x0F, runs >> 4), dim=-2).reshape(*lead, 2 * n)


def q8_0(raw: torch.Tensor) -> torch.Tensor:
    d = _f16(raw, 0)
    return raw[..., 2:].view(torch.int8).float() * d


def q4_0(raw: torch.Tensor) -> torch.Tensor:
    d = _f16(raw, 0)
    q = _nibbles(raw[..., 2:], 16).view(torch.int8) - 8
    return d * q.float()


def q4_1(raw: torch.Tensor) -> torch.Tensor:
    d, m = _f16(raw, 0), _f16(raw, 2)
    return d * _nibbles(raw[..., 4:], 16).float() + m


def k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes [..., 12] -> six-bit scales and mins [..., 8] (llama.cpp's get_scale_min_k4)."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mins = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mins


def q4_k(raw: torch.Tensor) -> torch.Tensor:
    *lead, _ = raw.shape
    d, dmin = _f16(raw, 0), _f16(raw, 2)
    sc, mins = k_scales(raw[..., 4 : 4 + K_SCALE_BYTES])
    scale = (d * sc.float())[..., None]  # [..., 8, 1]
    low = (dmin * mins.float())[..., None]
    q = _nibbles(raw[..., 16:], 32).reshape(*lead, 8, 32).float()
    return (scale * q - low).reshape(*lead, QK_K)


def q5_k(raw: torch.Tensor) -> torch.Tensor:
    *lead, _ = raw.shape
    d, dmin = _f16(raw, 0), _f16(raw, 2)
    sc, mins = k_scales(raw[..., 4 : 4 + K_SCALE_BYTES])
    scale = (d * sc.float())[..., None]
    low = (dmin * mins.float())[..., None]
    qh = raw[..., 16:48]  # [..., 32]: bit j of byte i is weight i of sub-block j
    shifts = torch.arange(8, dtype=torch.uint8, device=raw.device)[:, None]
    high = (qh[..., None, :] >> shifts) & 1  # [..., 8, 32]
    q = _nibbles(raw[..., 48:], 32).reshape(*lead, 8, 32) | (high << 4)
    return (scale * q.float() - low).reshape(*lead, QK_K)


def q6_k(raw: torch.Tensor) -> torch.Tensor:
    *lead, _ = raw.shape
    ql, qh = raw[..., 0:128], raw[..., 128:192]
    scales = raw[..., 192:208].view(torch.int8).float()
    d = _f16(raw, 208)
    scale = (d * scales)[..., None]  # [..., 16, 1]
    low = _nibbles(ql, 64).reshape(*lead, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=raw.device)[:, None]
    high = ((qh.reshape(*lead, 2, 1, 32) >> shifts) & 3).reshape(*lead, 8, 32)
    q = ((low | (high << 4)).view(torch.int8) - 32).reshape(*lead, 16, 16).float()
    return (scale * q).reshape(*lead, QK_K)


DEQUANTIZE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Q8_0": q8_0, "Q4_0": q4_0, "Q4_1": q4_1, "Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k,
}
assert set(DEQUANTIZE) == {n for n, t in GGML_TYPES.items() if not t.is_float}, "every block type has its dequantizer"


def ggml_rows(raw: torch.Tensor, kind: GgmlType) -> torch.Tensor:
    """Rows of a ggml matrix, uint8 [r, K / block * nbytes] -> float32 [r, K] (the reference's arithmetic)."""
    r = raw.shape[0]
    blocks = raw.reshape(r, -1, kind.nbytes)  # [r, K / block, nbytes]
    return DEQUANTIZE[kind.name](blocks).reshape(r, -1)


# -- the same values, computed for speed -------------------------------------------------------------
#
# At compute time the functions above cost a dozen passes and as many fresh tensors per chunk.
# These write the codes into this thread's scratch with `out=` (low and high nibbles straight
# into their interleaved places), widen them into the caller's float32 chunk once, and scale
# it in place: three or four passes over a chunk in cache. The arithmetic and its order are the
# reference's (scale * q - min), so the weights are the same to the bit (tests hold them to it).

NIBBLE_MASKS = {torch.int32: 0x0F0F0F0F, torch.int16: 0x0F0F, torch.uint8: 0x0F}


def _split_nibbles(qs: torch.Tensor, codes: torch.Tensor) -> None:
    """Bytes qs [..., span] -> codes [..., 2, span]: the low nibbles, then the high ones. Four (or
    two) bytes a word where the block layout aligns them: a byte-wise shift is several times
    slower on a CPU, and shifting a word then masking each byte's low nibble is the same."""
    for word in (torch.int32, torch.int16, torch.uint8):
        try:
            src, dst = qs.view(word), codes.view(word)
        except RuntimeError:  # not aligned to this word in the block layout
            continue
        mask = NIBBLE_MASKS[word]
        torch.bitwise_and(src, mask, out=dst[..., 0, :])
        torch.bitwise_right_shift(src, 4, out=dst[..., 1, :]).bitwise_and_(mask)
        return


def _scratch_codes(shape: tuple[int, ...]) -> torch.Tensor:
    return SCRATCH.take(math.prod(shape), torch.uint8).view(shape)


# Each type's per-block scales ("header", computed once per matmul for the whole matrix: small
# tensors, whose per-op cost would otherwise recur in every chunk), then its codes ("body", per chunk).
Header = tuple[torch.Tensor, ...]


def q8_0_header(raw: torch.Tensor) -> Header:
    return (_f16(raw, 0),)


def q8_0_body(raw: torch.Tensor, header: Header, out: torch.Tensor) -> torch.Tensor:
    r, nb, _ = raw.shape
    w = out.view(r, nb, 32)
    w.copy_(raw[..., 2:].view(torch.int8))
    return w.mul_(header[0])


def q4_0_body(raw: torch.Tensor, header: Header, out: torch.Tensor) -> torch.Tensor:
    r, nb, _ = raw.shape
    codes = _scratch_codes((r, nb, 2, 16))
    _split_nibbles(raw[..., 2:], codes)
    w = out.view(r, nb, 32)
    w.copy_(codes.view(torch.int8).sub_(8).view(r, nb, 32))
    return w.mul_(header[0])


def q4_1_header(raw: torch.Tensor) -> Header:
    return _f16(raw, 0), _f16(raw, 2)


def q4_1_body(raw: torch.Tensor, header: Header, out: torch.Tensor) -> torch.Tensor:
    r, nb, _ = raw.shape
    codes = _scratch_codes((r, nb, 2, 16))
    _split_nibbles(raw[..., 4:], codes)
    w = out.view(r, nb, 32)
    w.copy_(codes.view(torch.int8).view(r, nb, 32))  # int8 -> float32 is vectorised, uint8's is not
    return w.mul_(header[0]).add_(header[1])


def k_header(raw: torch.Tensor) -> Header:
    """Q4_K/Q5_K: (d * scale, dmin * min) per sub-block of 32, float32 [r, nb, 8, 1]."""
    sc, mins = k_scales(raw[..., 4 : 4 + K_SCALE_BYTES])
    return (_f16(raw, 0) * sc.float())[..., None], (_f16(raw, 2) * mins.float())[..., None]


def q4_k_body(raw: torch.Tensor, header: Header, out: torch.Tensor) -> torch.Tensor:
    r, nb, _ = raw.shape
    codes = _scratch_codes((r, nb, 4, 2, 32))
    _split_nibbles(raw[..., 16:].view(r, nb, 4, 32), codes)
    w = out.view(r, nb, 8, 32)
    w.copy_(codes.view(torch.int8).view(r, nb, 8, 32))
    return w.mul_(header[0]).sub_(header[1])


def q5_k_body(raw: torch.Tensor, header: Header, out: torch.Tensor) -> torch.Tensor:
    r, nb, _ = raw.shape
    codes = _scratch_codes((r, nb, 4, 2, 32))
    _split_nibbles(raw[..., 48:].view(r, nb, 4, 32), codes)
    high = SCRATCH.take(r * nb * 8 * 32, torch.int16).view(torch.uint8)[: r * nb * 8 * 32].view(r, nb, 8, 32)
    torch.bitwise_right_shift(raw[..., None, 16:48], _shifts(8, 1, raw.device), out=high)
    high.bitwise_and_(1).bitwise_left_shift_(4)
    q = codes.view(r, nb, 8, 32).bitwise_or_(high)
    w = out.view(r, nb, 8, 32)
    w.copy_(q.view(torch.int8))
    return w.mul_(header[0]).sub_(header[1])


def q6_k_header(raw: torch.Tensor) -> Header:
    return ((_f16(raw, 208) * raw[..., 192:208].view(torch.int8).float())[..., None],)  # [r, nb, 16, 1]


def q6_k_body(raw: torch.Tensor, header: Header, out: torch.Tensor) -> torch.Tensor:
    r, nb, _ = raw.shape
    codes = _scratch_codes((r, nb, 2, 2, 64))
    _split_nibbles(raw[..., 0:128].view(r, nb, 2, 64), codes)
    high = SCRATCH.take(r * nb * 256, torch.int16).view(torch.uint8)[: r * nb * 256].view(r, nb, 2, 4, 32)
    torch.bitwise_right_shift(raw[..., 128:192].view(r, nb, 2, 1, 32), _shifts(4, 2, raw.device), out=high)
    high.bitwise_and_(3).bitwise_left_shift_(4)
    q = codes.view(r, nb, 2, 4, 32).bitwise_or_(high).view(torch.int8).sub_(32)
    w = out.view(r, nb, 16, 16)
    w.copy_(q.view(r, nb, 16, 16))
    return w.mul_(header[0])


def _shifts(count: int, step: int, device: torch.device) -> torch.Tensor:
    """[count, 1] uint8 shifts 0, step, 2 step, ... (one per bit field of a byte)."""
    return torch.arange(0, count * step, step, dtype=torch.uint8, device=device)[:, None]


FAST: dict[str, tuple[Callable[[torch.Tensor], Header], Callable[[torch.Tensor, Header, torch.Tensor], torch.Tensor]]] = {
    "Q8_0": (q8_0_header, q8_0_body), "Q4_0": (q8_0_header, q4_0_body), "Q4_1": (q4_1_header, q4_1_body),
    "Q4_K": (k_header, q4_k_body), "Q5_K": (k_header, q5_k_body), "Q6_K": (q6_k_header, q6_k_body),
}
assert set(FAST) == set(DEQUANTIZE), "every block type has its fast dequantizer"


def ggml_rows_into(raw: torch.Tensor, kind: GgmlType, out: torch.Tensor) -> torch.Tensor:
    """`ggml_rows` into `out` [r, K] float32 (a CPU chunk of this thread's scratch), for speed."""
    header, body = FAST[kind.name]
    blocks = raw.view(raw.shape[0], -1, kind.nbytes)
    body(blocks, header(blocks), out)
    return out


class GgmlLinear(ShippedLinear):
    """y = x W^T for W stored as ggml blocks of `kind`: uint8 [N, K / block * nbytes], as the GGUF held them."""

    def __init__(self, raw: torch.Tensor, kind: GgmlType, in_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        assert raw.shape[1] * kind.block == in_features * kind.nbytes, "a row is whole blocks"
        self.kind = kind
        self.out_features, self.in_features = raw.shape[0], in_features
        self.register_buffer("weight", raw)
        self.register_buffer("bias", bias)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [T, K] -> [T, N]: on a CPU, the scales of the whole matrix once, its codes a chunk at a time."""
        if rows.device.type != "cpu":
            return super().matmul(rows)
        header_of, body = FAST[self.kind.name]
        blocks = self.weight.view(self.out_features, -1, self.kind.nbytes)
        header = header_of(blocks)

        def rows_of(lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
            body(blocks[lo:hi], tuple(h[lo:hi] for h in header), out)
            return out  # [hi - lo, K]

        return chunked_matmul(rows.float(), self.out_features, rows_of).to(rows.dtype)

    def rows_into(self, lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
        return ggml_rows_into(self.weight[lo:hi], self.kind, out)

    def dequantized(self) -> torch.Tensor:
        return ggml_rows(self.weight.cpu(), self.kind)

    def dequantized_on(self, device: torch.device) -> torch.Tensor:
        return ggml_rows(self.weight.to(device), self.kind)
