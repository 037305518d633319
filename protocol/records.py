"""The swarm messages: signed advertisements, gossip, heartbeats and joining.

A peer describes itself in a `PeerRecord`, encodes it, and signs the bytes
(`tessera.protocol.crypto.sign_record`); the `SignedRecord` is what travels, alone or in a
`GossipPush`. A receiver checks the signature, that the peer id is the one the
signing key implies, and that the record has not expired
(`tessera.protocol.crypto.verify_record`) before it believes a word of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.protocol.codec import message
from tessera.protocol.errors import InconsistentFields
from tessera.protocol.schema import INT64_MAX, wire

MAX_PEER_ID_SIZE = 64
"""libp2p peer ids: 38 bytes for an inline Ed25519 key, 34 for a SHA-256 multihash."""

MAX_ADDRS = 32
MAX_ADDR_LEN = 256
MAX_LAYERS = 2**16
MAX_SHARDS = 1024
MAX_NEIGHBOURS = 64
MAX_HELD_SPANS = 32
"""Layer ranges one record may list as held on disk (a peer merges touching ranges, so
more than a few means a cache scattered by many moves; the rest go unsaid)."""
MAX_RECORD_SIZE = 16 * 1024
"""An encoded PeerRecord at its limits (32 addresses of 256 characters, 64
neighbours, 32 held ranges) is 15,384 bytes."""

MAX_GOSSIP_RECORDS = 256
MAX_DIGEST_ENTRIES = 1024
"""Entries in one GossipDigest frame (about 60 bytes each: ~60 KiB); more peers take more frames."""
MAX_DIGEST_FRAMES = 16
"""Digest frames one exchange may send: a view of at most 16,384 peers, far above a real swarm's."""
MAX_RECORD_TTL = 3600.0
"""Seconds a record may claim to stay valid; peers re-advertise well within it."""


@message("nbr")
@dataclass(frozen=True)
class Neighbour:
    """A peer that the advertising peer talks to, and how far away it is.

    Attributes:
        peer_id: the neighbour's libp2p peer id.
        rtt_ms: measured round-trip time to it, in milliseconds.
    """

    peer_id: bytes = wire(max_len=MAX_PEER_ID_SIZE)
    rtt_ms: float = wire(min=0.0)


@message("layers")
@dataclass(frozen=True)
class LayerSpan:
    """Layers ``[start, end)`` of the model.

    Attributes:
        start: the first layer.
        end: one past the last layer.
    """

    start: int = wire(max=MAX_LAYERS)
    end: int = wire(max=MAX_LAYERS)

    def __post_init__(self) -> None:
        if self.start >= self.end:
            raise InconsistentFields(f"LayerSpan: layer range [{self.start!r}, {self.end!r}) is empty")


@message("record")
@dataclass(frozen=True)
class PeerRecord:
    """What a peer advertises about itself. Only ever trusted inside a SignedRecord.

    Attributes:
        peer_id: the advertising peer's libp2p peer id; must match the signing key.
        name: a display name chosen by the operator.
        model_id: the model served (e.g. "smollm2-135m").
        start: first layer of the claimed span.
        end: one past the last layer of the claimed span.
        shard_index: which tensor shard of the span this peer holds, in [0, shard_count).
        shard_count: how many shards the span is split into (1: not sharded).
        throughput: measured decode speed through ONE layer of the span, tokens/s
            (a span of n layers runs a token in n / throughput seconds).
        free_memory: bytes of accelerator (or host) memory still free.
        load: fraction of capacity in use (0 idle, 1 full; may exceed 1 when queueing).
        max_sessions: most concurrent sessions the peer accepts.
        state: lifecycle state, e.g. "joining", "serving", "draining".
        reachability: how to reach it: "direct", "hole-punched" or "relayed".
        addrs: multiaddrs where it may be dialled.
        neighbours: peers it is connected to, with round-trip times.
        issued_at: when the record was made (seconds since the epoch, sender's clock).
        expires_at: when the record stops being valid (same clock).
        seq: sequence number; a higher one replaces a lower one from the same peer.
        shard_group: the name of the tensor-shard group this peer is a rank of ("" when
            not sharded); the peers advertising one name, span and shard_count form it.
        dtype: the dtype it computes in ("float32", "bfloat16", ...); spot checks
            derive their tolerance from it.
        device: the kind of device it computes on: "cpu", "cuda" or "mps".
        device_free: bytes free on that device when the record was made (CUDA's
            free VRAM); 0 when the device does not say (CPU, MPS).
        held: the layers whose weights this peer has on disk, loaded or not (a whole
            model folder: all of them; a folder fetched from the swarm: the spans it
            fetched). A re-claim after churn prefers peers that hold what it needs: a
            load costs seconds, a download minutes. Empty: not said (an older peer).
    """

    peer_id: bytes = wire(max_len=MAX_PEER_ID_SIZE)
    name: str = wire(max_len=64)
    model_id: str = wire(max_len=128)
    start: int = wire(max=MAX_LAYERS)
    end: int = wire(max=MAX_LAYERS)
    shard_index: int = wire(max=MAX_SHARDS - 1)
    shard_count: int = wire(min=1, max=MAX_SHARDS)
    throughput: float = wire(min=0.0)
    free_memory: int = wire(max=INT64_MAX)
    load: float = wire(min=0.0)
    max_sessions: int = wire(max=2**20)
    state: str = wire(max_len=32)
    reachability: str = wire(max_len=32)
    addrs: tuple[str, ...] = wire(max_items=MAX_ADDRS, max_len=MAX_ADDR_LEN)
    neighbours: tuple[Neighbour, ...] = wire(max_items=MAX_NEIGHBOURS)
    issued_at: float = wire()
    expires_at: float = wire()
    seq: int = wire(max=INT64_MAX)
    dtype: str = wire(default="float32", max_len=16)
    shard_group: str = wire(default="", max_len=64)
    device: str = wire(default="cpu", max_len=16)
    device_free: int = wire(default=0, max=INT64_MAX)
    held: tuple[LayerSpan, ...] = wire(default=(), max_items=MAX_HELD_SPANS)

    def __post_init__(self) -> None:
        if self.start >= self.end:
            raise InconsistentFields(f"PeerRecord: layer range [{self.start!r}, {self.end!r}) is empty")
        if self.shard_index >= self.shard_count:
            raise InconsistentFields(
                f"PeerRecord: shard_index {self.shard_index!r} is not below shard_count {self.shard_count!r}"
            )
        if not 0.0 <= self.expires_at - self.issued_at <= MAX_RECORD_TTL:
            raise InconsistentFields(
                f"PeerRecord: lifetime from issued_at {self.issued_at!r} to expires_at "
                f"{self.expires_at!r} is outside [0, {MAX_RECORD_TTL}] seconds"
            )


