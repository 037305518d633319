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
"""Records (or departures, wants) in one gossip frame; a turn that carries more takes more frames."""
MAX_TURN_RANGES = 256
"""Range digests in one gossip frame (16 sub-ranges each of 16 ranges being compared)."""
MAX_RANGE_VERSIONS = 64
"""Versions listed in one range digest: a range is listed whole only when it is this small."""
GOSSIP_FRAME_LIMIT = 6 * (1 << 20)
"""Largest frame a gossip exchange reads (before or after its first): a ViewTurn at every limit
above — 256 ranges of 64 versions, 256 wants, 256 records of 16 KiB, 256 departures — is
6,060,351 bytes encoded, a GossipPush of 256 such records 4,228,117
(tests/protocol/test_frame_limits.py builds both)."""
HEARTBEAT_FRAME_LIMIT = 160
"""Largest frame the ping protocol reads: a Heartbeat (an int64 and a float64, and in an echo a
LoadReport: four counts and a float64) is at most 126 bytes encoded."""
MAX_RECORD_TTL = 2 * 86400.0
"""Seconds a record may claim to stay valid. Records live long (a day by default,
peer/node/config.py): a peer re-signs when what it says changes, and a dead peer's record is
removed by a `Departure`, not by waiting out its lifetime — so that nobody has to hear every
peer re-sign every few seconds (peer/net/gossip.py, "Traffic")."""
MAX_DEPARTURE_TTL = 3600.0
"""Seconds a departure may be kept (it must outlive the gossip that spreads it, not the record)."""
RANGE_HASH_SIZE = 16
MAX_RANGE_DEPTH = 16
"""Ranges split the 64-bit key space 16 ways per level (peer/net/record_set.py)."""


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
        context_tokens: the longest context one session over the whole claimed span can
            hold in the memory this peer keeps for session state (each layer's fixed
            state plus its state per token: a span of linear-attention layers holds the
            model's whole context in a fixed state); 0: not said (an older peer).
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
    context_tokens: int = wire(default=0, max=INT64_MAX)

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


MAX_LOAD_COUNT = 2**20
MAX_LOAD_WAIT = 3600.0
"""Seconds of queue a load report may name at most (a refusal's retry-after bound too)."""


@message("load")
@dataclass(frozen=True)
class LoadReport:
    """How busy a peer is, as it says with an answer that already flows (a ping's echo, a
    session's accept, a refusal): what a requester prices a route with between records.

    Attributes:
        sessions: sessions open here that a new open could not take the room of now (a step
            in flight, or within their idle grace): what is held idle and reclaimable is
            room, not load.
        max_sessions: the session slots it has.
        waiting_opens: opens waiting here for a slot now.
        steps_waiting: steps queued for compute now (the one computing included).
        wait: seconds a step that arrived now would wait before its compute starts (the
            peer's estimate from the work queued and its measured speed).
    """

    sessions: int = wire(max=MAX_LOAD_COUNT)
    max_sessions: int = wire(max=MAX_LOAD_COUNT)
    waiting_opens: int = wire(default=0, max=MAX_LOAD_COUNT)
    steps_waiting: int = wire(default=0, max=MAX_LOAD_COUNT)
    wait: float = wire(default=0.0, min=0.0, max=MAX_LOAD_WAIT)


@message("hb")
@dataclass(frozen=True)
class Heartbeat:
    """A liveness probe between neighbours; the reply echoes `seq` and `sent_at`.

    Attributes:
        seq: the sender's heartbeat counter.
        sent_at: the sender's clock when it sent the probe (for RTT measurement).
        load: in a reply, the answering peer's load now (a serving peer says it; None: not said).
    """

    seq: int = wire(max=INT64_MAX)
    sent_at: float = wire()
    load: LoadReport | None = None


@message("gossip")
@dataclass(frozen=True)
class GossipPush:
    """A batch of signed records the sender believes current.

    Attributes:
        records: the records; each is verified on its own by the receiver.
    """

    records: tuple[SignedRecord, ...] = wire(max_items=MAX_GOSSIP_RECORDS)


@message("ver")
@dataclass(frozen=True)
class Version:
    """Which version of one peer's entry the sender holds (listed when a range is small).

    Attributes:
        peer_id: the peer.
        seq: its record's sequence number (a departure: the seq of the record that died).
        gone_until: 0 for a live record; for a departure, when it is forgotten.
    """

    peer_id: bytes = wire(max_len=MAX_PEER_ID_SIZE)
    seq: int = wire(max=INT64_MAX)
    gone_until: float = wire(default=0.0, min=0.0)


@message("range")
@dataclass(frozen=True)
class RangeDigest:
    """One range of the key space as the sender holds it (peer/net/record_set.py).

    Attributes:
        depth: how many 4-bit steps down the range is (0: the whole key space).
        prefix: the top `4 * depth` bits the range's keys share.
        count: how many entries the sender holds in it.
        hash: the range's hash (16 zero bytes when empty).
        whole: `versions` lists every entry of the range (sent when the range is small).
        versions: those entries, when `whole`.
    """

    depth: int = wire(max=MAX_RANGE_DEPTH)
    prefix: int = wire(max=2**64 - 1)
    count: int = wire(max=INT64_MAX)
    hash: bytes = wire(size=RANGE_HASH_SIZE)
    whole: bool = wire(default=False)
    versions: tuple[Version, ...] = wire(default=(), max_items=MAX_RANGE_VERSIONS)

    def __post_init__(self) -> None:
        if self.prefix >> (4 * self.depth):
            raise InconsistentFields(f"RangeDigest: prefix {self.prefix!r} has more than {4 * self.depth} bits")
        if self.versions and not self.whole:
            raise InconsistentFields("RangeDigest: versions are listed only in a whole range")


@message("departed")
@dataclass(frozen=True)
class Departure:
    """A peer found gone: its record `seq` is dead (a departure beats that record, and a
    record with a higher seq — the peer, still alive, answering it — beats the departure).

    Attributes:
        peer_id: the peer that is gone.
        seq: the seq of its record that is dead.
        gone_until: when receivers forget the departure (at most MAX_DEPARTURE_TTL ahead).
    """

    peer_id: bytes = wire(max_len=MAX_PEER_ID_SIZE)
    seq: int = wire(max=INT64_MAX)
    gone_until: float = wire(min=0.0)


LINK_NONE = 0
LINK_ASK = 1
LINK_ACCEPT = 2
LINK_REFUSE = 3
LINK_BYE = 4


@message("turn")
@dataclass(frozen=True)
class ViewTurn:
    """One side's turn in a view exchange (peer/net/gossip.py): what it pushes, what it
    wants, and the ranges it asks the other side to compare. A turn larger than a frame
    takes several, `more` set on all but the last; an empty turn ends the exchange.

    Attributes:
        ranges: range digests for the other side to compare with its own.
        want: peers whose entries the sender wants (the other side showed newer ones).
        records: signed records the receiver lacks, holds older, or wanted.
        departures: departures the receiver lacks, holds older, or wanted.
        more: another frame of this turn follows.
        link: the first frame only: ask to be neighbours (LINK_ASK), the answer
            (LINK_ACCEPT, LINK_REFUSE), or stop being neighbours (LINK_BYE).
    """

    ranges: tuple[RangeDigest, ...] = wire(default=(), max_items=MAX_TURN_RANGES)
    want: tuple[bytes, ...] = wire(default=(), max_items=MAX_GOSSIP_RECORDS, max_len=MAX_PEER_ID_SIZE)
    records: tuple[SignedRecord, ...] = wire(default=(), max_items=MAX_GOSSIP_RECORDS)
    departures: tuple[Departure, ...] = wire(default=(), max_items=MAX_GOSSIP_RECORDS)
    more: bool = wire(default=False)
    link: int = wire(default=LINK_NONE, max=LINK_BYE)

    @property
    def empty(self) -> bool:
        return not (self.ranges or self.want or self.records or self.departures)
