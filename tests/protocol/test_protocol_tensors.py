"""The tensor codec: exact round trips for every allowed dtype and rank 0..4, zero
copies where promised, and every limit enforced before anything is allocated."""

from __future__ import annotations

import tracemalloc
import warnings

import cbor2
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.protocol.cbor import encode_head
from tessera.protocol.errors import (
    BadTensor,
    InvalidBoolean,
    NonFiniteTensor,
    TensorSizeMismatch,
    TensorTooLarge,
    UnsupportedDtype,
)
from tessera.protocol.tensors import DTYPES, TensorLimits, _swap_bytes, check_finite, decode_tensor, encode_tensor


def random_tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Random bit patterns: every value a dtype can hold, NaNs and infinities included."""
    g = torch.Generator().manual_seed(seed)
    n = int(torch.Size(shape).numel())
    if dtype is torch.bool:
        return (torch.randint(0, 2, (n,), generator=g) == 1).view(shape)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).view(shape)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("name", sorted(DTYPES))
@settings(max_examples=40, deadline=None)
@given(shape=st.lists(st.integers(0, 6), min_size=0, max_size=4).map(tuple), seed=st.integers(0, 2**31))
def test_every_dtype_and_rank_round_trips_bit_exactly(name: str, shape: tuple[int, ...], seed: int) -> None:
    t = random_tensor(DTYPES[name], shape, seed)
    blob = encode_tensor(t)
    back = decode_tensor(blob)
    assert same_bits(back, t)
    dtype, dims, pad, data = cbor2.loads(blob)  # plain CBOR: any library can read it
    assert (dtype, tuple(dims), len(data)) == (name, shape, t.numel() * t.element_size())
    assert pad == bytes(len(pad)) and (len(blob) - len(data)) % 8 == 0


def test_non_contiguous_and_strided_inputs_encode_their_values() -> None:
    t = torch.arange(24, dtype=torch.float32).view(4, 6)
    assert torch.equal(decode_tensor(encode_tensor(t.t())), t.t())
    assert torch.equal(decode_tensor(encode_tensor(t[:, ::2])), t[:, ::2])


def test_decoding_views_the_buffer_without_copying_or_warning() -> None:
    t = torch.randn(128, 576)
    blob = encode_tensor(t)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's non-writable warning must not reach callers
        view = decode_tensor(blob)
        decode_tensor(blob)  # nor from a later call, which no longer filters (torch warns once)
    data_offset = len(blob) - t.numel() * 4
    assert view.untyped_storage().nbytes() == t.numel() * 4  # a view of the data, not a copy of the frame
    assert data_offset % 8 == 0 and view.data_ptr() % 8 == 0
    writable = bytearray(blob)
    aliased = decode_tensor(writable)
    aliased[0, 0] = 42.0
    assert torch.frombuffer(writable, dtype=torch.float32, count=1, offset=data_offset).item() == 42.0


def test_writable_copies_read_only_input() -> None:
    blob = encode_tensor(torch.zeros(4))
    t = decode_tensor(blob, writable=True)
    t += 1
    assert decode_tensor(blob).sum().item() == 0.0


def test_misaligned_input_is_copied_and_still_correct() -> None:
    t = torch.randn(3, 5)
    blob = bytearray(b"\x00" + encode_tensor(t))
    view = memoryview(blob)[1:]  # the data now starts at an odd address
    assert torch.equal(decode_tensor(view), t)


def test_swap_bytes_is_an_involution_matching_numpy() -> None:
    t = torch.arange(6, dtype=torch.int32).view(2, 3)
    swapped = _swap_bytes(t)
    assert swapped.numpy().tolist() == t.numpy().byteswap().tolist()
    assert torch.equal(_swap_bytes(swapped), t)
    assert _swap_bytes(torch.tensor(True)) is not None


def header(dtype: str, shape: list[int], nbytes: int, pad: int = 0) -> bytes:
    parts = [encode_head(4, 4), cbor2.dumps(dtype), cbor2.dumps(shape), encode_head(2, pad), bytes(pad)]
    return b"".join(parts) + encode_head(2, nbytes)


@pytest.mark.parametrize(
    ("blob", "error", "needle"),
    [
        (header("complex64", [1], 8) + bytes(8), UnsupportedDtype, "dtype 'complex64', expected one of"),
        (header("float32", [2**40, 2**40], 0), TensorTooLarge, "shape[0] = 1099511627776 exceeds max_dim"),
        (header("float32", [1] * 9, 4) + bytes(4), TensorTooLarge, "rank 9 exceeds max_rank 8"),
        (header("float32", [4097, 4096], 0), TensorTooLarge, "needs 67125248 bytes, limit 67108864"),
        (header("float32", [2, 3], 24) + bytes(20), TensorSizeMismatch, "holds 20 bytes and claims 24"),
        (header("float32", [2, 3], 20) + bytes(20), TensorSizeMismatch, "needs 24"),
        (header("float32", [2], 8) + bytes(9), TensorSizeMismatch, "holds 9 bytes"),
        (header("float32", [2], 8, pad=9) + bytes(8), BadTensor, "pad is 9 bytes"),
        (header("bool", [3], 3) + b"\x00\x01\x02", InvalidBoolean, "bytes other than 0 and 1"),
        (cbor2.dumps(["float32", [1], b"\x00" * 4]), BadTensor, "array of 3 items, expected 4"),
        (cbor2.dumps(["float32", [-1], b"", b""]), BadTensor, "shape[0] has CBOR major type 1"),
        (b"", BadTensor, "data ends at offset 0"),
        (b"\x84\x7f", BadTensor, "indefinite length"),
    ],
)
def test_bad_encodings_get_typed_errors(blob: bytes, error: type, needle: str) -> None:
    with pytest.raises(error) as info:
        decode_tensor(blob)
    assert needle in str(info.value)


def test_limits_are_enforced_before_any_allocation() -> None:
    claim = header("float32", [2**24, 2**24, 2**24], 0)  # 2**74 elements, in 40 bytes
    tracemalloc.start()
    try:
        with pytest.raises(TensorTooLarge):
            decode_tensor(claim)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * 1024
    small = TensorLimits(dtypes=frozenset({"float16"}), max_rank=2, max_dim=8, max_bytes=64)
    with pytest.raises(UnsupportedDtype, match="expected one of \\['float16'\\]"):
        decode_tensor(encode_tensor(torch.zeros(2)), limits=small)
    with pytest.raises(TensorTooLarge, match="shape\\[1\\] = 9 exceeds max_dim 8"):
        decode_tensor(encode_tensor(torch.zeros(1, 9, dtype=torch.float16)), limits=small)
    with pytest.raises(TensorTooLarge, match="needs 128 bytes, limit 64"):
        decode_tensor(encode_tensor(torch.zeros(8, 8, dtype=torch.float16)), limits=small)


def test_unsupported_dtypes_cannot_be_encoded() -> None:
    with pytest.raises(UnsupportedDtype, match="complex64"):
        encode_tensor(torch.zeros(2, dtype=torch.complex64))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_check_finite_reports_nan_and_inf(bad: float, dtype: torch.dtype) -> None:
    t = torch.zeros(3, 4, dtype=dtype)
    check_finite(t)
    t[1, 2] = bad
    with pytest.raises(NonFiniteTensor, match=f"activations: 1 of 12 values are NaN or infinite; first at flat index 6 = {bad!r}"):
        check_finite(decode_tensor(encode_tensor(t)), what="activations")
    check_finite(torch.tensor([1, 2]))  # integers are always finite


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_check_finite_passes_finite_values_whose_sum_overflows(dtype: torch.dtype) -> None:
    big = torch.finfo(dtype).max
    t = torch.full((2, 3), big, dtype=dtype)
    assert not torch.isfinite(t.sum())  # the fast path cannot decide this one
    check_finite(t)
    t[1, 1] = -big
    t[0, 2] = float("nan")
    with pytest.raises(NonFiniteTensor, match="1 of 6 values are NaN or infinite; first at flat index 2"):
        check_finite(t)


def test_check_finite_names_the_first_of_several_bad_values() -> None:
    # the message points at where the damage starts (the others tested hold one bad value each)
    t = torch.zeros(12)
    t[3], t[5], t[9] = float("inf"), float("nan"), float("-inf")
    with pytest.raises(NonFiniteTensor, match="3 of 12 values are NaN or infinite; first at flat index 3 = inf"):
        check_finite(t)


# -- activations in a compact wire form (what a requester may ask its peers for) ---------------------

@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 70), st.integers(0, 2**31 - 1), st.sampled_from(["", "bfloat16", "fp8"]))
def test_a_wire_form_decodes_to_what_its_sender_attests(rows: int, width: int, seed: int, form: str) -> None:
    """`encode_wire` returns the very tensor the receiver decodes (a sender fingerprints that one),
    within the form's rounding of the original: bfloat16 2^-8 of each value, fp8 a scale per row
    and 3 mantissa bits (2^-4 of each value, plus its row's subnormal step)."""
    from tessera.protocol.tensors import FP8_MAX, encode_wire

    t = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)) * 10 ** (seed % 7 - 3)
    data, sent = encode_wire(t, form)
    got = decode_tensor(data)
    assert torch.equal(got, sent)
    bound = {"": 0.0, "bfloat16": 2.0**-8, "fp8": 2.0**-4}[form]
    step = t.abs().amax(dim=1, keepdim=True) / FP8_MAX * 2.0**-9 if form == "fp8" else 0.0  # e4m3's subnormal step
    assert bool(((got.float() - t).abs() <= bound * t.abs() + step + 1e-30).all())
    assert len(data) < {"": 5, "bfloat16": 2.6, "fp8": 1.4}[form] * rows * width + 64


def test_a_malformed_fp8_rows_tensor_gets_a_typed_error() -> None:
    from tessera.protocol.tensors import ROW_SCALED_FP8, encode_wire

    data, _ = encode_wire(torch.ones(3, 8), "fp8")
    with pytest.raises(TensorSizeMismatch):
        decode_tensor(data[:-1])
    with pytest.raises(UnsupportedDtype, match=ROW_SCALED_FP8):
        decode_tensor(data, limits=TensorLimits(dtypes=frozenset({"float32"})))
    with pytest.raises(UnsupportedDtype, match="wire form"):
        encode_wire(torch.ones(2, 2), "int4")
