"""The requester's end of one group hop: open a sharded session on every rank, scatter, gather.

Opening: the requester picks one fresh key per link — requester -> rank i (input
slices), rank i -> requester (output slices), and rank i -> rank j for every ordered
pair (the collectives) — and seals each to the two ends of its link only. Every rank
gets a `ShardOpen` naming all ranks; ranks link to each other before accepting.

A step: the requester holds the full hidden state at the group's first layer (it is
the junction: outside the interval), sends rank i its slice i, and waits for every
rank's output slice, which it assembles — the *compatibility gather*, at the group's
last layer, outside the interval — and logs both as one "audit" trace event
(`peer/plan/audit.py`). A rank that fails is named: its own stream's end, or the
rank another rank's collective error blames ("shard peer <id> ...").

A `GroupSession` is a `Segment` (peer/request/ports.py). It keeps the inputs it
was sent, so its span can be rebuilt elsewhere; but it is never patched in place
and never spot-checked — `gap` and `checkable` say why.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
import trio

from tessera.store import events
from tessera.protocol.activations import open_activations, seal_activations
from tessera.protocol.errors import WireError
from tessera.protocol.keys import EphemeralKey, public_key_from_peer_id
from tessera.protocol.links import Direction, LinkCipher, seal_link_key
from tessera.protocol.messages import ErrorMsg, LoadReport, Forward, Result, SealedKey, SessionAccept, SessionClose
from tessera.protocol.shards import ShardOpen, ShardPeer
from tessera.stages.shards.layout import HIDDEN, ROUNDS_PER_LAYER

from tessera.peer.base.backoff import Failure
from tessera.peer.base.errors import PeerError, PeerFailed, SessionRefused
from tessera.peer.request.failures import error_failure, reported_failure
from tessera.peer.request.chain import CLOSE_TIMEOUT, OPEN_TIMEOUT, STEP_TIMEOUT_FACTOR, STEP_TIMEOUT_FLOOR, receive_answer
from tessera.peer.request.chain_state import RequesterContext, peer_bytes
from tessera.peer.request.history import HiddenHistory
from tessera.peer.request.ports import Checkable, Gap, Replacement
from tessera.peer.plan.routing import Hop, Route
from tessera.peer.plan.audit import REQUESTER, StepLog
from tessera.peer.base.protocols import COLLECTIVE_TIMEOUT, SHARD_SESSION_PROTOCOL
from tessera.peer.net.transport import Channel

# Per collective, on top of the ranks' compute: a LAN round trip and a little crypto.
COLLECTIVE_ALLOWANCE = 0.02
# When no rank names a culprit, the requester must not give up before the ranks' own
# collective deadline has had its chance to name one.
GROUP_STEP_MIN = COLLECTIVE_TIMEOUT + 5.0


@dataclass
class RankState:
    """The requester's end of one rank's session."""

    rank: int
    peer: str
    channel: Channel
    send: LinkCipher  # requester -> rank: input slices
    result: LinkCipher  # rank -> requester: output slices
    failure: str | None = None
    failed_as: Failure = Failure.DROPPED  # the kind of `failure` (peer/base/backoff.py)
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)


@dataclass
class GatherSlot:
    """A step waiting for every rank's output slice, each of `shape`."""

    count: int
    shape: tuple[int, int]
    parts: dict[int, torch.Tensor] = field(default_factory=dict)
    done: trio.Event = field(default_factory=trio.Event)
    error: PeerFailed | None = None

    def add(self, rank: int, part: torch.Tensor) -> None:
        self.parts[rank] = part.clone()  # the decoded tensor views a read-only buffer
        if len(self.parts) == self.count:
            self.done.set()

    def fail(self, error: PeerFailed) -> None:
        if not self.done.is_set():
            self.error = error
            self.done.set()


def culprit(message: str, members: list[str], reporter: str) -> str:
    """The rank a rank's error blames ("shard peer <id> ..."), else the reporter itself."""
    return next((m for m in members if m != reporter and f"shard peer {m}" in message), reporter)


