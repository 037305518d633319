"""Peer ids: the one place outside net/ that speaks libp2p's `ID` (base58 text <-> raw bytes).

Every layer names peers by their base58 text; messages and signatures carry the raw bytes.
"""

from __future__ import annotations

from functools import lru_cache

from libp2p.peer.id import ID

# base58 is slow in pure Python, and the same peers (tens of thousands in a big simulation) are
# named in every record, session open and route: each id is converted once (both functions are pure).
ID_CACHE = 1 << 16


@lru_cache(maxsize=ID_CACHE)
def peer_id_bytes(peer_id: str) -> bytes:
    """The raw bytes of a base58 peer id (raises ValueError on bad base58)."""
    return ID.from_base58(peer_id).to_bytes()


@lru_cache(maxsize=ID_CACHE)
def peer_id_text(raw: bytes) -> str:
    """The base58 text of a raw peer id."""
    return ID(raw).to_base58()
