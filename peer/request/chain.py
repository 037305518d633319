"""One generation's chain of peers, as the requester drives it.

Opening: the requester picks a fresh X25519 key for the session and a fresh 32-byte key per link — requester ->
first peer, peer i -> peer i+1, last peer -> requester, and a tap link peer -> requester for every peer but the
last — and seals each to the peers at its ends (`tessera.protocol.links.seal_link_key`). The peers of a new route
are opened one by one, each told the queue the route was priced with (it refuses a longer one before holding
anything); the replacements of a repair all at once. A link stream that reaches a peer before its own
SessionOpen waits for it.

A step: the requester sends hidden states to the first peer; each peer pushes
its output straight to the next; the last returns to the requester. Taps carry
each span's output back too, off the critical path, into `RouteHistory`.

A `RouteSession` is a `Segment` (peer/request/ports.py): on its own it carries a
route of plain hops; inside a route with groups it carries one run of plain hops.
It reports the span its failed hops leave (`gap`: between their live neighbours)
and patches itself onto the route the repair loop chose for it (`patch`): the
replacements are rebuilt from the history and the neighbours relinked to them (the
steps are in peer/request/repair.py, which decides everything else).
"""

from __future__ import annotations

import os
import time
from typing import Callable, Mapping

import torch
import trio

from tessera.store import events
from tessera.store.trace import now as trace_now
from tessera.protocol.activations import open_payload, seal_payload
from tessera.protocol.errors import CipherClosed, WireError
from tessera.protocol.tensors import decode_tensor, encode_wire
from tessera.protocol.keys import EphemeralKey, public_key_from_peer_id
from tessera.protocol.links import Direction, LinkCipher, seal_link_key
from tessera.protocol.error_codes import NEXT_HOP_FAILED
from tessera.protocol.messages import (
    REPLY_FINGERPRINT, REPLY_FULL, Cancel, ErrorMsg, Forward, LoadReport, QueueNotice, Relink, Result, SealedKey,
    SessionAccept, SessionClose, SessionOpen, SessionRevoke,
)

from tessera.peer.base.backoff import ROUTE_WAIT, Failure
from tessera.peer.base.errors import OpenUnanswered, PeerError, PeerFailed, SessionRefused, StreamClosed
from tessera.peer.request.failures import error_failure, reported_failure
from tessera.peer.request.history import RouteHistory
from tessera.peer.request.loads import no_room, open_order
from tessera.peer.plan.routing import Hop, Route
from tessera.peer.request.chain_state import AttestedStep, HopState, RequesterContext, StepSlot, began_before, peer_bytes
from tessera.peer.request.ports import Gap, Replacement, Segment
from tessera.peer.base.protocols import SESSION_PROTOCOL
from tessera.peer.net.transport import Channel

# The dial to a peer, and apart its answer to SessionOpen (its wait for room and dial of its next hop):
# longer than the peer's bound on that (peer/serve/limits.py ACCEPT_TIMEOUT), so busy is not timed out.
OPEN_TIMEOUT = 15.0
# A step's deadline: this many times the advertised estimate, plus a floor for
# scheduling noise and a cold CPU cache. Generous on purpose: a false alarm costs a
# failover, a late alarm only a delay (see peer/request/repair.py).
STEP_TIMEOUT_FACTOR = 10.0
STEP_TIMEOUT_FLOOR = 5.0
# A step's deadline counts from when the peers start it: a peer that queues it behind other
# requesters' steps says so (QueueNotice: how long, and again when it starts; peer/serve/load.py),
# and the deadline moves by that wait (times QUEUE_WAIT_SLACK: a peer's estimate comes from its
# average step, and a queue of prefills runs longer than one of decodes), or to a full step's
# time from the start it reports. Queueing is not failing. QUEUE_WAIT_CAP bounds what notices may
# add, so a peer that keeps saying "queued" is a time-out all the same: two route waits, longer
# than going elsewhere costs (a route wait at worst, and a replay).
QUEUE_WAIT_SLACK = 2.0
QUEUE_WAIT_CAP = 2 * ROUTE_WAIT
CLOSE_TIMEOUT = 2.0
REVOKED = "revoked by the requester"  # the failure a revoked hop carries into the repair
# A live upstream peer's taps trail its pushes by one send; if they have not reached
# the failed step's position after this long, that peer is treated as failed too.
TAP_WAIT = 3.0
# A relink is one message and an ack from a live neighbour (which may dial the replacement).
RELINK_TIMEOUT = 10.0


