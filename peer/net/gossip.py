"""How the swarm view spreads: signed advertisements, kept in agreement by anti-entropy.

Every peer signs a `PeerRecord` about itself (span, state, speed, load, addresses,
RTTs to its neighbours) with an expiry, and re-signs it (a higher `seq`, a later
expiry) every advertise period, well before it expires. Records are relayed as
signed, so a relay cannot alter them; each receiver verifies signature, peer id
and expiry before a record enters its `ViewKeeper`, and only a higher `seq` of the
same peer replaces what it holds. A draining, paused or leaving peer says so in
its record's `state`.

Anti-entropy (one stream, `GOSSIP_PROTOCOL`; initiator I, responder R):

    I -> R  GossipDigest   (peer id, seq, expiry) of every live record I holds
    R -> I  GossipPush     the records R holds that I lacks or holds older
    R -> I  GossipPull     the peers whose records I holds newer (the last frame ends R's turn)
    I -> R  GossipPush     those records; then both sides close

Afterwards both hold, for every peer, the newer of their two records: one exchange
makes two neighbours agree. Every message is bounded (digests of MAX_DIGEST_ENTRIES
per frame, records in batches of MAX_GOSSIP_RECORDS), and only what differs travels.
A first frame that is a `GossipPush` gets the old whole-view answer (a push of
everything), so an older requester still learns the view.

Every `interval` (P, GOSSIP_INTERVAL) a peer's `tick` dials the peers it knows of
but is not connected to — from the view, and from an address book that outlives the
records (a connection libp2p closed or reset while idle, or a partition longer than
a TTL, is re-dialled from it) — and starts an exchange with EVERY connected
neighbour (each exchange on its own, so a slow neighbour delays nobody else). A
peer whose own record changes exchanges with its neighbours at once (`announce`).

The bound. Let δ be one exchange's duration (a dial plus a few round trips, at
most EXCHANGE_TIMEOUT). After the last change (a join, leave, crash, move, memory
change, or a link healing), any two live peers that can reach each other — directly,
or through peers that can — hold the same live record set within 2 gossip periods
plus 2δ. Why: a changed record reaches every connected neighbour of its source at
once (`announce`, δ); any two connected peers exchange at least once in every
window of 1.9 periods (each tick skips a neighbour exchanged with less than 0.9 of a
period ago, so a pair exchanges about once a period rather than twice), so a peer
that is not the source's neighbour gets it from one within 1.9P + δ; and a peer
that knows of a peer it is not connected to dials it at its next tick (≤ P) and
exchanges at once — which is how a healed link, or a connection libp2p closed while
idle, rejoins the two sides. A crashed peer's record disappears everywhere at its
expiry (at most RECORD_TTL after its last refresh); the copies agree on that expiry
by then, since its last refresh spreads within the same bound. A peer the address
book forgot (REDIAL_WINDOW after its record expired, dials then back off up to
MAX_REDIAL_BACKOFF) adds that backoff to the bound; join addresses are never
forgotten. A peer that said it was leaving is not re-dialled at all, but for a join address,
retried with that doubling backoff until its peer advertises again. tests/net/test_gossip_convergence.py checks the bound under random sequences
of joins, leaves, crashes, vanishings, moves, memory changes and partitions.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterable, Sequence

import trio
from libp2p.peer.id import ID

from tessera.protocol.crypto import verify_record
from tessera.protocol.errors import WireError
from tessera.protocol.records import (
    MAX_DIGEST_ENTRIES, MAX_DIGEST_FRAMES, MAX_GOSSIP_RECORDS, DigestEntry, GossipDigest, GossipPull, GossipPush,
    Heartbeat, PeerRecord, SignedRecord,
)
from tessera.stages.weights.quant import base_model_id

from tessera.peer.base.errors import PeerError
from tessera.peer.base.protocols import GOSSIP_PROTOCOL, PING_PROTOCOL
from tessera.peer.net.transport import Channel, Stream, Transport
from tessera.peer.plan.view import LEAVING, PeerInfo, SwarmView, merge_spans

log = logging.getLogger(__name__)

# One exchange is four small messages on an existing connection: a few RTTs.
# 5 s leaves room for a relayed link across continents without stalling the loop.
EXCHANGE_TIMEOUT = 5.0
CONNECT_TIMEOUT = 2.0  # a dial to a peer the view names (it may be gone)
# How often neighbours run anti-entropy; advertisements live RECORD_TTL (peer/node/config.py),
# several periods. TESSERA_GOSSIP_INTERVAL (tests only) shortens it so a test runs in seconds.
GOSSIP_INTERVAL = float(os.environ.get("TESSERA_GOSSIP_INTERVAL", "2.0"))
PING_TIMEOUT = 5.0
RTT_SMOOTHING = 0.3  # weight of a new sample in the moving average
# A known peer whose record expired is re-dialled every tick for this long (a partition or
# an idle connection libp2p closed heals within the bound), then with a doubling backoff up to
# MAX_REDIAL_BACKOFF, and forgotten FORGET_AFTER after its record expired (a day: a swarm
# must stay one swarm for days, and a dial a minute to a dead address costs nothing).
REDIAL_WINDOW = 600.0
MAX_REDIAL_BACKOFF = 300.0
FORGET_AFTER = 86400.0
MAX_PARALLEL_DIALS = 16
SEEN_SIGNATURES = 4096  # a few refreshes of a swarm of hundreds  # dials one tick runs at once (each at most CONNECT_TIMEOUT)
MAX_FOREIGN_MODELS = 256  # other-model peers remembered for the join message; more says nothing new


@lru_cache(maxsize=4096)
def peer_id_str(raw: bytes) -> str:
    return ID(raw).to_base58()  # base58 is slow in Python, and every digest names every peer


def material(record: PeerRecord | None) -> tuple | None:
    """What placement and routing read from a record: a change here is announced at once;
    a refresh (seq, expiry, load, RTTs) travels with the next tick."""
    if record is None:
        return None
    return (record.start, record.end, record.state, record.free_memory, record.max_sessions, record.throughput,
            record.addrs, record.shard_index, record.shard_count, record.shard_group, record.reachability, record.held)


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
        held=merge_spans((h.start, h.end) for h in record.held),
    )


@dataclass
class Known:
    signed: SignedRecord
    record: PeerRecord
    info: PeerInfo


@dataclass
class BookEntry:
    """Where a peer was last seen, kept after its record expires (see REDIAL_WINDOW)."""

    addrs: tuple[str, ...]
    expires_at: float  # of the newest record seen; inf for a join address
    leaving: bool = False  # it said it was going: not re-dialled (a join address: with a doubling backoff)
    seed: bool = False  # a join address: re-dialled whenever we are not connected, never forgotten
    next_dial: float = 0.0
    backoff: float = 0.0


class ViewKeeper:
    """The verified advertisements one node holds, for one model.

    `merge` is the only way in: every record is verified; records of other models
    are dropped (peers chain only on the identical model); for each peer the
    highest `seq` wins. A model id carries the span's quantization (`+int8`, ...;
    stages/weights/quant.py `model_tag`); `accept_mixed` keeps every quantization of the same
    model (a requester that accepts mixed precision). `book` remembers where every
    peer was seen (see BookEntry).
    """

    def __init__(self, *, model_id: str, num_layers: int, clock: Callable[[], float],
                 accept_mixed: bool = False) -> None:
        self.model_id = model_id
        self.accept_mixed = accept_mixed
        self.num_layers = num_layers
        self.clock = clock
        self.known: dict[str, Known] = {}
        self.book: dict[str, BookEntry] = {}
        self.changed = trio.Event()
        self.rejected = 0
        # peer id -> model id of peers that advertised another model (bounded: gossip is untrusted)
        self.foreign_models: dict[str, str] = {}
        # signatures of records verified before (kept or found older): the same record again,
        # brought by several neighbours in one period, costs a dict lookup, not a verification
        self._seen: dict[bytes, None] = {}

    def merge(self, records: Iterable[SignedRecord]) -> list[str]:
        """Verify and keep records; return the peer ids whose entry changed."""
        now = self.clock()
        updated = []
        for signed in records:
            if signed.signature in self._seen:
                continue
            try:
                record = verify_record(signed, now=now)
            except WireError as bad:
                self.rejected += 1
                log.debug("ignored advertisement: %s", bad)
                continue
            self._seen[signed.signature] = None
            if len(self._seen) > SEEN_SIGNATURES:
                del self._seen[next(iter(self._seen))]  # the oldest
            pid = peer_id_str(record.peer_id)
            if not self.accepts(record.model_id):
                if len(self.foreign_models) < MAX_FOREIGN_MODELS:  # kept only to tell a joiner why (peer/net/join.py)
                    self.foreign_models[pid] = record.model_id
                continue
            old = self.known.get(pid)
            if old is not None and old.record.seq >= record.seq:
                continue
            self.known[pid] = Known(signed, record, info_from_record(record))
            seed = self.book.get(pid)
            if seed is not None and seed.seed:
                seed.addrs = tuple(dict.fromkeys(seed.addrs + tuple(record.addrs)))
                seed.leaving = record.state == LEAVING
                if not seed.leaving:  # back (a restart): dialled as usual again
                    seed.backoff, seed.next_dial = 0.0, 0.0
            elif record.addrs:
                self.book[pid] = BookEntry(tuple(record.addrs), record.expires_at, leaving=record.state == LEAVING)
            updated.append(pid)
        if updated:
            self.changed.set()
            self.changed = trio.Event()
        return updated

    def accepts(self, model_id: str) -> bool:
        if self.accept_mixed:
            return base_model_id(model_id) == base_model_id(self.model_id)
        return model_id == self.model_id

    def remember(self, addr: str) -> str | None:
        """Keep a join address for good (never forgotten); returns its peer id, if it names one."""
        peer_id = addr.rsplit("/p2p/", 1)[-1] if "/p2p/" in addr else ""
        if not peer_id:
            return None
        entry = self.book.get(peer_id)
        addrs = (addr,) + tuple(a for a in (entry.addrs if entry else ()) if a != addr)
        self.book[peer_id] = BookEntry(addrs, float("inf"), seed=True)
        return peer_id

    def forget(self, peer_id: str) -> None:
        known = self.known.pop(peer_id, None)
        if known is not None:
            self._seen.pop(known.signed.signature, None)  # the same record may come back

    def live(self) -> dict[str, Known]:
        now = self.clock()
        return {pid: k for pid, k in self.known.items() if k.record.expires_at > now}

    def records(self) -> list[SignedRecord]:
        return [k.signed for k in self.live().values()]

    def digest(self) -> list[DigestEntry]:
        return [DigestEntry(k.record.peer_id, k.record.seq, k.record.expires_at) for k in self.live().values()]

    def compare(self, theirs: Iterable[DigestEntry]) -> tuple[list[SignedRecord], list[bytes]]:
        """Against another side's digest: (our live records it lacks or holds older, the peer
        ids whose unexpired record it holds newer than ours)."""
        now = self.clock()
        live = self.live()
        their_seq: dict[str, int] = {}
        wanted: dict[bytes, None] = {}  # an ordered set
        for entry in theirs:
            try:
                pid = peer_id_str(entry.peer_id)
            except Exception:  # not a valid multihash: nothing to want or compare
                continue
            their_seq[pid] = max(entry.seq, their_seq.get(pid, -1))
            mine = self.known.get(pid)
            if entry.expires_at > now and (mine is None or mine.record.seq < entry.seq):
                wanted[entry.peer_id] = None
        give = [k.signed for pid, k in live.items() if their_seq.get(pid, -1) < k.record.seq]
        return give, list(wanted)

    def snapshot(self) -> SwarmView:
        """The live (unexpired) peers as an immutable view."""
        return SwarmView.of(self.num_layers, (k.info for k in self.live().values()))

    def addrs(self, peer_id: str) -> tuple[str, ...]:
        known = self.known.get(peer_id)
        if known is not None:
            return known.info.addrs
        entry = self.book.get(peer_id)
        return entry.addrs if entry else ()

    def dial_targets(self, me: str, connected: Iterable[str]) -> list[tuple[str, tuple[str, ...]]]:
        """The peers to dial now: every one with a live record, and those the book still
        remembers (see REDIAL_WINDOW), that we are not connected to; forgets stale entries."""
        now = self.clock()
        skip = set(connected) | {me}
        out = []
        for pid, entry in list(self.book.items()):
            if pid in skip or not entry.addrs:
                continue
            if entry.leaving:
                # It said it was going (a graceful leave): not re-dialled every tick (it was, at
                # twice a second across the gossip and ping rounds, for as long as the peer ran).
                # A join address is tried again with a doubling backoff (its peer may come back);
                # any other entry is dropped once its record has expired.
                if entry.seed and now >= entry.next_dial:
                    entry.backoff = min(MAX_REDIAL_BACKOFF, max(entry.backoff * 2, GOSSIP_INTERVAL))
                    entry.next_dial = now + entry.backoff
                    out.append((pid, entry.addrs))
                elif not entry.seed and entry.expires_at <= now:
                    del self.book[pid]
                continue
            if entry.expires_at > now:
                out.append((pid, entry.addrs))
                continue
            if now - entry.expires_at > FORGET_AFTER:
                del self.book[pid]
                continue
            if now < entry.next_dial:
                continue
            if now - entry.expires_at > REDIAL_WINDOW:
                entry.backoff = min(MAX_REDIAL_BACKOFF, max(entry.backoff * 2, GOSSIP_INTERVAL))
                entry.next_dial = now + entry.backoff
            out.append((pid, entry.addrs))
        return out

    async def wait_changed(self) -> None:
        await self.changed.wait()


class Gossip:
    """Anti-entropy with every neighbour (see the module docstring); serves `GOSSIP_PROTOCOL`."""

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
        # neighbours whose last exchange failed, and how many times in a row: a vanished peer
        # can stay "connected" for a while, and an announce that waited EXCHANGE_TIMEOUT on it
        # would delay every advertisement (and so every move) behind it; only ticks retry them
        self.failing: dict[str, int] = {}
        self._exchanging: set[str] = set()  # one exchange per neighbour at a time
        # when we last completed an exchange with each neighbour, either side starting it: a
        # tick skips one exchanged with less than a period ago (pairs exchange about once a
        # period, not twice, and the bound holds: the newer of any two views crosses each link
        # within a period)
        self.last_exchange: dict[str, float] = {}
        self._dialling: set[str] = set()
        self._dial_limit = trio.CapacityLimiter(MAX_PARALLEL_DIALS)
        self.exchanges = 0  # completed, for tests and status
        transport.set_handler(GOSSIP_PROTOCOL, self.handle)

    def _with_own(self) -> None:
        """Our own record is in the keeper (the digest is made from it)."""
        own = self.own_record()
        if own is not None:
            known = self.keeper.known.get(self.transport.peer_id)
            if known is None or known.signed is not own:
                self.keeper.merge([own])

    def _outgoing(self) -> list[SignedRecord]:
        own = self.own_record()
        records = [r for r in self.keeper.records() if own is None or r.public_key != own.public_key]
        return ([own] if own else []) + records

    # -- the responder ----------------------------------------------------------------------

    async def handle(self, stream: Stream) -> None:
        channel = Channel(stream)
        try:
            with trio.fail_after(EXCHANGE_TIMEOUT):
                first = await channel.receive()
                if isinstance(first, GossipPush):  # the whole-view exchange (older initiators, tests)
                    self.keeper.merge(first.records)
                    for chunk in chunks(self._outgoing(), MAX_GOSSIP_RECORDS):
                        await channel.send(GossipPush(tuple(chunk)))
                elif isinstance(first, GossipDigest):
                    await self._answer_digest(channel, first)
                    self.last_exchange[stream.remote] = trio.current_time()
                else:
                    raise WireError(f"expected GossipDigest or GossipPush, got {type(first).__name__}")
            await channel.close()
        except (trio.TooSlowError, PeerError, WireError) as bad:
            log.debug("gossip from %s failed: %s", stream.remote, bad)
            await channel.reset()  # a stalled or garbled exchange is abandoned, not half-closed

    async def _answer_digest(self, channel: Channel, first: GossipDigest) -> None:
        theirs = list(first.entries)
        frame = first
        while frame.more:
            if len(theirs) >= MAX_DIGEST_ENTRIES * MAX_DIGEST_FRAMES:
                raise WireError(f"gossip digest longer than {MAX_DIGEST_FRAMES} frames")
            frame = await channel.receive()
            if not isinstance(frame, GossipDigest):
                raise WireError(f"expected GossipDigest, got {type(frame).__name__}")
            theirs += frame.entries
        self._with_own()
        give, wanted = self.keeper.compare(theirs)
        for chunk in chunks(give, MAX_GOSSIP_RECORDS):
            if chunk:
                await channel.send(GossipPush(tuple(chunk)))
        pulls = list(chunks(wanted, MAX_GOSSIP_RECORDS))
        for i, chunk in enumerate(pulls):
            await channel.send(GossipPull(tuple(chunk), more=i < len(pulls) - 1))
        budget = len(wanted)  # they may send at most what we asked for
        while (msg := await channel.receive_or_none()) is not None:
            if not isinstance(msg, GossipPush):
                raise WireError(f"expected GossipPush, got {type(msg).__name__}")
            budget -= len(msg.records)
            if budget < 0:
                raise WireError("gossip: sent more records than were pulled")
            self.keeper.merge(msg.records)

    # -- the initiator ----------------------------------------------------------------------

    async def exchange(self, peer_id: str) -> bool:
        """One anti-entropy exchange with `peer_id`; False if it failed (the peer may be gone)."""
        if peer_id in self._exchanging:
            return True  # one is running; it will bring what this one would
        self._exchanging.add(peer_id)
        try:
            with trio.fail_after(EXCHANGE_TIMEOUT):
                channel = Channel(await self.transport.open_stream(peer_id, GOSSIP_PROTOCOL))
                try:
                    await self._run_digest(channel)
                except BaseException:
                    await channel.reset()
                    raise
            self.failing.pop(peer_id, None)
            self.exchanges += 1
            self.last_exchange[peer_id] = trio.current_time()
            return True
        except (trio.TooSlowError, PeerError, WireError) as bad:
            log.debug("gossip with %s failed: %s", peer_id, bad)
            # Counted, never acted on by dropping the connection: a timeout on a loaded peer is
            # not a dead link, and the connection carries that peer's sessions too.
            self.failing[peer_id] = self.failing.get(peer_id, 0) + 1
            return False
        finally:
            self._exchanging.discard(peer_id)

    async def _run_digest(self, channel: Channel) -> None:
        self._with_own()
        digest = self.keeper.digest()
        frames = list(chunks(digest, MAX_DIGEST_ENTRIES))[:MAX_DIGEST_FRAMES]
        for i, frame in enumerate(frames):
            await channel.send(GossipDigest(tuple(frame), more=i < len(frames) - 1))
        wanted: list[bytes] = []
        while True:
            msg = await channel.receive()
            if isinstance(msg, GossipPush):
                self.keeper.merge(msg.records)
            elif isinstance(msg, GossipPull):
                wanted += msg.peer_ids
                if len(wanted) > len(digest):
                    raise WireError("gossip: pulled more records than the digest named")
                if not msg.more:
                    break
            else:
                raise WireError(f"expected GossipPush or GossipPull, got {type(msg).__name__}")
        live = self.keeper.live()
        give = [live[pid].signed for pid in dict.fromkeys(_ids(wanted)) if pid in live]
        for chunk in chunks(give, MAX_GOSSIP_RECORDS):
            await channel.send(GossipPush(tuple(chunk)))
        await channel.close()
        while await channel.receive_or_none() is not None:  # their close; nothing more is expected
            raise WireError("gossip: unexpected frame after the exchange")

    async def announce(self, *, retry_failing: bool = False) -> None:
        """Exchange with every connected peer now (after our own record changed); peers
        whose last exchange failed only when `retry_failing`."""
        connected = self.transport.connected()
        for gone in set(self.failing) - set(connected):
            del self.failing[gone]  # a peer we dropped is forgotten, not kept
        async with trio.open_nursery() as nursery:
            for peer_id in connected:
                if retry_failing or peer_id not in self.failing:
                    nursery.start_soon(self.exchange, peer_id)

    async def _dial(self, peer_id: str, addrs: Sequence[str], on_connect: Callable[[str], None]) -> bool:
        if peer_id in self._dialling:
            return False
        self._dialling.add(peer_id)
        try:
            async with self._dial_limit:
                with trio.move_on_after(CONNECT_TIMEOUT):
                    for addr in addrs[:4]:  # a few: a peer lists its interfaces, the first usually works
                        try:
                            if await self.transport.connect(addr) == peer_id:
                                on_connect(peer_id)
                                return True
                        except PeerError:
                            continue
            return False
        finally:
            self._dialling.discard(peer_id)

    async def connect_known(self, on_connect: Callable[[str], None] = lambda peer_id: None) -> None:
        """Dial, in parallel, the peers the view and the address book name that we are not
        connected to (each for at most CONNECT_TIMEOUT; one that fails may be gone)."""
        targets = self.keeper.dial_targets(self.transport.peer_id, self.transport.connected())
        async with trio.open_nursery() as nursery:
            for peer_id, addrs in targets:
                nursery.start_soon(self._dial, peer_id, addrs, on_connect)

    async def round(self, on_connect: Callable[[str], None] = lambda peer_id: None) -> None:
        """One tick, awaited: meet the peers we know of, then exchange with every neighbour
        (those whose last exchange failed included)."""
        await self.connect_known(on_connect)
        await self.announce(retry_failing=True)

    def tick(self, nursery: trio.Nursery, on_connect: Callable[[str], None] = lambda peer_id: None) -> None:
        """Start this period's work without waiting for it: a dial to each known peer we are
        not connected to (then an exchange with it), an exchange with every neighbour. A peer
        with a dial or an exchange still running is skipped (it cannot pile up)."""
        connected = self.transport.connected()
        for gone in set(self.failing) - set(connected):
            del self.failing[gone]
        for gone in set(self.last_exchange) - set(connected):
            del self.last_exchange[gone]
        for peer_id, addrs in self.keeper.dial_targets(self.transport.peer_id, connected):
            if peer_id not in self._dialling:
                nursery.start_soon(self._dial_and_exchange, peer_id, addrs, on_connect)
        recent = trio.current_time() - self.interval * 0.9  # a tick's own jitter is not "recent"
        for peer_id in connected:
            if peer_id not in self._exchanging and self.last_exchange.get(peer_id, -math.inf) < recent:
                nursery.start_soon(self.exchange, peer_id)

    async def _dial_and_exchange(self, peer_id: str, addrs: Sequence[str], on_connect: Callable[[str], None]) -> None:
        if await self._dial(peer_id, addrs, on_connect):
            await self.exchange(peer_id)

    async def run(self, on_connect: Callable[[str], None] = lambda peer_id: None) -> None:
        """Tick every `interval`, until cancelled."""
        async with trio.open_nursery() as nursery:
            while True:
                self.tick(nursery, on_connect)
                await trio.sleep(self.interval)


def chunks(items: list, size: int) -> Iterable[list]:
    for i in range(0, max(len(items), 1), size):
        yield items[i : i + size]


def _ids(raw: Iterable[bytes]) -> Iterable[str]:
    for pid in raw:
        try:
            yield peer_id_str(pid)
        except Exception:  # not a multihash: a peer id nobody holds
            continue


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
        seq = self._seq  # this probe's own: pings to several neighbours run at once
        try:
            with trio.fail_after(PING_TIMEOUT):
                channel = Channel(await self.transport.open_stream(peer_id, PING_PROTOCOL))
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
        return rtt

    async def ping_all(self) -> None:
        async with trio.open_nursery() as nursery:
            for peer_id in self.transport.connected():
                nursery.start_soon(self.ping, peer_id)
        for gone in set(self.rtt_ms) - set(self.transport.connected()):
            del self.rtt_ms[gone]
