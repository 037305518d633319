"""The stage server: serves a span of layers to requesters' sessions.

Two protocols: `SESSION_PROTOCOL`, a stream the requester opens for each session
(open, control, inputs when we are first, results when we are last, taps), and
`LINK_PROTOCOL`, a stream the previous peer of a chain opens to push its output
to us. Limits are explicit and checked before anything is allocated: sessions
at once, sessions per requester, context length, KV-cache bytes (charged as a session
grows), rows and wait of a batch of steps (peer/serve/batcher.py: the steps of sessions
that arrive together run as one stacked forward). Who is admitted when the peer is
full, and whose idle session gives way, is peer/serve/admission.py's.

Bounded before admitted: a stream's first frame is read with a small limit
(protocol/admission.py `OPEN_FRAME_LIMIT` for an open request, `LINK_FRAME_LIMIT` for a link
hello), and only once its session is admitted do its streams read frames up to what the
session's declared `max_length` allows a step to carry. Until then a stream holds a place
among the peer's unadmitted streams, every protocol together (peer/net/intake.py: per
identity, per address, in all, and a budget of bytes, shared fairly among identities); an
open that finds no room, or loses its place to a newcomer of a lighter identity, is told
`BUSY` with a retry-after — a refusal, which its requester never counts as a strike.
A peer that sends garbage gets an error message and loses its stream; every other
session goes on.
"""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

import torch
import trio

from tessera.protocol.admission import LINK_FRAME_LIMIT, OPEN_FRAME_LIMIT, has_work, session_frame_limit
from tessera.protocol.errors import WireError
from tessera.protocol.keys import Identity
from tessera.protocol.messages import (
    Cancel, ErrorMsg, Forward, LinkHello, LoadReport, QueueNotice, Relink, SessionAccept, SessionClose, SessionOpen,
    SessionRevoke,
)
from tessera.protocol.shards import ShardOpen
from tessera.protocol.tensors import DEFAULT_LIMITS, TensorLimits
from tessera.stages.errors import StageError
from tessera.stages.engine.stage import Stage
from tessera.stages.layers.cache import kv_positions
from tessera.store.trace import NullTracer, Tracer, now as trace_now
from tessera.store import events

from tessera.peer.base.errors import PeerError, StreamClosed
from tessera.peer.base.ids import peer_id_bytes, peer_id_text
from tessera.peer.serve.session import DeferredTap, ServedSession
from tessera.protocol.error_codes import (
    BAD_FRAME, BAD_REQUEST, BAD_SPAN, BUSY, COMPUTE_FAILED, DRAINING, LEAVING, NEXT_HOP_FAILED, QUEUE_LONGER, RECLAIMED,
    TOO_LONG,
)
from tessera.peer.serve.admission import Admission, Limits, Refused
from tessera.peer.serve.limits import ACCEPT_TIMEOUT, LINK_WAIT, OPEN_TIMEOUT, REAPER_INTERVAL, ServerLimits, ServerStats
from tessera.peer.serve.batcher import BatchBudget, BatchInterrupted
from tessera.peer.serve.compute import StepCompute
from tessera.peer.base.protocols import LINK_PROTOCOL, SESSION_PROTOCOL
from tessera.peer.base.quick import send_quick, wait_set
from tessera.peer.base.threads import in_worker
from tessera.peer.net.intake import RETRY_AFTER as NO_ROOM_RETRY_AFTER, NoRoom, Ticket
from tessera.peer.net.transport import Channel, Stream, Transport, receive_link_hello

log = logging.getLogger(__name__)

# Why a session ended when its requester revoked this peer from it (SessionRevoke).
REVOKED = "revoked by the requester"
# How long telling an evicted session's requester why may take (it may be gone or stalled).
EVICT_NOTICE_TIMEOUT = 2.0
# What an open that found no place among the unadmitted streams is told (peer/net/intake.py).
NO_ROOM = "no room for another stream not admitted yet; try again shortly"


async def close_quietly(channel: Channel) -> None:
    """Close a stream we are done with; one the other side already reset (or a stalled one) is let go."""
    with trio.CancelScope(shield=True), trio.move_on_after(EVICT_NOTICE_TIMEOUT):
        try:
            await channel.close()
        except PeerError:
            pass  # already gone


