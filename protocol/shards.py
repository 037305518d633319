"""Messages of tensor-shard groups: opening a sharded session, and the collectives' frames.

A *group* of n peers serves a span together, each holding one hidden slice (see
`stages/shards/sharded.py`). The requester opens the session on every member with a
`ShardOpen`; then, on the member's session stream, it sends the member's input slice
(a `Forward`) and receives its output slice (a `Result`), as on any session stream.
Inside the group, rank i pushes its collective contributions to rank j on a link of
its own (i -> j) as `Collective` frames. Every link — requester <-> member and each
directed member pair — has its own key, chosen by the requester and sealed to the
two ends only, so no member reads what two others exchange and nobody outside the
group (relays, other peers) reads anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.protocol.admission import WORK_NONCE_SIZE
from tessera.protocol.codec import message
from tessera.protocol.errors import InconsistentFields
from tessera.protocol.messages import (
    MAX_LINK_ID,
    MAX_PAYLOAD,
    MAX_POSITION,
    PUBLIC_KEY_SIZE,
    SESSION_ID_SIZE,
    SealedKey,
)
from tessera.protocol.records import MAX_ADDR_LEN, MAX_ADDRS, MAX_LAYERS, MAX_PEER_ID_SIZE
from tessera.protocol.schema import INT64_MAX, wire

MAX_GROUP = 64
"""Most ranks in one group (every rank receives a key pair per other rank)."""

MAX_GROUP_NAME = 64


@message("shard-peer")
@dataclass(frozen=True)
class ShardPeer:
    """Another rank of the group, as the recipient of a ShardOpen sees it.

    Attributes:
        peer_id: its libp2p peer id.
        addrs: where it may be dialled.
        send_key: key of the link from the recipient to this rank.
        recv_key: key of the link from this rank to the recipient.
    """

    peer_id: bytes = wire(max_len=MAX_PEER_ID_SIZE)
    addrs: tuple[str, ...] = wire(max_items=MAX_ADDRS, max_len=MAX_ADDR_LEN)
    send_key: SealedKey
    recv_key: SealedKey


@message("shard-open")
@dataclass(frozen=True)
class ShardOpen:
    """Requester -> each rank of a group: serve layers [start, end) as rank `shard_index`.

    Attributes:
        session_id: the session, 16 random bytes (the same on every rank).
        start, end: the layers the group runs for this session (half-open).
        max_length: most tokens the session may reach.
        requester: the requester's peer id; inputs come from it and outputs go to it.
        ephemeral_public: the requester's X25519 key for this session (every key here
            was sealed with its private half).
        group: the group's name, as its ranks advertise it.
        shard_index: the recipient's rank; the group has len(others) + 1 ranks.
        in_key: key of the link requester -> this rank (its input slices).
        out_key: key of the link this rank -> requester (its output slices).
        others: every other rank, in rank order (the recipient's place skipped).
        work: the requester's proof of work for its identity (as in SessionOpen).
    """

    session_id: bytes = wire(size=SESSION_ID_SIZE)
    start: int = wire(max=MAX_LAYERS)
    end: int = wire(max=MAX_LAYERS)
    max_length: int = wire(min=1, max=MAX_POSITION)
    requester: bytes = wire(max_len=MAX_PEER_ID_SIZE)
    ephemeral_public: bytes = wire(size=PUBLIC_KEY_SIZE)
    group: str = wire(max_len=MAX_GROUP_NAME)
    shard_index: int = wire(max=MAX_GROUP - 1)
    in_key: SealedKey
    out_key: SealedKey
    others: tuple[ShardPeer, ...] = wire(max_items=MAX_GROUP - 1)
    work: bytes = wire(default=b"", max_len=WORK_NONCE_SIZE)

    def __post_init__(self) -> None:
        if self.start >= self.end:
            raise InconsistentFields(f"ShardOpen: layer range [{self.start!r}, {self.end!r}) is empty")
        if not self.others:
            raise InconsistentFields("ShardOpen: a group has at least 2 ranks; no other rank is listed")
        if self.shard_index > len(self.others):
            raise InconsistentFields(
                f"ShardOpen: shard_index {self.shard_index!r} is beyond a group of {len(self.others) + 1}"
            )

    @property
    def shard_count(self) -> int:
        return len(self.others) + 1

    def rank_of(self, k: int) -> int:
        """The rank of `others[k]`."""
        return k if k < self.shard_index else k + 1


@message("coll")
@dataclass(frozen=True)
class Collective:
    """Rank i -> rank j: i's contribution to one collective of one step.

    Every field except `payload` and `counter` is clear and bound into the AEAD
    associated data (`tessera.protocol.activations`), as in a Forward.

    Attributes:
        session_id: the session.
        step: the step (as numbered by the requester's Forward).
        link_id: the directed link i -> j this frame travels on.
        counter: the link's frame counter (strictly increasing).
        seq: which collective of the step (1, 2, ... in the order every rank runs them).
        payload: ciphertext of an encoded tensor (`tessera.protocol.tensors.encode_tensor`).
    """

    session_id: bytes = wire(size=SESSION_ID_SIZE)
    step: int = wire(max=INT64_MAX)
    link_id: int = wire(max=MAX_LINK_ID)
    counter: int = wire(max=INT64_MAX)
    seq: int = wire(max=INT64_MAX)
    payload: bytes = wire(max_len=MAX_PAYLOAD)


__all__ = ["MAX_GROUP", "Collective", "ShardOpen", "ShardPeer"]
