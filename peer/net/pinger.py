"""Round-trip times to the peers we are connected to: probes, a moving average, and the answer to others'.

Records carry the RTTs to a peer's neighbours (routing prices links with them); the
TUI shows them. Only connected peers are probed, so the work is bounded by a peer's
connections (peer/net/membership.py), not by the swarm. A failed probe is also the
quickest sign that a neighbour vanished: `on_failure` hands it to gossip's membership.
A serving peer's echo carries its load (`load`: peer/serve/load.py), which a requester
hears (`on_load`) and prices routes with between records.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

import trio

from tessera.store import events
from tessera.store.trace import NullTracer, Tracer
from tessera.protocol.errors import WireError
from tessera.protocol.records import HEARTBEAT_FRAME_LIMIT, Heartbeat, LoadReport

from tessera.peer.base.errors import PeerError
from tessera.peer.base.protocols import PING_PROTOCOL
from tessera.peer.net.transport import Channel, Stream, Transport

PING_TIMEOUT = 5.0
RTT_SMOOTHING = 0.3  # weight of a new sample in the moving average


class Pinger:
    """Measures RTTs to neighbours (moving average), and answers their probes."""

    def __init__(self, transport: Transport, *, clock: Callable[[], float] = trio.current_time,
                 on_failure: Callable[[str], None] = lambda peer_id: None, tracer: Tracer | None = None,
                 load: Callable[[], LoadReport | None] = lambda: None,
                 on_load: Callable[[str, LoadReport | None], None] = lambda peer_id, load: None) -> None:
        self.transport = transport
        self.clock = clock
        self.on_failure = on_failure  # told of a peer whose probe failed (gossip's membership looks closer)
        self.load = load  # what this node's echoes say of its load (None: nothing)
        self.on_load = on_load  # told what a probed peer's echo said of its load
        self.tracer = tracer or NullTracer()  # every measured round trip is traced: a replay's links
        self.rtt_ms: dict[str, float] = {}
        self._seq = 0
        transport.set_handler(PING_PROTOCOL, self.handle)

    async def handle(self, stream: Stream) -> None:
        ticket = self.transport.intake.enter(stream)  # a stranger's stream throughout (peer/net/intake.py)
        if ticket is None:
            await stream.reset()
            return
        with ticket:
            channel = Channel(stream, max_frame=HEARTBEAT_FRAME_LIMIT, on_frame=ticket.charge)
            try:
                with trio.fail_after(PING_TIMEOUT):
                    while (probe := await channel.receive_or_none()) is not None:
                        if not isinstance(probe, Heartbeat):
                            raise WireError(f"expected Heartbeat, got {type(probe).__name__}")
                        await channel.send(replace(probe, load=self.load()))
            except (trio.TooSlowError, PeerError, WireError):
                await channel.reset()
        if ticket.evicted:
            await stream.reset()

    async def ping(self, peer_id: str, *, addrs: Sequence[str] = (), timeout: float = PING_TIMEOUT) -> float | None:
        """One probe (dialling `addrs` if not connected); the RTT in ms (also folded into
        `rtt_ms`), or None if it failed or took over `timeout` seconds."""
        self._seq += 1
        seq = self._seq  # this probe's own: pings to several neighbours run at once
        try:
            with trio.fail_after(timeout):
                channel = Channel(await self.transport.open_stream(peer_id, PING_PROTOCOL, addrs=addrs),
                                  max_frame=HEARTBEAT_FRAME_LIMIT)
                sent = self.clock()
                await channel.send(Heartbeat(seq, sent))
                reply = await channel.receive()
                rtt = (self.clock() - sent) * 1000.0
                await channel.close()
        except (trio.TooSlowError, PeerError, WireError):
            # an RTT kept after a failed probe showed a dead link as alive (the TUI showed an RTT
            # to a peer whose records no longer came through); it is measured again on success
            self.rtt_ms.pop(peer_id, None)
            return None
        if not isinstance(reply, Heartbeat) or reply.seq != seq:
            self.rtt_ms.pop(peer_id, None)
            return None
        old = self.rtt_ms.get(peer_id)
        self.rtt_ms[peer_id] = rtt if old is None else (1 - RTT_SMOOTHING) * old + RTT_SMOOTHING * rtt
        self.on_load(peer_id, reply.load)
        self.tracer.emit(events.Rtt(remote=peer_id, duration=rtt / 1000.0))
        return rtt

    async def ping_all(self) -> None:
        async def one(peer_id: str) -> None:
            if await self.ping(peer_id) is None:
                self.on_failure(peer_id)

        async with trio.open_nursery() as nursery:
            for peer_id in self.transport.connected():
                nursery.start_soon(one, peer_id)
        for gone in set(self.rtt_ms) - set(self.transport.connected()):
            del self.rtt_ms[gone]
