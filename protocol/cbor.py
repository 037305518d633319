"""The strict CBOR subset that the protocol speaks, and a decoder for exactly it.

Encoding uses cbor2. Decoding does not: cbor2 is a general decoder, and a general
decoder is the wrong tool for bytes from strangers. It turns semantic tags into
datetimes, regular expressions, bignums and shared (even cyclic) references; it
ignores trailing bytes; and it builds every container the input declares, so that a
64 MiB frame of one-byte items becomes a list of 64 million objects (gigabytes of
memory from one frame). The decoder here accepts only what our messages contain:

- unsigned and negative integers (up to 64 bits), byte strings, UTF-8 text strings;
- arrays and maps of definite length, maps with text keys only and no duplicates;
- false, true, null, and half/single/double precision floats.

Everything else — tags, indefinite lengths, `undefined`, other simple values,
reserved additional-information values, trailing bytes — is `InvalidCbor`. It also
counts data items against a budget (`max_items`) and nesting against `max_depth`
*before* building anything, so that hostile input can cost at most
O(len(data) + max_items) memory and time. Any standard CBOR encoder produces input
it accepts, as long as it sticks to those types.
"""

from __future__ import annotations

import struct
from typing import Any

import cbor2

from tessera.protocol.errors import InvalidCbor

MAX_ITEMS = 8192
"""Default budget of data items in one message. The largest legitimate message (a
GossipPush of 256 signed records) holds about 2,000; 8,192 items cost < 1 MB."""

MAX_DEPTH = 16
"""Default nesting limit. Our deepest message (a PeerRecord's neighbours inside the
envelope) nests four levels; 16 leaves room for new messages."""

# CBOR major types (RFC 8949 §3.1).
UINT, NEGINT, BYTES, TEXT, ARRAY, MAP, TAG, SIMPLE = range(8)

_WIDTH = {24: 1, 25: 2, 26: 4, 27: 8}
_FLOAT = {2: struct.Struct(">e"), 4: struct.Struct(">f"), 8: struct.Struct(">d")}
_SIMPLE_VALUES = {20: False, 21: True, 22: None}


def dumps(value: Any) -> bytes:
    """Encode a tree of int/float/bool/None/str/bytes/list/tuple/dict as CBOR.

    The caller passes only values of those types (the message schema guarantees it),
    so this cannot fail on wire data.
    """
    return cbor2.dumps(value)


def encode_head(major: int, arg: int) -> bytes:
    """The shortest head for major type `major` with argument `arg` (0 <= arg < 2**64)."""
    if arg < 24:
        return bytes((major << 5 | arg,))
    for info, width in _WIDTH.items():
        if arg < 1 << (8 * width):
            return bytes((major << 5 | info,)) + arg.to_bytes(width, "big")
    raise ValueError(f"CBOR argument {arg!r} does not fit in 64 bits")


def read_head(data: memoryview, pos: int) -> tuple[int, int, int, int]:
    """Read one CBOR item head at `pos`.

    Returns (major type, additional info, argument, position after the head). For
    floats (major 7, info 25..27) the argument is the raw IEEE bit pattern.

    Raises:
        InvalidCbor: the head is truncated, or uses an indefinite length or a
            reserved additional-information value.
    """
    if pos >= len(data):
        raise InvalidCbor(f"data ends at offset {pos!r} where an item head was expected")
    initial = data[pos]
    major, info = initial >> 5, initial & 31
    pos += 1
    if info < 24:
        return major, info, info, pos
    width = _WIDTH.get(info)
    if width is None:
        raise InvalidCbor(
            f"item head 0x{initial:02x} at offset {pos - 1!r}: additional info {info!r} "
            "(indefinite length or reserved) is not allowed"
        )
    end = pos + width
    if end > len(data):
        raise InvalidCbor(f"item head at offset {pos - 1!r} is truncated: needs {width!r} more bytes")
    return major, info, int.from_bytes(data[pos:end], "big"), end


