"""Every way that bytes from the network can be wrong, one class per condition.

All of them derive from `WireError`, so a peer that reads a frame can rely on one
contract: a decoder in `protocol` either returns a valid value or raises a
`WireError` subclass. Nothing else escapes — not cbor2 or nacl exceptions, not
`ValueError`, not `RecursionError` or `MemoryError` provoked by hostile input.
(Calling a function with the wrong *Python* types is a programming error and raises
`TypeError` as usual; that is not something a remote peer can cause.)

Each message names the field or quantity that was wrong and repeats the bad value
with `{value!r}`, so that a log line is enough to see what happened.

The hierarchy, for `except` clauses:

    WireError
    ├── FrameTooLarge, TruncatedFrame, EndOfStream, BadLengthPrefix   (framing)
    ├── MalformedMessage                                               (messages)
    │   ├── InvalidCbor
    │   ├── UnsupportedVersion, UnknownMessageType, UnexpectedMessage
    │   ├── MissingField, UnknownField, WrongFieldType, FieldOutOfRange
    │   └── InconsistentFields
    ├── BadTensor                                                       (tensors)
    │   ├── UnsupportedDtype, TensorTooLarge, TensorSizeMismatch
    │   ├── InvalidBoolean
    │   └── NonFiniteTensor
    └── crypto: BadKey, DecryptionFailed, WrongLink, ReplayedFrame, CipherClosed,
        CounterExhausted, BadSignature, ForgedPeerId, ExpiredRecord,
        RecordFromFuture
"""

from __future__ import annotations


class WireError(Exception):
    """Base class: something that crossed (or was about to cross) the wire is invalid."""


# --- framing -------------------------------------------------------------------------


class FrameTooLarge(WireError):
    """A frame's length prefix (or a payload to send) exceeds the frame size limit."""


class TruncatedFrame(WireError):
    """The stream or buffer ended in the middle of a frame."""


class EndOfStream(WireError):
    """The stream ended cleanly between two frames (not an attack; the peer closed)."""


class BadLengthPrefix(WireError):
    """A frame's varint length prefix is overlong or not minimally encoded."""


# --- messages ------------------------------------------------------------------------


class MalformedMessage(WireError):
    """A message is not a valid encoding of any registered message type."""


class InvalidCbor(MalformedMessage):
    """The bytes are not CBOR of the strict subset that the protocol speaks."""


class UnsupportedVersion(MalformedMessage):
    """The message carries a protocol version this code does not speak."""


class UnknownMessageType(MalformedMessage):
    """The message's type tag is not in the registry."""


class UnexpectedMessage(MalformedMessage):
    """A valid message arrived where the caller expected a different type."""


class MissingField(MalformedMessage):
    """A field without a default is absent from the message."""


class UnknownField(MalformedMessage):
    """The message holds a field that its type does not declare."""


class WrongFieldType(MalformedMessage):
    """A field's value has the wrong type for its annotation."""


class FieldOutOfRange(MalformedMessage):
    """A field's value (or its length, or its item count) is outside its declared limits."""


class InconsistentFields(MalformedMessage):
    """Fields that are each valid contradict each other (e.g. start >= end)."""


# --- tensors -------------------------------------------------------------------------


class BadTensor(WireError):
    """A tensor encoding is invalid."""


class UnsupportedDtype(BadTensor):
    """The tensor's dtype is not in the allow-list."""


class TensorTooLarge(BadTensor):
    """The tensor's rank, a dimension, or its total size exceeds the limits."""


class TensorSizeMismatch(BadTensor):
    """The raw data length does not equal prod(shape) * itemsize."""


class InvalidBoolean(BadTensor):
    """A bool tensor holds a byte other than 0 or 1."""


class NonFiniteTensor(BadTensor):
    """A floating-point tensor holds NaN or infinity."""


# --- cryptography --------------------------------------------------------------------


class BadKey(WireError):
    """A key has the wrong length or is not a valid curve point."""


class DecryptionFailed(WireError):
    """Authenticated decryption failed: wrong key, or tampered ciphertext, nonce or associated data."""


class WrongLink(WireError):
    """A frame or sealed key names a session or link other than the one it was given to."""


class ReplayedFrame(WireError):
    """A frame's counter is not greater than the last one accepted on its link."""


class CipherClosed(WireError):
    """A link cipher was used after `forget()` dropped its key."""


class CounterExhausted(WireError):
    """A link has sent 2**64 - 1 frames; it must be re-keyed."""


class BadSignature(WireError):
    """A signature does not verify under the given public key."""


class ForgedPeerId(WireError):
    """A record's peer id is not the one derived from the key that signed it."""


class ExpiredRecord(WireError):
    """A signed record's expiry time has passed."""


class RecordFromFuture(WireError):
    """A signed record claims to be issued later than now plus the allowed clock skew."""


def show(value: object, *, limit: int = 64) -> str:
    """`repr(value)` for an error message, cut short so hostile input stays small.

    A 60 MiB byte string must not become a 240 MiB error message, so strings, byte
    strings and sequences longer than `limit` show their first `limit` items and a
    count of the rest.
    """
    if isinstance(value, (str, bytes, bytearray, memoryview)) and len(value) > limit:
        return f"{bytes(value[:limit]) if isinstance(value, memoryview) else value[:limit]!r}...(+{len(value) - limit} more)"
    if isinstance(value, (list, tuple)) and len(value) > 8:
        return f"[{', '.join(show(v, limit=limit) for v in value[:8])}, ...(+{len(value) - 8} more)]"
    if isinstance(value, dict):
        return f"<map with {len(value)} entries>"
    text = repr(value)
    return text if len(text) <= 4 * limit else f"{text[: 4 * limit]}...(+{len(text) - 4 * limit} chars)"
