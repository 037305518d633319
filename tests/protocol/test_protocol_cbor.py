"""The strict CBOR decoder: what it accepts, what it refuses, and what refusing costs."""

from __future__ import annotations

import math
import time
import tracemalloc

import cbor2
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tessera.protocol.cbor import encode_head, loads
from tessera.protocol.errors import InvalidCbor

scalars = (
    st.integers(-(2**64), 2**64 - 1)
    | st.floats(allow_nan=False)
    | st.booleans()
    | st.none()
    | st.binary(max_size=64)
    | st.text(max_size=32)
)
trees = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=30,
)


@given(trees)
def test_agrees_with_cbor2_on_the_subset(value: object) -> None:
    for canonical in (False, True):
        assert loads(cbor2.dumps(value, canonical=canonical)) == value


def test_nan_decodes() -> None:
    assert math.isnan(loads(cbor2.dumps(math.nan)))


@pytest.mark.parametrize(
    ("blob", "needle"),
    [
        (b"\xc1\x00", "semantic tag 1"),  # epoch datetime
        (b"\xc2\x41\x01", "semantic tag 2"),  # bignum
        (b"\xd8\x23\x61a", "semantic tag 35"),  # regular expression
        (b"\xd8\x1c\x81\xd8\x1d\x00", "semantic tag 28"),  # shared (cyclic) reference
        (b"\xd9\xd9\xf7\x00", "semantic tag 55799"),
        (b"\x5f\x41a\xff", "indefinite length"),
        (b"\x9f\xff", "indefinite length"),
        (b"\xbf\xff", "indefinite length"),
        (b"\xf7", "simple value 23"),  # undefined
        (b"\xf0", "simple value 16"),
        (b"\xf8\x20", "simple value 32"),
        (b"\xff", "additional info 31"),  # a lone break
        (b"\x1c", "additional info 28"),
        (b"\xa2\x61a\x00\x61a\x01", "duplicate map key 'a'"),
        (b"\xa1\x01\x02", "map key at offset 1 is int"),
        (b"\x62\xff\xfe", "not valid UTF-8"),
        (b"\x00\x00", "1 trailing bytes"),
        (b"", "data ends at offset 0"),
        (b"\x1b\x00\x00", "truncated"),
    ],
)
def test_refuses_everything_outside_the_subset(blob: bytes, needle: str) -> None:
    with pytest.raises(InvalidCbor) as info:
        loads(blob)
    assert needle in str(info.value)


@pytest.mark.parametrize("major", [2, 3, 4, 5])
def test_huge_claimed_lengths_cost_nothing(major: int) -> None:
    blob = encode_head(major, 2**64 - 1) + b"\x00" * 100
    tracemalloc.start()
    try:
        with pytest.raises(InvalidCbor, match="claims"):
            loads(blob)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024


def test_many_small_items_hit_the_item_budget_not_memory() -> None:
    # 1 MB of one-byte items: a general decoder would build a million-element list.
    blob = encode_head(4, 1_000_000) + b"\x00" * 1_000_000
    tracemalloc.start()
    try:
        with pytest.raises(InvalidCbor, match="1000000 entries"):
            loads(blob)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024
    with pytest.raises(InvalidCbor, match="claims 20 entries; 20 bytes and 9 items remain"):
        loads(encode_head(4, 20) + b"\x00" * 20, max_items=10)
    nested = encode_head(4, 5) + (encode_head(4, 3) + b"\x00" * 3) * 5  # 21 items, each container small
    assert len(loads(nested, max_items=21)) == 5
    with pytest.raises(InvalidCbor, match="claims 3 entries; .* 0 items remain"):
        loads(nested, max_items=10)


def test_deep_nesting_is_refused_quickly_without_recursion_error() -> None:
    start = time.perf_counter()
    for opener in (b"\x81", b"\xa1\x61a"):
        with pytest.raises(InvalidCbor, match="nests deeper than the limit"):
            loads(opener * 1_000_000 + b"\x00")
    assert time.perf_counter() - start < 5
    assert loads(b"\x81" * 15 + b"\x00", max_depth=16) == [[[[[[[[[[[[[[[0]]]]]]]]]]]]]]]


def test_encode_head_is_minimal() -> None:
    for arg in (0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1):
        assert encode_head(0, arg) == cbor2.dumps(arg)