class GroupSession:
    """A session on every rank of one group hop; `step` scatters slices in and gathers them out."""

    def __init__(self, ctx: RequesterContext, hop: Hop, *, max_length: int) -> None:
        if not hop.members:
            raise ValueError(f"hop {hop.peer_id!r} is not a group hop")
        self.ctx = ctx
        self.hop = hop
        self.max_length = max_length
        self.count = len(hop.members)
        self.width = ctx.hidden_size // self.count
        self.session_id = os.urandom(16)
        self.ephemeral = EphemeralKey.generate()
        self.ranks: list[RankState] = []
        self.inputs_sent = HiddenHistory(max_length, ctx.hidden_size)  # what the requester sent, to rebuild elsewhere
        self.pending: dict[int, GatherSlot] = {}
        self._next_link = 0
        self._next_step = 0
        self.closed = False

    @property
    def members(self) -> list[str]:
        return list(self.hop.members)

    # -- as a Segment (peer/request/ports.py) ---------------------------------------------

    @property
    def span(self) -> tuple[int, int]:
        return self.hop.start, self.hop.end

    @property
    def route_hops(self) -> list[Hop]:
        return [self.hop]

    @property
    def peers(self) -> list[str]:
        return self.members

    def failed_run(self, is_out: Callable[[str], bool]) -> tuple[int, int] | None:
        """The group is one hop: it failed when any rank did (or is out)."""
        if any(r.failure for r in self.ranks) or any(is_out(m) for m in self.members):
            return 0, 0
        return None

    async def inputs_ready(self, i: int, position: int) -> PeerFailed | None:
        return None  # the requester sent them itself (`inputs_sent`); no tap to wait for

    def failures(self, i: int, j: int) -> list[PeerFailed]:
        return [PeerFailed(r.peer, r.failure, r.failed_as) for r in self.ranks if r.failure]

    def said(self) -> dict[str, LoadReport]:
        return {}  # a rank's accept is not read for its load: a group is routed as one hop

    def gap(self, i: int, j: int) -> Gap:
        """The whole span, between the requester's ends, never one rank: the ranks' link keys
        were sealed for exactly these members and each rank's cache is a column slice of one
        shared cache, so a newcomer could join neither. It may go onto a replica, another
        group, or a mix."""
        why = "; ".join(f"{r.peer}: {r.failure}" for r in self.ranks if r.failure) or "failed"
        return Gap(self.hop.start, self.hop.end, in_place=False, groups=True, why=why)

    def inputs(self, position: int) -> torch.Tensor:
        return self.inputs_sent.upto(position)

    async def patch(self, i: int, j: int, route: Route, position: int, *, through_end: bool = False,
                    room: float | None = None) -> Replacement:
        raise ValueError("a tensor-shard group is never patched in place (GroupSession.gap)")

    async def revoke(self, peer: str) -> None:
        """A rank is not revoked mid-answer (a group cannot drop one rank); the requester's
        policy denies it, so the next repair re-routes the whole group (`failed_run`)."""

    def checkable(self) -> Checkable | None:
        """None: a group is not spot-checked, for two reasons. Every column of its output is a
        reduce-scatter of partial sums from every rank (stages/shards/layout.py), so a wrong
        output cannot be pinned on one rank, and a verdict must name one peer to ban; and its
        ranks sign no attestation of their slices (peer/serve/shard_server.py sends a bare
        Result), so no report could be verified by others. The plain hops of the same route
        are checked (`SpotChecker.unchecked` records the skipped span)."""
        return None

    def _link(self) -> tuple[int, bytes]:
        self._next_link += 1
        return self._next_link, os.urandom(32)

    def _seal(self, link: tuple[int, bytes], peer: str) -> SealedKey:
        return seal_link_key(link[1], session_id=self.session_id, link_id=link[0], sender=self.ephemeral,
                             recipient_public_ed25519=public_key_from_peer_id(peer_bytes(peer)))

    def _cipher(self, link: tuple[int, bytes]) -> LinkCipher:
        return LinkCipher(link[1], session_id=self.session_id, link_id=link[0], direction=Direction.FORWARD)

    # -- opening --------------------------------------------------------------------

    async def open(self, *, max_waits: Mapping[str, float] | None = None) -> None:
        """Open the session on every rank at once. Raises SessionRefused or PeerFailed (naming a rank).
        `max_waits` is not asked of ranks: a group is routed as one hop, its ranks' queues unpriced."""
        n, members = self.count, self.members
        into = [self._link() for _ in range(n)]
        out = [self._link() for _ in range(n)]
        pair = {(i, j): self._link() for i in range(n) for j in range(n) if i != j}  # link i -> j
        addrs = [tuple(self.ctx.keeper.addrs(m)) for m in members]
        opens = []
        for i, peer in enumerate(members):
            others = tuple(
                ShardPeer(peer_bytes(m), addrs[j], send_key=self._seal(pair[(i, j)], peer),
                          recv_key=self._seal(pair[(j, i)], peer))
                for j, m in enumerate(members) if j != i
            )
            opens.append(ShardOpen(
                session_id=self.session_id, start=self.hop.start, end=self.hop.end, max_length=self.max_length,
                requester=self.ctx.identity.peer_id, ephemeral_public=self.ephemeral.public,
                group=self.hop.group, shard_index=i, in_key=self._seal(into[i], peer), out_key=self._seal(out[i], peer),
                others=others, work=self.ctx.work,
            ))
        results: list[RankState | BaseException | None] = [None] * n

        async def open_one(i: int) -> None:
            try:
                results[i] = await self._open_rank(i, opens[i], self._cipher(into[i]), self._cipher(out[i]))
            except (PeerError, WireError, trio.TooSlowError) as error:
                results[i] = error

        async with trio.open_nursery() as nursery:
            for i in range(n):
                nursery.start_soon(open_one, i)
        opened = [r for r in results if isinstance(r, RankState)]
        failed = [(i, r) for i, r in enumerate(results) if not isinstance(r, RankState)]
        if failed:
            for state in opened:
                self.ctx.nursery.start_soon(self._close_rank, state, "a rank of the group failed to open")
            i, error = failed[0]
            if isinstance(error, SessionRefused):
                # a rank that could not reach another rank refuses naming it: blame that one
                blamed = culprit(str(error), members, members[i])
                if blamed != members[i]:
                    raise PeerFailed(blamed, f"unreachable from rank {i}: {error}", Failure.DROPPED)
                raise error
            if isinstance(error, PeerFailed):
                raise error
            if isinstance(error, PeerError):
                raise PeerFailed(members[i], str(error), error_failure(error))
            raise PeerFailed(members[i], f"opening the group session: {type(error).__name__}: {error}",
                             error_failure(error))
        self.ranks = opened
        self.ctx.tracer.emit(events.SessionOpen(session=self.session_id,
                                                group=self.hop.group, span=(self.hop.start, self.hop.end),
                                                members=members, max_length=self.max_length))

    async def _open_rank(self, i: int, msg: ShardOpen, send: LinkCipher, result: LinkCipher) -> RankState:
        peer = self.members[i]
        with trio.fail_after(OPEN_TIMEOUT):
            stream = await self.ctx.transport.open_stream(peer, SHARD_SESSION_PROTOCOL, addrs=self.ctx.keeper.addrs(peer))
            channel = Channel(stream)
            await channel.send(msg)
            reply = await receive_answer(channel, peer)
        if isinstance(reply, ErrorMsg):
            await channel.close()
            self.ctx.loads.report(peer, reply.load)
            raise SessionRefused(peer, reply.code, reply.message, retry_after=reply.retry_after)
        if not isinstance(reply, SessionAccept) or reply.session_id != self.session_id:
            await channel.reset()
            raise PeerFailed(peer, f"answered ShardOpen with {type(reply).__name__}", Failure.BROKE)
        state = RankState(i, peer, channel, send, result)
        self.ctx.nursery.start_soon(self._read, state)
        return state

    # -- receiving --------------------------------------------------------------------

    async def _read(self, state: RankState) -> None:
        with state.scope:
            try:
                while True:
                    msg = await state.channel.receive()
                    if isinstance(msg, Result) and msg.link_id == state.result.link_id:
                        slot = self.pending.get(msg.step)
                        part = open_activations(state.result, msg)
                        if slot is not None and tuple(part.shape) != slot.shape:
                            raise WireError(f"rank {state.rank} sent a slice of shape {tuple(part.shape)}, "
                                            f"expected {slot.shape}")
                        if slot is not None:
                            slot.add(state.rank, part)
                    elif isinstance(msg, ErrorMsg):
                        self._fail(state, f"{msg.code}: {msg.message}", blame=True, failure=reported_failure(msg.code))
                    else:
                        raise WireError(f"unexpected {type(msg).__name__} from rank {state.rank}")
            except (PeerError, WireError) as error:
                if not self.closed:
                    self._fail(state, f"{type(error).__name__}: {error}", failure=error_failure(error))

    def _fail(self, state: RankState, reason: str, *, blame: bool = False, failure: Failure = Failure.DROPPED) -> None:
        """Mark a rank failed — or the rank its error names — and wake every waiting step."""
        peer = culprit(reason, self.members, state.peer) if blame else state.peer
        if peer != state.peer:
            failure = Failure.DROPPED  # the rank named is the one another could not reach
        target = next((s for s in self.ranks if s.peer == peer), state)
        if target.failure is None:
            target.failure = reason
            target.failed_as = failure
        self.ctx.tracer.emit(events.Error(session=self.session_id, remote=peer, reason=reason[:300]))
        error = PeerFailed(peer, reason, failure)
        for slot in self.pending.values():
            slot.fail(error)

    # -- stepping -----------------------------------------------------------------------

    def step_timeout(self, n_tokens: int) -> float:
        view = self.ctx.keeper.snapshot()
        speeds = [(view.get(m).throughput if view.get(m) else 0.0) for m in self.members]
        slowest = min(speeds) if speeds and min(speeds) > 0 else 1.0
        layers = self.hop.num_layers
        estimate = layers * n_tokens / slowest + layers * ROUNDS_PER_LAYER * COLLECTIVE_ALLOWANCE + 0.1
        return max(GROUP_STEP_MIN, STEP_TIMEOUT_FLOOR + STEP_TIMEOUT_FACTOR * estimate)

    def cols(self, rank: int) -> tuple[int, int]:
        return rank * self.width, (rank + 1) * self.width

    async def step(self, hidden: torch.Tensor, start_pos: int) -> torch.Tensor:
        """Scatter hidden states [T, H] into the group, gather its output [T, H]. Raises PeerFailed."""
        self.inputs_sent.write(start_pos, hidden)
        failed = next((r for r in self.ranks if r.failure), None)
        if failed is not None:
            raise PeerFailed(failed.peer, failed.failure or "failed", failed.failed_as)
        self._next_step += 1
        step = self._next_step
        n = hidden.shape[0]
        slot = self.pending[step] = GatherSlot(self.count, (n, self.width))
        started = time.perf_counter()
        try:
            for state in self.ranks:
                lo, hi = self.cols(state.rank)
                template = Forward(self.session_id, step, state.send.link_id, 0, start_pos, n, self.hop.end, b"")
                try:
                    await state.channel.send(seal_activations(state.send, template, hidden[:, lo:hi].contiguous()))
                except PeerError as error:
                    raise PeerFailed(state.peer, f"sending step {step}: {error}") from None
            with trio.move_on_after(self.step_timeout(n)) as waited:
                await slot.done.wait()
            if waited.cancelled_caught:
                late = next(r.peer for r in self.ranks if r.rank not in slot.parts)
                raise PeerFailed(late, f"group step {step} timed out", Failure.TIMED_OUT)
            if slot.error is not None:
                raise slot.error
            output = torch.cat([slot.parts[r] for r in range(self.count)], dim=1)  # the compatibility gather
        finally:
            self.pending.pop(step, None)
        self._audit(step, n)
        self.ctx.tracer.emit(events.Result(session=self.session_id, step=step, duration=time.perf_counter() - started,
                                           start_pos=start_pos, n_tokens=n, group=self.hop.group))
        return output

    def _audit(self, step: int, n: int) -> None:
        """The requester's side of the audit: it held the full state only at the span's ends."""
        h = self.ctx.hidden_size
        slices = [[r, *self.cols(r)] for r in range(self.count)]
        records = (
            {"layer": self.hop.start, "event": "scatter", "op": "input", "space": HIDDEN, "width": h, "rows": n,
             "sent": slices},
            {"layer": self.hop.end, "event": "compat_gather", "op": "output", "space": HIDDEN, "width": h,
             "rows": n, "received": slices},
        )
        log = StepLog(node=self.ctx.transport.peer_id, session=self.session_id.hex(), step=step, role=REQUESTER,
                      group=self.hop.group, index=-1, count=self.count, start=self.hop.start, end=self.hop.end,
                      hidden=h, records=records)
        self.ctx.tracer.emit(log.event(), peer=log.node)

    # -- closing -------------------------------------------------------------------------

    async def close(self, reason: str = "done") -> None:
        if self.closed:
            return
        self.closed = True
        with trio.CancelScope(shield=True):
            for state in self.ranks:
                await self._close_rank(state, reason)
        self.ephemeral.forget()

    async def _close_rank(self, state: RankState, reason: str) -> None:
        state.scope.cancel()
        state.send.forget()
        state.result.forget()
        with trio.move_on_after(CLOSE_TIMEOUT):
            try:
                await state.channel.send(SessionClose(self.session_id, reason[:200]))
                await state.channel.close()
            except PeerError:
                pass  # the rank is gone already; its session dies with its stream