class RouteSession:
    """A session over a route of peers; `step` runs hidden states through all of them."""

    def __init__(self, ctx: RequesterContext, route: Route, *, max_length: int, keep_history: bool = True) -> None:
        self.ctx = ctx
        self.route = route
        self.max_length = max_length
        self.session_id = os.urandom(16)
        self.ephemeral = EphemeralKey.generate()
        self.hops: list[HopState] = []
        self.history = RouteHistory(max_length, ctx.hop_width)
        self.keep_history = keep_history  # a spot checker's shadow session needs none
        self.pending: dict[int, StepSlot] = {}
        self.tap_arrived = trio.Event()  # set (and replaced) whenever a tap lands in the history
        self.retired_attestations: list[AttestedStep] = []  # of hops a failover replaced
        self._next_link = 0
        self._next_step = 0
        self.closed = False

    @property
    def hex(self) -> str:
        return self.session_id.hex()

    # -- as a Segment, and as a route of one segment (peer/request/ports.py) ------------

    @property
    def span(self) -> tuple[int, int]:
        return self.route.hops[0].start, self.route.hops[-1].end

    @property
    def route_hops(self) -> list[Hop]:
        return [h.hop for h in self.hops] if self.hops else list(self.route.hops)

    @property
    def peers(self) -> list[str]:
        return [h.peer for h in self.hops] if self.hops else list(self.route.peer_ids)

    @property
    def segments(self) -> list[Segment]:
        return [self]

    def checkable(self) -> RouteSession:
        return self  # every hop signs what it computed, and the history holds both its ends

    def splice(self, segment: Segment, replacement: Replacement) -> None:
        if segment is not self or replacement.segments != [self]:
            raise ValueError("a route of plain hops is patched in place (RouteSession.replace)")

    def repaired(self) -> Route:
        self.route = Route(tuple(h.hop for h in self.hops), self.route.cost_ms)
        return self.route

    async def replay_after(self, segments: list[Segment], hidden: torch.Tensor) -> torch.Tensor:
        return hidden  # nothing comes after the only segment

    async def revoke(self, peer: str) -> None:
        for state in [h for h in self.hops if h.peer == peer]:
            await self.revoke_hop(state)

    def new_link(self) -> tuple[int, bytes]:
        self._next_link += 1
        return self._next_link, os.urandom(32)

    def seal(self, link: tuple[int, bytes], peer: str) -> SealedKey:
        link_id, key = link
        return seal_link_key(
            key, session_id=self.session_id, link_id=link_id, sender=self.ephemeral,
            recipient_public_ed25519=public_key_from_peer_id(peer_bytes(peer)),
        )

    def cipher(self, link: tuple[int, bytes]) -> LinkCipher:
        return LinkCipher(link[1], session_id=self.session_id, link_id=link[0], direction=Direction.FORWARD)

    # -- opening --------------------------------------------------------------------

    async def open(self, *, began: float | None = None, max_waits: Mapping[str, float] | None = None) -> None:
        """Open every hop of the route (as `open_hops`). Raises SessionRefused or PeerFailed.
        `began`: when (trio's clock) the answer this session carries began, traced with the open."""
        self.hops, _, _ = await self.open_hops(list(self.route.hops), prev=None, next_=None, max_waits=max_waits)
        self.ctx.tracer.emit(events.SessionOpen(session=self.session_id,
                                                route=[[h.peer_id, h.start, h.end] for h in self.route.hops],
                                                max_length=self.max_length, began_before=began_before(began)))

    async def open_hops(
        self, hops: list[Hop], *, prev: str | None, next_: str | None, max_waits: Mapping[str, float] | None = None,
    ) -> tuple[list[HopState], tuple[int, bytes], tuple[int, bytes]]:
        """Open sessions on consecutive `hops`, linked among themselves: all at once, or, given
        `max_waits` (peer -> the queue it may have for the route to be worth its price), one by
        one, those likeliest to refuse first (loads.py `open_order`), each asked to refuse a longer
        queue (QUEUE_LONGER) before the rest are asked.

        The first hop is fed by `prev` (a peer id; None = this requester) and the last
        sends to `next_` (a peer id; None = this requester). When `prev` is a peer, the
        first hop also gets an inject link from the requester (to replay inputs into it).
        Returns the hop states and the boundary links (into the first, out of the last),
        whose keys the caller seals to `prev` / `next_` when relinking them.
        Raises SessionRefused or PeerFailed (every hop opened here is closed again).
        """
        into = [self.new_link() for _ in hops]  # link into hop i
        out_last = self.new_link()
        plans = []
        for i, hop in enumerate(hops):
            last = i + 1 == len(hops)
            out = out_last if last else into[i + 1]
            next_peer = (next_ if last else hops[i + 1].peer_id)
            prev_peer = (prev if i == 0 else hops[i - 1].peer_id)
            # every hop but the chain's last sends the requester a tap (a copy of its output)
            tap = self.new_link() if next_peer is not None else None
            inject = self.new_link() if i == 0 and prev is not None else None
            msg = SessionOpen(
                session_id=self.session_id, start=hop.start, end=hop.end, max_length=self.max_length,
                requester=self.ctx.identity.peer_id, ephemeral_public=self.ephemeral.public,
                in_key=self.seal(into[i], hop.peer_id), out_key=self.seal(out, hop.peer_id),
                next_peer=peer_bytes(next_peer) if next_peer is not None else None,
                next_addrs=self.ctx.keeper.addrs(next_peer) if next_peer is not None else (),
                tap_key=self.seal(tap, hop.peer_id) if tap else None,
                prev_peer=peer_bytes(prev_peer) if prev_peer is not None else None,
                inject_key=self.seal(inject, hop.peer_id) if inject else None, work=self.ctx.work,
                wire_form=self.ctx.wire, max_wait=None if max_waits is None else max_waits.get(hop.peer_id),
            )
            links = {
                "send": self.cipher(inject) if inject else (self.cipher(into[0]) if i == 0 else None),
                "tap": self.cipher(tap) if tap else None,
                "result": self.cipher(out_last) if last and next_ is None else None,
            }
            plans.append((hop, msg, links))
        results: list[HopState | BaseException | None] = [None] * len(plans)
        for hop in hops:  # counted from now, before any await: opens started at once spread out
            self.ctx.hold(hop.peer_id)

        async def open_one(i: int) -> None:
            hop, msg, links = plans[i]
            try:
                results[i] = await self._open_hop(hop, msg, **links)
            except (PeerError, WireError, trio.TooSlowError) as error:
                results[i] = error

        try:
            if max_waits is None:
                async with trio.open_nursery() as nursery:
                    for i in range(len(plans)):
                        nursery.start_soon(open_one, i)
            else:
                # one by one: a peer that refuses is asked before the others hold anything for a
                # route that is not taken (a round trip each, against a route opened and closed)
                for i in open_order(hops, self.ctx.loads.reported()):
                    await open_one(i)
                    if not isinstance(results[i], HopState):
                        break
        except BaseException:  # cancelled (the answer's deadline): nothing stays counted
            for i, r in enumerate(results):
                if isinstance(r, HopState):
                    self.ctx.release(r)
                else:
                    self.ctx.drop(plans[i][0].peer_id)
            raise
        opened = [r for r in results if isinstance(r, HopState)]
        failed = [(plans[i][0], r) for i, r in enumerate(results) if r is not None and not isinstance(r, HopState)]
        for i, r in enumerate(results):
            if not isinstance(r, HopState):  # failed, or not asked after one did
                self.ctx.drop(plans[i][0].peer_id)
        if failed:
            for state in opened:
                self.ctx.nursery.start_soon(self.close_hop, state, "a peer of the route refused")
            hop, error = blame(failed, hops, next_)
            if isinstance(error, (SessionRefused, PeerFailed)):
                raise error
            # anything else (unreachable, a stream that closed, a bad frame, a timeout) is
            # this hop failing: the caller bans it and routes around it
            raise PeerFailed(hop.peer_id, f"opening the session: {type(error).__name__}: {error}", error_failure(error))
        return opened, into[0], out_last

    async def _open_hop(self, hop: Hop, msg: SessionOpen, **links: LinkCipher | None) -> HopState:
        with trio.fail_after(OPEN_TIMEOUT):  # the dial, where not connected yet
            stream = await self.ctx.transport.open_stream(hop.peer_id, SESSION_PROTOCOL, addrs=self.ctx.keeper.addrs(hop.peer_id))
        with trio.fail_after(OPEN_TIMEOUT):  # the answer, from the stream's open: no slow dial takes the peer's time
            channel = Channel(stream)
            await channel.send(msg)
            reply = await receive_answer(channel, hop.peer_id)
        if isinstance(reply, ErrorMsg):
            await channel.close()
            self.ctx.loads.report(hop.peer_id, reply.load)  # a refusal for lack of room says how full
            raise SessionRefused(hop.peer_id, reply.code, reply.message, retry_after=reply.retry_after)
        if not isinstance(reply, SessionAccept) or reply.session_id != self.session_id:
            await channel.reset()
            raise PeerFailed(hop.peer_id, f"answered SessionOpen with {type(reply).__name__}", Failure.BROKE)
        self.ctx.loads.report(hop.peer_id, reply.load)
        state = HopState(hop, channel, accepted=reply.load, **links)
        self.ctx.nursery.start_soon(self._read, state)
        return state

    # -- receiving ------------------------------------------------------------------

    async def _read(self, state: HopState) -> None:
        """Route one peer's frames: results to waiting steps, taps to the history, errors to failures."""
        with state.scope:
            try:
                while True:
                    msg = await state.channel.receive()
                    if isinstance(msg, Result):
                        self._on_result(state, msg)
                    elif isinstance(msg, QueueNotice):
                        self._on_queued(state, msg)
                    elif isinstance(msg, ErrorMsg):
                        self._fail(state, f"{msg.code}: {msg.message}", code=msg.code)
                    elif isinstance(msg, SessionAccept):
                        state.acked.set()
                        state.acked = trio.Event()
                    else:
                        raise WireError(f"unexpected {type(msg).__name__} from a stage peer")
            except (PeerError, WireError) as error:
                if not self.closed:
                    self._fail(state, f"{type(error).__name__}: {error}", failure=error_failure(error))

    def _on_queued(self, state: HopState, msg: QueueNotice) -> None:
        """A peer says where a step of ours is in its queue: the step's deadline moves (`wait`),
        and routing hears of the peer's wait."""
        if msg.session_id != self.session_id:
            raise WireError("a queue notice for another session")
        if not msg.started:
            self.ctx.loads.queued(state.peer, msg.wait)
        slot = self.pending.get(msg.step)
        if slot is not None:
            slot.notice(state.peer, msg.started, msg.wait)

    def _on_result(self, state: HopState, msg: Result) -> None:
        """A tap or the chain's result: outputs go to the history (so the requester holds every
        span's output), the step's end to its waiting slot; the attestation is kept."""
        # paired with the peer's push (store/timeline.py): it puts the requester's clock on the timeline
        self.ctx.tracer.emit(events.Receive(session=self.session_id, step=msg.step, remote=state.peer,
                                            bytes=len(msg.payload)))
        is_tap = state.tap is not None and msg.link_id == state.tap.link_id
        cipher = state.tap if is_tap else state.result
        if cipher is None or msg.link_id != cipher.link_id:
            raise WireError(f"result on link {msg.link_id}, which is not one of this peer's")
        slot = self.pending.get(msg.step)
        ends_step = slot is not None and (slot.tap_from == state.peer if is_tap else slot.tap_from is None)
        payload = open_payload(cipher, msg)
        if msg.attestation:
            state.attested.append(AttestedStep.of(state, msg))
        if ends_step and slot.fingerprint:
            slot.complete_raw(payload)
            return
        hidden = decode_tensor(payload)
        if self.keep_history:
            self.history.at(state.hop.end).write(msg.start_pos, hidden)
        if is_tap:
            self.tap_arrived.set()
            self.tap_arrived = trio.Event()
        if ends_step:
            slot.complete(hidden)

    def _fail(self, state: HopState, reason: str, *, code: str | None = None, failure: Failure | None = None) -> None:
        """Mark a hop failed and wake every waiting step with the error (`failure`: its kind,
        else the kind `code`, the error the peer reported, says).

        A peer reporting that its push to the next peer failed is alive; the next peer
        is the one to blame.
        """
        failure = failure or reported_failure(code)
        if code == NEXT_HOP_FAILED and state in self.hops:
            index = self.hops.index(state)
            if index + 1 < len(self.hops):
                state = self.hops[index + 1]
                reason = f"unreachable from the previous peer: {reason}"
                if state.failure is None:  # (the next peer's own report, if first, says more)
                    # its link was reset: out of room for unadmitted streams, or gone (Bans.link_reset)
                    failure = self.ctx.link_reset(state.peer)
        if state.failure is None:
            state.failure = reason
            state.failed_as = failure
        state.acked.set()  # wake a relink waiting on this peer; it checks `failure`
        self.ctx.tracer.emit(events.Error(session=self.session_id, remote=state.peer, reason=reason[:300]))
        error = PeerFailed(state.peer, reason, failure)
        for slot in self.pending.values():
            slot.fail(error)

    # -- stepping -------------------------------------------------------------------

    def step_timeout(self, n_tokens: int, hops: list[Hop] | None = None) -> float:
        """A deadline from the hops' advertised speeds (not a fixed minute)."""
        view = self.ctx.keeper.snapshot()
        estimate = 0.0
        chosen = hops if hops is not None else [h.hop for h in self.hops]
        for hop in chosen:
            info = view.get(hop.peer_id)
            speed = info.throughput if info and info.throughput > 0 else 1.0
            estimate += hop.num_layers * n_tokens / speed
        estimate += len(chosen) * 0.1  # per-hop network allowance
        return STEP_TIMEOUT_FLOOR + STEP_TIMEOUT_FACTOR * estimate

    async def step(self, hidden: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Run hidden states [T, H] at positions [start_pos, start_pos + T) through the route.

        Returns the last hop's output [T, H]. Raises PeerFailed naming the peer that failed.
        """
        step, slot = await self.submit(hidden, start_pos)
        return await self.wait(step, slot, hidden.shape[0], start_pos)

    async def submit(self, hidden: torch.Tensor, start_pos: int) -> tuple[int, StepSlot]:
        """Send a step through the whole route without waiting for it. Raises PeerFailed."""
        first = self.hops[0]
        if self.keep_history:
            self.history.at(first.hop.start).write(start_pos, hidden)
        failed = next((h for h in self.hops if h.failure), None)
        if failed is not None:
            raise PeerFailed(failed.peer, failed.failure or "failed", failed.failed_as)
        return await self.send(first, hidden, start_pos, stop_layer=self.ctx.num_layers)

    async def run(
        self,
        first: HopState,
        hidden: torch.Tensor,
        start_pos: int,
        *,
        stop_layer: int,
        hops: list[Hop],
        tap_from: str | None = None,
    ) -> torch.Tensor:
        """Send one step into `first` and wait for its end: the chain's result, or — for a
        step that stops early (a replay) — the tap of the peer `tap_from` where it stops."""
        step, slot = await self.send(first, hidden, start_pos, stop_layer=stop_layer, tap_from=tap_from)
        return await self.wait(step, slot, hidden.shape[0], start_pos, hops=hops)

    async def send(
        self, first: HopState, hidden: torch.Tensor, start_pos: int, *, stop_layer: int,
        tap_from: str | None = None, reply: int = REPLY_FULL,
    ) -> tuple[int, StepSlot]:
        """Send one step without waiting (several may be in flight). Raises PeerFailed."""
        self._next_step += 1
        step = self._next_step
        slot = self.pending[step] = StepSlot(tap_from=tap_from, fingerprint=reply == REPLY_FINGERPRINT)
        slot.sent_at = time.perf_counter()
        n = hidden.shape[0]
        assert first.send is not None, "the requester feeds only the first hop or an injected one"
        template = Forward(self.session_id, step, first.send.link_id, 0, start_pos, n, stop_layer, b"", reply=reply)
        try:
            frame = seal_payload(first.send, template, encode_wire(hidden, self.ctx.wire)[0])
            wall, mono_ns = trace_now()  # a push is stamped as its send starts (store/trace.py)
            await first.channel.send(frame)
        except CipherClosed:
            # this requester closed its session there (close_hop forgot the keys) while a step
            # still took it for the route's first hop: a hop to replace, not the peer's fault
            # (it crashed a whole simulation: 30 peers, 250 answers, 50 requesters at load 0.8)
            self.pending.pop(step, None)
            if first.failure is None:
                first.failure, first.failed_as = "its session there was closed by this requester", Failure.REFUSED
            raise PeerFailed(first.peer, first.failure, first.failed_as) from None
        except PeerError as error:
            self.pending.pop(step, None)
            raise PeerFailed(first.peer, f"sending step {step}: {error}") from None
        self.ctx.tracer.emit(events.Push(session=self.session_id, step=step, remote=first.peer, bytes=len(frame.payload),
                                         start_pos=start_pos, n_tokens=n), wall=wall, mono_ns=mono_ns)
        return step, slot

    async def wait(self, step: int, slot: StepSlot, n: int, start_pos: int, *, hops: list[Hop] | None = None) -> torch.Tensor:
        """The end of a step sent with `send` (for a REPLY_FINGERPRINT step, the fingerprint
        bytes). Raises PeerFailed naming the peer that failed."""
        try:
            if not await self._until_done(slot, self.step_timeout(n, hops)):
                raise PeerFailed(self.suspect(start_pos + n), f"step {step} timed out", Failure.TIMED_OUT)
            if slot.error is not None:
                raise slot.error
            self.ctx.tracer.emit(events.Result(session=self.session_id, step=step, duration=time.perf_counter() - slot.sent_at,
                                               start_pos=start_pos, n_tokens=n))
            result = slot.raw if slot.fingerprint else slot.value
            assert result is not None
            return result  # type: ignore[return-value]
        finally:
            self.pending.pop(step, None)

    @staticmethod
    async def _until_done(slot: StepSlot, timeout: float) -> bool:
        """Wait for the step's end; False when its deadline passed first. The deadline is
        `timeout` from now, moved by what peers say of their queue (QUEUE_WAIT_SLACK) and
        never past QUEUE_WAIT_CAP beyond it."""
        now = trio.current_time()
        deadline, cap = now + timeout, now + timeout + QUEUE_WAIT_CAP
        while not slot.done.is_set():
            with trio.move_on_at(deadline):
                await slot.progress.wait()
            if slot.done.is_set():
                break
            if not slot.notices:
                return False  # the deadline passed
            now = trio.current_time()
            for _, started, wait in slot.notices:
                until = now + timeout if started else now + QUEUE_WAIT_SLACK * wait + timeout
                deadline = max(deadline, min(until, cap))
            slot.notices.clear()
            slot.progress = trio.Event()
        return True

    async def cancel(self, step: int) -> None:
        """Tell every hop to drop `step` if it has not run yet (a speculative block that became invalid)."""
        self.pending.pop(step, None)
        for state in self.hops:
            if state.revoked:
                continue  # a revoked peer gets no further frame for this session
            try:
                await state.channel.send(Cancel(self.session_id, step))
            except PeerError:
                pass  # a dead hop is the failover's business, not the cancel's

    def suspect(self, end_pos: int) -> str:
        """On a timeout: the first hop whose output (tap) for the step never arrived."""
        for state in self.hops[:-1]:
            if self.history.known(state.hop.end) < end_pos:
                return state.peer
        return self.hops[-1].peer

    # -- what the repair loop (ResilientSession.repair) reads and asks for -------------

    def failed_run(self, is_out: Callable[[str], bool]) -> tuple[int, int] | None:
        failed = [i for i, h in enumerate(self.hops) if h.failure or is_out(h.peer)]
        if not failed:
            return None
        j = failed[-1]
        i = j
        while i - 1 in failed:
            i -= 1
        return i, j

    async def wait_known(self, layer: int, position: int) -> bool:
        """Wait (briefly) until the inputs of `layer` are held for positions [0, position)."""
        with trio.move_on_after(TAP_WAIT):
            while self.history.known(layer) < position:
                await self.tap_arrived.wait()
        return self.history.known(layer) >= position

    async def inputs_ready(self, i: int, position: int) -> PeerFailed | None:
        if await self.wait_known(self.hops[i].hop.start, position):
            return None
        upstream = self.hops[i - 1]
        if upstream.failure is None:
            upstream.failure, upstream.failed_as = "its taps stopped arriving", Failure.TIMED_OUT
        return PeerFailed(upstream.peer, upstream.failure, upstream.failed_as)

    def failures(self, i: int, j: int) -> list[PeerFailed]:
        return [PeerFailed(h.peer, h.failure, h.failed_as) for h in self.hops[i : j + 1] if h.failure]

    def said(self) -> dict[str, LoadReport]:
        return {h.peer: h.accepted for h in self.hops if h.accepted is not None}

    def gap(self, i: int, j: int) -> Gap:
        """Hops i..j (layers [a, b)), between their live neighbours. The live peers of this
        session stay out of the new route: a peer runs one hop of a session (its id is the
        session's), so one already in the route cannot take another piece ("session ... is
        already open here" failed simulated answers)."""
        hops = self.hops
        dead = hops[i : j + 1]
        return Gap(
            hops[i].hop.start, hops[j].hop.end,
            source=hops[i - 1].peer if i > 0 else None, sink=hops[j + 1].peer if j + 1 < len(hops) else None,
            exclude=tuple(h.peer for h in hops if h not in dead),
            in_place=True, groups=False,  # replacements are chained peer to peer; groups need the requester
            why="; ".join(f"{h.peer}: {h.failure}" for h in dead if h.failure) or "failed",
        )

    def inputs(self, position: int) -> torch.Tensor:
        return self.history.at(self.span[0]).upto(position)

    async def patch(self, i: int, j: int, route: Route, position: int, *, through_end: bool = False,
                    room: float | None = None) -> Replacement:
        """Open `route` in place of hops i..j (layers [a, b)), rebuild the replacements' caches,
        relink the neighbours (peer/request/repair.py, steps 3-4). `room`: replay only on
        replacements that said, as they accepted, that a step would wait at most this long;
        else SessionRefused(busy) names the first that did not (all are closed again)."""
        hops = self.hops
        a, b = hops[i].hop.start, hops[j].hop.end
        up = hops[i - 1] if i > 0 else None
        down = hops[j + 1] if j + 1 < len(hops) else None
        dead = hops[i : j + 1]
        # A peer coming back takes the span again as a replacement would, from the history;
        # its old session (still open on a stopped-then-resumed process) is closed first.
        returning = [state for state in dead if state.peer in route.peer_ids]
        for state in returning:
            await self.close_hop(state, "failed; reopened after its comeback")
        new, into, out = await self.open_hops(
            list(route.hops), prev=up.peer if up else None, next_=down.peer if down else None
        )
        replayed = None
        try:
            if room is not None and position > 0:
                no_room({h.peer: h.accepted for h in new if h.accepted is not None}, room)
            if down is not None:
                # first, so that the link stream the last replacement opened is accepted at once
                await self.relink(down, Relink(
                    self.session_id, None, (), in_key=self.seal(out, down.peer), prev_peer=peer_bytes(new[-1].peer),
                ))
            if through_end and up is not None:
                await self.relink_up(up, new, into)
            if position > 0:
                # one prefill-shaped step rebuilds every replacement's KV cache; it stops at b
                # (or runs on to the end, rebuilding every later cache too)
                stop = self.ctx.num_layers if through_end else b
                out_rows = await self.run(
                    new[0], self.history.at(a).upto(position), 0, stop_layer=stop,
                    hops=list(route.hops), tap_from=new[-1].peer if down is not None and not through_end else None,
                )
                if through_end:
                    replayed = out_rows  # the clean hidden states of [0, position) at this chain's end
            if up is not None and not through_end:
                await self.relink_up(up, new, into)
        except BaseException:
            for state in new:
                self.ctx.nursery.start_soon(self.close_hop, state, "replacement abandoned")
            raise
        self.retired_attestations += [a for state in dead for a in state.attested]
        self.hops[i : j + 1] = new
        for state in dead:
            if state not in returning:
                # in the background: a dead peer's stream may take a while to give up
                self.ctx.nursery.start_soon(self.close_hop, state, "replaced after a failure")
        return Replacement([self], [h.peer for h in new], replayed)

    async def relink_up(self, up: HopState, new: list[HopState], into: tuple[int, bytes]) -> None:
        await self.relink(up, Relink(
            self.session_id, peer_bytes(new[0].peer), self.ctx.keeper.addrs(new[0].peer),
            out_key=self.seal(into, up.peer),
        ))

    async def relink(self, state: HopState, msg: Relink) -> None:
        """Send a live neighbour its new link and wait for its ack. Raises PeerFailed."""
        acked = state.acked
        try:
            await state.channel.send(msg)
        except PeerError as error:
            if state.scope.cancel_called:
                # this requester closed its session there (replaced, abandoned) while a repair
                # still took it for a live neighbour: the peer did nothing wrong; route around it
                raise PeerFailed(state.peer, f"relink: its session here was closed already ({error})",
                                 Failure.REFUSED) from None
            raise PeerFailed(state.peer, f"relink: {error}") from None
        with trio.move_on_after(RELINK_TIMEOUT):
            await acked.wait()
        if state.failure is not None:
            raise PeerFailed(state.peer, f"relink not acknowledged: {state.failure}", state.failed_as)
        if not acked.is_set():
            raise PeerFailed(state.peer, "relink not acknowledged: timeout", Failure.TIMED_OUT)

    # -- closing --------------------------------------------------------------------

    async def close(self, reason: str = "done") -> None:
        if self.closed:
            return
        self.closed = True
        with trio.CancelScope(shield=True):
            for state in self.hops:
                await self.close_hop(state, reason)
        self.ephemeral.forget()
        self.ctx.tracer.emit(events.SessionClose(session=self.session_id, reason=reason))

    async def revoke_hop(self, state: HopState) -> None:
        """Take `state`'s peer out of this session now: nothing more is sent to it or read from
        it but one SessionRevoke (it drops the session's KV cache and keys, and confirms in its
        trace); steps waiting on the route fail, and the repair moves its span elsewhere."""
        if state.revoked:
            return
        state.revoked = True
        self.ctx.release(state)
        if state.failure is None:
            state.failure = REVOKED
        state.scope.cancel()
        for cipher in (state.send, state.tap, state.result):
            if cipher is not None:
                cipher.forget()
        state.acked.set()  # a relink waiting on it checks `failure`
        error = PeerFailed(state.peer, REVOKED)
        for slot in self.pending.values():
            slot.fail(error)
        self.ctx.tracer.emit(events.SessionRevoked(session=self.session_id, remote=state.peer,
                                                   span=(state.hop.start, state.hop.end)))
        with trio.move_on_after(CLOSE_TIMEOUT):
            try:
                await state.channel.send(SessionRevoke(self.session_id))
                await state.channel.close()
            except PeerError:
                pass  # the peer is gone already; its session died with its stream

    async def close_hop(self, state: HopState, reason: str) -> None:
        self.ctx.release(state)
        if state.revoked:
            return  # told and closed at the revocation; it gets no further frame
        state.scope.cancel()
        for cipher in (state.send, state.tap, state.result):
            if cipher is not None:
                cipher.forget()
        with trio.move_on_after(CLOSE_TIMEOUT):
            try:
                await state.channel.send(SessionClose(self.session_id, reason[:200]))
                await state.channel.close()
            except PeerError:
                pass  # the peer is gone already; its session dies with its stream


async def receive_answer(channel: Channel, peer: str) -> object:
    """The answer to an open sent on `channel`. A stream `peer` ended before any answer raises
    OpenUnanswered: that may be a peer out of room for streams not admitted yet (the requester's
    bans tell it from a drop: peer/base/backoff.py `Bans.unanswered_open`)."""
    try:
        return await channel.receive()
    except StreamClosed as ended:
        raise OpenUnanswered(peer, f"ended the open unanswered: {ended}") from None


def blame(failed: list[tuple[Hop, BaseException]], hops: list[Hop], next_: str | None) -> tuple[Hop, BaseException]:
    """Which failure of an open to report. A hop that refused with NEXT_HOP_FAILED is alive:
    it could not reach the peer after it, so that peer is the one to ban, unless another
    hop failed in its own right (reported first)."""
    own = [(hop, error) for hop, error in failed
           if not (isinstance(error, SessionRefused) and error.code == NEXT_HOP_FAILED)]
    if own:
        return own[0]
    hop, error = failed[0]
    index = hops.index(hop)
    culprit = hops[index + 1].peer_id if index + 1 < len(hops) else next_
    if culprit is None:
        return hop, error
    return hop, PeerFailed(culprit, f"unreachable from the previous peer: {error}", Failure.DROPPED)
