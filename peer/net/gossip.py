"""How the swarm view spreads: signed records over a bounded overlay, reconciled by range hashes.

Every peer signs a `PeerRecord` about itself (span, state, speed, memory, addresses,
RTTs to its neighbours) and holds every other peer's: placement needs the whole swarm,
and so does a requester's routing. Records are relayed as signed, so a relay cannot
alter them; each receiver verifies signature, peer id and expiry before a record enters
its `ViewKeeper`, and only a higher `seq` of the same peer replaces what it holds.

Who talks to whom (peer/net/membership.py). A peer keeps a bounded, continually
refreshed random sample of the swarm as neighbours: OUTBOUND it dialled, at most
MAX_INBOUND that dialled it. Nothing dials the whole view.

What travels (peer/net/reconcile.py). Every gossip period P (GOSSIP_INTERVAL) a peer runs
one exchange with one random neighbour: each side's set of entries has a hash per range
of the key space (peer/net/record_set.py); the exchange compares the whole-set hashes and
descends only where they differ, and the entries that differ cross, both ways (push-pull).
A peer whose own record changes pushes it to its neighbours at once (`announce`), and so
does a peer that finds a neighbour gone (a `Departure`).

What does not travel. A record that did not change is not re-sent: records live a day
(RECORD_TTL, peer/node/config.py) and their owner re-signs when what placement and
routing read changes (`material`), or when three quarters of the lifetime are gone. A
dead peer's record goes by a departure, reported by a neighbour that saw it go (its
connection dropped or its exchange failed, and a probe failed too); a graceful leaver's
LEAVING record is short-lived. A departure beats the record it reports; a peer that hears
of its own departure (a false report, a healed partition) answers with a newer record.

The bound. Let N be the swarm's size. After the last change (a join, leave, crash, move,
memory change, or a link healing), any two live peers that can reach each other hold the
same entries within

    B(N) = D + (ceil(log2 N) + 2) * P

where D is the time for a death to be reported: a crashed neighbour's dropped connection is
seen at the next tick and its probe fails at once (a few RTTs); a vanished one (silent) is
found by a neighbour's pinger within a ping period, or sooner by a neighbour's exchange with
it (each picks one of its ~12 neighbours at random each period), and a probe confirms it
(`detection_seconds`: D <= ping period + 2 PING_TIMEOUT + PROBE_TIMEOUT + P). Why log2 N: push-pull anti-entropy with random
partners spreads one change to all N in log3 N + O(ln ln N) rounds (Karp, Schindelhauer,
Shenker & Vöcking, 2000); partners drawn from a random sparse overlay rather than the
whole swarm, and one exchange per peer per period, make it slower by a constant, and
log2 N + 2 covered every run of tests/net/test_gossip_convergence.py (3–64 peers) and the
simulator's bursts at up to 10,000 (bench/scale.py).

Traffic per peer per period, independent of N: one exchange begun and one answered on
average, each a 16-byte hash each way when the views agree; a change costs every peer
about one copy of it (push-pull sends an entry only to a side that lacks it) plus the
range digests down to it, 16 hashes per level, O(log N) levels. A joining peer, or a
requester, pulls the whole view once (its set is empty: everything is sent) and then
follows changes. At ten thousand peers a day-long record lifetime costs each peer the
renewal of about seven records a minute.
"""

from __future__ import annotations

import logging
import math
import os
import random
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterable, Iterator, Mapping

import trio

from tessera.protocol.crypto import MAX_CLOCK_SKEW
from tessera.protocol.errors import WireError
from tessera.protocol.records import (
    GOSSIP_FRAME_LIMIT, LINK_ASK, LINK_NONE, MAX_DEPARTURE_TTL, MAX_GOSSIP_RECORDS, Departure, GossipPush,
    PeerRecord, SignedRecord, ViewTurn,
)
from tessera.stages.kernels.quant import base_model_id

from tessera.peer.base.errors import PeerError
from tessera.peer.base.ids import peer_id_bytes, peer_id_text
from tessera.peer.base.protocols import GOSSIP_PROTOCOL
from tessera.peer.net import record_set as rs
from tessera.peer.net.membership import PROBE_TIMEOUT, Membership
from tessera.peer.net.pinger import PING_TIMEOUT
from tessera.peer.net.verified import Known, verified_entry
from tessera.peer.net.reconcile import (
    JOIN_SAMPLE, MAX_TURNS, PULL_RANGES, TurnOut, answer, frames, opening, pull_ranges,
)
from tessera.peer.net.transport import Channel, Stream, Transport
from tessera.peer.plan.view import LEAVING, PeerInfo, SwarmView

