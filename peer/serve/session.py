"""One session as a stage server holds it: keys, neighbours, queue, and the step it runs.

Frames for a session arrive on two kinds of stream — the requester's session
stream (control, and inputs when this peer is first in the chain or is being
replayed into) and a link stream from the previous peer. Both feed one queue,
and one worker task per session takes frames in order: decrypt, compute (in a
worker thread, one forward at a time per peer), encrypt, push to the next peer
— or, at the end of the chain, return to the requester — and send the requester
a tap: a copy of this span's output, which the requester keeps so it can rebuild
a replacement's cache if the next peer dies. Steps of several sessions that are
queued together run as one stacked forward (`compute_batch`, peer/serve/batcher.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
import trio

from tessera.protocol.activations import open_payload, seal_payload
from tessera.protocol.attest import Attestation, sha256, sign_attestation
from tessera.protocol.fingerprint import fingerprint_bytes
from tessera.protocol.keys import Identity
from tessera.protocol.links import Direction, LinkCipher, open_link_key
from tessera.protocol.messages import REPLY_FINGERPRINT, Forward, LinkHello, Result, SealedKey
from tessera.protocol.tensors import TensorLimits, check_finite, decode_tensor, encode_wire

from tessera.stages.errors import SpanError, StageError
from tessera.stages.engine.stage import Stage
from tessera.store.trace import Tracer

from tessera.peer.base.protocols import LINK_PROTOCOL
from tessera.peer.net.transport import Channel, Transport



class ComputeContext(Protocol):
    """What a session needs of the server that holds it (a `StageServer` is one): no more."""

    transport: Transport
    identity: Identity
    stage: Stage
    tensor_limits: TensorLimits
    tamper: Callable[[torch.Tensor], torch.Tensor]
    tracer: Tracer

QUEUE_DEPTH = 64  # frames waiting per session; a requester keeps only a few steps in flight


@dataclass
class ServedSession:
    """A session's state on one peer. Spans are half-open: this peer runs layers [start, end)."""

    session_id: bytes
    requester: str
    start: int
    end: int
    capacity: int
    control: Channel
    ephemeral_public: bytes
    inbound: dict[int, LinkCipher] = field(default_factory=dict)  # link id -> receiving cipher
    link_sources: dict[int, str] = field(default_factory=dict)  # link id -> who may send on it
    out: LinkCipher | None = None
    next_peer: str | None = None  # None: results go to the requester
    next_addrs: tuple[str, ...] = ()
    next_channel: Channel | None = None
    tap: LinkCipher | None = None
    # admission (peer/serve/admission.py): when it last stepped (on trio's clock; set when
    # admitted), whether it ever did, steps queued or running, the KV charged to it
    last_active: float = 0.0
    opened_at: float = 0.0  # trio time when admitted: its pace so far (peer/serve/leaving.py) is measured from it
    stepped: bool = False
    inflight: int = 0
    grace_until: float = -math.inf  # protected until then before its first step (admission.py `opened`)
    kv_positions: int = 0
    kv_bytes: int = 0
    frame_limit: int = 0  # largest frame its streams may carry (protocol/admission.py session_frame_limit)
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)  # its serving; cancelled to evict it
    evicted: tuple[str, str, float | None] | None = None  # (code, why, retry_after) when the peer ended it
    steps: int = 0
    tokens: int = 0
    cancelled: set[int] = field(default_factory=set)
    registered: trio.Event = field(default_factory=trio.Event)  # a new inbound link was added
    link_scopes: list[trio.CancelScope] = field(default_factory=list)  # readers of its link streams
    closed: bool = False
    revoked: bool = False  # the requester revoked this peer from the session (SessionRevoke)
    wire: str = ""  # the form its activations go out in (protocol/tensors.py WIRE_FORMS): the requester's choice
    ended: trio.Event = field(default_factory=trio.Event)  # its streams are closed (StageServer.handle_session)

    def __post_init__(self) -> None:
        self.queue_in, self.queue_out = trio.open_memory_channel[object](QUEUE_DEPTH)

    @property
    def short_id(self) -> str:
        return self.session_id.hex()[:8]

    # -- keys -------------------------------------------------------------------

    def open_key(self, identity: Identity, sealed: SealedKey) -> bytes:
        return open_link_key(
            sealed, session_id=self.session_id, link_id=sealed.link_id,
            recipient=identity, sender_public=self.ephemeral_public,
        )

    def add_inbound(self, identity: Identity, sealed: SealedKey, source: str) -> None:
        """Accept frames on link `sealed.link_id`, only from `source` (a peer id or the requester)."""
        key = self.open_key(identity, sealed)
        self.inbound[sealed.link_id] = LinkCipher(
            key, session_id=self.session_id, link_id=sealed.link_id, direction=Direction.FORWARD
        )
        self.link_sources[sealed.link_id] = source
        self.registered.set()
        self.registered = trio.Event()

    def set_outbound(self, identity: Identity, sealed: SealedKey) -> None:
        key = self.open_key(identity, sealed)
        if self.out is not None:
            self.out.forget()
        self.out = LinkCipher(key, session_id=self.session_id, link_id=sealed.link_id, direction=Direction.FORWARD)

    def set_tap(self, identity: Identity, sealed: SealedKey) -> None:
        key = self.open_key(identity, sealed)
        self.tap = LinkCipher(key, session_id=self.session_id, link_id=sealed.link_id, direction=Direction.FORWARD)

    def forget_keys(self) -> None:
        for cipher in [*self.inbound.values(), self.out, self.tap]:
            if cipher is not None:
                cipher.forget()
        self.inbound.clear()

    # -- neighbours ---------------------------------------------------------------

    async def connect_next(self, server: ComputeContext) -> None:
        """Open the link stream to the next peer (if any) and announce which link it carries."""
        if self.next_channel is not None:
            await self.next_channel.close()
            self.next_channel = None
        if self.next_peer is None or self.out is None:
            return
        stream = await server.transport.open_stream(self.next_peer, LINK_PROTOCOL, addrs=self.next_addrs)
        channel = Channel(stream)
        await channel.send(LinkHello(self.session_id, self.out.link_id))
        self.next_channel = channel

    # -- one step -----------------------------------------------------------------

    def compute(self, server: ComputeContext, msg: Forward) -> tuple[list[object], float]:
        """Decrypt, run this span, encrypt (in a worker thread). Returns (messages to send, compute seconds).

        Raises WireError (bad frame), StageError (shape, context, NaN/Inf).
        """
        hidden, inputs_hash = self.prepare(server, msg)
        started = time.perf_counter()
        output = server.stage.forward(self.session_id, hidden, msg.start_pos)
        elapsed = time.perf_counter() - started
        return self.finish(server, msg, output, inputs_hash), elapsed

    def prepare(self, server: ComputeContext, msg: Forward) -> tuple[torch.Tensor, bytes]:
        """A step's input: decrypted, decoded and checked. Returns (its hop [T, hop_width], hash of the plaintext).

        Raises WireError (bad frame), StageError (shape, NaN/Inf).
        """
        plaintext = open_payload(self.inbound[msg.link_id], msg)
        hidden = decode_tensor(plaintext, limits=server.tensor_limits)
        expected = (msg.n_tokens, server.stage.spec.hop_width(self.start))  # a token's hop: stages/layers/hop.py
        if tuple(hidden.shape) != expected:
            raise SpanError(f"step {msg.step}: hidden states of shape {tuple(hidden.shape)!r}, expected {expected!r}")
        check_finite(hidden, what="input activations")
        return hidden, sha256(plaintext)

    def finish(self, server: ComputeContext, msg: Forward, output: torch.Tensor, inputs_hash: bytes) -> list[object]:
        """A step's output, checked and sealed into the frames it sends. Raises StageError (NaN/Inf)."""
        output = server.tamper(output)
        check_finite(output, what="output activations")
        return self.package(server, msg, output, inputs_hash=inputs_hash)

    def package(self, server: ComputeContext, msg: Forward, output: torch.Tensor, *, inputs_hash: bytes) -> list[object]:
        """The frames one step sends: the output onward (or, at the chain's end, to the
        requester), and a tap copy of it to the requester.

        A step whose `stop_layer` is this span's end stops here even if a next peer
        exists: that is a replay rebuilding this peer's cache after a failover, and the
        peers downstream already hold those positions.

        Every frame to the requester carries this peer's attestation of the step; the
        one that ends the step carries only a fingerprint when the step asked for that.
        A tap that does not end the step is not built here but returned as a `DeferredTap`
        after the onward frame: the server sends that frame first and seals and signs the
        tap after it, so the next peer's compute does not wait for the copy.
        """
        assert self.out is not None, "a session always has an outbound link"
        frames: list[object] = []
        last_hop = self.next_peer is None
        stops_here = last_hop or msg.stop_layer <= self.end
        # once, for both the onward frame and the tap; in a compact form, what is fingerprinted and
        # attested is what the receivers decode
        encoded, output = encode_wire(output, self.wire)
        if not stops_here:
            template = Forward(
                self.session_id, msg.step, self.out.link_id, 0, msg.start_pos, msg.n_tokens, msg.stop_layer, b"",
                reply=msg.reply,
            )
            frames.append(seal_payload(self.out, template, encoded))
        to_requester = self.out if last_hop else self.tap
        if to_requester is None:
            return frames
        tap = DeferredTap(self, to_requester, msg, output, encoded, inputs_hash, ends_step=stops_here)
        frames.append(tap.seal(server.identity) if stops_here else tap)
        return frames


