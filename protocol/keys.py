"""Keys: a peer's long-term Ed25519 identity, a session's ephemeral X25519 key, peer ids.

A peer's identity is one Ed25519 key pair, the same one its libp2p host uses, so
its peer id here is byte-for-byte its libp2p peer id: the identity multihash of the
protobuf-encoded public key,

    0x00 0x24 | 0x08 0x01 0x12 0x20 | public key (32 bytes)
    identity,  PublicKey{Type: Ed25519, Data: <32 bytes>}
    36 bytes

For encryption the same key is converted to X25519 (the birational map between the
two curves, as libsodium's crypto_sign_ed25519_*_to_curve25519 does), so a peer
needs no second key and anyone who knows its peer id can seal a key to it.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

import nacl.bindings as sodium
import nacl.exceptions
import nacl.utils

from tessera.protocol.errors import BadKey, show

KEY_SIZE = 32
PEER_ID_PREFIX = b"\x00\x24\x08\x01\x12\x20"
"""Identity multihash (code 0x00, length 36) of PublicKey{Type=Ed25519(1), Data=32 bytes}."""


def peer_id_from_public_key(public_key: bytes) -> bytes:
    """The libp2p peer id (bytes) of an Ed25519 public key.

    Raises:
        BadKey: the key is not 32 bytes.
    """
    _check_size(public_key, "Ed25519 public key")
    return PEER_ID_PREFIX + public_key


def public_key_from_peer_id(peer_id: bytes) -> bytes:
    """The Ed25519 public key inlined in a libp2p peer id.

    Raises:
        BadKey: the peer id is not an inline Ed25519 key (e.g. an RSA key's hash).
    """
    if len(peer_id) != len(PEER_ID_PREFIX) + KEY_SIZE or not peer_id.startswith(PEER_ID_PREFIX):
        raise BadKey(f"peer id {show(peer_id)} does not inline an Ed25519 public key")
    return peer_id[len(PEER_ID_PREFIX) :]


def x25519_public_from_ed25519(public_key: bytes) -> bytes:
    """Convert an Ed25519 public key to the X25519 public key of the same secret.

    Raises:
        BadKey: not 32 bytes, or not a valid Ed25519 point.
    """
    _check_size(public_key, "Ed25519 public key")
    try:
        return _pk_to_curve25519(bytes(public_key))
    except nacl.exceptions.CryptoError:
        raise BadKey(f"Ed25519 public key {public_key.hex()!r} is not a valid curve point") from None


@lru_cache(maxsize=4096)
def _pk_to_curve25519(public_key: bytes) -> bytes:
    # A requester seals a session's link keys to the same few peers again and again: the
    # conversion (a field inversion, ~30 us) is done once per peer, not once per key.
    return sodium.crypto_sign_ed25519_pk_to_curve25519(public_key)


class Identity:
    """A peer's long-term Ed25519 key pair. Its repr never shows the secret."""

    __slots__ = ("_seed", "_secret", "public_key", "peer_id", "_x25519", "_last_exchange")

    def __init__(self, seed: bytes) -> None:
        """Use `generate()` or `from_seed()`.

        Raises:
            BadKey: `seed` is not 32 bytes.
        """
        _check_size(seed, "Ed25519 seed", secret=True)
        self._seed = bytes(seed)
        self.public_key, self._secret = sodium.crypto_sign_seed_keypair(self._seed)
        self.peer_id = PEER_ID_PREFIX + self.public_key
        self._x25519: tuple[bytes, bytes] | None = None  # (private, public), converted once
        self._last_exchange: tuple[bytes, bytes] | None = None  # (their public, shared secret)

    @classmethod
    def generate(cls) -> Identity:
        """A new identity from the operating system's random generator."""
        return cls(nacl.utils.random(KEY_SIZE))

    @classmethod
    def from_seed(cls, seed: bytes) -> Identity:
        """The identity whose 32-byte Ed25519 seed (private key) is `seed`.

        Raises:
            BadKey: `seed` is not 32 bytes.
        """
        return cls(seed)

    @property
    def seed(self) -> bytes:
        """The 32-byte private seed: store it, never send it."""
        return self._seed

    def sign(self, data: bytes) -> bytes:
        """A 64-byte Ed25519 signature of `data`."""
        return sodium.crypto_sign(data, self._secret)[: sodium.crypto_sign_BYTES]

    def x25519_private(self) -> bytes:
        """The X25519 private key that corresponds to this identity."""
        return self._x25519_pair()[0]

    def x25519_public(self) -> bytes:
        """The X25519 public key that corresponds to this identity."""
        return self._x25519_pair()[1]

    def _x25519_pair(self) -> tuple[bytes, bytes]:
        # converted once per identity, not once per sealed key a peer opens
        if self._x25519 is None:
            self._x25519 = (sodium.crypto_sign_ed25519_sk_to_curve25519(self._secret),
                            sodium.crypto_sign_ed25519_pk_to_curve25519(self.public_key))
        return self._x25519

    def exchange(self, peer_x25519_public: bytes) -> bytes:
        """X25519(our converted private key, their public key).

        The last answer is kept: a session's in, out and tap keys are all sealed to us
        with one ephemeral key, so opening them costs one exchange, not three.

        Raises:
            BadKey: the peer's key is not 32 bytes or is of low order.
        """
        last = self._last_exchange
        if last is not None and last[0] == peer_x25519_public:
            return last[1]
        shared = x25519(self.x25519_private(), peer_x25519_public)
        self._last_exchange = (bytes(peer_x25519_public), shared)
        return shared

    def __repr__(self) -> str:
        return f"Identity(peer_id={self.peer_id.hex()!r})"


class EphemeralKey:
    """A requester's X25519 key pair for one session; `forget()` drops the secret."""

    __slots__ = ("_private", "public", "_shared")

    def __init__(self, private: bytes) -> None:
        """Use `generate()` or `from_private()`.

        Raises:
            BadKey: `private` is not 32 bytes.
        """
        _check_size(private, "X25519 private key", secret=True)
        self._private: bytes | None = bytes(private)
        self.public = sodium.crypto_scalarmult_base(self._private)
        # their public key -> shared secret: a session seals two or three link keys to each
        # peer of its chain (in, out, tap), all with this key; one exchange per peer serves them
        self._shared: dict[bytes, bytes] = {}

    @classmethod
    def generate(cls) -> EphemeralKey:
        """A fresh key pair from the operating system's random generator."""
        return cls(nacl.utils.random(KEY_SIZE))

    @classmethod
    def from_private(cls, private: bytes) -> EphemeralKey:
        """The key pair with this 32-byte private key (tests, deterministic replays).

        Raises:
            BadKey: `private` is not 32 bytes.
        """
        return cls(private)

    def exchange(self, peer_x25519_public: bytes) -> bytes:
        """X25519(our private, their public).

        Raises:
            BadKey: the key was forgotten, or the peer's key is bad or of low order.
        """
        if self._private is None:
            raise BadKey("ephemeral key was forgotten; it cannot seal any more keys")
        shared = self._shared.get(peer_x25519_public) if type(peer_x25519_public) is bytes else None
        if shared is None:
            shared = self._shared[bytes(peer_x25519_public)] = x25519(self._private, peer_x25519_public)
        return shared

    def forget(self) -> None:
        """Drop the private key and the secrets made with it (best effort: Python may keep
        copies in freed memory)."""
        self._private = None
        self._shared.clear()

    def __repr__(self) -> str:
        return f"EphemeralKey(public={self.public.hex()!r})"


def x25519(private: bytes, public: bytes) -> bytes:
    """The X25519 shared secret.

    Raises:
        BadKey: `public` is not 32 bytes, or is a low-order point (all-zero result).
    """
    _check_size(public, "X25519 public key")
    try:
        return sodium.crypto_scalarmult(bytes(private), bytes(public))
    except nacl.exceptions.CryptoError:
        raise BadKey(f"X25519 public key {public.hex()!r} is of low order") from None


def derive_key(secret: bytes, *, context: bytes, parts: tuple[bytes, ...]) -> bytes:
    """A 32-byte key: BLAKE2b keyed with `secret`, personalised with `context`
    (at most 16 bytes), over each part prefixed with its length (so that no two
    different part lists hash the same input)."""
    h = hashlib.blake2b(key=secret, person=context, digest_size=KEY_SIZE)
    for part in parts:
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return h.digest()


def _check_size(key: bytes, what: str, *, secret: bool = False) -> None:
    if not isinstance(key, (bytes, bytearray)):
        raise TypeError(f"{what} must be bytes, got {type(key).__name__}")
    if len(key) != KEY_SIZE:
        shown = f"{len(key)} bytes" if secret else f"{show(bytes(key))} ({len(key)} bytes)"
        raise BadKey(f"{what} is {shown}, expected {KEY_SIZE}")