log = logging.getLogger(__name__)

# How often a peer exchanges with one neighbour. TESSERA_GOSSIP_INTERVAL (tests only)
# shortens it so a test runs in seconds.
GOSSIP_INTERVAL = float(os.environ.get("TESSERA_GOSSIP_INTERVAL", "2.0"))
# Each turn of an exchange must arrive within this: a few RTTs, and room for a relayed link
# across continents; a turn carrying a whole view (a joiner's pull) is many frames, each in time.
TURN_TIMEOUT = 5.0
EXCHANGE_TIMEOUT = TURN_TIMEOUT  # (the name older callers use for one exchange's wait)
DEPARTURE_TTL = 600.0
"""How long a departure is kept: far longer than it takes to reach everyone (B(N) is about a
minute at ten thousand peers), so no stale copy of the dead record outlives it."""
SLICES_PER_PULL = 4  # a newcomer's pull: 64 exchanges of 4 slices each (reconcile.PULL_RANGES)
PULL_CONCURRENCY = 16
PULL_TIMEOUT = 30.0  # one slice pull: a few turns, up to 1/64 of the view
MAX_VIEW_ENTRIES = 1 << 16
"""Entries one exchange may bring (a whole view): a swarm of 65,536 peers."""
REDIAL_WINDOW = 1800.0
"""A peer reported gone is dialled again (peer/net/membership.py) for this long: a partition
shorter than this heals by itself."""
MAX_GRAVES = 64  # peers reported gone whose addresses are kept for that (the most recent)
MAX_FOREIGN_MODELS = 256  # other-model peers remembered for the join message; more says nothing new


def detection_seconds(interval: float, ping_interval: float) -> float:
    """D in the bound: how long a death may take to be reported by a neighbour. A vanished
    peer is probed by every neighbour's pinger within a ping period (a round of pings waits
    out PING_TIMEOUT before the next begins), the failed ping sets off a probe, and the
    report starts with the next tick (peer/net/pinger.py `on_failure`, `Gossip.suspect`)."""
    return ping_interval + 2 * PING_TIMEOUT + PROBE_TIMEOUT + interval


def bound_seconds(n: int, interval: float = GOSSIP_INTERVAL, ping_interval: float = 5.0) -> float:
    """B(N): after the last change, how soon any two live peers in touch agree (see the docstring);
    `ping_interval` is the peers' (peer/node/config.py PING_INTERVAL: 5 s)."""
    return detection_seconds(interval, ping_interval) + (math.ceil(math.log2(max(n, 2))) + 2) * interval


def material(record: PeerRecord | None) -> tuple | None:
    """What placement and routing read from a record: a change here is re-signed and announced
    at once. The rest (load, RTTs, device memory) travels with the next re-signing — except
    whether the peer has a free session slot (routing skips a full one)."""
    if record is None:
        return None
    return (record.start, record.end, record.state, record.free_memory, record.max_sessions, record.throughput,
            record.addrs, record.shard_index, record.shard_count, record.shard_group, record.reachability, record.held,
            record.load >= 1.0)


@dataclass
class Grave:
    """A peer reported gone, kept to be dialled again (see REDIAL_WINDOW)."""

    addrs: tuple[str, ...]
    since: float
    next_probe: float
    backoff: float


class KnownRecords(Mapping[str, Known]):
    """A keeper's records by peer id (departures left out), read from its trie."""

    def __init__(self, root: rs.Node | None) -> None:
        self.root = root

    def __getitem__(self, peer_id: str) -> Known:
        try:
            entry = rs.get(self.root, peer_id_bytes(peer_id))
        except ValueError:
            raise KeyError(peer_id) from None
        if entry is None or entry.dead:
            raise KeyError(peer_id)
        return entry.value

    def __iter__(self) -> Iterator[str]:
        return (e.value.info.peer_id for e in rs.entries(self.root) if not e.dead)

    def __len__(self) -> int:
        return sum(1 for e in rs.entries(self.root) if not e.dead)