@dataclass(frozen=True)
class DeferredTap:
    """A step's frame to the requester, built on demand: fingerprint, attestation, seal.

    The cipher's counter is taken when `seal` runs, so taps of one link must be sealed
    in step order (one worker per session does that) — the requester's replay window
    rejects nothing it would have accepted before.
    """

    session: ServedSession
    cipher: LinkCipher
    msg: Forward
    output: torch.Tensor
    encoded: bytes
    inputs_hash: bytes
    ends_step: bool  # the step's last frame: it carries only a fingerprint when the step asked for that

    def seal(self, identity: Identity) -> Result:
        """Raises CipherClosed (the session ended meanwhile), CounterExhausted."""
        session, msg = self.session, self.msg
        fingerprint = fingerprint_bytes(self.output)
        outputs_hash = sha256(fingerprint)
        attestation = sign_attestation(identity, Attestation(
            identity.peer_id, session.session_id, msg.step, msg.start_pos, msg.n_tokens,
            session.start, session.end, self.inputs_hash, outputs_hash,
        ))
        template = Result(session.session_id, msg.step, self.cipher.link_id, 0, msg.start_pos, msg.n_tokens, b"",
                          inputs_hash=self.inputs_hash, outputs_hash=outputs_hash, attestation=attestation)
        if self.ends_step and msg.reply == REPLY_FINGERPRINT:
            return seal_payload(self.cipher, template, fingerprint)
        return seal_payload(self.cipher, template, self.encoded)


