"""How the swarm view spreads: signed advertisements, exchanged between neighbours.

Every peer signs a `PeerRecord` about itself (span, speed, load, addresses,
RTTs to its neighbours) with an expiry. Neighbours swap everything they know in
one round trip (`GossipPush` each way) every `GOSSIP_INTERVAL`, and at once
when a peer's own record changes. Records are relayed as signed, so a relay
cannot alter them; each receiver verifies signature, peer id and expiry before a
record enters its `ViewKeeper`, and a newer `seq` replaces an older one.

Anti-entropy with whole views is simple and robust for the swarm sizes peers
run (tens of peers); it is O(N) per exchange, which the in-memory simulation of
a thousand peers avoids by sharing one keeper (see peer/simulation).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable

import trio
from libp2p.peer.id import ID

from tessera.protocol.crypto import verify_record
from tessera.protocol.errors import WireError
from tessera.protocol.records import MAX_GOSSIP_RECORDS, GossipPush, Heartbeat, PeerRecord, SignedRecord
from tessera.stages.quant import base_model_id

from tessera.peer.base.errors import PeerError
from tessera.peer.net.transport import GOSSIP_PROTOCOL, PING_PROTOCOL, Channel, Stream, Transport
from tessera.peer.plan.view import PeerInfo, SwarmView

log = logging.getLogger(__name__)

# One exchange is two small messages on an existing connection: a few RTTs.
# 5 s leaves room for a relayed link across continents without stalling the loop.
EXCHANGE_TIMEOUT = 5.0
CONNECT_TIMEOUT = 2.0  # a dial to a peer the view names (it may be gone)
# How often neighbours swap views; advertisements live RECORD_TTL (peer/node/peer_node.py), several periods.
GOSSIP_INTERVAL = 2.0
PING_TIMEOUT = 5.0
RTT_SMOOTHING = 0.3  # weight of a new sample in the moving average
MAX_FOREIGN_MODELS = 256  # other-model peers remembered for the join message; more says nothing new


def peer_id_str(raw: bytes) -> str:
    return ID(raw).to_base58()


def info_from_record(record: PeerRecord) -> PeerInfo:
    return PeerInfo(
        peer_id=peer_id_str(record.peer_id),
        model_id=record.model_id,
        start=record.start,
        end=record.end,
        throughput=record.throughput,
        name=record.name,
        free_memory=record.free_memory,
        load=record.load,
        max_sessions=record.max_sessions,
        state=record.state,
        reachability=record.reachability,
        addrs=tuple(record.addrs),
        rtt_ms={peer_id_str(n.peer_id): n.rtt_ms for n in record.neighbours},
        expires_at=record.expires_at,
        issued_at=record.issued_at,
        dtype=record.dtype,
        shard_index=record.shard_index,
        shard_count=record.shard_count,
        shard_group=record.shard_group,
        device=record.device,
        device_free=record.device_free,
    )


@dataclass
class Known:
    signed: SignedRecord
    record: PeerRecord
    info: PeerInfo


class ViewKeeper:
    """The verified advertisements one node holds, for one model.

    `merge` is the only way in: every record is verified; records of other models
    are dropped (peers chain only on the identical model); for each peer the
    highest `seq` wins. A model id carries the span's quantization (`+int8`, ...;
    stages/quant.py `model_tag`); `accept_mixed` keeps every quantization of the same
    model (a requester that accepts mixed precision).
    """

    def __init__(self, *, model_id: str, num_layers: int, clock: Callable[[], float],
                 accept_mixed: bool = False) -> None:
        self.model_id = model_id
        self.accept_mixed = accept_mixed
        self.num_layers = num_layers
        self.clock = clock
        self.known: dict[str, Known] = {}
        self.changed = trio.Event()
        self.rejected = 0
        # peer id -> model id of peers that advertised another model (bounded: gossip is untrusted)
        self.foreign_models: dict[str, str] = {}

    def merge(self, records: Iterable[SignedRecord]) -> list[str]:
        """Verify and keep records; return the peer ids whose entry changed."""
        now = self.clock()
        updated = []
        for signed in records:
            try:
                record = verify_record(signed, now=now)
            except WireError as bad:
                self.rejected += 1
                log.debug("ignored advertisement: %s", bad)
                continue
            pid = peer_id_str(record.peer_id)
            if not self.accepts(record.model_id):
                if len(self.foreign_models) < MAX_FOREIGN_MODELS:  # kept only to tell a joiner why (peer/net/join.py)
                    self.foreign_models[pid] = record.model_id
                continue
            old = self.known.get(pid)
            if old is not None and old.record.seq >= record.seq:
                continue
            self.known[pid] = Known(signed, record, info_from_record(record))
            updated.append(pid)
        if updated:
            self.changed.set()
            self.changed = trio.Event()
        return updated

    def accepts(self, model_id: str) -> bool:
        if self.accept_mixed:
            return base_model_id(model_id) == base_model_id(self.model_id)
        return model_id == self.model_id

    def forget(self, peer_id: str) -> None:
        self.known.pop(peer_id, None)

    def records(self) -> list[SignedRecord]:
        now = self.clock()
        return [k.signed for k in self.known.values() if k.record.expires_at > now]

    def snapshot(self) -> SwarmView:
        """The live (unexpired) peers as an immutable view."""
        now = self.clock()
        return SwarmView.of(self.num_layers, (k.info for k in self.known.values() if k.record.expires_at > now))

    def addrs(self, peer_id: str) -> tuple[str, ...]:
        known = self.known.get(peer_id)
        return known.info.addrs if known else ()

    async def wait_changed(self) -> None:
        await self.changed.wait()


class Gossip:
    """Swaps advertisements with neighbours; serves `GOSSIP_PROTOCOL`."""

    def __init__(
        self,
        transport: Transport,
        keeper: ViewKeeper,
        *,
        own_record: Callable[[], SignedRecord | None] = lambda: None,
        interval: float = GOSSIP_INTERVAL,
    ) -> None:
        self.transport = transport
        self.keeper = keeper
        self.own_record = own_record
        self.interval = interval
        # neighbours whose last exchange failed: a vanished peer can stay "connected" for a
        # while, and an announce that waited EXCHANGE_TIMEOUT on it would delay every
        # advertisement (and so every move) behind it; only the periodic round retries them
        self.failing: set[str] = set()
        transport.set_handler(GOSSIP_PROTOCOL, self.handle)

    def _outgoing(self) -> list[SignedRecord]:
        own = self.own_record()
        records = [r for r in self.keeper.records() if own is None or r.public_key != own.public_key]
        return ([own] if own else []) + records

    async def handle(self, stream: Stream) -> None:
        channel = Channel(stream)
        try:
            with trio.fail_after(EXCHANGE_TIMEOUT):
                theirs = await channel.receive()
                if not isinstance(theirs, GossipPush):
                    raise WireError(f"expected GossipPush, got {type(theirs).__name__}")
                self.keeper.merge(theirs.records)
                for chunk in chunks(self._outgoing()):
                    await channel.send(GossipPush(tuple(chunk)))
            await channel.close()
        except (trio.TooSlowError, PeerError, WireError) as bad:
            log.debug("gossip from %s failed: %s", stream.remote, bad)
            await channel.reset()  # a stalled or garbled exchange is abandoned, not half-closed

    async def exchange(self, peer_id: str) -> bool:
        """One round trip with `peer_id`; False if it failed (the peer may be gone)."""
        try:
            with trio.fail_after(EXCHANGE_TIMEOUT):
                channel = Channel(await self.transport.open_stream(peer_id, GOSSIP_PROTOCOL))
                outgoing = self._outgoing()
                await channel.send(GossipPush(tuple(outgoing[:MAX_GOSSIP_RECORDS])))
                while (reply := await channel.receive_or_none()) is not None:
                    if isinstance(reply, GossipPush):
                        self.keeper.merge(reply.records)
            self.failing.discard(peer_id)
            return True
        except (trio.TooSlowError, PeerError, WireError) as bad:
            log.debug("gossip with %s failed: %s", peer_id, bad)
            self.failing.add(peer_id)
            return False

    async def announce(self, *, retry_failing: bool = False) -> None:
        """Exchange with every connected peer now (after our own record changed); peers
        whose last exchange failed only when `retry_failing` (the periodic round)."""
        connected = self.transport.connected()
        self.failing.intersection_update(connected)  # a peer we dropped is forgotten, not kept
        async with trio.open_nursery() as nursery:
            for peer_id in connected:
                if retry_failing or peer_id not in self.failing:
                    nursery.start_soon(self.exchange, peer_id)

    async def connect_known(self, on_connect: Callable[[str], None] = lambda peer_id: None) -> None:
        """Dial the peers the view names that we are not connected to yet (each for at most
        CONNECT_TIMEOUT; one that fails may be gone, and its record will expire)."""
        connected = set(self.transport.connected())
        for info in self.keeper.snapshot().peers:
            if info.peer_id != self.transport.peer_id and info.peer_id not in connected and info.addrs:
                with trio.move_on_after(CONNECT_TIMEOUT):
                    try:
                        await self.transport.connect(info.addrs[0])
                    except PeerError:
                        continue
                    on_connect(info.peer_id)

    async def round(self, on_connect: Callable[[str], None] = lambda peer_id: None) -> None:
        """The periodic round: meet the peers the view names, then exchange with every
        neighbour (those whose last exchange failed included)."""
        await self.connect_known(on_connect)
        await self.announce(retry_failing=True)

    async def run(self) -> None:
        while True:
            await self.round()
            await trio.sleep(self.interval)


def chunks(records: list[SignedRecord]) -> Iterable[list[SignedRecord]]:
    for i in range(0, max(len(records), 1), MAX_GOSSIP_RECORDS):
        yield records[i : i + MAX_GOSSIP_RECORDS]


class Pinger:
    """Measures RTTs to neighbours (moving average), and answers their probes."""

    def __init__(self, transport: Transport, *, clock: Callable[[], float] = trio.current_time) -> None:
        self.transport = transport
        self.clock = clock
        self.rtt_ms: dict[str, float] = {}
        self._seq = 0
        transport.set_handler(PING_PROTOCOL, self.handle)

    async def handle(self, stream: Stream) -> None:
        channel = Channel(stream)
        try:
            with trio.fail_after(PING_TIMEOUT):
                while (probe := await channel.receive_or_none()) is not None:
                    if not isinstance(probe, Heartbeat):
                        raise WireError(f"expected Heartbeat, got {type(probe).__name__}")
                    await channel.send(probe)
        except (trio.TooSlowError, PeerError, WireError):
            await channel.reset()

    async def ping(self, peer_id: str) -> float | None:
        """One probe; the RTT in ms (also folded into `rtt_ms`), or None if it failed."""
        self._seq += 1
        try:
            with trio.fail_after(PING_TIMEOUT):
                channel = Channel(await self.transport.open_stream(peer_id, PING_PROTOCOL))
                sent = self.clock()
                await channel.send(Heartbeat(self._seq, sent))
                reply = await channel.receive()
                rtt = (self.clock() - sent) * 1000.0
                await channel.close()
        except (trio.TooSlowError, PeerError, WireError):
            return None
        if not isinstance(reply, Heartbeat) or reply.seq != self._seq:
            return None
        old = self.rtt_ms.get(peer_id)
        self.rtt_ms[peer_id] = rtt if old is None else (1 - RTT_SMOOTHING) * old + RTT_SMOOTHING * rtt
        return rtt

    async def ping_all(self) -> None:
        async with trio.open_nursery() as nursery:
            for peer_id in self.transport.connected():
                nursery.start_soon(self.ping, peer_id)
        for gone in set(self.rtt_ms) - set(self.transport.connected()):
            del self.rtt_ms[gone]