@message("signed")
@dataclass(frozen=True)
class SignedRecord:
    """An encoded PeerRecord and the Ed25519 signature over it.

    Attributes:
        record: the encoded PeerRecord, exactly the bytes that were signed.
        public_key: the signer's Ed25519 public key (its peer id is derived from it).
        signature: Ed25519 signature over a domain prefix + `record`.
    """

    record: bytes = wire(max_len=MAX_RECORD_SIZE)
    public_key: bytes = wire(size=32)
    signature: bytes = wire(size=64)


@message("hb")
@dataclass(frozen=True)
class Heartbeat:
    """A liveness probe between neighbours; the reply echoes `seq` and `sent_at`.

    Attributes:
        seq: the sender's heartbeat counter.
        sent_at: the sender's clock when it sent the probe (for RTT measurement).
    """

    seq: int = wire(max=INT64_MAX)
    sent_at: float = wire()


@message("gossip")
@dataclass(frozen=True)
class GossipPush:
    """A batch of signed records the sender believes current.

    Attributes:
        records: the records; each is verified on its own by the receiver.
    """

    records: tuple[SignedRecord, ...] = wire(max_items=MAX_GOSSIP_RECORDS)


@message("dent")
@dataclass(frozen=True)
class DigestEntry:
    """Which version of one peer's record the sender holds.

    Attributes:
        peer_id: the record's peer id.
        seq: the record's sequence number (a higher one replaces a lower one).
        expires_at: the record's expiry (the sender's copy; shown to the other side so
            that an expired entry is never pulled).
    """

    peer_id: bytes = wire(max_len=MAX_PEER_ID_SIZE)
    seq: int = wire(max=INT64_MAX)
    expires_at: float = wire()


@message("digest")
@dataclass(frozen=True)
class GossipDigest:
    """Anti-entropy, first move: every live record the sender holds, as (peer, seq, expiry).

    A view larger than MAX_DIGEST_ENTRIES goes in several frames, `more` set on all but
    the last (at most MAX_DIGEST_FRAMES).

    Attributes:
        entries: one per peer whose unexpired record the sender holds.
        more: another digest frame follows.
    """

    entries: tuple[DigestEntry, ...] = wire(max_items=MAX_DIGEST_ENTRIES)
    more: bool = wire(default=False)


@message("pull")
@dataclass(frozen=True)
class GossipPull:
    """Anti-entropy, answer to a digest: send me these peers' records (you hold newer ones).

    Sent after the records the digest showed the other side lacks (as GossipPush frames);
    the frame with `more` unset ends the answer.

    Attributes:
        peer_ids: the peers whose records are wanted (each named in the digest).
        more: another pull frame follows.
    """

    peer_ids: tuple[bytes, ...] = wire(max_items=MAX_GOSSIP_RECORDS, max_len=MAX_PEER_ID_SIZE)
    more: bool = wire(default=False)