class ViewKeeper:
    """The verified records (and departures) one node holds, for one model.

    `merge` and `depart` are the only ways in: every record is verified; records of other
    models are dropped (peers chain only on the identical model); for each peer the
    higher version wins (peer/net/record_set.py). A model id carries the span's
    quantization (`+int8`, ...; stages/kernels/quant.py `model_tag`); `accept_mixed` keeps every
    quantization of the same model (a requester that accepts mixed precision). `seeds`
    are the join addresses (never forgotten); the graveyard keeps the addresses of peers
    reported gone, for a while (see REDIAL_WINDOW).
    """

    def __init__(self, *, model_id: str, num_layers: int, clock: Callable[[], float],
                 accept_mixed: bool = False) -> None:
        self.model_id = model_id
        self.accept_mixed = accept_mixed
        self.num_layers = num_layers
        self.clock = clock
        self.root: rs.Node | None = None
        self.seeds: dict[str, tuple[str, ...]] = {}
        self.graves: dict[str, Grave] = {}
        self.changed = trio.Event()
        self.rejected = 0
        # peer id -> model id of peers that advertised another model (bounded: gossip is untrusted)
        self.foreign_models: dict[str, str] = {}

    # -- what comes in ------------------------------------------------------------------------

    def merge(self, records: Iterable[SignedRecord]) -> list[str]:
        """Verify and keep records; return the peer ids whose entry changed."""
        now = self.clock()
        root = self.root
        updated = []
        for signed in records:
            try:
                entry = verified_entry(signed, now)
            except WireError as bad:
                self.rejected += 1
                log.debug("ignored advertisement: %s", bad)
                continue
            known: Known = entry.value
            if not self.accepts(known.record.model_id):
                if len(self.foreign_models) < MAX_FOREIGN_MODELS:  # kept only to tell a joiner why (peer/net/join.py)
                    self.foreign_models[known.info.peer_id] = known.record.model_id
                continue
            old = rs.get(root, entry.peer_id, entry.key)
            if old is not None and old.version >= entry.version:
                continue
            root = rs.put(root, entry)
            self.graves.pop(known.info.peer_id, None)
            updated.append(known.info.peer_id)
        self._set(root, updated)
        return updated

    def depart(self, departures: Iterable[Departure]) -> list[str]:
        """Keep departures that are newer than what we hold; return the peer ids they changed."""
        now = self.clock()
        root = self.root
        updated = []
        for d in departures:
            if not now < d.gone_until <= now + MAX_DEPARTURE_TTL + MAX_CLOCK_SKEW + 60.0:
                self.rejected += 1
                continue
            try:
                peer_id = peer_id_text(d.peer_id)
            except Exception:  # not a valid multihash: a peer nobody holds
                self.rejected += 1
                continue
            entry = rs.Entry(d.peer_id, d.seq, dead=True, gone_until=d.gone_until, ends=d.gone_until, value=None)
            old = rs.get(root, d.peer_id, entry.key)
            if old is not None and old.version >= entry.version:
                continue
            if old is not None and not old.dead and old.value.info.addrs:
                self._bury(peer_id, old.value.info.addrs, now)
            root = rs.put(root, entry)
            updated.append(peer_id)
        self._set(root, updated)
        return updated

    def report_gone(self, peer_id: str) -> Departure | None:
        """We saw `peer_id` go: a departure for the record we hold of it (None if we hold none)."""
        entry = rs.get(self.root, peer_id_bytes(peer_id))
        if entry is None or entry.dead:
            return None
        # on a one-minute grid: the neighbours that each see the peer go within the same
        # minute report the same departure, which then spreads once, not once per reporter
        until = math.ceil((self.clock() + DEPARTURE_TTL) / 60.0) * 60.0
        departure = Departure(entry.peer_id, entry.seq, until)
        self.depart([departure])
        return departure

    def adopt(self, root: rs.Node | None) -> None:
        """Take in another keeper's whole set (already verified: a node's own keeper, a simulation
        that gives a formed swarm's view to each of its peers); the higher version of each wins."""
        self._set(rs.union(self.root, root), [None])

    def _set(self, root: rs.Node | None, updated: list) -> None:
        self.root = root
        if updated:
            self.changed.set()
            self.changed = trio.Event()

    def accepts(self, model_id: str) -> bool:
        if self.accept_mixed:
            return base_model_id(model_id) == base_model_id(self.model_id)
        return model_id == self.model_id

    def remember(self, addr: str) -> str | None:
        """Keep a join address for good; returns its peer id, if it names one."""
        peer_id = addr.rsplit("/p2p/", 1)[-1] if "/p2p/" in addr else ""
        if not peer_id:
            return None
        self.seeds[peer_id] = (addr,) + tuple(a for a in self.seeds.get(peer_id, ()) if a != addr)
        return peer_id

    def prune(self) -> None:
        """Drop expired records and departures, and graves past REDIAL_WINDOW."""
        now = self.clock()
        root = rs.prune(self.root, now)
        if root is not self.root:
            self._set(root, [None])
        for peer_id in [p for p, g in self.graves.items() if now - g.since > REDIAL_WINDOW]:
            del self.graves[peer_id]

    # -- the graveyard ----------------------------------------------------------------------

    def _bury(self, peer_id: str, addrs: tuple[str, ...], now: float) -> None:
        self.graves[peer_id] = Grave(addrs, now, now + GOSSIP_INTERVAL, GOSSIP_INTERVAL)
        while len(self.graves) > MAX_GRAVES:
            del self.graves[next(iter(self.graves))]  # the oldest

    def grave_to_probe(self, now: float) -> str | None:
        """The peer reported gone that is due for a dial (the longest waiting), if any."""
        due = [(g.next_probe, p) for p, g in self.graves.items() if g.next_probe <= now]
        return min(due)[1] if due else None

    def grave_probed(self, peer_id: str, alive: bool, now: float) -> None:
        grave = self.graves.get(peer_id)
        if grave is None:
            return
        if alive:
            del self.graves[peer_id]  # it refutes; its record comes back through gossip
        else:
            grave.backoff = min(300.0, grave.backoff * 2)
            grave.next_probe = now + grave.backoff

    # -- what is read -----------------------------------------------------------------------

    @property
    def known(self) -> KnownRecords:
        """Every record held (expired ones until the next prune), by peer id."""
        return KnownRecords(self.root)

    def get(self, peer_id: str) -> Known | None:
        entry = rs.get(self.root, peer_id_bytes(peer_id))
        return None if entry is None or entry.dead else entry.value

    def entry(self, peer_id: str) -> rs.Entry | None:
        """The peer's entry, record or departure."""
        return rs.get(self.root, peer_id_bytes(peer_id))

    def live(self) -> dict[str, Known]:
        now = self.clock()
        return {e.value.info.peer_id: e.value for e in rs.entries(self.root)
                if not e.dead and e.value.record.expires_at > now}

    def records(self) -> list[SignedRecord]:
        return [k.signed for k in self.live().values()]

    def snapshot(self) -> SwarmView:
        """The live (unexpired) peers as an immutable view (built once per distinct set)."""
        self.prune()
        root = self.root
        if root is None:
            return SwarmView(self.num_layers, ())
        key = ("view", self.num_layers)
        view = root.memo.get(key)
        if view is None:
            view = root.memo[key] = SwarmView.of(self.num_layers, (e.value.info for e in rs.entries(root)
                                                                   if not e.dead))
        return view

    def addrs(self, peer_id: str) -> tuple[str, ...]:
        known = self.get(peer_id)
        if known is not None:
            return known.info.addrs
        grave = self.graves.get(peer_id)
        return grave.addrs if grave is not None else self.seeds.get(peer_id, ())

    def sample(self, rng: random.Random, fits: Callable[[str], bool], tries: int = 8) -> str | None:
        """A random live peer of the view that `fits` (and is dialable, not leaving), or None."""
        for _ in range(tries):
            entry = rs.sample(self.root, rng.getrandbits(rs.KEY_BITS))
            if entry is None:
                return None
            if entry.dead:
                continue
            info: PeerInfo = entry.value.info
            if info.addrs and info.state != LEAVING and fits(info.peer_id):
                return info.peer_id
        return None

    async def wait_changed(self) -> None:
        await self.changed.wait()


