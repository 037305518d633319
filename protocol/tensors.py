"""The tensor codec: dtype name + shape + raw little-endian bytes, and nothing else.

An encoded tensor is one CBOR array (any CBOR library can read it):

    [dtype: text, shape: [uint, ...], pad: bytes (0-7 zero bytes), data: bytes]

`data` holds the elements in C (row-major) order, little-endian. `pad` makes `data`
start at a multiple of 8 bytes from the start of the encoding, so that a decoder can
view the elements in place: the buffer that holds the encoding (e.g. the plaintext
that AEAD decryption returns) is itself 8-aligned, and torch gets aligned data
without a copy.

Decoding validates everything before it touches the data: the dtype against an
allow-list, the rank, each dimension and the total byte size against
`TensorLimits`, and that the data is exactly prod(shape) * itemsize bytes. Only then
does it build a tensor, and that tensor is a view of the input buffer
(`torch.frombuffer`), not a copy, unless it has to copy (see `decode_tensor`).

Activations that hold NaN or infinity are valid encodings; the stage that computes
with them calls `check_finite` and reports the typed error.
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass
from functools import lru_cache

import torch

from tessera.protocol.cbor import ARRAY, BYTES, TEXT, UINT, encode_head, read_head
from tessera.protocol.errors import (
    BadTensor,
    InvalidBoolean,
    InvalidCbor,
    NonFiniteTensor,
    TensorSizeMismatch,
    TensorTooLarge,
    UnsupportedDtype,
    show,
)

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
"""Every dtype the codec knows, by wire name. Anything else cannot be encoded."""

_NAMES = {dtype: name for name, dtype in DTYPES.items()}

ROW_SCALED_FP8 = "f8e4m3/rows"
"""A float tensor [..., H] as float8_e4m3fn codes with one float32 scale per row (the last
dimension a row): data = the R scales (little-endian float32), then the R x H codes; it decodes
to float32 codes * scale. Lossy (3 mantissa bits): an activation form a requester may ask for
(`encode_wire`), never what a tensor is by default."""

FP8_MAX = 448.0  # the largest finite float8_e4m3fn: a row's largest |value| is coded as it

WIRE_FORMS = ("", "bfloat16", "fp8")
"""How activations cross the wire: "" in the sender's compute dtype (exact, the default);
"bfloat16" (half the bytes of float32, ~3 significant digits); "fp8" (ROW_SCALED_FP8, a quarter)."""
_ALIGN = 8
_LITTLE_ENDIAN = sys.byteorder == "little"



@dataclass(frozen=True)
class TensorLimits:
    """What a decoder accepts. Checked before anything is allocated.

    Attributes:
        dtypes: the allowed dtype names (a subset of DTYPES).
        max_rank: most dimensions.
        max_dim: largest single dimension.
        max_bytes: largest data size, prod(shape) * itemsize.
    """

    dtypes: frozenset[str] = frozenset(DTYPES) | {ROW_SCALED_FP8}
    max_rank: int = 8
    max_dim: int = 2**24
    max_bytes: int = 64 * 1024 * 1024


DEFAULT_LIMITS = TensorLimits()


def encode_tensor(t: torch.Tensor) -> bytes:
    """Encode a tensor (copied to CPU and made contiguous first if it is not).

    Raises:
        UnsupportedDtype: the dtype is not in DTYPES.
    """
    name = _NAMES.get(t.dtype)
    if name is None:
        raise UnsupportedDtype(f"tensor dtype {t.dtype!r} cannot be encoded, expected one of {sorted(DTYPES)}")
    t = t.detach().to("cpu").contiguous()
    if not _LITTLE_ENDIAN:
        t = _swap_bytes(t)
    data = t.reshape(-1).view(torch.uint8).numpy()  # a view: no copy until the join
    return b"".join((_head(name, tuple(t.shape), data.nbytes), data))


def encode_wire(t: torch.Tensor, form: str) -> tuple[bytes, torch.Tensor]:
    """Activations `t` [..., H] in wire form `form` (WIRE_FORMS): (the encoding, the tensor the receiver
    will decode from it). A sender fingerprints and attests the second, so that what it signs is
    what the next hop computes on. Raises UnsupportedDtype for an unknown form."""
    if form == "":
        return encode_tensor(t), t
    if form == "bfloat16":
        narrow = t.to(torch.bfloat16)
        return encode_tensor(narrow), narrow
    if form == "fp8":
        rows = t.detach().to("cpu", torch.float32).reshape(-1, t.shape[-1]) if t.dim() else t.reshape(1, 1)
        scales = (rows.abs().amax(dim=1) / FP8_MAX).clamp_(min=torch.finfo(torch.float32).tiny)  # [R]
        codes = (rows / scales[:, None]).to(torch.float8_e4m3fn)  # |rows / scale| <= 448: no overflow
        little = scales if _LITTLE_ENDIAN else _swap_bytes(scales)
        data = torch.cat((little.view(torch.uint8), codes.view(torch.uint8).reshape(-1)))
        return (b"".join((_head(ROW_SCALED_FP8, tuple(t.shape), data.numel()), data.numpy())),
                (codes.float() * scales[:, None]).view(t.shape))
    raise UnsupportedDtype(f"activation wire form {show(form)} is unknown, expected one of {list(WIRE_FORMS)}")


def _decode_row_scaled_fp8(view: memoryview, pos: int, shape: tuple[int, ...], numel: int) -> torch.Tensor:
    """ROW_SCALED_FP8's data at `pos` (its size already checked) -> float32 of `shape`."""
    if numel == 0:
        return torch.empty(shape)
    rows = numel // shape[-1]
    scales = torch.frombuffer(bytearray(view[pos : pos + 4 * rows]), dtype=torch.float32)
    if not _LITTLE_ENDIAN:
        scales = _swap_bytes(scales)
    codes = torch.frombuffer(bytearray(view[pos + 4 * rows :]), dtype=torch.uint8).view(torch.float8_e4m3fn)
    return (codes.view(rows, -1).float() * scales[:, None]).view(shape)


