"""Link keys and the link cipher: end-to-end encryption of activations, hop by hop.

Keys. For every link of a session the requester picks a fresh random 32-byte key
and seals it, in the SessionOpen it sends, to each peer at an end of that link
(the requester itself holds its own keys). Sealing is an ephemeral-static
X25519 exchange between the session's EphemeralKey and the recipient's identity
key (converted from Ed25519), a BLAKE2b key derivation over both public keys, the
session id and the link id, and XChaCha20-Poly1305 with the session id and link id
as associated data. Only the recipient can open it, and only for that session and
link; relays and other peers see 72 opaque bytes.

Frames. `LinkCipher` encrypts with XChaCha20-Poly1305 (IETF). For frame number
`counter` it uses

    nonce = BLAKE2b-120(session id, link id) || direction || counter (8 bytes LE)
    AD    = "tessera/link/v1", version, session id, link id, direction  (each length-prefixed)
            || step (8 bytes LE) || counter (8 bytes LE) || the caller's clear header

A key belongs to one link of one session, and the sender never reuses a counter,
so a nonce never repeats under a key. The receiver accepts a counter only if it is
greater than the last one it accepted (gaps are fine: a cancelled step leaves
one), so a replayed or backwards-reordered frame is `ReplayedFrame`; a frame from
another session or link, or with any bit of its ciphertext, counter, step or header
changed, fails authentication: `DecryptionFailed`.
"""

from __future__ import annotations

import enum
import hashlib

import nacl.bindings as sodium
import nacl.exceptions
import nacl.utils

from tessera.protocol.codec import PROTOCOL_VERSION
from tessera.protocol.errors import (
    BadKey,
    CipherClosed,
    CounterExhausted,
    DecryptionFailed,
    FieldOutOfRange,
    ReplayedFrame,
    WrongLink,
    show,
)
from tessera.protocol.keys import KEY_SIZE, EphemeralKey, Identity, derive_key, x25519_public_from_ed25519
from tessera.protocol.messages import SEALED_KEY_BOX_SIZE, SealedKey
from tessera.protocol.schema import INT64_MAX

NONCE_SIZE = sodium.crypto_aead_xchacha20poly1305_ietf_NPUBBYTES
TAG_SIZE = sodium.crypto_aead_xchacha20poly1305_ietf_ABYTES
MAX_COUNTER = INT64_MAX
"""A link may send this many frames; at one per millisecond that is 292 million years."""

_SEAL_CONTEXT = b"tessera-seal-v1"
_NONCE_CONTEXT = b"tessera-nonce-v1"


class Direction(enum.IntEnum):
    """Which way a frame travels on a link (both ends construct the cipher alike)."""

    FORWARD = 0
    """From the link's sending end to its receiving end: activations."""
    BACKWARD = 1
    """Back along the link: replies, if a protocol needs them."""


def seal_link_key(
    key: bytes,
    *,
    session_id: bytes,
    link_id: int,
    sender: EphemeralKey,
    recipient_public_ed25519: bytes,
) -> SealedKey:
    """Seal a link key so that only the peer with this Ed25519 public key can open it.

    Raises:
        BadKey: `key` is not 32 bytes, the recipient key is not a valid point, or
            `sender` was forgotten.
    """
    if len(key) != KEY_SIZE:
        raise BadKey(f"link key is {len(key)} bytes, expected {KEY_SIZE}")
    recipient_x = x25519_public_from_ed25519(recipient_public_ed25519)
    kek = _key_encryption_key(sender.exchange(recipient_x), sender.public, recipient_x, session_id, link_id)
    nonce = nacl.utils.random(NONCE_SIZE)
    ad = _sealed_key_ad(session_id, link_id)
    box = sodium.crypto_aead_xchacha20poly1305_ietf_encrypt(bytes(key), ad, nonce, kek)
    return SealedKey(link_id=link_id, box=nonce + box)


def open_link_key(
    sealed: SealedKey,
    *,
    session_id: bytes,
    link_id: int,
    recipient: Identity,
    sender_public: bytes,
) -> bytes:
    """Open a sealed link key; `sender_public` is the session's ephemeral X25519 key.

    Raises:
        WrongLink: the sealed key names a link other than `link_id`.
        BadKey: `sender_public` is not 32 bytes or is a low-order point.
        DecryptionFailed: the key was sealed to another peer, for another session
            or link, by another sender, or the box was altered.
    """
    if sealed.link_id != link_id:
        raise WrongLink(f"sealed key is for link {sealed.link_id!r}, expected link {link_id!r}")
    if len(sealed.box) != SEALED_KEY_BOX_SIZE:
        raise DecryptionFailed(f"sealed key box is {len(sealed.box)!r} bytes, expected {SEALED_KEY_BOX_SIZE}")
    recipient_x = recipient.x25519_public()
    shared = recipient.exchange(sender_public)
    kek = _key_encryption_key(shared, bytes(sender_public), recipient_x, session_id, link_id)
    nonce, box = sealed.box[:NONCE_SIZE], sealed.box[NONCE_SIZE:]
    try:
        return sodium.crypto_aead_xchacha20poly1305_ietf_decrypt(box, _sealed_key_ad(session_id, link_id), nonce, kek)
    except nacl.exceptions.CryptoError:
        raise DecryptionFailed(
            f"sealed key for session {session_id.hex()!r} link {link_id!r} does not open with this peer's key"
        ) from None


