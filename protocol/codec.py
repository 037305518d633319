"""Encoding and decoding of registered messages.

Every message travels as one CBOR array, the envelope:

    [PROTOCOL_VERSION, tag, {field name: value, ...}]

`tag` is the short string the message class was registered with (`@message("fwd")`),
and the map holds one entry per dataclass field, nested messages as nested maps,
tuples as arrays, None as null. Decoding checks, in this order: the size limit,
the strict CBOR subset (`tessera.protocol.cbor`), the envelope shape, the version, the tag,
the expected type if the caller names one, and then every field against its
annotation and limits (`tessera.protocol.schema`); finally the dataclass's own
`__post_init__` checks invariants that span fields.

Compatibility: a field that has a default may be absent (it takes the default), so
a field added later with a default does not break older senders. An unknown field is
an error: within one protocol version both sides know the same fields.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from tessera.protocol import cbor
from tessera.protocol.errors import (
    FrameTooLarge,
    MalformedMessage,
    UnexpectedMessage,
    UnknownMessageType,
    UnsupportedVersion,
    show,
)
from tessera.protocol.schema import message_types, register, schema_of

PROTOCOL_VERSION = 1
"""Carried in every message; bump it when a change is not backwards compatible."""

MAX_MESSAGE_SIZE = 64 * 1024 * 1024
"""Default largest encoded message that `decode` accepts (the default frame limit)."""

T = TypeVar("T")


def message(tag: str) -> Callable[[type[T]], type[T]]:
    """Class decorator: register a frozen dataclass as a wire message under `tag`.

    Usage (decorators apply bottom-up, so the dataclass exists first):

        @message("hb")
        @dataclass(frozen=True)
        class Heartbeat: ...

    Raises:
        TypeError: at import, if the class or one of its annotations is unsupported.
    """

    def decorate(cls: type[T]) -> type[T]:
        register(cls, tag)
        return cls

    return decorate


def encode(msg: object) -> bytes:
    """Encode a registered message (validating every field first).

    Raises:
        MalformedMessage (a subclass such as WrongFieldType or FieldOutOfRange):
            a field violates its annotation or limits; the message would be
            refused by the receiver, so it is refused here.
        TypeError: `msg` is not an instance of a registered message class.
    """
    try:
        schema = schema_of(type(msg))
    except KeyError:
        raise TypeError(f"{type(msg).__name__} is not a registered message type") from None
    return cbor.dumps([PROTOCOL_VERSION, schema.tag, schema.dump(msg)])


def decode(
    data: bytes | bytearray | memoryview,
    *,
    max_size: int = MAX_MESSAGE_SIZE,
    expect: type | tuple[type, ...] | None = None,
) -> Any:
    """Decode one message, or raise a typed error saying what is wrong with it.

    Args:
        data: exactly one encoded message (e.g. one frame's payload).
        max_size: refuse longer input before looking at it.
        expect: if given, the message class (or classes) the caller is prepared to
            receive here; anything else raises UnexpectedMessage.

    Raises:
        FrameTooLarge: `data` is longer than `max_size`.
        InvalidCbor: not CBOR of the strict subset (see tessera.protocol.cbor).
        MalformedMessage: the envelope is not [version, tag, map].
        UnsupportedVersion: the version is not PROTOCOL_VERSION.
        UnknownMessageType: the tag is not registered.
        UnexpectedMessage: the type is registered but not in `expect`.
        MissingField, UnknownField, WrongFieldType, FieldOutOfRange: a field is
            absent, undeclared, of the wrong type, or outside its limits.
        InconsistentFields: the fields contradict each other.
    """
    if len(data) > max_size:
        raise FrameTooLarge(f"message of {len(data)!r} bytes exceeds max_size {max_size!r}")
    envelope = cbor.loads(data)
    if type(envelope) is not list or len(envelope) != 3:
        raise MalformedMessage(f"envelope {show(envelope)} is not a 3-item array [version, tag, fields]")
    version, tag, fields = envelope
    if type(version) is not int or version != PROTOCOL_VERSION:
        raise UnsupportedVersion(f"protocol version {show(version)}, expected {PROTOCOL_VERSION!r}")
    types = message_types()
    cls = types.get(tag) if type(tag) is str else None
    if cls is None:
        raise UnknownMessageType(f"message type {show(tag)}, expected one of {sorted(types)}")
    if expect is not None and not (cls is expect if isinstance(expect, type) else cls in expect):
        wanted = [expect] if isinstance(expect, type) else list(expect)
        raise UnexpectedMessage(f"message type {tag!r} ({cls.__name__}), expected {[c.__name__ for c in wanted]}")
    return schema_of(cls).load(fields)
