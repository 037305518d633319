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
them as stored). The layout is made once at load, a matrix at a time, and is the only copy held.
"""

from __future__ import annotations

import torch

TILE = 16  # rows a tile interleaves: one AVX-512 vector of float32 lanes


def tiles_of(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """rows [N, ...] -> (head [N // TILE, ..., TILE], tail [1, ..., N % TILE] or None), contiguous."""
    n = rows.shape[0]
    whole = n - n % TILE

    def lanes_last(part: torch.Tensor, width: int) -> torch.Tensor:
        return part.reshape(part.shape[0] // width, width, *rows.shape[1:]).movedim(1, -1).contiguous()

    head = lanes_last(rows[:whole], TILE)
    return head, (lanes_last(rows[whole:], n - whole) if n > whole else None)


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
