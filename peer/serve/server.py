"""The stage server: serves a span of layers to requesters' sessions.

Two protocols: `SESSION_PROTOCOL`, a stream the requester opens for each session
(open, control, inputs when we are first, results when we are last, taps), and
`LINK_PROTOCOL`, a stream the previous peer of a chain opens to push its output
to us. Limits are explicit and checked before anything is allocated: sessions
at once, sessions per requester, context length, KV-cache bytes, rows and wait of a
batch of steps (peer/serve/batcher.py: the steps of sessions that arrive together run
as one stacked forward). A peer that
sends garbage gets an error message and loses its stream; every other session
goes on.
"""

from __future__ import annotations

import logging
import time
from typing import Awaitable, Callable

import torch
import trio

from tessera.protocol.errors import WireError
from tessera.protocol.keys import Identity
from tessera.protocol.messages import (
    Cancel, ErrorMsg, Forward, LinkHello, Relink, SessionAccept, SessionClose, SessionOpen, SessionRevoke,
)
from tessera.protocol.tensors import DEFAULT_LIMITS, TensorLimits
from tessera.stages.errors import StageError
from tessera.stages.stage import Stage
from tessera.store.trace import NullTracer, Tracer, now as trace_now
from tessera.store import events

from tessera.peer.base.errors import PeerError, StreamClosed
from tessera.peer.net.verified import peer_id_str
from tessera.peer.serve.session import DeferredTap, ServedSession, compute_batch
from tessera.protocol.error_codes import (
    BAD_FRAME, BAD_REQUEST, BAD_SPAN, BUSY, COMPUTE_FAILED, DRAINING, NEXT_HOP_FAILED, TOO_LONG,
)
from tessera.peer.serve.limits import (
    LINK_WAIT, OPEN_TIMEOUT, REAPER_INTERVAL, Refused, ServerLimits, ServerStats,
)
from tessera.peer.serve.batcher import BatchBudget, BatchInterrupted, StepBatcher
from tessera.peer.base.protocols import LINK_PROTOCOL, SESSION_PROTOCOL
from tessera.peer.base.threads import in_worker
from tessera.peer.net.transport import Channel, Stream, Transport, receive_link_hello

log = logging.getLogger(__name__)

# Why a session ended when its requester revoked this peer from it (SessionRevoke).
REVOKED = "revoked by the requester"