def loads(data: bytes | bytearray | memoryview, *, max_items: int = MAX_ITEMS, max_depth: int = MAX_DEPTH) -> Any:
    """Decode exactly one item of the strict subset, which must fill `data` entirely.

    Arrays come back as lists, maps as dicts with str keys, floats as float.

    Raises:
        InvalidCbor: anything outside the subset, truncation, trailing bytes, more
            than `max_items` items or deeper than `max_depth`.
    """
    view = memoryview(data).cast("B") if not isinstance(data, memoryview) or data.format != "B" else data
    decoder = _Decoder(view, max_items)
    value, end = decoder.item(0, max_depth)
    if end != len(view):
        raise InvalidCbor(f"{len(view) - end!r} trailing bytes after the item (it ends at offset {end!r})")
    return value


class _Decoder:
    """One pass over one buffer; `budget` counts down the items still allowed."""

    __slots__ = ("data", "budget")

    def __init__(self, data: memoryview, max_items: int) -> None:
        self.data = data
        self.budget = max_items

    def item(self, pos: int, depth: int) -> tuple[Any, int]:
        # The hot path of every message received: the head is read inline when its argument
        # fits in the initial byte (read_head does the rest, and raises its errors).
        self.budget -= 1
        if self.budget < 0:
            raise InvalidCbor(f"more data items than the limit; stopped at offset {pos!r}")
        data = self.data
        if pos < len(data) and (initial := data[pos]) & 31 < 24:
            major, info, arg, pos = initial >> 5, initial & 31, initial & 31, pos + 1
        else:
            major, info, arg, pos = read_head(data, pos)
        if major == UINT:
            return arg, pos
        if major == TEXT or major == BYTES:
            end = pos + arg
            if end > len(data):
                raise InvalidCbor(
                    f"string at offset {pos!r} claims {arg!r} bytes but only {len(data) - pos!r} remain"
                )
            if major == BYTES:
                return bytes(data[pos:end]), end
            try:
                return str(data[pos:end], "utf-8"), end
            except UnicodeDecodeError as exc:
                raise InvalidCbor(f"text string at offset {pos!r} is not valid UTF-8: {exc.reason!s}") from None
        if major == ARRAY or major == MAP:
            return self.container(major, arg, pos, depth)
        if major == NEGINT:
            return -1 - arg, pos
        if major == SIMPLE:
            if info in _SIMPLE_VALUES:
                return _SIMPLE_VALUES[info], pos
            if info in (25, 26, 27):
                width = _WIDTH[info]
                return _FLOAT[width].unpack(arg.to_bytes(width, "big"))[0], pos
            raise InvalidCbor(f"simple value {arg!r} at offset {pos - 1!r} is not false/true/null/float")
        raise InvalidCbor(f"semantic tag {arg!r} at offset {pos - 1!r} is not allowed")

    def container(self, major: int, count: int, pos: int, depth: int) -> tuple[Any, int]:
        if depth <= 0:
            raise InvalidCbor(f"container at offset {pos!r} nests deeper than the limit")
        # Every item costs at least one byte: a count larger than what remains is a
        # lie, and refusing it here keeps a huge claimed count from costing anything.
        needed = count if major == ARRAY else 2 * count
        if needed > len(self.data) - pos or needed > self.budget:
            raise InvalidCbor(
                f"container at offset {pos!r} claims {count!r} entries; "
                f"{len(self.data) - pos!r} bytes and {self.budget!r} items remain"
            )
        item, depth = self.item, depth - 1
        if major == ARRAY:
            values = []
            append = values.append
            for _ in range(count):
                value, pos = item(pos, depth)
                append(value)
            return values, pos
        mapping: dict[str, Any] = {}
        for _ in range(count):
            key_pos = pos
            key, pos = item(pos, depth)
            if type(key) is not str:
                raise InvalidCbor(f"map key at offset {key_pos!r} is {type(key).__name__}, expected text")
            if key in mapping:
                raise InvalidCbor(f"duplicate map key {key[:64]!r} at offset {key_pos!r}")
            mapping[key], pos = item(pos, depth)
        return mapping, pos