class StageServer:
    """Serves `stage` to sessions over `transport`."""

    # What `admit` builds for a session; a tensor-shard peer's server builds its own kind
    # (peer/serve/shard_server.py).
    session_class: type[ServedSession] = ServedSession
    # Whether steps take turns at the compute (peer/serve/compute.py); a tensor-shard rank's do not
    # (peer/serve/shard_server.py says why).
    exclusive_compute = True

    def __init__(
        self,
        transport: Transport,
        identity: Identity,
        stage: Stage,
        *,
        limits: ServerLimits | None = None,
        tracer: Tracer | None = None,
        ledger: Callable[[str, int, int], None] | None = None,
        tensor_limits: TensorLimits = DEFAULT_LIMITS,
    ) -> None:
        self.transport = transport
        self.identity = identity
        self.stage = stage
        self.limits = limits or ServerLimits()
        self.tracer = tracer or NullTracer()
        self.ledger = ledger  # (requester, layer_tokens, bytes) per step
        self.tensor_limits = tensor_limits
        self.sessions: dict[bytes, ServedSession] = {}
        self.session_added = trio.Event()
        self.accepting = True
        self.leaving = False  # the peer is leaving the swarm: opens are refused as LEAVING, not DRAINING
        self.stats = ServerStats()
        self.tamper: Callable[[torch.Tensor], torch.Tensor] = lambda t: t  # fault injection (tests, demos)
        # How a step's compute runs: in a worker thread, so that heartbeats and stream reads
        # never stall (and nothing of a step is freed there: peer/base/threads.py). A simulation
        # swaps in a cost model that advances trio's MockClock.
        self.run_compute: Callable[[Callable[[], object]], Awaitable[object]] = in_worker
        # Who computes next, and how: in turns fairly among requesters, or batched (peer/serve/compute.py).
        self.compute = StepCompute(self, budget=BatchBudget(self.limits.batch_rows, self.limits.batch_wait),
                                   exclusive=self.exclusive_compute, notice=self._notice)
        self.emptied = trio.Event()
        self.running = trio.Event()  # cleared while the operator has paused compute
        self.running.set()
        self.admission = Admission(self, Limits(
            max_sessions=self.limits.max_sessions, max_sessions_per_requester=self.limits.max_sessions_per_requester,
            kv_budget=self.limits.kv_budget,
        ))
        self.intake = transport.intake  # streams not admitted yet, with every other protocol's
        transport.set_handler(SESSION_PROTOCOL, self.handle_session)
        transport.set_handler(LINK_PROTOCOL, self.handle_link)

    @property
    def load(self) -> float:
        """The share of session slots a newcomer could not have now (what the record advertises):
        sessions held idle past their grace are room, not load (admission.py `Admission.held`)."""
        return self.admission.held(self.admission.clock()) / max(self.limits.max_sessions, 1)

    def load_report(self, *, to: ServedSession | None = None) -> LoadReport:
        """How busy this peer is now, as its answers say it (peer/serve/load.py); `to`: the session
        being accepted, whose own prompt is no wait for it."""
        queue = self.compute.queue
        # prompts on their way: sessions admitted that have not sent their first step
        pending = sum(1 for s in self.sessions.values() if not s.stepped and not s.inflight and s is not to)
        wait = queue.expected_wait(pending=pending)
        return LoadReport(sessions=self.admission.held(self.admission.clock()), max_sessions=self.limits.max_sessions,
                          waiting_opens=len(self.admission.waiting), steps_waiting=queue.steps_waiting(),
                          wait=round(min(wait, 3600.0), 3))

    def kv_in_use(self) -> int:
        """KV bytes charged to the open sessions: what their caches have grown to."""
        return sum(s.kv_bytes for s in self.sessions.values())

    # -- admission ----------------------------------------------------------------

    def first_charge(self, msg: SessionOpen) -> int:
        """KV bytes a session is charged when admitted: its first chunk of positions."""
        return self.stage.session_bytes(kv_positions(1, msg.max_length), msg.start, msg.end)

    def check_open(self, msg: SessionOpen | ShardOpen) -> None:
        """What an open asks, against what this peer serves, before any wait or allocation. Raises Refused."""
        if self.leaving:
            raise Refused(LEAVING, "this peer is leaving the swarm and takes no new sessions")
        if not self.accepting:
            raise Refused(DRAINING, "this peer is draining and takes no new sessions")
        if msg.session_id in self.sessions:
            raise Refused(BAD_REQUEST, f"session {msg.session_id.hex()} is already open here")
        if not self.stage.start <= msg.start < msg.end <= self.stage.end:
            raise Refused(BAD_SPAN, f"layers [{msg.start}, {msg.end}) asked, this peer serves [{self.stage.start}, {self.stage.end})")
        max_length = min(self.limits.max_length, self.stage.spec.max_position)
        if msg.max_length > max_length:
            raise Refused(TOO_LONG, f"max_length {msg.max_length} exceeds this peer's limit of {max_length}")
        # A shard's open carries no wire form (its ranks exchange partial sums, not hops).
        if isinstance(msg, SessionOpen) and msg.wire_form == "fp8" and self.stage.spec.hop_id_digits:
            raise Refused(BAD_REQUEST, f"the fp8 wire form rounds away the token ids this {self.stage.spec.family} "
                                       "model's hops carry (its hash layers route by them): ask for bfloat16 or exact")
        if self.first_charge(msg) > self.limits.kv_budget:
            raise Refused(TOO_LONG, f"{self.first_charge(msg)} bytes of KV cache exceed the budget of "
                                    f"{self.limits.kv_budget}")

    def check_queue(self, msg: SessionOpen | ShardOpen) -> None:
        """What the requester routed with (`max_wait`): a longer queue here is news it prices and
        routes again with, before this peer holds anything for it (peer/request/repair.py).
        Raises Refused(QUEUE_LONGER). A shard's open says none (a group's ranks are unpriced)."""
        if isinstance(msg, SessionOpen) and msg.max_wait is not None:
            wait = self.load_report().wait
            if wait > msg.max_wait:
                raise Refused(QUEUE_LONGER, f"a step would wait {wait:.1f} s in this peer's queue, longer than the "
                                            f"{msg.max_wait:g} s the route was priced with")

    async def make_room(self, msg: SessionOpen | ShardOpen, channel: Channel) -> None:
        """Wait (a bounded time) until the open's requester may have a session here; the
        caller admits it before its next checkpoint. Raises Refused. An open whose route was
        priced with a shorter queue than this peer's is refused first, without waiting for room
        it would not take."""
        self.check_open(msg)
        self.check_queue(msg)
        try:
            work = has_work(peer_id_bytes(channel.remote), msg.work)
        except ValueError:
            work = False  # a remote id that is not base58 (a test transport's name) proves nothing
        await self.admission.wait_for_room(channel.remote, self.first_charge(msg), work=work)

    def admit(self, msg: SessionOpen, channel: Channel) -> ServedSession:
        """Check limits and keys, open the session on the stage, charge its first KV chunk.
        Raises Refused. Room was made by `make_room` just before."""
        requester = channel.remote
        self.check_open(msg)
        mine = sum(1 for s in self.sessions.values() if s.requester == requester)
        if len(self.sessions) >= self.limits.max_sessions or mine >= self.limits.max_sessions_per_requester:
            raise Refused(BUSY, f"no room: {len(self.sessions)} sessions open here, {mine} of them this "
                                f"requester's", retry_after=self.admission.retry_after(
                                    self.admission.requester(requester), self.admission.clock()))
        self.check_queue(msg)  # (again: it may have grown while the open waited for room)
        session = self.session_class(
            session_id=msg.session_id, requester=requester, start=msg.start, end=msg.end,
            capacity=msg.max_length, control=channel, ephemeral_public=msg.ephemeral_public, wire=msg.wire_form,
        )
        try:
            prev = peer_id_text(msg.prev_peer) if msg.prev_peer is not None else requester
            session.add_inbound(self.identity, msg.in_key, prev)
            if msg.inject_key is not None:
                session.add_inbound(self.identity, msg.inject_key, requester)
            session.set_outbound(self.identity, msg.out_key)
            if msg.tap_key is not None:
                session.set_tap(self.identity, msg.tap_key)
        except WireError as bad:
            raise Refused(BAD_REQUEST, f"cannot open the session keys: {bad}") from None
        session.next_peer = peer_id_text(msg.next_peer) if msg.next_peer is not None else None
        session.next_addrs = tuple(msg.next_addrs)
        self.stage.open(msg.session_id, capacity=msg.max_length, start=msg.start, end=msg.end)
        session.kv_positions = kv_positions(1, msg.max_length)
        session.kv_bytes = self.first_charge(msg)
        session.opened_at = trio.current_time()
        # a token's hop a position, into its span or out of it, whichever is wider (ModelSpec.hop_width)
        widest = max(self.stage.spec.hop_width(msg.start), self.stage.spec.hop_width(msg.end))
        session.frame_limit = session_frame_limit(msg.max_length, widest)
        channel.max_frame = session.frame_limit  # admitted: its steps may come now
        self.sessions[msg.session_id] = session
        self.admission.opened(session)
        self.session_added.set()
        self.session_added = trio.Event()
        self.stats.sessions_opened += 1
        return session

    def drop(self, session: ServedSession, reason: str) -> None:
        if session.closed:
            return
        session.closed = True
        for scope in session.link_scopes:
            scope.cancel()  # read nothing more for it: a frame still on its way is discarded unread
        session.forget_keys()
        self.stage.close(session.session_id)
        self.compute.forget(session.session_id)
        self.sessions.pop(session.session_id, None)
        self.admission.closed(session)
        if not self.sessions:
            self.emptied.set()
            self.emptied = trio.Event()
        self.tracer.emit(events.SessionClose(session=session.session_id, span=(session.start, session.end),
                                             reason=reason, steps=session.steps, tokens=session.tokens))

    # -- the requester's stream ---------------------------------------------------

    async def handle_session(self, stream: Stream) -> None:
        session = await self.open_stream(stream, SessionOpen, OPEN_FRAME_LIMIT, self.admit, self._drop_refused)
        if session is None:
            return
        onward = session.next_channel
        self.tracer.emit(events.SessionOpen(session=session.session_id, span=(session.start, session.end),
                                            remote=session.requester, next=session.next_peer, capacity=session.capacity,
                                            via=stream.via, next_via=onward.stream.via if onward is not None else None))
        reason = "requester closed"
        try:
            with session.scope:  # cancelled by `evict`
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._work, session)
                    reason = await self._read_control(session)
                    nursery.cancel_scope.cancel()
        finally:
            if session.evicted is not None:
                reason = session.evicted[1]
            self.drop(session, reason)
            if session.revoked:  # the confirmation: KV cache and keys are gone, nothing more is read
                self.tracer.emit(events.SessionRevoked(session=session.session_id, span=(session.start, session.end),
                                                       remote=session.requester, steps=session.steps, tokens=session.tokens))
            with trio.CancelScope(shield=True):
                await self.end_stream(session)
            session.ended.set()  # its requester has been told (StageServer.hand_over waits for it)

    async def end_stream(self, session: ServedSession) -> None:
        """Close a session's streams: the link onward, and the requester's stream (an evicted
        session's requester is told why first, and when to come back; a notice that cannot
        be sent in time resets the stream)."""
        if session.next_channel is not None:
            await close_quietly(session.next_channel)
            session.next_channel = None
        if session.evicted is not None:
            code, why, retry_after = session.evicted
            with trio.move_on_after(EVICT_NOTICE_TIMEOUT) as notice:
                try:
                    await session.control.send(ErrorMsg(code, why[:1000], session.session_id, retry_after))
                except PeerError:
                    pass  # the requester is gone; nothing left to tell it
            if notice.cancelled_caught:
                await session.control.reset()  # a requester that does not read: no graceful end
                return
        await session.control.close()

    async def open_stream(self, stream: Stream, kind: type, frame_limit: int, admit: Callable,
                          forget: Callable[..., Awaitable[None]]):
        """A session stream from its arrival to its admission (`accept`), holding a place among the
        unadmitted streams (peer/net/intake.py) until then: one that finds no place, or loses it
        to a lighter identity, is told BUSY (a refusal, not a failure) and ended. The admitted
        session, or None. (Shared by plain and tensor-shard sessions, peer/serve/shard_server.py.)"""
        busy = ErrorMsg(BUSY, NO_ROOM, None, NO_ROOM_RETRY_AFTER)
        ticket = self.intake.enter(stream)
        if ticket is None:
            self.stats.unadmitted_refused += 1
            await self.intake.refuse(stream, busy, limit=frame_limit)
            return None
        session = None
        with ticket:
            channel = Channel(stream, max_frame=frame_limit, on_frame=ticket.charge)
            session = await self.accept(channel, kind, admit, forget, ticket)
        if ticket.evicted and session is None:  # a lighter identity's newcomer took its place
            self.stats.unadmitted_refused += 1
            await self.intake.refuse(stream, busy, limit=frame_limit)
        return session

    async def accept(self, channel: Channel, kind: type, admit: Callable, forget: Callable[..., Awaitable[None]],
                     ticket: Ticket):
        """Read the opening message (of type `kind`), wait for room, admit it (freeing `ticket`'s
        place among the unadmitted streams), connect the next hop and answer SessionAccept; or
        refuse with a code, `forget` what was set up, and return None."""
        session = None
        retry_after = None
        try:
            with trio.fail_after(ACCEPT_TIMEOUT):
                try:
                    msg = await channel.receive()
                except NoRoom as full:  # its frame did not fit the budget of unadmitted streams
                    log.debug("session stream from %s: %s", channel.remote, full)
                    raise Refused(BUSY, NO_ROOM, retry_after=NO_ROOM_RETRY_AFTER) from None
                except WireError as bad:
                    # not an open request (too big, not framed, not CBOR): nothing we say would be
                    # read, and a stream closed politely would still take what the sender pushes
                    # until its window runs out (py-libp2p buffers it); reset it unread
                    log.debug("session stream from %s refused: %s", channel.remote, bad)
                    self.stats.refused += 1
                    await channel.reset()
                    return None
                if not isinstance(msg, kind):
                    raise Refused(BAD_REQUEST, f"expected {kind.__name__}, got {type(msg).__name__}")
                await self.make_room(msg, channel)
                session = admit(msg, channel)
                ticket.release()  # admitted: no longer a stranger's stream
                channel.on_frame = None
                await session.connect_next(self)
                await channel.send(SessionAccept(msg.session_id, msg.max_length, load=self.load_report(to=session)))
            return session
        except Refused as refusal:
            code, message, retry_after = refusal.code, str(refusal), refusal.retry_after
        except (trio.TooSlowError, PeerError, WireError, StageError) as bad:
            # admitted, then failed: the next hop could not be reached
            code = NEXT_HOP_FAILED if session is not None else BAD_REQUEST
            message = f"{type(bad).__name__}: {bad}"
        self.stats.refused += 1
        await self._refuse(channel, code, message, getattr(session, "session_id", None), retry_after=retry_after)
        await forget(session, code)
        return None

    async def _drop_refused(self, session: ServedSession | None, reason: str) -> None:
        if session is not None:
            self.drop(session, reason)

    async def _refuse(self, channel: Channel, code: str, message: str, session_id: bytes | None,
                      *, retry_after: float | None = None) -> None:
        try:
            with trio.move_on_after(OPEN_TIMEOUT):
                # a refusal for lack of room (or of a short queue) says how full this peer is, as
                # well as when to come back
                load = self.load_report() if code in (BUSY, QUEUE_LONGER) else None
                await channel.send(ErrorMsg(code, message[:1000], session_id, retry_after, load))
                await channel.close()
        except PeerError:
            pass  # the requester is gone; nothing left to tell it

    async def _read_control(self, session: ServedSession) -> str:
        """Route the requester's messages until it closes; returns why the session ended."""
        channel = session.control
        while True:
            try:
                msg = await channel.receive()
            except StreamClosed:
                return "requester stream ended"
            except WireError as bad:
                return f"bad frame from requester: {bad}"
            if isinstance(msg, SessionClose):
                return msg.reason or "closed"
            if isinstance(msg, SessionRevoke):
                session.revoked = True
                return REVOKED
            if isinstance(msg, Cancel):
                session.cancelled.add(msg.step)
            elif isinstance(msg, Relink):
                try:
                    if msg.in_key is not None:
                        prev = peer_id_text(msg.prev_peer) if msg.prev_peer is not None else session.requester
                        session.add_inbound(self.identity, msg.in_key, prev)
                except WireError as bad:
                    await self._error(session, BAD_REQUEST, f"relink keys: {bad}")
                    continue
                await send_quick(session.queue_in, msg)
            elif isinstance(msg, Forward):
                if session.link_sources.get(msg.link_id) != session.requester:
                    await self._error(session, BAD_FRAME, f"link {msg.link_id} does not come from the requester")
                    continue
                self.tracer.emit(events.Receive(session=msg.session_id, step=msg.step, remote=session.requester,
                                                bytes=len(msg.payload), span=(session.start, session.end)))
                await self._queue_step(session, msg)
            else:
                await self._error(session, BAD_REQUEST, f"unexpected {type(msg).__name__} on a session stream")

    # -- the previous peer's stream -----------------------------------------------

    async def handle_link(self, stream: Stream) -> None:
        ticket = self.intake.enter(stream)
        if ticket is None:
            self.stats.unadmitted_refused += 1
            await stream.reset()  # no place among the streams not admitted yet (peer/net/intake.py)
            return
        session = None
        with ticket:  # a place until the link is placed; cancelled if a lighter identity takes it
            channel = Channel(stream, max_frame=LINK_FRAME_LIMIT, on_frame=ticket.charge)
            try:
                with trio.fail_after(LINK_WAIT):
                    hello = await receive_link_hello(channel)
                    session = await self._wait_for_link(hello)
            except (trio.TooSlowError, PeerError, WireError) as bad:
                log.debug("link from %s refused: %s", stream.remote, bad)
        if session is None:
            await channel.reset()  # a link we cannot place carries nothing we could use
            return
        channel.on_frame = None
        if session.link_sources.get(hello.link_id) != stream.remote:
            await channel.reset()  # only the peer the requester named may feed this link
            return
        channel.max_frame = session.frame_limit  # placed: the session's steps may come now
        with trio.CancelScope() as reading:  # cancelled when the session is dropped (see drop)
            session.link_scopes.append(reading)
            while not session.closed:
                try:
                    msg = await channel.receive()
                except StreamClosed:
                    break  # the previous peer left (or ended the session); the requester relinks us if need be
                except WireError as bad:
                    await self._error(session, BAD_FRAME, f"from {stream.remote}: {bad}")
                    await channel.reset()
                    return
                if not isinstance(msg, Forward) or msg.link_id != hello.link_id:
                    await self._error(session, BAD_FRAME, f"unexpected {type(msg).__name__} on link {hello.link_id}")
                    await channel.reset()
                    return
                self.tracer.emit(events.Receive(session=msg.session_id, step=msg.step, remote=stream.remote,
                                                bytes=len(msg.payload), span=(session.start, session.end)))
                await self._queue_step(session, msg)
        await close_quietly(channel)  # the link is over: a stream left open stays in its connection's tables

    async def _wait_for_link(self, hello: LinkHello) -> ServedSession:
        while True:
            session = self.sessions.get(hello.session_id)
            if session is not None and hello.link_id in session.inbound:
                return session
            waiter = session.registered if session is not None else self.session_added
            await waiter.wait()

    # -- the work -----------------------------------------------------------------

    async def _queue_step(self, session: ServedSession, msg: Forward) -> None:
        """A step arrived: the session is in use (only steps count: control frames do not keep a
        session from being reclaimed) and stays protected until the step has run."""
        session.inflight += 1
        self.admission.stepped(session)
        await send_quick(session.queue_in, msg)

    async def _work(self, session: ServedSession) -> None:
        async for msg in session.queue_out:
            if isinstance(msg, Relink):
                await self._relink(session, msg)
            elif isinstance(msg, Forward):
                try:
                    if msg.step in session.cancelled:
                        session.cancelled.discard(msg.step)
                        continue
                    await self._step(session, msg)
                finally:
                    session.inflight -= 1
                    self.admission.stepped(session)

    async def _relink(self, session: ServedSession, msg: Relink) -> None:
        try:
            if msg.out_key is not None:
                session.set_outbound(self.identity, msg.out_key)
                session.next_peer = peer_id_text(msg.next_peer) if msg.next_peer is not None else None
                session.next_addrs = tuple(msg.next_addrs)
                with trio.fail_after(OPEN_TIMEOUT):
                    await session.connect_next(self)
            await session.control.send(SessionAccept(session.session_id, session.capacity))
        except (WireError, PeerError, trio.TooSlowError) as bad:
            await self._error(session, NEXT_HOP_FAILED, f"relink: {type(bad).__name__}: {bad}")

    async def _step(self, session: ServedSession, msg: Forward) -> None:
        if msg.link_id not in session.inbound:
            await self._error(session, BAD_FRAME, f"step {msg.step} on unknown link {msg.link_id}")
            return
        try:
            self._grow(session, msg.start_pos + msg.n_tokens)
        except Refused as refusal:
            await self._error(session, refusal.code, f"step {msg.step}: {refusal}", retry_after=refusal.retry_after)
            return
        await self._compute_step(session, msg)

    def _grow(self, session: ServedSession, need: int) -> None:
        """Charge the KV chunks a step reaching position `need` needs (the cache grows by the same
        rule: stages/layers/cache.py `kv_positions`), reclaiming idle sessions if memory is short.
        Raises Refused (busy) when even that leaves too little; a step past the session's
        capacity is the stage's to refuse."""
        if need <= session.kv_positions or need > session.capacity:
            return
        positions = kv_positions(need, session.capacity)
        extra = self.stage.session_bytes(positions, session.start, session.end) - session.kv_bytes
        if not self.admission.make_room(extra, now=self.admission.clock(), slot=False, spare=session,
                                        asker=session.requester):
            raise Refused(BUSY, f"{extra} more bytes of KV cache would exceed the budget of {self.limits.kv_budget} "
                                f"({self.kv_in_use()} in use) and no session here is idle",
                          retry_after=self.admission.retry_after(self.admission.requester(session.requester),
                                                                 self.admission.clock()))
        session.kv_positions = positions
        session.kv_bytes += extra

    async def _compute_step(self, session: ServedSession, msg: Forward) -> None:
        await wait_set(self.running)
        try:
            frames, seconds, batch = await self.compute.run(session, msg)
        except (WireError, StageError, BatchInterrupted) as bad:
            code = BAD_FRAME if isinstance(bad, WireError) else COMPUTE_FAILED
            await self._error(session, code, f"step {msg.step}: {bad}")
            return
        computed = trace_now()  # the Forward event ends here; it is emitted after the push, off the critical path
        sent = await self._push(session, msg, frames)
        n_layers = session.end - session.start
        session.steps += 1
        session.tokens += msg.n_tokens
        self.stats.steps += 1
        self.stats.tokens += msg.n_tokens
        self.stats.layer_tokens += msg.n_tokens * n_layers
        self.stats.bytes_in += len(msg.payload)
        self.stats.bytes_out += sent
        self.tracer.emit(events.Forward(session=msg.session_id, step=msg.step, span=(session.start, session.end),
                                        duration=seconds, start_pos=msg.start_pos, n_tokens=msg.n_tokens, batch=batch),
                         wall=computed[0], mono_ns=computed[1])
        if self.ledger is not None:
            self.ledger(session.requester, msg.n_tokens * n_layers, len(msg.payload) + sent)

    async def _push(self, session: ServedSession, msg: Forward, frames: list[object]) -> int:
        """Send a step's frames: the onward one first, then (sealed only now) the tap. Returns the
        payload bytes sent; stops early when the session or its requester is gone."""
        sent = 0
        for frame in frames:
            if isinstance(frame, DeferredTap):
                try:
                    frame = frame.seal(self.identity)
                except WireError:
                    return sent  # the session ended meanwhile (its keys are forgotten): no one to tap
            sent += len(frame.payload)
            if isinstance(frame, Forward):
                try:
                    if session.next_channel is None:
                        raise StreamClosed("no link to the next peer")
                    wall, mono_ns = trace_now()  # a push is stamped as its send starts (store/trace.py)
                    await session.next_channel.send(frame)
                    self.tracer.emit(events.Push(session=msg.session_id, step=msg.step, remote=session.next_peer,
                                                 bytes=len(frame.payload), span=(session.start, session.end)),
                                     wall=wall, mono_ns=mono_ns)
                except PeerError as bad:
                    await self._error(session, NEXT_HOP_FAILED, f"push to {session.next_peer}: {bad}")
            else:
                try:
                    wall, mono_ns = trace_now()  # a push is stamped as its send starts (store/trace.py)
                    await session.control.send(frame)
                    self.tracer.emit(events.Push(session=msg.session_id, step=msg.step, remote=session.requester,
                                                 bytes=len(frame.payload), span=(session.start, session.end)),
                                     wall=wall, mono_ns=mono_ns)
                except PeerError:
                    return sent  # the requester is gone; the control reader ends the session
        return sent

    async def _notice(self, session: ServedSession, notice: QueueNotice) -> bool:
        """Tell a session's requester where its step is in the queue; False if it could not be told."""
        try:
            await session.control.send(notice)
        except PeerError:
            return False  # the requester is gone; its session ends when the control reader notices
        return True

    async def _error(self, session: ServedSession, code: str, message: str, *,
                     retry_after: float | None = None) -> None:
        self.stats.errors += 1
        self.tracer.emit(events.Error(session=session.session_id, code=code, message=message[:500]))
        try:
            await session.control.send(ErrorMsg(code, message[:1000], session.session_id, retry_after))
        except PeerError:
            pass  # the requester is gone; its session ends when the control reader notices

    # -- eviction -----------------------------------------------------------------

    def evict(self, session: ServedSession, code: str, why: str, *, retry_after: float | None = None) -> None:
        """End `session` now: its KV cache and slot are freed at once, and its serving task
        tells the requester (`code`, `why`) and resets the stream (handle_session)."""
        if session.closed:
            return
        session.evicted = (code, why, retry_after)
        self.tracer.emit(events.Error(session=session.session_id, code=code, message=why[:500]))
        self.drop(session, why)
        session.scope.cancel()

    def reclaim(self, session: ServedSession) -> None:
        """Admission's pressure valve: an idle session gives its room to another requester."""
        self.stats.reclaimed += 1
        self.evict(session, RECLAIMED, "reclaimed: idle while another requester needed its room",
                   retry_after=self.admission.limits.idle_grace)

    # -- housekeeping -------------------------------------------------------------

    async def reap_idle(self) -> None:
        """Drop sessions idle past `idle_timeout` even without pressure (a requester that
        vanished without closing); under pressure admission reclaims them much sooner."""
        while True:
            await trio.sleep(REAPER_INTERVAL)
            cutoff = self.admission.clock() - self.limits.idle_timeout
            for session in [s for s in self.sessions.values() if not s.inflight and s.last_active < cutoff]:
                self.evict(session, BAD_REQUEST, "idle timeout")

    def pause(self) -> None:
        """Hold every step and take no new sessions (running sessions' requesters will fail over)."""
        self.accepting = False
        if self.running.is_set():
            self.running = trio.Event()

    def resume(self) -> None:
        self.accepting = True
        self.running.set()

    async def drain(self, grace: float) -> None:
        """Take no new sessions; wait up to `grace` seconds for running ones to finish."""
        self.accepting = False
        with trio.move_on_after(grace):
            while self.sessions:
                await self.emptied.wait()

    async def hand_over(self, why: str) -> int:
        """The peer is leaving: end every session still here, telling each requester LEAVING (go
        elsewhere now; no fault of ours), and return once their streams are closed (or the
        notices' time ran out), so that the host may close after them. Returns how many."""
        self.leaving = True
        self.accepting = False
        sessions = list(self.sessions.values())
        for session in sessions:
            self.evict(session, LEAVING, why)
        with trio.move_on_after(EVICT_NOTICE_TIMEOUT + 1.0):  # end_stream's own bound, plus its close
            for session in sessions:
                await session.ended.wait()
        return len(sessions)
