"""A group member's links to the other members for one session: the network `Exchange`.

Ranks i < j share ONE stream per session, which the lower rank i opens on
`SHARD_LINK_PROTOCOL` (first frame a LinkHello) and both use: i's frames to j go one
way on link i -> j, j's to i the other way on link j -> i. Only one side dials, so
two ranks opening a session never race to dial each other (py-libp2p keeps one
connection per peer and closes the surplus — with whatever streams it carries). Each
link has its own key from the requester's ShardOpen (`LinkCipher`, counters strictly
increasing), so what i sends j is readable by j alone. A task per stream drops the
other rank's frames into its inbox.

The sharded stage runs in a worker thread and calls `exchange(seq, outgoing)` for
every collective. That seals the outgoing contributions in the thread, hops into
trio (`trio.from_thread.run`, so the compute task's cancellation reaches it) to
send them all and take one frame from every inbox — within COLLECTIVE_TIMEOUT — and
opens them back in the thread. A frame for another step or collective, a link that
closes, or a deadline missed fails the collective with a `CollectiveError` naming the
rank (and peer) to blame, and poisons the links: the requester moves the whole
session to another group or replica, so nothing is retried here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import trio

from tessera.protocol.activations import open_activations, seal_activations
from tessera.protocol.errors import WireError
from tessera.protocol.links import LinkCipher
from tessera.protocol.messages import LinkHello
from tessera.protocol.shards import Collective
from tessera.protocol.tensors import DEFAULT_LIMITS, TensorLimits
from tessera.stages.shards.collectives import CollectiveError, Exchange

from tessera.peer.base.protocols import COLLECTIVE_TIMEOUT, SHARD_LINK_PROTOCOL
from tessera.peer.base.errors import PeerError, StreamClosed
from tessera.peer.net.transport import Channel, Transport


# Frames a rank may run ahead of us per link: the next collective's frame can arrive
# before this rank has consumed the current one, never more than a few.
INBOX_DEPTH = 8


@dataclass
class GroupLinks:
    """Rank `rank`'s links for one session (see module docstring)."""

    session_id: bytes
    rank: int
    members: list[str]  # peer ids, in rank order
    addrs: list[tuple[str, ...]]
    send: dict[int, LinkCipher]  # rank j -> cipher of the link rank -> j
    recv: dict[int, LinkCipher]  # rank j -> cipher of the link j -> rank
    limits: TensorLimits = DEFAULT_LIMITS
    channels: dict[int, Channel] = field(default_factory=dict)  # rank j -> the stream shared with j
    failure: str | None = None

    def __post_init__(self) -> None:
        self._inbox = {j: trio.open_memory_channel[Collective | str](INBOX_DEPTH) for j in self.recv}
        self._joined = {j: trio.Event() for j in self.recv}  # the stream shared with j is up

    @property
    def count(self) -> int:
        return len(self.members)

    def source_of(self, link_id: int) -> int | None:
        """The rank that may send on inbound link `link_id` (None: not one of ours)."""
        return next((j for j, c in self.recv.items() if c.link_id == link_id), None)

    # -- streams ----------------------------------------------------------------------

    async def connect(self, transport: Transport) -> None:
        """Open the stream to every higher rank (which may not have the session yet: its link
        handler waits for it). Raises CollectiveError naming an unreachable rank."""
        errors: list[CollectiveError] = []

        async def one(j: int) -> None:
            try:
                stream = await transport.open_stream(self.members[j], SHARD_LINK_PROTOCOL, addrs=self.addrs[j])
                channel = Channel(stream)
                await channel.send(LinkHello(self.session_id, self.send[j].link_id))
                self.channels[j] = channel
                self._joined[j].set()
            except PeerError as error:
                errors.append(self._fail(j, f"unreachable: {error}"))

        async with trio.open_nursery() as nursery:
            for j in self.send:
                if j > self.rank:
                    nursery.start_soon(one, j)
        if errors:
            raise errors[0]

    def dialed(self) -> list[tuple[int, Channel]]:
        """The streams this rank opened (their readers run in the session's nursery)."""
        return [(j, c) for j, c in self.channels.items() if j > self.rank]

    async def accept(self, j: int, channel: Channel) -> None:
        """A lower rank's stream arrived (the link handler): use it both ways until it ends."""
        self.channels[j] = channel
        self._joined[j].set()
        await self.read_from(j, channel)

    async def read_from(self, j: int, channel: Channel) -> None:
        """Feed rank j's frames into its inbox until the stream ends."""
        inbox = self._inbox[j][0]
        try:
            while True:
                msg = await channel.receive()
                if not isinstance(msg, Collective) or msg.link_id != self.recv[j].link_id:
                    raise WireError(f"unexpected {type(msg).__name__} on the link from rank {j}")
                await inbox.send(msg)
        except (PeerError, WireError) as error:
            reason = "its link closed" if isinstance(error, StreamClosed) else f"{type(error).__name__}: {error}"
            try:
                inbox.send_nowait(reason)  # wakes a collective waiting on rank j at once
            except (trio.WouldBlock, trio.ClosedResourceError):
                pass  # the inbox is full of frames nobody will read, or the session is gone

    async def aclose(self) -> None:
        for cipher in [*self.send.values(), *self.recv.values()]:
            cipher.forget()
        for channel in self.channels.values():
            with trio.move_on_after(1.0):
                try:
                    await channel.close()
                except PeerError:
                    pass  # the other rank is gone already; nothing to close politely
        for send, recv in self._inbox.values():
            send.close()
            recv.close()

    # -- the exchange -------------------------------------------------------------------

    def exchange_for(self, step: int) -> Exchange:
        """The `Exchange` of one step: called from the compute thread, once per collective."""

        def exchange(seq: int, outgoing: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
            if self.failure is not None:
                raise CollectiveError(f"the group's links already failed: {self.failure}")
            frames = {}
            for j, tensor in enumerate(outgoing):
                if j == self.rank:
                    continue
                assert tensor is not None, "a collective sends every other rank something"
                template = Collective(self.session_id, step, self.send[j].link_id, 0, seq, b"")
                frames[j] = seal_activations(self.send[j], template, tensor)  # type: ignore[type-var]
            received = trio.from_thread.run(self._swap, step, seq, frames)
            incoming: list[torch.Tensor | None] = [None] * self.count
            for j, msg in received.items():
                try:
                    incoming[j] = open_activations(self.recv[j], msg, limits=self.limits)  # type: ignore[arg-type]
                except WireError as bad:
                    raise self._fail(j, f"a bad collective frame: {bad}") from None
            return incoming

        return exchange

    async def _swap(self, step: int, seq: int, frames: dict[int, Collective]) -> dict[int, Collective]:
        """Send our contributions, then take one from every other rank (in the trio thread).

        Sequential on purpose: a send only waits for the receiver's link reader, which
        drains into the inbox whatever that rank is computing, so nothing here waits on
        another rank's progress but the takes — and those wait for all ranks anyway.
        """
        received: dict[int, Collective] = {}
        with trio.move_on_after(COLLECTIVE_TIMEOUT):
            for j, frame in frames.items():
                await self._joined[j].wait()  # a lower rank's stream may still be on its way
                try:
                    await self.channels[j].send(frame)
                except PeerError as error:
                    raise self._fail(j, f"sending to it: {error}") from None
            for j in frames:
                item = await self._inbox[j][1].receive()
                if isinstance(item, str):
                    raise self._fail(j, item)
                if item.step != step or item.seq != seq:
                    raise self._fail(j, f"it sent step {item.step} collective {item.seq}, expected {step}/{seq}")
                received[j] = item
        late = [j for j in frames if j not in received]
        if late:
            raise self._fail(late[0], f"no contribution to collective {seq} of step {step} "
                                      f"within {COLLECTIVE_TIMEOUT:.0f} s")
        return received

    def _fail(self, j: int, reason: str) -> CollectiveError:
        """Poison the links and name the culprit: the requester parses the peer id out."""
        message = f"shard peer {self.members[j]} (rank {j}) failed: {reason}"
        self.failure = self.failure or message
        return CollectiveError(message)