def compute_batch(
    server: ComputeContext, jobs: list[tuple[ServedSession, Forward]]
) -> tuple[list[list[object] | Exception], float]:
    """Several sessions' steps as ONE stacked forward (in a worker thread; see peer/serve/batcher.py).

    Returns, per job in order, its frames or the error that step alone raised (a bad
    frame, a shape, a context overflow, NaN/Inf — or anything else one session's input
    or output raised: it is that session's to raise, not its batch's), and the compute
    seconds of the batch.
    """
    outcomes: list[list[object] | Exception | None] = [None] * len(jobs)
    ready: list[tuple[int, torch.Tensor, bytes]] = []
    for i, (session, msg) in enumerate(jobs):
        try:
            ready.append((i, *session.prepare(server, msg)))
        except Exception as bad:  # returned to its own session's task, which raises it
            outcomes[i] = bad
    started = time.perf_counter()
    outputs = server.stage.forward_batch(
        [(jobs[i][0].session_id, hidden, jobs[i][1].start_pos) for i, hidden, _ in ready]
    )
    elapsed = time.perf_counter() - started
    for (i, _, inputs_hash), output in zip(ready, outputs):
        session, msg = jobs[i]
        try:
            if isinstance(output, StageError):
                raise output
            outcomes[i] = session.finish(server, msg, output, inputs_hash)
        except Exception as bad:  # as above
            outcomes[i] = bad
    assert all(o is not None for o in outcomes), "every job has frames or an error"
    return outcomes, elapsed  # type: ignore[return-value]