class LinkCipher:
    """Encrypts (sender) or decrypts (receiver) the frames of one direction of one link.

    Not thread-safe: each end of a link owns its cipher.
    """

    def __init__(self, key: bytes, *, session_id: bytes, link_id: int, direction: Direction) -> None:
        """Raises:
        BadKey: `key` is not 32 bytes.
        """
        if len(key) != KEY_SIZE:
            raise BadKey(f"link key is {len(key)} bytes, expected {KEY_SIZE}")
        self.session_id = bytes(session_id)
        self.link_id = link_id
        self.direction = Direction(direction)
        self._key: bytes | None = bytes(key)
        link = _pack(self.session_id, _u64(link_id, "link_id"))
        self._nonce_prefix = hashlib.blake2b(link, person=_NONCE_CONTEXT, digest_size=15).digest() + bytes(
            (self.direction,)
        )
        self._ad_prefix = _pack(b"tessera/link/v1", bytes((PROTOCOL_VERSION,)), link, bytes((self.direction,)))
        self._sent = 0
        self._accepted = 0

    @property
    def last_accepted(self) -> int:
        """The highest counter opened so far (0: none)."""
        return self._accepted

    @property
    def last_sent(self) -> int:
        """The counter of the last frame sealed (0: none)."""
        return self._sent

    def seal(self, *, step: int, header: bytes, plaintext: bytes) -> tuple[int, bytes]:
        """Encrypt one frame; returns (counter, ciphertext). The counter travels in clear.

        Raises:
            CipherClosed: `forget()` was called.
            CounterExhausted: the link has sent MAX_COUNTER frames.
            FieldOutOfRange: `step` is not in [0, 2**63 - 1].
        """
        key = self._live_key()
        if self._sent >= MAX_COUNTER:
            raise CounterExhausted(f"link {self.link_id!r} has sent {self._sent!r} frames; re-key it")
        counter = self._sent + 1
        ad = self._ad(step, counter, header)
        ciphertext = sodium.crypto_aead_xchacha20poly1305_ietf_encrypt(bytes(plaintext), ad, self._nonce(counter), key)
        self._sent = counter
        return counter, ciphertext

    def open(self, *, step: int, header: bytes, counter: int, ciphertext: bytes) -> bytes:
        """Authenticate and decrypt one frame; only then is its counter recorded.

        Raises:
            CipherClosed: `forget()` was called.
            ReplayedFrame: `counter` is not above the last accepted counter (0 at first).
            FieldOutOfRange: `step` is not in [0, 2**63 - 1], or `counter` is above it.
            DecryptionFailed: wrong key, session or link, or anything altered.
        """
        key = self._live_key()
        if type(counter) is not int or counter > MAX_COUNTER:
            raise FieldOutOfRange(f"frame counter {show(counter)} is not an int in [1, {MAX_COUNTER}]")
        if counter <= self._accepted:
            raise ReplayedFrame(
                f"link {self.link_id!r}: frame counter {counter!r} is not above the last accepted {self._accepted!r}"
            )
        ad = self._ad(step, counter, header)
        if len(ciphertext) < TAG_SIZE:
            raise DecryptionFailed(f"link {self.link_id!r}: ciphertext of {len(ciphertext)!r} bytes is shorter than a tag")
        try:
            plaintext = sodium.crypto_aead_xchacha20poly1305_ietf_decrypt(
                bytes(ciphertext), ad, self._nonce(counter), key
            )
        except nacl.exceptions.CryptoError:
            raise DecryptionFailed(
                f"link {self.link_id!r} step {step!r} counter {counter!r}: frame does not authenticate"
            ) from None
        self._accepted = counter
        return plaintext

    def forget(self) -> None:
        """Drop the key (session closed or expired); later seal/open raise CipherClosed.

        Best effort: Python may keep copies of the key in freed memory.
        """
        self._key = None

    def __enter__(self) -> LinkCipher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.forget()

    def __repr__(self) -> str:
        state = "open" if self._key is not None else "forgotten"
        return (
            f"LinkCipher(session_id={self.session_id.hex()!r}, link_id={self.link_id!r}, "
            f"direction={self.direction.name}, {state}, sent={self._sent}, accepted={self._accepted})"
        )

    def _live_key(self) -> bytes:
        if self._key is None:
            raise CipherClosed(f"link {self.link_id!r} cipher was forgotten (session closed)")
        return self._key

    def _nonce(self, counter: int) -> bytes:
        return self._nonce_prefix + counter.to_bytes(8, "little")

    def _ad(self, step: int, counter: int, header: bytes) -> bytes:
        return b"".join((self._ad_prefix, _u64(step, "step"), counter.to_bytes(8, "little"), header))


def _key_encryption_key(shared: bytes, sender_x: bytes, recipient_x: bytes, session_id: bytes, link_id: int) -> bytes:
    return derive_key(
        shared, context=_SEAL_CONTEXT, parts=(sender_x, recipient_x, bytes(session_id), _u64(link_id, "link_id"))
    )


def _sealed_key_ad(session_id: bytes, link_id: int) -> bytes:
    return _pack(b"tessera/link-key/v1", bytes((PROTOCOL_VERSION,)), bytes(session_id), _u64(link_id, "link_id"))


def _pack(*parts: bytes) -> bytes:
    """Concatenate with 4-byte length prefixes, so the result parses one way only."""
    return b"".join(len(p).to_bytes(4, "little") + p for p in parts)


def _u64(value: int, name: str) -> bytes:
    if type(value) is not int or not 0 <= value <= MAX_COUNTER:
        raise FieldOutOfRange(f"{name} {show(value)} is not an int in [0, {MAX_COUNTER}]")
    return value.to_bytes(8, "little")
