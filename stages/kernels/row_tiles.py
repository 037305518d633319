"""Rows of a 4-bit matrix laid out for a compiled one-row product: TILE rows side by side, their bytes interleaved.

A 4-bit format's matrix ships row-major: row n's code bytes, then row n + 1's. The one-row product
under torch.compile (stages/engine/compiled/forms.py) is a reduction over each row, which inductor
vectorises along the row: it does well for float32 (a contiguous load of weights and inputs, one
multiply-add), badly for codes with a scale per group of 16 or 32 inputs: the group's scale and
the byte's two nibbles (an even and an odd input) do not line up with a vector of inputs, and the
generated loop falls back to per-lane gathers and transposes (measured here, a 2816 x 1024 INT4
matrix: 0.25x float32's product; NVFP4 0.13x).

Laid out as tiles, the same bytes are `[N / TILE, ..., TILE]`: byte j of rows 16 t .. 16 t + 15
side by side. The product then runs along the tile's lanes instead: one vector load gives byte j of
16 rows, each lane's scale is a contiguous load too, and the inputs of byte j are two scalars
broadcast to every lane, so inductor's loop is one vectorised multiply-add per byte per 16 rows
with every load contiguous (the INT4 matrix above: 1.7x float32's product). The weight each lane
forms is the dequantized weight, value for value (the scale applied to each code as the reference
does), and only the order of the float32 sum differs from the reference's matmul.

A matrix whose rows are not a multiple of TILE keeps its last rows as one narrower tile (`tail`),
so the layout holds exactly the bytes it was given (placement and `Stage.weight_bytes` count
them as stored). The layout is made once at load, a matrix at a time, in place: the tiles are views
of the tensor as read.
"""

from __future__ import annotations

import torch

TILE = 16  # rows a tile interleaves: one AVX-512 vector of float32 lanes


TILING_BYTES = 1 << 16  # bytes permuted at a time: below glibc's mmap threshold (128 KiB), so tiling
# frees no mmapped chunk (freeing one raises the threshold, and the forward pass's temporaries then stay
# in the heap after they are freed: measured, an INT4 span held 1.26x its bytes instead of 1.04x)


def tiles_of(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """rows [N, ...] (contiguous; taken over: its bytes are permuted in place) -> (head [N // TILE, ..., TILE],
    tail [1, ..., N % TILE] or None), views of its storage: each tile's bytes are its rows' own bytes, in
    another order, so the matrix is tiled a few tiles at a time with no copy of it."""
    assert rows.is_contiguous(), "a matrix is tiled in place"
    n, rest = rows.shape[0], rows.shape[1:]
    whole = n - n % TILE
    row_elements = rows[0].numel() if n else 0
    flat = rows.view(-1)

    def lanes_last(lo: int, hi: int, width: int) -> torch.Tensor:
        """Rows [lo, hi) (whole tiles of `width`) permuted in place; their tiles' view."""
        span = flat[lo * row_elements : hi * row_elements]
        step = max(width, TILING_BYTES // max(1, row_elements * rows.element_size()) // width * width)
        for a in range(0, hi - lo, step):
            part = span[a * row_elements : min(hi - lo, a + step) * row_elements]
            tiles = part.view(-1, width, *rest).movedim(1, -1).contiguous()  # a few tiles: small
            part.copy_(tiles.view(-1))
        return span.view(-1, *rest, width)

    head = lanes_last(0, whole, TILE) if whole else rows.new_empty(0, *rest, TILE)
    return head, (lanes_last(whole, n, n - whole) if n > whole else None)


def rows_of(tiles: torch.Tensor) -> torch.Tensor:
    """Tiles [T, ..., width] -> their rows [T width, ...] (a copy; a view under torch.compile's fusion)."""
    return tiles.movedim(-1, 1).reshape(tiles.shape[0] * tiles.shape[-1], *tiles.shape[1:-1])


def tile_rows(head: torch.Tensor, tail: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor:
    """Rows [lo, hi) of the matrix held as `head` and `tail` tiles, as rows [hi - lo, ...]."""
    parts = []
    whole = head.shape[0] * TILE
    if lo < whole:
        first, last = lo // TILE, -(-min(hi, whole) // TILE)
        parts.append(rows_of(head[first:last])[lo - first * TILE : min(hi, whole) - first * TILE])
    if hi > whole:
        parts.append(rows_of(tail)[max(lo, whole) - whole : hi - whole])
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def tile_count(head: torch.Tensor, tail: torch.Tensor | None) -> int:
    """Rows held."""
    return head.shape[0] * TILE + (0 if tail is None else tail.shape[-1])
