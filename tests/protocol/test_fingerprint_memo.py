"""protocol/fingerprint.py remembers small outputs' fingerprints by their exact content: what it
returns is always what computing the fingerprint afresh returns, for any dtype, shape, layout and
values (ties among the largest entries included), and an output changed in place is fingerprinted
again."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.protocol import fingerprint as fp
from tessera.protocol.codec import encode


@st.composite
def outputs(draw) -> torch.Tensor:
    rows, width = draw(st.integers(0, 6)), draw(st.integers(1, 40))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    values = draw(st.lists(st.sampled_from([0.0, 0.5, -0.5, 1.0, 3.25, -7.0]), min_size=rows * width,
                           max_size=rows * width))  # few distinct values: many ties
    t = torch.tensor(values, dtype=torch.float32).reshape(rows, width).to(dtype)
    if draw(st.booleans()) and width > 1:
        t = torch.cat([t, t], dim=1)[:, ::2]  # a strided view of the same values
    return t


@settings(max_examples=150, deadline=None)
@given(outputs(), st.integers(1, 10))
def test_remembered_fingerprints_are_the_computed_ones(t: torch.Tensor, k: int) -> None:
    fresh = encode(fp.fingerprint(t, k))
    assert fp.fingerprint_bytes(t, k) == fresh
    assert fp.fingerprint_bytes(t.clone(), k) == fresh  # another tensor, the same content
    assert fp.fingerprint_bytes(t, k) == fresh  # remembered


def test_an_output_changed_in_place_is_fingerprinted_again() -> None:
    t = torch.full((2, 16), 0.5)
    before = fp.fingerprint_bytes(t)
    t[1, 3] = 9.0
    after = fp.fingerprint_bytes(t)
    assert after != before
    assert after == encode(fp.fingerprint(t))


def test_large_outputs_are_not_kept() -> None:
    fp._memo.clear()
    rows = fp._MEMO_MAX_BYTES // (4 * 64) + 1
    big = torch.randn(rows, 64)
    assert fp.fingerprint_bytes(big) == encode(fp.fingerprint(big))
    assert not fp._memo
