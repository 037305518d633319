"""Fingerprints of activations (what a spot check sends), and how far two honest computations may differ.

A fingerprint keeps, for each row of an output [T, H], the k entries of largest
magnitude (indices ascending, values) and the row's RMS — the idea of TOPLOC
(arXiv 2501.16007): a perturbation large enough to matter moves the large
entries, and two fingerprints compare in O(k) per row.

Differences are measured entry by entry, relative to the entry's own size plus
the row's RMS: d = |a - b| / (|a| + |b| + rms). (Hidden states have a few huge
outlier dimensions; relative to the RMS alone, honest rounding of those would
look large.) Measured on SmolLM2 here: two float32 computations of a span by
different kernels differ by d ~ 1e-5; float32 vs bfloat16 by d ~ 0.025 (one
layer) to 0.09 (30 layers), about 6 x roundoff x sqrt(layers); a perturbation
of 2% of the RMS shows as d ~ 0.04. So two float32 peers are held to 1e-3 — a
2% perturbation cannot hide — while a bfloat16 peer gets 16 x roundoff x
sqrt(layers), under which a small perturbation can hide: checks therefore prefer
checkers of the accused's precision or better, and say which tolerance they used.
"""

from __future__ import annotations

import math

import torch

from tessera.protocol.attest import Fingerprint, sha256
from tessera.protocol.codec import decode, encode
from tessera.protocol.tensors import decode_tensor, encode_tensor

TOP_K = 8
# unit roundoff of each dtype (half an ulp at 1.0)
ROUNDOFF = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
SAFETY = 16.0  # x the measured honest spread of ~6 x roundoff x sqrt(layers): ~2.5x margin
FLOAT32_FLOOR = 1e-3  # 100x the summation-order noise between two float32 peers


def fingerprint(output: torch.Tensor, k: int = TOP_K) -> Fingerprint:
    """The fingerprint of a [T, H] output (computed in float32)."""
    x = output.detach().float()
    k = min(k, x.shape[-1])
    idx = torch.topk(x.abs(), k, dim=-1).indices.sort(dim=-1).values  # [T, k] ascending
    values = torch.gather(x, -1, idx)
    scale = x.pow(2).mean(-1).sqrt()
    return Fingerprint(encode_tensor(idx.to(torch.int32)), encode_tensor(values), encode_tensor(scale))


def fingerprint_bytes(output: torch.Tensor, k: int = TOP_K) -> bytes:
    return encode(fingerprint(output, k))


def fingerprint_hash(output: torch.Tensor) -> bytes:
    return sha256(fingerprint_bytes(output))


def parse(data: bytes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indices [T, k], values [T, k], scale [T]) from encoded fingerprint bytes (raises WireError)."""
    fp = decode(data, expect=Fingerprint)
    return decode_tensor(fp.indices), decode_tensor(fp.values), decode_tensor(fp.scale)


def tolerance(dtype_a: str, dtype_b: str, n_layers: int) -> float:
    """Largest honest difference, relative to a row's RMS, between two peers' outputs of a span."""
    eps = max(ROUNDOFF.get(dtype_a, ROUNDOFF["bfloat16"]), ROUNDOFF.get(dtype_b, ROUNDOFF["bfloat16"]))
    return max(FLOAT32_FLOOR, SAFETY * eps * math.sqrt(max(n_layers, 1)))


def relative_difference(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Entrywise |a - b| / (|a| + |b| + scale), scale broadcast per row."""
    return (a - b).abs() / (a.abs() + b.abs() + scale.unsqueeze(-1).clamp_min(1e-12))


def rows_agree(a: bytes, b: bytes, tol: float) -> torch.Tensor:
    """Per row: True when both fingerprints pick the same entries with values within tol.

    A row whose top-k sets differ is reported as not agreeing: a boundary swap between
    two near-equal entries happens honestly, so the caller then compares full rows.
    """
    ia, va, sa = parse(a)
    ib, vb, sb = parse(b)
    if ia.shape != ib.shape:
        return torch.zeros(max(ia.shape[0], ib.shape[0]), dtype=torch.bool)
    scale = torch.maximum(sa, sb)
    same_entries = (ia == ib).all(-1)
    close_values = relative_difference(va, vb, scale).amax(-1) <= tol
    close_scale = ((sa - sb).abs() / (sa + sb).clamp_min(1e-12)) <= tol
    return same_entries & close_values & close_scale


def rows_conflict(a: bytes, b: bytes, tol: float) -> torch.Tensor:
    """Per row: True when two fingerprints prove different outputs — an entry both picked,
    or the RMS, differs beyond tol. (Top-k sets that merely differ prove nothing: two
    near-equal entries may swap places honestly.)"""
    ia, va, sa = parse(a)
    ib, vb, sb = parse(b)
    if ia.shape != ib.shape:
        return torch.ones(max(ia.shape[0], ib.shape[0]), dtype=torch.bool)
    scale = torch.maximum(sa, sb)
    common = ia.unsqueeze(-1) == ib.unsqueeze(-2)  # [T, k, k]: entry i of a is entry j of b
    diff = relative_difference(va.unsqueeze(-1), vb.unsqueeze(-2), scale.unsqueeze(-1))
    value_conflict = (common & (diff > tol)).flatten(1).any(-1)
    scale_conflict = ((sa - sb).abs() / (sa + sb).clamp_min(1e-12)) > tol
    return value_conflict | scale_conflict


def row_differences(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per row: the largest entrywise relative difference of two full outputs [T, H]."""
    a, b = a.float(), b.float()
    scale = torch.maximum(a.pow(2).mean(-1).sqrt(), b.pow(2).mean(-1).sqrt())
    return relative_difference(a, b, scale).amax(-1)


def full_rows_agree(a: torch.Tensor, b: torch.Tensor, tol: float) -> torch.Tensor:
    """Per row: within tolerance (the decision when fingerprints disagree)."""
    return row_differences(a, b) <= tol
