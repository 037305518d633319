"""What a requester brings to be admitted: a small proof of work for its identity, and the
sizes that bound what a peer reads before and after admitting a session.

An identity costs nothing to make (an Ed25519 key), so a peer that shares its session
slots fairly among requesters would share them among as many identities as an
attacker cares to generate. A *proof of work* puts a price on each one: a nonce such
that

    sha256(WORK_CONTEXT || peer_id || nonce)

starts with `WORK_BITS` zero bits. It is bound to the identity alone (not to a peer or
a time), so a requester solves it once and shows it to every peer of the swarm; a
peer checks it with one hash. At 18 bits a requester in pure Python spends about
0.1 s (2^18 hashes at ~2 M/s; the median of a geometric number of tries), an attacker
with native SHA-256 about 10 ms per identity: not a wall, a price per identity that
the peer's queue (peer/serve/admission.py) turns into a bound — an identity without
work waits behind every identity with it, and one with work gets one grace period
of holding a slot idle, not more.

Bounded before admitted: a session stream's first frame is an open request, small
and of a known largest size (`OPEN_FRAME_LIMIT`, `SHARD_OPEN_FRAME_LIMIT`; a link's,
`LINK_FRAME_LIMIT`); only an
admitted session's streams read bigger frames, up to what its declared `max_length`
allows a step to carry (`session_frame_limit`).
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

WORK_CONTEXT = b"tessera/admission-work/v1\x00"
WORK_BITS = 18
"""Leading zero bits of the work hash (see the module docstring for the cost)."""

WORK_NONCE_SIZE = 8
"""Nonces are 8 bytes (little-endian counters when solved here)."""

OPEN_FRAME_LIMIT = 16 * 1024
"""Largest first frame on a session stream. A SessionOpen at its wire limits is about
9.5 KiB (32 next-hop addresses of 256 bytes, four sealed keys, two peer ids); a
LinkHello some 40 bytes. Anything bigger is refused at its length prefix."""

LINK_FRAME_LIMIT = 64
"""Largest first frame on a link stream (plain or between tensor-shard ranks): a LinkHello, a
16-byte session id and a link id, is at most 50 bytes encoded (tests/protocol/test_frame_limits.py)."""

SHARD_OPEN_FRAME_LIMIT = 1024 * 1024
"""Largest first frame on a tensor-shard session stream: a ShardOpen lists every other
rank of a group of up to 64 with its addresses (at the wire limits about 540 KiB)."""

FRAME_OVERHEAD = 4096
"""A step frame's bytes beyond its tensor's data: the Forward's clear header, the tensor
codec's header (dtype, shape) and the AEAD's tag, with room to spare."""

LARGEST_ITEMSIZE = 8
"""Bytes per activation element on the wire at most: float64, the widest dtype the tensor
codec carries (peers send float32, or 2-byte halves)."""

MAX_SESSIONS_PER_REQUESTER = 8
"""Sessions a peer holds for one requester identity at once (half of a peer's default 16
slots, peer/serve/limits.py): an open past it is refused `busy` at once. A rule of the swarm,
not a setting: a requester counts its own sessions on each peer, so it routes past a peer that
holds this many of them instead of opening a route there to be refused (peer/request/client.py
`Swarm.plan`)."""


def work_digest(peer_id: bytes, nonce: bytes) -> bytes:
    return hashlib.sha256(WORK_CONTEXT + peer_id + nonce).digest()


def leading_zero_bits(digest: bytes) -> int:
    value = int.from_bytes(digest, "big")
    return len(digest) * 8 - value.bit_length()


def has_work(peer_id: bytes, nonce: bytes, *, bits: int = WORK_BITS) -> bool:
    """Whether `nonce` proves `bits` of work for `peer_id` (one hash)."""
    return len(nonce) == WORK_NONCE_SIZE and leading_zero_bits(work_digest(peer_id, nonce)) >= bits


@lru_cache(maxsize=64)
def solve_work(peer_id: bytes, *, bits: int = WORK_BITS) -> bytes:
    """A nonce proving `bits` of work for `peer_id` (about 2**bits hashes; cached per identity).

    Blocks for as long as it takes (~0.1 s at WORK_BITS in Python): call it off the event loop.
    """
    base = hashlib.sha256(WORK_CONTEXT + peer_id)
    size = base.digest_size
    if bits <= 0:
        return bytes(WORK_NONCE_SIZE)
    # leading_zero_bits(d) >= bits  <=>  int(d) < 2**(8*size - bits)  <=>  d < that bound's
    # big-endian bytes (equal lengths compare as numbers): one bytes comparison a try, not
    # an int conversion, so the search finds the same first nonce, faster.
    # (bits >= 8*size asks for an all-zero digest: no bound below it, and no nonce is found,
    # as before.)
    below = (1 << (8 * size - bits)).to_bytes(size, "big") if bits < 8 * size else bytes(size)
    copy = base.copy
    counter = 0
    while True:
        nonce = counter.to_bytes(WORK_NONCE_SIZE, "little")
        h = copy()
        h.update(nonce)
        if h.digest() < below:
            return nonce
        counter += 1


def session_frame_limit(max_length: int, width: int) -> int:
    """Largest frame an admitted session's streams may carry: a step of every position the
    session declared (`max_length`) of `width` activations each, plus the frame's overhead."""
    return max_length * width * LARGEST_ITEMSIZE + FRAME_OVERHEAD
