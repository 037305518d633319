"""The messages of the session protocol: opening a session, stepping it, closing it.

Each message is a frozen dataclass registered with a short type tag; `encode` and
`decode` (from `tessera.protocol.codec`, re-exported here) turn any of them into bytes and
back, checking every field against its annotation and the limits declared with
`wire(...)`. To add a message, write a dataclass with `@message("tag")`; to add a
field, add it (with a default, if old senders may omit it). The tests derive their
strategies and fuzz corpora from the registry, so both are covered automatically.

Vocabulary. A *session* is one requester's generation through one chain of peers.
A *link* is one directed hop of that chain — requester -> first peer, peer i ->
peer i+1, last peer -> requester, and optional *tap* links peer -> requester — each
with its own id (unique within the session) and its own key. A *step* is one
forward pass of the chain (a prefill chunk, a decoded token, or a block of drafted
tokens). Positions are token indices in the session's sequence; layer ranges are
half-open, [start, end). The gossip/advertisement messages live in
`tessera.protocol.records` and are re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.protocol.admission import WORK_NONCE_SIZE
from tessera.protocol.codec import MAX_MESSAGE_SIZE, PROTOCOL_VERSION, decode, encode, message
from tessera.protocol.errors import InconsistentFields
from tessera.protocol.records import (
    MAX_ADDR_LEN,
    MAX_ADDRS,
    MAX_LAYERS,
    MAX_PEER_ID_SIZE,
    Departure,
    GossipPush,
    Heartbeat,
    LoadReport,
    Neighbour,
    PeerRecord,
    RangeDigest,
    SignedRecord,
    Version,
    ViewTurn,
)
from tessera.protocol.schema import INT64_MAX, wire
from tessera.protocol.tensors import WIRE_FORMS

__all__ = [
    "MAX_MESSAGE_SIZE",
    "PROTOCOL_VERSION",
    "Cancel",
    "ErrorMsg",
    "Forward",
    "REPLY_FULL",
    "REPLY_FINGERPRINT",
    "Departure",
    "GossipPush",
    "Heartbeat",
    "LinkHello",
    "LoadReport",
    "Neighbour",
    "PeerRecord",
    "QueueNotice",
    "Relink",
    "Result",
    "SealedKey",
    "SessionAccept",
    "SessionClose",
    "SessionOpen",
    "SessionRevoke",
    "SignedRecord",
    "RangeDigest",
    "Version",
    "ViewTurn",
    "decode",
    "encode",
    "message",
    "wire",
]

SESSION_ID_SIZE = 16
"""Session ids are 16 random bytes chosen by the requester."""

PUBLIC_KEY_SIZE = 32
SEALED_KEY_BOX_SIZE = 24 + 32 + 16
"""A sealed link key: 24-byte nonce + 32-byte key + 16-byte Poly1305 tag."""

MAX_LINK_ID = 2**32 - 1
MAX_POSITION = 2**24
"""Largest token position or context length (16M tokens; far above any model's)."""

MAX_STEP_TOKENS = 2**20
MAX_PAYLOAD = MAX_MESSAGE_SIZE - 4096
"""Largest encrypted activation payload: a full frame less room for the header."""

MAX_TEXT = 1024
MAX_RETRY_AFTER = 3600.0
"""Seconds a refusal may ask a requester to wait at most."""


@message("sealed")
@dataclass(frozen=True)
class SealedKey:
    """A link key sealed to one peer (see `tessera.protocol.links.seal_link_key`).

    Attributes:
        link_id: the link this key is for; the seal is bound to it.
        box: nonce + XChaCha20-Poly1305 ciphertext of the 32-byte key.
    """

    link_id: int = wire(max=MAX_LINK_ID)
    box: bytes = wire(size=SEALED_KEY_BOX_SIZE)


@message("open")
@dataclass(frozen=True)
class SessionOpen:
    """Requester -> each peer of a chain: serve layers [start, end) for this session.

    Attributes:
        session_id: the session, 16 random bytes.
        start: first layer this peer computes.
        end: one past the last layer this peer computes.
        max_length: most tokens the session may reach (the KV cache to reserve).
        requester: the requester's libp2p peer id (bytes), where results and errors go.
        ephemeral_public: the requester's X25519 public key for this session only;
            every SealedKey here was sealed with its private half.
        in_key: the key of the link into this peer (from the previous hop, or from
            the requester if this peer is first).
        out_key: the key of the link out of this peer (to the next hop, or to the
            requester if this is the last peer).
        next_peer: peer id of the next hop; None if this peer sends its results
            straight to the requester.
        next_addrs: multiaddrs where the next hop may be dialled (may be empty).
        tap_key: optional key of a tap link from this peer to the requester (a copy
            of this peer's output, which the requester keeps to rebuild a
            replacement's cache after a failure, and to verify the span).
        prev_peer: peer id of the previous hop, the only peer allowed to open the
            in_key link; None if the requester itself feeds this peer.
        inject_key: optional key of a link from the requester straight to this
            peer (used to replay inputs into a replacement, or to spot-check it).
        work: the requester's proof of work for its identity (see
            `tessera.protocol.admission`); empty: none (such a requester waits behind
            every requester with work when the peer is full).
        wire_form: the form this peer sends its activations in (`tessera.protocol.tensors.WIRE_FORMS`):
            "" its compute dtype (exact, the default), or a compact one the requester asked
            for ("bfloat16", "fp8": lossy, see docs/pages/quantization.md).
        max_wait: the longest a step may wait in this peer's queue, in seconds, for the route to
            be worth what the requester priced it at; None: any wait. A peer whose step would
            wait longer refuses (code "queue-longer", with its load report) and holds nothing.
    """

    session_id: bytes = wire(size=SESSION_ID_SIZE)
    start: int = wire(max=MAX_LAYERS)
    end: int = wire(max=MAX_LAYERS)
    max_length: int = wire(min=1, max=MAX_POSITION)
    requester: bytes = wire(max_len=MAX_PEER_ID_SIZE)
    ephemeral_public: bytes = wire(size=PUBLIC_KEY_SIZE)
    in_key: SealedKey
    out_key: SealedKey
    next_peer: bytes | None = wire(max_len=MAX_PEER_ID_SIZE)
    next_addrs: tuple[str, ...] = wire(max_items=MAX_ADDRS, max_len=MAX_ADDR_LEN)
    tap_key: SealedKey | None = None
    prev_peer: bytes | None = wire(default=None, max_len=MAX_PEER_ID_SIZE)
    inject_key: SealedKey | None = None
    work: bytes = wire(default=b"", max_len=WORK_NONCE_SIZE)
    wire_form: str = wire(default="", max_len=16)
    max_wait: float | None = wire(default=None, min=0.0, max=MAX_RETRY_AFTER)

    def __post_init__(self) -> None:
        if self.start >= self.end:
            raise InconsistentFields(f"SessionOpen: layer range [{self.start!r}, {self.end!r}) is empty")
        if self.wire_form not in WIRE_FORMS:
            raise InconsistentFields(f"SessionOpen: wire form {self.wire_form!r} is not one of {list(WIRE_FORMS)}")


@message("accept")
@dataclass(frozen=True)
class SessionAccept:
    """Peer -> requester: the session is open.

    Attributes:
        session_id: the session.
        max_length: tokens the peer reserved, at most the requested max_length.
        load: the peer's load as it admitted the session (None: not said; a relink's ack says nothing).
    """

    session_id: bytes = wire(size=SESSION_ID_SIZE)
    max_length: int = wire(min=1, max=MAX_POSITION)
    load: LoadReport | None = None


@message("close")
@dataclass(frozen=True)
class SessionClose:
    """Either side: the session is over; drop its KV cache and keys.

    Attributes:
        session_id: the session.
        reason: a short human-readable reason ("done", "timeout", ...).
    """

    session_id: bytes = wire(size=SESSION_ID_SIZE)
    reason: str = wire(max_len=256)


@message("revoke")
@dataclass(frozen=True)
class SessionRevoke:
    """Requester -> peer: this peer is no longer trusted with the session.

    The peer drops the session's KV cache and keys at once, records that it did
    (a ``session_revoked`` trace event), and reads nothing more for it: the
    requester has moved the span to another peer and sends it no further frame.

    Attributes:
        session_id: the session.
    """

    session_id: bytes = wire(size=SESSION_ID_SIZE)


@message("hello")
@dataclass(frozen=True)
class LinkHello:
    """The first frame on a peer -> peer (or peer -> requester) link stream.

    Attributes:
        session_id: the session the link belongs to.
        link_id: which link of it this stream carries.
    """

    session_id: bytes = wire(size=SESSION_ID_SIZE)
    link_id: int = wire(max=MAX_LINK_ID)


@message("fwd")
@dataclass(frozen=True)
class Forward:
    """One step's hidden states, on their way into the next span of layers.

    Every field except `payload` and `counter` travels in clear and is bound into the
    AEAD associated data (see `tessera.protocol.activations`), so none can be altered.

    Attributes:
        session_id: the session.
        step: the step number (increases by one per forward pass of the chain).
        link_id: the link this frame travels on.
        counter: the link's frame counter (strictly increasing; replay defence).
        start_pos: position of the first token of this step.
        n_tokens: how many tokens (rows of hidden states) this step carries.
        stop_layer: the layer where this step ends: the peer whose span ends at or
            beyond it sends its output back to the requester (as a tap) instead of
            pushing it on. The model's layer count for a normal step; a span's end
            when a failover replays inputs into replacement peers only.
        payload: XChaCha20-Poly1305 ciphertext of an encoded tensor
            (`tessera.protocol.tensors.encode_tensor`).
        reply: what the peer that returns this step to the requester sends back:
            REPLY_FULL, the output tensor; REPLY_FINGERPRINT, only its fingerprint
            (a spot-checking peer; see tessera.protocol.attest).
    """

    session_id: bytes = wire(size=SESSION_ID_SIZE)
    step: int = wire(max=INT64_MAX)
    link_id: int = wire(max=MAX_LINK_ID)
    counter: int = wire(max=INT64_MAX)
    start_pos: int = wire(max=MAX_POSITION)
    n_tokens: int = wire(min=1, max=MAX_STEP_TOKENS)
    stop_layer: int = wire(max=MAX_LAYERS)
    payload: bytes = wire(max_len=MAX_PAYLOAD)
    reply: int = wire(default=0, max=1)


REPLY_FULL = 0
REPLY_FINGERPRINT = 1


@message("res")
@dataclass(frozen=True)
class Result:
    """The last hop's output (or a tap's copy), sent to the requester.

    Same header as Forward, without stop_layer; see Forward for the fields. The
    payload holds the output tensor, or — when the step asked for REPLY_FINGERPRINT —
    an encoded `tessera.protocol.attest.Fingerprint`.

    Attributes (beyond Forward's):
        inputs_hash: sha256 of the encoded input tensor this peer computed from.
        outputs_hash: sha256 of the encoded fingerprint of its output (see tessera.protocol.attest).
        attestation: the peer's Ed25519 signature over an `Attestation` of this step
            (session, step, positions, span, both hashes): evidence that it, and nobody
            else, produced this output from these inputs.
    """

    session_id: bytes = wire(size=SESSION_ID_SIZE)
    step: int = wire(max=INT64_MAX)
    link_id: int = wire(max=MAX_LINK_ID)
    counter: int = wire(max=INT64_MAX)
    start_pos: int = wire(max=MAX_POSITION)
    n_tokens: int = wire(min=1, max=MAX_STEP_TOKENS)
    payload: bytes = wire(max_len=MAX_PAYLOAD)
    inputs_hash: bytes = wire(default=b"", max_len=32)
    outputs_hash: bytes = wire(default=b"", max_len=32)
    attestation: bytes = wire(default=b"", max_len=64)


@message("relink")
@dataclass(frozen=True)
class Relink:
    """Requester -> peer: its neighbour in the chain changed (failover).

    Attributes:
        session_id: the session.
        next_peer: new next hop; None means the requester itself.
        next_addrs: where the next hop may be dialled.
        out_key: key of the new outgoing link, if it changed.
        in_key: key of the new incoming link, if it changed.
        prev_peer: the peer that will feed the new incoming link (None: the requester).
    """

    session_id: bytes = wire(size=SESSION_ID_SIZE)
    next_peer: bytes | None = wire(max_len=MAX_PEER_ID_SIZE)
    next_addrs: tuple[str, ...] = wire(max_items=MAX_ADDRS, max_len=MAX_ADDR_LEN)
    out_key: SealedKey | None = None
    in_key: SealedKey | None = None
    prev_peer: bytes | None = wire(default=None, max_len=MAX_PEER_ID_SIZE)


@message("cancel")
@dataclass(frozen=True)
class Cancel:
    """Requester -> peer: drop step `step` if it has not run yet.

    Attributes:
        session_id: the session.
        step: the step to drop.
    """

    session_id: bytes = wire(size=SESSION_ID_SIZE)
    step: int = wire(max=INT64_MAX)


@message("err")
@dataclass(frozen=True)
class ErrorMsg:
    """Either side: something went wrong.

    Attributes:
        code: a short machine-readable code (e.g. "overloaded", "bad-frame").
        message: a human-readable explanation.
        session_id: the session concerned, if any.
        retry_after: for a refusal that passes ("busy"): the seconds after which the
            peer expects to have room for the asker; None: not said.
        load: with a refusal for lack of room, how full the peer is (None: not said).
    """

    code: str = wire(max_len=64)
    message: str = wire(max_len=MAX_TEXT)
    session_id: bytes | None = wire(default=None, size=SESSION_ID_SIZE)
    retry_after: float | None = wire(default=None, min=0.0, max=MAX_RETRY_AFTER)
    load: LoadReport | None = None


@message("queued")
@dataclass(frozen=True)
class QueueNotice:
    """Peer -> requester, on a session's stream: where one of its steps is in this peer's queue.

    Sent when a step must wait behind others' before its compute starts (`started` False:
    `ahead` steps before it, about `wait` seconds), and again when it starts (`started` True),
    so that the requester counts the step's deadline from when the peer starts it: time spent
    queued behind other requesters is not a failure of this peer.

    Attributes:
        session_id: the session.
        step: the step concerned.
        started: False: the step is queued; True: its compute starts now.
        ahead: steps queued before it (0 once started).
        wait: the peer's estimate of the seconds until it starts (0 once started).
    """

    session_id: bytes = wire(size=SESSION_ID_SIZE)
    step: int = wire(max=INT64_MAX)
    started: bool = wire(default=False)
    ahead: int = wire(default=0, max=2**20)
    wait: float = wire(default=0.0, min=0.0, max=MAX_RETRY_AFTER)