@lru_cache(maxsize=1024)
def _head(name: str, shape: tuple[int, ...], nbytes: int) -> bytes:
    """Everything before the data: [dtype, shape, pad, data's head] (the same few shapes
    go out step after step, so each is built once)."""
    head = [encode_head(ARRAY, 4), encode_head(TEXT, len(name)), name.encode("ascii"), encode_head(ARRAY, len(shape))]
    head += [encode_head(UINT, d) for d in shape]
    data_head = encode_head(BYTES, nbytes)
    pad = -(sum(map(len, head)) + 1 + len(data_head)) % _ALIGN
    head += [encode_head(BYTES, pad), bytes(pad), data_head]
    return b"".join(head)


def decode_tensor(
    data: bytes | bytearray | memoryview,
    *,
    limits: TensorLimits = DEFAULT_LIMITS,
    writable: bool = False,
) -> torch.Tensor:
    """Decode a tensor, viewing `data` in place where possible.

    Aliasing: the result shares memory with `data` when the data is aligned for its
    dtype and the host is little-endian (the normal case). If `data` is read-only
    (`bytes`), so is that memory: do not modify the tensor in place — torch cannot
    enforce it, and writing into a `bytes` object breaks Python's guarantees. Pass
    `writable=True` to get a private copy in that case, or pass a `bytearray`. A
    tensor that has to be copied anyway (misaligned data, big-endian host, an empty
    tensor) never aliases.

    Raises:
        BadTensor: not a [dtype, shape, pad, data] array.
        UnsupportedDtype: the dtype is unknown or not in `limits.dtypes`.
        TensorTooLarge: the rank, a dimension or the byte size exceeds `limits`.
        TensorSizeMismatch: the data is not exactly prod(shape) * itemsize bytes,
            or bytes follow it.
        InvalidBoolean: a bool tensor holds a byte other than 0 or 1.
    """
    view = data if isinstance(data, memoryview) and data.format == "B" else memoryview(data).cast("B")
    count, pos = _expect(view, 0, ARRAY, "encoding")
    if count != 4:
        raise BadTensor(f"tensor encoding is an array of {count!r} items, expected 4 [dtype, shape, pad, data]")
    dtype, pos = _read_dtype(view, pos, limits)
    shape, pos = _read_shape(view, pos, limits)
    scaled = dtype is None  # ROW_SCALED_FP8: decodes to float32
    if scaled and not shape:
        raise BadTensor(f"a {ROW_SCALED_FP8} tensor has rows: its shape is empty")
    itemsize = 4 if scaled else dtype.itemsize
    numel = 1
    for d in shape:
        numel *= d
    if numel * itemsize > limits.max_bytes:
        raise TensorTooLarge(f"tensor shape {shape!r} of {dtype or ROW_SCALED_FP8} needs {numel * itemsize!r} bytes, "
                             f"limit {limits.max_bytes!r}")
    pad, pos = _expect(view, pos, BYTES, "pad")
    if pad >= _ALIGN:
        raise BadTensor(f"tensor pad is {pad!r} bytes, expected fewer than {_ALIGN}")
    nbytes, pos = _expect(view, pos + pad, BYTES, "data")
    want = (numel + 4 * (numel // shape[-1] if shape[-1] else 0)) if scaled else numel * itemsize
    if nbytes != want or pos + nbytes != len(view):
        raise TensorSizeMismatch(
            f"tensor data holds {len(view) - pos!r} bytes and claims {nbytes!r}; "
            f"shape {shape!r} of {dtype or ROW_SCALED_FP8} needs {want!r}"
        )
    if scaled:
        return _decode_row_scaled_fp8(view, pos, shape, numel)
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    if dtype is torch.bool and int(_frombuffer(view, torch.uint8, numel, pos).max()) > 1:
        raise InvalidBoolean(f"bool tensor of shape {shape!r} holds bytes other than 0 and 1")
    t = _frombuffer(view, dtype, numel, pos)
    if t.data_ptr() % itemsize or (writable and view.readonly):
        t = t.clone()
    if not _LITTLE_ENDIAN:
        t = _swap_bytes(t)
    return t.view(shape)


def check_finite(t: torch.Tensor, *, what: str = "tensor") -> None:
    """Raise NonFiniteTensor if a floating-point tensor holds NaN or infinity.

    `what` names the tensor in the message (e.g. "activations after layer 7").

    Raises:
        NonFiniteTensor: some element is NaN or +-inf.
    """
    if not t.is_floating_point() or t.numel() == 0:
        return
    # A sum over a NaN or an infinity is NaN or infinite, so a finite sum proves every element
    # finite: one reduction (1.5 us for a step's [10, 576] here) where isfinite-then-all costs 12.
    # A sum of finite elements may still overflow: then the elementwise check decides.
    if math.isfinite(t.sum()):
        return
    finite = torch.isfinite(t)
    if bool(finite.all()):
        return
    bad = (~finite).reshape(-1)
    first = int(bad.nonzero()[0, 0])
    raise NonFiniteTensor(
        f"{what}: {int(bad.sum())!r} of {t.numel()!r} values are NaN or infinite; "
        f"first at flat index {first!r} = {t.reshape(-1)[first].item()!r}"
    )


_readonly_warned = False  # torch has given its one read-only-buffer warning (see _frombuffer)


def _frombuffer(view: memoryview, dtype: torch.dtype, count: int, offset: int) -> torch.Tensor:
    global _readonly_warned
    if not view.readonly or _readonly_warned:
        return torch.frombuffer(view, dtype=dtype, count=count, offset=offset)
    # torch warns (once per process: TORCH_WARN_ONCE) that it cannot protect a read-only
    # buffer. Here that is expected and documented (decode_tensor), so the warning is
    # silenced for the first such call; later calls have nothing to silence, and skip
    # catch_warnings (it costs five times the decode of a step's activations).
    # (catch_warnings swaps the global filter list; if threads race here, the worst case
    # is that this one narrow filter outlives the call.)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        t = torch.frombuffer(view, dtype=dtype, count=count, offset=offset)
    _readonly_warned = True
    return t


def _expect(view: memoryview, pos: int, major: int, what: str) -> tuple[int, int]:
    try:
        got, _, arg, pos = read_head(view, pos)
    except InvalidCbor as exc:
        raise BadTensor(f"tensor {what}: {exc}") from None
    if got != major:
        raise BadTensor(f"tensor {what} has CBOR major type {got!r}, expected {major!r}")
    return arg, pos


def _read_dtype(view: memoryview, pos: int, limits: TensorLimits) -> tuple[torch.dtype | None, int]:
    """The dtype named at `pos` (None for ROW_SCALED_FP8) and the position after it."""
    length, pos = _expect(view, pos, TEXT, "dtype")
    if pos + length > len(view):
        raise BadTensor(f"tensor dtype name claims {length!r} bytes, only {len(view) - pos!r} remain")
    name = bytes(view[pos : pos + min(length, 16)]).decode("ascii", errors="replace")
    known = DTYPES.keys() | {ROW_SCALED_FP8}
    if length > 16 or name not in known or name not in limits.dtypes:
        raise UnsupportedDtype(f"tensor dtype {show(name)}, expected one of {sorted(limits.dtypes & known)}")
    return DTYPES.get(name), pos + length


def _read_shape(view: memoryview, pos: int, limits: TensorLimits) -> tuple[tuple[int, ...], int]:
    rank, pos = _expect(view, pos, ARRAY, "shape")
    if rank > limits.max_rank:
        raise TensorTooLarge(f"tensor rank {rank!r} exceeds max_rank {limits.max_rank!r}")
    shape = []
    for axis in range(rank):
        d, pos = _expect(view, pos, UINT, f"shape[{axis}]")
        if d > limits.max_dim:
            raise TensorTooLarge(f"tensor shape[{axis}] = {d!r} exceeds max_dim {limits.max_dim!r}")
        shape.append(d)
    return tuple(shape), pos


def _swap_bytes(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` with the bytes of every element reversed (for big-endian hosts)."""
    size = t.element_size()
    if size == 1 or t.numel() == 0:
        return t
    swapped = t.reshape(-1).view(torch.uint8).view(-1, size).flip(1).contiguous()
    return swapped.view(t.dtype).view(t.shape)