class Gossip:
    """A peer's gossip: its neighbours (peer/net/membership.py) and the view exchange it runs
    with them (see the module docstring); serves `GOSSIP_PROTOCOL`.

    `own_record` gives this peer's current signed record (None: a requester, an observer);
    `refute(seq)` is told when a departure of our own record arrives (re-sign above `seq`);
    `protected(peer)` names connections never closed here (relay reservations)."""

    def __init__(
        self,
        transport: Transport,
        keeper: ViewKeeper,
        *,
        own_record: Callable[[], SignedRecord | None] = lambda: None,
        interval: float = GOSSIP_INTERVAL,
        rng: random.Random | None = None,
        refute: Callable[[int], None] = lambda seq: None,
        on_connect: Callable[[str], None] = lambda peer_id: None,
        protected: Callable[[str], bool] = lambda peer_id: False,
    ) -> None:
        self.transport = transport
        self.keeper = keeper
        self.own_record = own_record
        self.interval = interval
        self.refute = refute
        self.rng = rng or random.Random()
        self.membership = Membership(transport, keeper, link=self._link, rng=self.rng,
                                     report_gone=self._report_gone, on_connect=on_connect, protected=protected)
        self._exchanging: set[str] = set()  # peers with an exchange of ours running (one at a time)
        self._nursery: trio.Nursery | None = None  # where run() starts pushes and probes
        self.exchanges = 0  # completed, for tests and status
        self.bytes_sent = 0  # every gossip frame this peer sent (both roles)
        transport.set_handler(GOSSIP_PROTOCOL, self.handle)

    def _with_own(self) -> None:
        """Our set is current: what expired is gone, and our own record is in (its hashes include it)."""
        self.keeper.prune()
        own = self.own_record()
        if own is not None:
            entry = self.keeper.entry(self.transport.peer_id)
            if entry is None or entry.dead or entry.value.signed.signature != own.signature:
                self.keeper.merge([own])

    def _take(self, turn: TurnOut) -> None:
        """Merge what a turn pushed; answer a departure of our own record."""
        if turn.records:
            self.keeper.merge(turn.records)
        if turn.departures:
            me = self.transport.peer_id
            if me in self.keeper.depart(turn.departures):
                entry = self.keeper.entry(me)
                self.refute(entry.seq if entry is not None else 0)

    # -- one exchange ----------------------------------------------------------------------

    async def _send(self, channel: Channel, turn: TurnOut, link: int = LINK_NONE) -> None:
        for frame in frames(turn, link=link):
            self.bytes_sent += await channel.send(frame)

    async def _receive(self, channel: Channel, budget: list[int]) -> tuple[TurnOut, int]:
        """One turn (its frames until `more` is unset) and the first frame's link field."""
        turn, link, first = TurnOut(), LINK_NONE, True
        deadline = trio.current_time() + TURN_TIMEOUT  # each frame of a turn within it of the last
        while True:
            with trio.fail_at(deadline):
                frame = await channel.receive()
            deadline = trio.current_time() + TURN_TIMEOUT
            if not isinstance(frame, ViewTurn):
                raise WireError(f"expected ViewTurn, got {type(frame).__name__}")
            if first:
                link, first = frame.link, False
            budget[0] -= len(frame.records) + len(frame.departures) + len(frame.want) + len(frame.ranges)
            if budget[0] < 0:
                raise WireError(f"gossip: an exchange brought more than {MAX_VIEW_ENTRIES} entries")
            turn.ranges += frame.ranges
            turn.want += frame.want
            turn.records += frame.records
            turn.departures += frame.departures
            if not frame.more:
                return turn, link

    async def _converse(self, channel: Channel, received: TurnOut | None, budget: list[int]) -> None:
        """Answer turns until one side's turn is empty (`received` None: we open)."""
        if received is None:
            received, _ = await self._receive(channel, budget)
        for _ in range(MAX_TURNS):
            self._take(received)
            if received.empty:
                return
            reply = answer(self.keeper.root, received, salt=rs.key_of(channel.remote.encode()))
            await self._send(channel, reply)
            if reply.empty:
                return
            received, _ = await self._receive(channel, budget)
        raise WireError(f"gossip: an exchange took more than {MAX_TURNS} turns")

    async def handle(self, stream: Stream) -> None:
        """The responder's side of an exchange: a stranger's stream throughout (peer/net/intake.py)."""
        ticket = self.transport.intake.enter(stream)
        if ticket is None:
            await stream.reset()
            return
        with ticket:
            await self._respond(stream, Channel(stream, memo=True, max_frame=GOSSIP_FRAME_LIMIT, on_frame=ticket.charge))
        if ticket.evicted:
            await stream.reset()

    async def _respond(self, stream: Stream, channel: Channel) -> None:
        try:
            with trio.fail_after(TURN_TIMEOUT):
                first = await channel.receive()
            if isinstance(first, GossipPush):  # an older requester's whole-view exchange
                self.keeper.merge(first.records)
                for chunk in chunks(self.keeper.records(), MAX_GOSSIP_RECORDS):
                    self.bytes_sent += await channel.send(GossipPush(tuple(chunk)))
            elif isinstance(first, ViewTurn):
                self._with_own()
                budget = [MAX_VIEW_ENTRIES]
                turn = TurnOut(list(first.ranges), list(first.want), list(first.records), list(first.departures))
                if first.more:
                    rest, _ = await self._receive(channel, budget)
                    turn.ranges += rest.ranges
                    turn.want += rest.want
                    turn.records += rest.records
                    turn.departures += rest.departures
                reply_link = self.membership.answer(stream.remote, first.link)
                self._take(turn)
                if not turn.empty:
                    reply = answer(self.keeper.root, turn, salt=rs.key_of(stream.remote.encode()))
                    await self._send(channel, reply, link=reply_link)
                    if not reply.empty:
                        await self._converse(channel, None, budget)
                elif first.link == LINK_ASK:
                    await self._send(channel, TurnOut(), link=reply_link)
            else:
                raise WireError(f"expected ViewTurn or GossipPush, got {type(first).__name__}")
            await channel.close()
        except (trio.TooSlowError, PeerError, WireError) as bad:
            log.debug("gossip from %s failed: %s", stream.remote, bad)
            await channel.reset()  # a stalled or garbled exchange is abandoned, not half-closed

    async def _run(self, peer_id: str, *, link: int = LINK_NONE, push: TurnOut | None = None,
                   timeout: float = math.inf) -> int | None:
        """One exchange begun by us (a digest of our set, or `push`): the remote's answer to
        `link`, or None if the exchange failed."""
        try:
            with trio.fail_after(timeout):
                with trio.fail_after(TURN_TIMEOUT):  # a silent peer's stream never opens
                    stream = await self.transport.open_stream(peer_id, GOSSIP_PROTOCOL)
                channel = Channel(stream, memo=True, max_frame=GOSSIP_FRAME_LIMIT)  # a responder's frames too
                try:
                    self._with_own()
                    budget = [MAX_VIEW_ENTRIES]
                    await self._send(channel, push if push is not None else opening(self.keeper.root), link=link)
                    received, answer_link = await self._receive(channel, budget)
                    await self._converse(channel, received, budget)
                    await channel.close()
                    with trio.move_on_after(TURN_TIMEOUT) as waiting:  # their close (a vanished peer never sends it)
                        while await channel.receive_or_none() is not None:
                            raise WireError("gossip: unexpected frame after the exchange")
                    if waiting.cancelled_caught:
                        await channel.reset()
                except BaseException:
                    await channel.reset()
                    raise
            self.exchanges += 1
            return answer_link
        except (trio.TooSlowError, PeerError, WireError) as bad:
            log.debug("gossip with %s failed: %s", peer_id, bad)
            return None

    async def _link(self, peer_id: str, link: int, timeout: float) -> int | None:
        return await self._run(peer_id, link=link, timeout=timeout)

    async def exchange(self, peer_id: str, *, whole_from_it: bool = False) -> bool:
        """One exchange with `peer_id` (connected); False if it failed (the peer may be gone).

        A newcomer (nothing held) gets a sample from it and then pulls the view from random
        peers (`pull_view`); `whole_from_it` pulls all of it from `peer_id` instead (to see
        exactly what one peer holds). A connection we gossip over and that is no neighbour's
        (a join address, a status check) is membership's to close once idle."""
        if peer_id in self._exchanging:
            return True  # one is running; it will bring what this one would
        if peer_id not in self.membership.outbound and peer_id not in self.membership.inbound:
            self.membership.opened.setdefault(peer_id, trio.current_time())
        newcomer = self.keeper.root is None
        self._exchanging.add(peer_id)
        try:
            push = pull_ranges(self.keeper.root, range(PULL_RANGES)) if whole_from_it else None
            if await self._run(peer_id, push=push) is None:
                return False
        finally:
            self._exchanging.discard(peer_id)
        if newcomer and not whole_from_it and self.keeper.root is not None and self.keeper.root.count >= JOIN_SAMPLE:
            await self.pull_view()
        return True

    async def pull_view(self) -> None:
        """Pull the whole view in slices, each from a random peer of what we hold (a newcomer
        holding a sample), PULL_CONCURRENCY at a time; a slice whose peer fails is asked of another."""
        me = self.transport.peer_id
        limit = trio.CapacityLimiter(PULL_CONCURRENCY)

        async def one(slices: list[int]) -> None:
            async with limit:
                for _ in range(3):
                    peer_id = self.keeper.sample(self.rng, lambda p: p != me)
                    if peer_id is None:
                        return
                    if not await self.membership.dial(peer_id):
                        continue
                    done = await self._run(peer_id, push=pull_ranges(self.keeper.root, slices),
                                           timeout=PULL_TIMEOUT) is not None
                    await self.membership.release(peer_id)
                    if done:
                        return

        async with trio.open_nursery() as nursery:
            for first in range(0, PULL_RANGES, SLICES_PER_PULL):
                nursery.start_soon(one, list(range(first, first + SLICES_PER_PULL)))

    # -- pushing changes ---------------------------------------------------------------------

    async def announce(self, *, departures: Iterable[Departure] = (), own: bool = True) -> None:
        """Push our own record (after it changed; unless not `own`) and `departures` to every
        neighbour now."""
        record = self.own_record() if own else None
        turn = TurnOut(records=[record] if record is not None else [], departures=list(departures))
        if turn.empty:
            return
        async with trio.open_nursery() as nursery:
            for peer_id in self.membership.neighbours():
                nursery.start_soon(self._push, peer_id, turn)

    async def _push(self, peer_id: str, turn: TurnOut) -> None:
        await self._run(peer_id, push=turn, timeout=TURN_TIMEOUT)

    def _report_gone(self, peer_id: str) -> None:
        departure = self.keeper.report_gone(peer_id)
        if departure is not None and self._nursery is not None:
            self._nursery.start_soon(partial(self.announce, departures=[departure], own=False))

    # -- each period ---------------------------------------------------------------------

    def tick(self, nursery: trio.Nursery) -> None:
        """This period's work, started and not awaited: look after the neighbours (dials,
        probes, refreshing the sample, closing idle connections) and begin one exchange with a
        random neighbour."""
        self._nursery = nursery
        self._with_own()
        self.membership.maintain(nursery)
        partner = self.membership.partner(self._exchanging)
        if partner is not None:
            nursery.start_soon(self._periodic, partner)

    async def _periodic(self, peer_id: str) -> None:
        if not await self.exchange(peer_id):
            self.suspect(peer_id)

    def suspect(self, peer_id: str) -> None:
        """Something we sent `peer_id` went unanswered (an exchange, a ping): if it is a
        neighbour, probe it, and report it gone if the probe fails too."""
        if self._nursery is not None:
            self.membership.exchange_failed(peer_id, self._nursery)

    async def settle_join(self) -> None:
        """After joining: draw our first neighbours now, then close the join connections that
        did not become neighbours' (a join address would otherwise hold one per newcomer)."""
        await self.round()
        for peer_id in list(self.membership.opened):
            await self.membership.release(peer_id)

    async def round(self) -> None:
        """One tick, awaited (a requester's refresh, a test)."""
        async with trio.open_nursery() as nursery:
            self.tick(nursery)
        self._nursery = None  # closed: a report of a peer gone is pushed by its own tick

    async def run(self) -> None:
        """Tick every `interval`, until cancelled."""
        async with trio.open_nursery() as nursery:
            while True:
                self.tick(nursery)
                await trio.sleep(self.interval)

    def status(self) -> dict:
        return {**self.membership.status(), "exchanges": self.exchanges, "bytes_sent": self.bytes_sent}


def chunks(items: list, size: int) -> Iterable[list]:
    for i in range(0, max(len(items), 1), size):
        yield items[i : i + size]
