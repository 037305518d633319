"""The stage server of a tensor-shard peer: rank i of a group serving a span together.

It is a `StageServer` (same limits, control stream, work queue, trace, ledger) with
three differences:

- Sessions open with a `ShardOpen` on `SHARD_SESSION_PROTOCOL` (a plain SessionOpen
  is refused: one rank cannot run a span alone). Admission checks that the group,
  rank and span are the ones this peer advertises, then opens the links to the
  other ranks (`peer/serve/shard_links.py`) before accepting.
- A step's input and output are this rank's hidden slice, and its compute runs the
  `ShardedStage` with network collectives; every step's audit (what this rank held,
  every collective it joined) becomes one trace event of kind "audit"
  (`peer/plan/audit.py` checks them).
- Steps do not take turns at the server's compute queue: a rank blocked in a collective of
  session A while holding it would deadlock against a rank that took session B
  first. Sessions' steps are independent (own KV cache, read-only weights), and
  within a session they stay in order (one worker per session).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import trio

from tessera.store import events
from tessera.protocol.activations import open_activations, seal_activations
from tessera.protocol.admission import LINK_FRAME_LIMIT, OPEN_FRAME_LIMIT, SHARD_OPEN_FRAME_LIMIT
from tessera.protocol.errors import WireError
from tessera.protocol.links import Direction, LinkCipher
from tessera.protocol.messages import Forward, LinkHello, Result, SessionOpen
from tessera.protocol.shards import ShardOpen
from tessera.protocol.tensors import check_finite
from tessera.stages.shards.collectives import Collectives
from tessera.stages.errors import SpanError
from tessera.stages.shards.sharded import ShardedStage

from tessera.peer.base.errors import PeerError
from tessera.peer.base.ids import peer_id_text
from tessera.peer.serve.session import ComputeContext, ServedSession
from tessera.protocol.error_codes import BAD_REQUEST, BAD_SPAN
from tessera.peer.serve.admission import Refused
from tessera.peer.serve.limits import LINK_WAIT
from tessera.peer.serve.server import StageServer
from tessera.peer.plan.audit import SHARD, StepLog
from tessera.peer.base.protocols import SHARD_LINK_PROTOCOL, SHARD_SESSION_PROTOCOL
from tessera.peer.serve.shard_links import GroupLinks
from tessera.peer.base.protocols import SESSION_PROTOCOL
from tessera.peer.net.transport import Channel, Stream, receive_link_hello

log = logging.getLogger(__name__)


@dataclass
class ShardServedSession(ServedSession):
    """A session on one rank: the usual keys and queue, plus the links to the other ranks."""

    links: GroupLinks | None = None
    group: str = ""

    async def connect_next(self, server: ComputeContext) -> None:
        """A rank has no next hop; it links to the other ranks instead."""
        assert self.links is not None, "links are set at admission"
        await self.links.connect(server.transport)

    def compute(self, server: ComputeContext, msg: Forward) -> tuple[list[object], float]:
        """Decrypt this rank's input slice, run the span with the group, encrypt the output slice.

        Raises WireError (bad frame), StageError (shape, context, NaN/Inf, a failed collective).
        """
        stage = server.stage
        assert isinstance(stage, ShardedStage) and self.links is not None
        hidden = open_activations(self.inbound[msg.link_id], msg, limits=server.tensor_limits)
        if tuple(hidden.shape) != (msg.n_tokens, stage.width):
            raise SpanError(f"step {msg.step}: hidden slice of shape {tuple(hidden.shape)!r}, "
                            f"expected {(msg.n_tokens, stage.width)!r}")
        check_finite(hidden, what="input activations")
        records: list[dict] = []
        group = Collectives(stage.index, stage.count, self.links.exchange_for(msg.step), audit=records.append)
        started = time.perf_counter()
        output = stage.forward(self.session_id, hidden, msg.start_pos, group)
        elapsed = time.perf_counter() - started
        audit = StepLog(
            node=server.transport.peer_id, session=self.session_id.hex(), step=msg.step, role=SHARD,
            group=self.group, index=stage.index, count=stage.count, start=self.start, end=self.end,
            hidden=stage.spec.hidden_size, records=tuple(records),
        )
        server.tracer.emit(audit.event(), peer=audit.node)
        output = server.tamper(output)
        check_finite(output, what="output activations")
        assert self.out is not None, "a session always has an outbound link"
        # a rank is always the end of its chain: its output slice goes back to the requester
        template = Result(self.session_id, msg.step, self.out.link_id, 0, msg.start_pos, msg.n_tokens, b"")
        return [seal_activations(self.out, template, output)], elapsed


class ShardServer(StageServer):
    """Serves rank `stage.index` of group `group` (see module docstring)."""

    session_class = ShardServedSession
    exclusive_compute = False  # see module docstring

    def __init__(self, *args, group: str, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not isinstance(self.stage, ShardedStage):
            raise TypeError("a ShardServer serves a ShardedStage")
        self.group = group
        self.transport.set_handler(SESSION_PROTOCOL, self.refuse_plain)
        self.transport.set_handler(SHARD_SESSION_PROTOCOL, self.handle_shard_session)
        self.transport.set_handler(SHARD_LINK_PROTOCOL, self.handle_shard_link)

    # -- admission ----------------------------------------------------------------------

    def admit_shard(self, msg: ShardOpen, channel: Channel) -> ShardServedSession:
        """Check the group, rank and span, then the usual limits and keys. Raises Refused."""
        stage = self.stage
        assert isinstance(stage, ShardedStage)
        mine = (self.group, stage.index, stage.count)
        if (msg.group, msg.shard_index, msg.shard_count) != mine:
            raise Refused(BAD_SPAN, f"asked for rank {msg.shard_index}/{msg.shard_count} of group {msg.group!r}; "
                                    f"this peer is rank {stage.index}/{stage.count} of {self.group!r}")
        plain = SessionOpen(
            session_id=msg.session_id, start=msg.start, end=msg.end, max_length=msg.max_length,
            requester=msg.requester, ephemeral_public=msg.ephemeral_public, in_key=msg.in_key, out_key=msg.out_key,
            next_peer=None, next_addrs=(),
        )
        session = self.admit(plain, channel)
        assert isinstance(session, ShardServedSession)
        session.group = self.group
        members, addrs = [self.transport.peer_id] * msg.shard_count, [()] * msg.shard_count
        send, recv = {}, {}
        try:
            for k, other in enumerate(msg.others):
                j = msg.rank_of(k)
                members[j], addrs[j] = peer_id_text(other.peer_id), tuple(other.addrs)
                send[j] = self._cipher(session, other.send_key)
                recv[j] = self._cipher(session, other.recv_key)
        except WireError as bad:
            self.drop(session, BAD_REQUEST)
            raise Refused(BAD_REQUEST, f"cannot open the group's link keys: {bad}") from None
        if len(set(members)) != msg.shard_count:
            self.drop(session, BAD_REQUEST)
            raise Refused(BAD_REQUEST, "a peer is listed twice in the group (each rank needs its own peer)")
        session.links = GroupLinks(session_id=msg.session_id, rank=msg.shard_index, members=members, addrs=addrs,
                                   send=send, recv=recv, limits=self.tensor_limits)
        return session

    def _cipher(self, session: ServedSession, sealed) -> LinkCipher:
        key = session.open_key(self.identity, sealed)
        return LinkCipher(key, session_id=session.session_id, link_id=sealed.link_id, direction=Direction.FORWARD)

    # -- the requester's stream ---------------------------------------------------------

    async def refuse_plain(self, stream: Stream) -> None:
        stage = self.stage
        assert isinstance(stage, ShardedStage)
        await self._refuse(Channel(stream, max_frame=OPEN_FRAME_LIMIT), BAD_SPAN, f"this peer is rank {stage.index}/{stage.count} of group "
                           f"{self.group!r}: it runs its span only with its group (ShardOpen)", None)

    async def handle_shard_session(self, stream: Stream) -> None:
        """As `StageServer.handle_session`, for a ShardOpen."""
        session = await self.open_stream(stream, ShardOpen, SHARD_OPEN_FRAME_LIMIT, self.admit_shard, self._forget)
        if session is None:
            return
        self.tracer.emit(events.SessionOpen(session=session.session_id, span=(session.start, session.end),
                                            remote=session.requester, group=self.group, rank=self.stage.index,
                                            capacity=session.capacity, via=stream.via))
        reason = "requester closed"
        try:
            with session.scope:  # cancelled by `evict`
                async with trio.open_nursery() as nursery:
                    assert session.links is not None
                    for j, link in session.links.dialed():  # the streams to higher ranks carry both ways
                        nursery.start_soon(session.links.read_from, j, link)
                    nursery.start_soon(self._work, session)
                    reason = await self._read_control(session)
                    nursery.cancel_scope.cancel()
        finally:
            if session.evicted is not None:
                reason = session.evicted[1]
            with trio.CancelScope(shield=True):
                await self._forget(session, reason)
                await self.end_stream(session)
            session.ended.set()  # its requester has been told (StageServer.hand_over waits for it)

    async def _forget(self, session: ShardServedSession | None, reason: str) -> None:
        if session is None:
            return
        self.drop(session, reason)
        if session.links is not None:
            await session.links.aclose()

    # -- the other ranks' links -----------------------------------------------------------

    async def handle_shard_link(self, stream: Stream) -> None:
        ticket = self.intake.enter(stream)
        if ticket is None:
            self.stats.unadmitted_refused += 1
            await stream.reset()  # no place among the streams not admitted yet (peer/net/intake.py)
            return
        placed: tuple[ShardServedSession, int] | None = None
        with ticket:  # a place until the link is placed; cancelled if a lighter identity takes it
            channel = Channel(stream, max_frame=LINK_FRAME_LIMIT, on_frame=ticket.charge)
            try:
                with trio.fail_after(LINK_WAIT):
                    hello = await receive_link_hello(channel)
                    placed = await self._wait_for_rank(hello)
            except (trio.TooSlowError, PeerError, WireError) as bad:
                log.debug("shard link from %s refused: %s", stream.remote, bad)
        if placed is None:
            await channel.reset()  # a link we cannot place carries nothing we could use
            return
        session, rank = placed
        channel.on_frame = None
        assert session.links is not None
        if session.links.members[rank] != stream.remote or rank > session.links.rank:
            await channel.reset()  # only the lower rank the requester named may open this link
            return
        channel.max_frame = session.frame_limit  # placed: the session's collectives may come now
        await session.links.accept(rank, channel)

    async def _wait_for_rank(self, hello: LinkHello) -> tuple[ShardServedSession, int]:
        while True:
            session = self.sessions.get(hello.session_id)
            links = getattr(session, "links", None)
            if links is not None:
                rank = links.source_of(hello.link_id)
                if rank is None:
                    raise WireError(f"link {hello.link_id} is not one of this rank's")
                return session, rank  # type: ignore[return-value]
            await self.session_added.wait()


__all__ = ["ShardServer", "ShardServedSession"]