class StageServer:
    """Serves `stage` to sessions over `transport`."""

    # What `admit` builds for a session; a tensor-shard peer's server builds its own kind
    # (peer/serve/shard_server.py).
    session_class: type[ServedSession] = ServedSession

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
        self.compute_lock = trio.Lock()
        self.accepting = True
        self.stats = ServerStats()
        self.tamper: Callable[[torch.Tensor], torch.Tensor] = lambda t: t  # fault injection (tests, demos)
        # How a step's compute runs: in a worker thread, so that heartbeats and stream reads
        # never stall (and nothing of a step is freed there: peer/base/threads.py). A simulation
        # swaps in a cost model that advances trio's MockClock.
        self.run_compute: Callable[[Callable[[], object]], Awaitable[object]] = in_worker
        # Steps of different sessions queued together run as one stacked forward (peer/serve/batcher.py).
        self.batcher = StepBatcher(self._run_batch, BatchBudget(self.limits.batch_rows, self.limits.batch_wait))
        self.emptied = trio.Event()
        self.running = trio.Event()  # cleared while the operator has paused compute
        self.running.set()
        transport.set_handler(SESSION_PROTOCOL, self.handle_session)
        transport.set_handler(LINK_PROTOCOL, self.handle_link)

    @property
    def load(self) -> float:
        return len(self.sessions) / max(self.limits.max_sessions, 1)

    def kv_in_use(self) -> int:
        return sum(self.stage.session_bytes(s.capacity, s.end - s.start) for s in self.sessions.values())

    # -- admission ----------------------------------------------------------------

    def admit(self, msg: SessionOpen, channel: Channel) -> ServedSession:
        """Check limits and keys, allocate the KV cache. Raises Refused."""
        requester = channel.remote
        if not self.accepting:
            raise Refused(DRAINING, "this peer is draining and takes no new sessions")
        if msg.session_id in self.sessions:
            raise Refused(BAD_REQUEST, f"session {msg.session_id.hex()} is already open here")
        if len(self.sessions) >= self.limits.max_sessions:
            raise Refused(BUSY, f"{len(self.sessions)} sessions open, the limit is {self.limits.max_sessions}")
        mine = sum(1 for s in self.sessions.values() if s.requester == requester)
        if mine >= self.limits.max_sessions_per_requester:
            raise Refused(BUSY, f"requester has {mine} sessions here, the limit is {self.limits.max_sessions_per_requester}")
        if not self.stage.start <= msg.start < msg.end <= self.stage.end:
            raise Refused(BAD_SPAN, f"layers [{msg.start}, {msg.end}) asked, this peer serves [{self.stage.start}, {self.stage.end})")
        max_length = min(self.limits.max_length, self.stage.spec.max_position)
        if msg.max_length > max_length:
            raise Refused(TOO_LONG, f"max_length {msg.max_length} exceeds this peer's limit of {max_length}")
        need = self.stage.session_bytes(msg.max_length, msg.end - msg.start)
        if self.kv_in_use() + need > self.limits.kv_budget:
            raise Refused(TOO_LONG, f"{need} more bytes of KV cache would exceed the budget of {self.limits.kv_budget}")
        session = self.session_class(
            session_id=msg.session_id, requester=requester, start=msg.start, end=msg.end,
            capacity=msg.max_length, control=channel, ephemeral_public=msg.ephemeral_public,
        )
        try:
            prev = peer_id_str(msg.prev_peer) if msg.prev_peer is not None else requester
            session.add_inbound(self.identity, msg.in_key, prev)
            if msg.inject_key is not None:
                session.add_inbound(self.identity, msg.inject_key, requester)
            session.set_outbound(self.identity, msg.out_key)
            if msg.tap_key is not None:
                session.set_tap(self.identity, msg.tap_key)
        except WireError as bad:
            raise Refused(BAD_REQUEST, f"cannot open the session keys: {bad}") from None
        session.next_peer = peer_id_str(msg.next_peer) if msg.next_peer is not None else None
        session.next_addrs = tuple(msg.next_addrs)
        self.stage.open(msg.session_id, capacity=msg.max_length, start=msg.start, end=msg.end)
        self.sessions[msg.session_id] = session
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
        self.batcher.forget(session.session_id)
        self.sessions.pop(session.session_id, None)
        if not self.sessions:
            self.emptied.set()
            self.emptied = trio.Event()
        self.tracer.emit(events.SessionClose(session=session.session_id, span=(session.start, session.end),
                                             reason=reason, steps=session.steps, tokens=session.tokens))

    # -- the requester's stream ---------------------------------------------------

    async def handle_session(self, stream: Stream) -> None:
        channel = Channel(stream)
        session = await self.accept(channel, SessionOpen, self.admit, self._drop_refused)
        if session is None:
            return
        onward = session.next_channel
        self.tracer.emit(events.SessionOpen(session=session.session_id, span=(session.start, session.end),
                                            remote=session.requester, next=session.next_peer, capacity=session.capacity,
                                            via=stream.via, next_via=onward.stream.via if onward is not None else None))
        reason = "requester closed"
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._work, session)
                reason = await self._read_control(session)
                nursery.cancel_scope.cancel()
        finally:
            self.drop(session, reason)
            if session.revoked:  # the confirmation: KV cache and keys are gone, nothing more is read
                self.tracer.emit(events.SessionRevoked(session=session.session_id, span=(session.start, session.end),
                                                       remote=session.requester, steps=session.steps, tokens=session.tokens))
            with trio.CancelScope(shield=True):
                await channel.close()

    async def accept(self, channel: Channel, kind: type, admit: Callable, forget: Callable[..., Awaitable[None]]):
        """Read the opening message (of type `kind`), admit it, connect the next hop and
        answer SessionAccept; or refuse with a code, `forget` what was set up, and return None.
        (Shared by plain sessions and tensor-shard sessions, peer/serve/shard_server.py.)"""
        session = None
        try:
            with trio.fail_after(OPEN_TIMEOUT):
                msg = await channel.receive()
                if not isinstance(msg, kind):
                    raise Refused(BAD_REQUEST, f"expected {kind.__name__}, got {type(msg).__name__}")
                session = admit(msg, channel)
                await session.connect_next(self)
                await channel.send(SessionAccept(msg.session_id, msg.max_length))
            return session
        except Refused as refusal:
            code, message = refusal.code, str(refusal)
        except (trio.TooSlowError, PeerError, WireError, StageError) as bad:
            # admitted, then failed: the next hop could not be reached
            code = NEXT_HOP_FAILED if session is not None else BAD_REQUEST
            message = f"{type(bad).__name__}: {bad}"
        self.stats.refused += 1
        await self._refuse(channel, code, message, getattr(session, "session_id", None))
        await forget(session, code)
        return None

    async def _drop_refused(self, session: ServedSession | None, reason: str) -> None:
        if session is not None:
            self.drop(session, reason)

    async def _refuse(self, channel: Channel, code: str, message: str, session_id: bytes | None) -> None:
        try:
            with trio.move_on_after(OPEN_TIMEOUT):
                await channel.send(ErrorMsg(code, message[:1000], session_id))
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
            session.last_active = time.monotonic()
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
                        prev = peer_id_str(msg.prev_peer) if msg.prev_peer is not None else session.requester
                        session.add_inbound(self.identity, msg.in_key, prev)
                except WireError as bad:
                    await self._error(session, BAD_REQUEST, f"relink keys: {bad}")
                    continue
                await session.queue_in.send(msg)
            elif isinstance(msg, Forward):
                if session.link_sources.get(msg.link_id) != session.requester:
                    await self._error(session, BAD_FRAME, f"link {msg.link_id} does not come from the requester")
                    continue
                self.tracer.emit(events.Receive(session=msg.session_id, step=msg.step, remote=session.requester,
                                                bytes=len(msg.payload), span=(session.start, session.end)))
                await session.queue_in.send(msg)
            else:
                await self._error(session, BAD_REQUEST, f"unexpected {type(msg).__name__} on a session stream")

    # -- the previous peer's stream -----------------------------------------------

    async def handle_link(self, stream: Stream) -> None:
        channel = Channel(stream)
        try:
            with trio.fail_after(LINK_WAIT):
                hello = await receive_link_hello(channel)
                session = await self._wait_for_link(hello)
        except (trio.TooSlowError, PeerError, WireError) as bad:
            log.debug("link from %s refused: %s", stream.remote, bad)
            await channel.reset()  # a link we cannot place carries nothing we could use
            return
        if session.link_sources.get(hello.link_id) != stream.remote:
            await channel.reset()  # only the peer the requester named may feed this link
            return
        with trio.CancelScope() as reading:  # cancelled when the session is dropped (see drop)
            session.link_scopes.append(reading)
            while not session.closed:
                try:
                    msg = await channel.receive()
                except StreamClosed:
                    return  # the previous peer left; the requester will relink us
                except WireError as bad:
                    await self._error(session, BAD_FRAME, f"from {stream.remote}: {bad}")
                    await channel.reset()
                    return
                if not isinstance(msg, Forward) or msg.link_id != hello.link_id:
                    await self._error(session, BAD_FRAME, f"unexpected {type(msg).__name__} on link {hello.link_id}")
                    await channel.reset()
                    return
                session.last_active = time.monotonic()
                self.tracer.emit(events.Receive(session=msg.session_id, step=msg.step, remote=stream.remote,
                                                bytes=len(msg.payload), span=(session.start, session.end)))
                await session.queue_in.send(msg)

    async def _wait_for_link(self, hello: LinkHello) -> ServedSession:
        while True:
            session = self.sessions.get(hello.session_id)
            if session is not None and hello.link_id in session.inbound:
                return session
            waiter = session.registered if session is not None else self.session_added
            await waiter.wait()

    # -- the work -----------------------------------------------------------------

    async def _work(self, session: ServedSession) -> None:
        async for msg in session.queue_out:
            if isinstance(msg, Relink):
                await self._relink(session, msg)
            elif isinstance(msg, Forward):
                if msg.step in session.cancelled:
                    session.cancelled.discard(msg.step)
                    continue
                await self._step(session, msg)

    async def _relink(self, session: ServedSession, msg: Relink) -> None:
        try:
            if msg.out_key is not None:
                session.set_outbound(self.identity, msg.out_key)
                session.next_peer = peer_id_str(msg.next_peer) if msg.next_peer is not None else None
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
        await self.running.wait()
        try:
            if self.batching:
                frames, seconds, batch = await self.batcher.submit(session.session_id, (session, msg), msg.n_tokens)
            else:
                async with self.compute_lock:
                    frames, seconds = await self.run_compute(lambda: session.compute(self, msg))
                batch = 1
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

    @property
    def batching(self) -> bool:
        """Whether steps of different sessions run stacked: a budget over one row, and a stage
        that can (a tensor-shard rank or a simulated stage runs each step alone)."""
        return self.limits.batch_rows > 1 and isinstance(self.stage, Stage)

    async def _run_batch(self, jobs: list[tuple[ServedSession, Forward]]) -> list[object]:
        """The batcher's compute: one stacked forward in a worker thread; per job (frames,
        seconds of the batch, batch size) or that job's own error."""
        async with self.compute_lock:
            outcomes, seconds = await self.run_compute(lambda: compute_batch(self, jobs))
        return [o if isinstance(o, Exception) else (o, seconds, len(jobs)) for o in outcomes]

    async def _error(self, session: ServedSession, code: str, message: str) -> None:
        self.stats.errors += 1
        self.tracer.emit(events.Error(session=session.session_id, code=code, message=message[:500]))
        try:
            await session.control.send(ErrorMsg(code, message[:1000], session.session_id))
        except PeerError:
            pass  # the requester is gone; its session ends when the control reader notices

    # -- housekeeping -------------------------------------------------------------

    async def reap_idle(self) -> None:
        """Drop sessions idle past the limit (a requester that vanished without closing)."""
        while True:
            await trio.sleep(REAPER_INTERVAL)
            cutoff = time.monotonic() - self.limits.idle_timeout
            for session in [s for s in self.sessions.values() if s.last_active < cutoff]:
                await self._error(session, BAD_REQUEST, "idle timeout")
                self.drop(session, "idle timeout")
                await session.control.reset()

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
