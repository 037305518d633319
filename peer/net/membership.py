"""Who a peer gossips with: a bounded, continually refreshed random sample of the swarm.

Every peer holds the whole view (peer/net/gossip.py), so a random sample of the swarm
is a draw from it, with no shuffling protocol (Bitcoin's address manager works the same
way: a full table of addresses, a few random outbound connections, a bounded number
of inbound ones). A peer

- dials OUTBOUND random peers of its view and asks each to be its neighbour (the first
  frame of a gossip exchange says so, `LINK_ASK`);
- accepts at most MAX_INBOUND such asks (`LINK_REFUSE` beyond: the asker draws again);
- every REFRESH_PERIODS gossip periods drops its oldest outbound neighbour (`LINK_BYE`,
  then the connection closes once idle) and draws a new one, so the sample keeps
  changing — a newcomer is soon somebody's neighbour, and an eclipse does not last;
- watches its neighbours: one whose connection drops without a goodbye, or whose
  exchange fails, is probed (a dial and an exchange, PROBE_TIMEOUT); if the probe fails
  too, the peer reports it gone (a `Departure` for the record it holds, pushed to its
  neighbours at once and spread like any change);
- keeps the addresses of peers reported gone for a while (the keeper's graveyard) and
  probes one of them every GRAVE_PROBE_PERIODS periods: a partition heals through
  them (the peer on the other side, alive after all, sees the departure and refutes it
  with a newer record);
- closes connections it opened for membership (joining, probes, refused asks,
  neighbours it dropped) once they carry no stream for IDLE_CLOSE seconds. The side
  that dialled closes; a connection somebody else opened (a session, a relay
  reservation) is theirs to close.

The bound. Membership holds at most MAX_CONNECTIONS = MAX_NEIGHBOURS + 2 = 26 connections
per peer in a steady swarm, whatever the swarm's size (see MAX_CONNECTIONS). With peers
drawing uniformly, a peer's inbound count is about Poisson(OUTBOUND): mean 6, and above 18
for about one peer in 100,000. A peer also sees, for a period or two, connections others
opened that it does not hold: an ask it refused, a link the other side dropped; their opener
closes them (tests/swarm/test_membership_swarm.py holds both). Sessions add their own
connections (a route's neighbours, a requester), bounded by the session limits
(peer/serve/limits.py); libp2p keeps those until their owners close them.
"""

from __future__ import annotations

import os
import random
from typing import Awaitable, Callable, Protocol, Sequence

import trio

from tessera.protocol.records import LINK_ACCEPT, LINK_ASK, LINK_BYE, LINK_NONE, LINK_REFUSE

from tessera.peer.base.errors import PeerError
from tessera.peer.net.transport import Transport

OUTBOUND = int(os.environ.get("TESSERA_GOSSIP_OUTBOUND", "6"))
"""Neighbours a peer dials: gossipsub's mesh degree D and near Bitcoin's 8 outbound. A random
graph where every node has 6 out-edges is connected with overwhelming probability, a death
is seen by several, and a change crosses it in O(log N) periods. TESSERA_GOSSIP_OUTBOUND
(tests only) lowers it so a test's small swarm shows the bound."""
MAX_INBOUND = int(os.environ.get("TESSERA_GOSSIP_INBOUND", str(3 * OUTBOUND)))
"""Neighbours a peer accepts: three times the mean in-degree (OUTBOUND), so an ask is rarely
refused, and no peer — a popular join address included — holds more."""
MAX_NEIGHBOURS = OUTBOUND + MAX_INBOUND
MAX_CONNECTIONS = MAX_NEIGHBOURS + 2
"""Connections membership holds at once in a steady swarm: its neighbours (dialled ones and
the asks in flight together at most OUTBOUND), one dropped by the sample's refresh until it
closes at the next tick, one probe of a peer reported gone. A newcomer holds up to
PULL_CONCURRENCY (gossip.py) more while it pulls the view, and a join address's connection
until its first neighbours answer."""
REFRESH_PERIODS = 10
"""Every this many gossip periods the oldest outbound neighbour is replaced by a new draw."""
IDLE_CLOSE = 30.0
"""Seconds a connection membership opened may sit idle (no stream) before it is closed."""
CONNECT_TIMEOUT = 2.0
"""A dial to a peer of the view (a few RTTs on a live address; it may be gone)."""
RELAYED_CONNECT_TIMEOUT = 10.0
"""A dial to a peer that advertises only relayed addresses (behind NAT): a reservation's relay
opens a hop and a stop stream, and the two ends run Noise over them, each a round trip
through the relay; measured 2-4 s on a loaded machine (tests/net/test_nat.py), as long as
the transport's own dial allows (peer/net/libp2p.py DIAL_TIMEOUT). Cut at 2 s, the dial
failed and the peer was not drawn again for a minute."""
PROBE_TIMEOUT = 5.0
"""A probe's exchange: one digest each way on a connection that should be up. As long as a
turn's timeout: a peer reported gone vanishes from every view until it refutes it, so a
loaded peer (a CPU peer computing, two processes to a core) must not be taken for a dead one;
a crashed peer's probe fails at once anyway (connection refused)."""
REFUSED_BACKOFF = 60.0
"""A peer that refused us (full) is not drawn again for this long."""
FAILED_BACKOFF = 5.0
"""A peer we could not link with (the dial or the exchange failed: it may be gone, or busy) is
first left alone for this long, then twice as long for each failure in a row, up to
REFUSED_BACKOFF, each wait stretched by a random factor in [1, 1.5). Short and random at first
because a failure is often a collision, not an absence: two peers behind NAT that draw each
other in the same tick dial each other through their relay at once, and both connections are
torn down (tests/net/test_nat.py, one run in three on a loaded machine). With one fixed minute
they stayed strangers for that minute, both; with different short waits one asks again first
and the other's next draw finds the link made."""
MAX_SEED_BACKOFF = 300.0
"""A join address that does not answer (its peer left, or is restarting) backs off as
FAILED_BACKOFF says, doubling up to this: a peer alone does not dial a gone one every minute
for hours, each a libp2p failure line, yet finds it within five minutes of its return."""
GRAVE_PROBE_PERIODS = 4
"""Every this many periods, one peer reported gone is dialled again (partitions heal)."""
MAX_AVOID = 256  # peers remembered as refusing or unreachable (bounded: the swarm may be huge)

Link = Callable[[str, int, float], Awaitable[int | None]]  # (peer, link ask, timeout) -> its answer, None: failed


class MemberView(Protocol):
    """What membership reads of a peer's view (gossip.py's ViewKeeper)."""

    seeds: dict[str, tuple[str, ...]]  # join addresses, by peer id

    def sample(self, rng: random.Random, fits: Callable[[str], bool]) -> str | None:
        """A random live peer of the view that `fits`, or None."""
        ...

    def addrs(self, peer_id: str) -> tuple[str, ...]: ...

    def grave_to_probe(self, now: float) -> str | None:
        """A peer reported gone that is due to be dialled again, or None."""
        ...

    def grave_probed(self, peer_id: str, alive: bool, now: float) -> None: ...


class Membership:
    """The neighbour set of one peer (see the module docstring). `link(peer, ask, timeout)`
    runs a gossip exchange carrying a link ask and returns the answer (None if it failed)."""

    def __init__(self, transport: Transport, keeper: MemberView, *, link: Link, rng: random.Random,
                 report_gone: Callable[[str], None], on_connect: Callable[[str], None] = lambda peer_id: None,
                 protected: Callable[[str], bool] = lambda peer_id: False) -> None:
        self.transport = transport
        self.keeper = keeper
        self.link = link
        self.rng = rng
        self.report_gone = report_gone
        self.on_connect = on_connect
        self.protected = protected  # connections never closed here (a relay reservation's)
        self.outbound: dict[str, float] = {}  # neighbour -> since when
        self.inbound: dict[str, float] = {}
        self.pending: set[str] = set()  # links being asked, probes running
        self.opened: dict[str, float] = {}  # connections we opened that are no neighbour's -> since
        # peer -> (not drawn before this time, unless its addresses are no longer these)
        self.avoid: dict[str, tuple[float, tuple[str, ...]]] = {}
        self.failures: dict[str, float] = {}  # peer -> the wait after its last failure in a row (FAILED_BACKOFF)
        self.byes: set[str] = set()  # neighbours that said goodbye (their connection may close)
        self.ticks = 0

    # -- reading --------------------------------------------------------------------------

    def neighbours(self) -> list[str]:
        return sorted(self.outbound.keys() | self.inbound.keys())

    def partner(self, busy: set[str]) -> str | None:
        """A random neighbour to exchange with this period."""
        choices = [p for p in self.neighbours() if p not in busy]
        return self.rng.choice(choices) if choices else None

    def status(self) -> dict:
        return {"outbound": sorted(self.outbound), "inbound": sorted(self.inbound), "opened": sorted(self.opened),
                "bound": MAX_CONNECTIONS}

    # -- the responder's side of a link ---------------------------------------------------

    def answer(self, peer_id: str, ask: int) -> int:
        """What we answer a link ask (or goodbye) from `peer_id`."""
        if ask == LINK_ASK:
            if peer_id in self.outbound or peer_id in self.inbound:
                return LINK_ACCEPT
            if len(self.inbound) >= MAX_INBOUND:
                return LINK_REFUSE
            self.inbound[peer_id] = trio.current_time()
            self.byes.discard(peer_id)
            return LINK_ACCEPT
        if ask == LINK_BYE:
            self.inbound.pop(peer_id, None)
            if peer_id in self.outbound:  # both had chosen each other: the link stays ours
                return LINK_NONE
            self.byes.add(peer_id)
        return LINK_NONE

    # -- each period ------------------------------------------------------------------------

    def maintain(self, nursery: trio.Nursery) -> None:
        """Notice lost neighbours, refresh the sample, fill it, probe a grave, close idle connections."""
        now = trio.current_time()
        connected = set(self.transport.connected())
        self.ticks += 1
        for peer_id in [p for p in self.neighbours() if p not in connected]:
            was_outbound = self.outbound.pop(peer_id, None) is not None
            self.inbound.pop(peer_id, None)
            if peer_id in self.byes:
                self.byes.discard(peer_id)
            elif peer_id not in self.pending:
                self.pending.add(peer_id)
                nursery.start_soon(self._probe, peer_id, was_outbound)
        self.byes &= connected
        if self.ticks % REFRESH_PERIODS == 0 and len(self.outbound) >= OUTBOUND:
            oldest = min(self.outbound, key=lambda p: (self.outbound[p], p))
            nursery.start_soon(self._drop, oldest)
        asking = sum(1 for p in self.pending if p not in self.outbound and p not in self.inbound)
        for _ in range(OUTBOUND - len(self.outbound) - asking):
            peer_id = self._draw(connected)
            if peer_id is None:
                break
            self.pending.add(peer_id)
            nursery.start_soon(self._ask, peer_id)
        if self.ticks % GRAVE_PROBE_PERIODS == 0:
            grave = self.keeper.grave_to_probe(now)
            if grave is not None and grave not in self.pending and grave not in connected:
                self.pending.add(grave)
                nursery.start_soon(self._probe_grave, grave)
        for peer_id, since in list(self.opened.items()):
            if peer_id in self.outbound or peer_id in self.inbound or peer_id not in connected:
                del self.opened[peer_id]
            elif (peer_id not in self.pending and now - since >= IDLE_CLOSE and not self.protected(peer_id)
                  and self.transport.stream_count(peer_id) == 0):
                del self.opened[peer_id]
                nursery.start_soon(self.transport.disconnect, peer_id)
        for peer_id in [p for p, (until, _) in self.avoid.items() if until <= now]:
            del self.avoid[peer_id]

    async def release(self, peer_id: str) -> None:
        """We are done with a connection we opened (a pull, a refused ask): closed now if idle and
        no neighbour's, else left for `maintain` to close once it is."""
        if peer_id in self.outbound or peer_id in self.inbound or peer_id in self.pending or self.protected(peer_id):
            return
        if self.transport.stream_count(peer_id) == 0 and peer_id in self.transport.connected():
            self.opened.pop(peer_id, None)
            await self.transport.disconnect(peer_id)
        else:
            self.opened[peer_id] = trio.current_time() - IDLE_CLOSE

    def exchange_failed(self, peer_id: str, nursery: trio.Nursery) -> None:
        """A neighbour's exchange failed: probe it (it may be gone)."""
        if (peer_id in self.outbound or peer_id in self.inbound) and peer_id not in self.pending:
            self.pending.add(peer_id)
            nursery.start_soon(self._probe, peer_id, peer_id in self.outbound)

    # -- drawing, asking, probing ---------------------------------------------------------------

    def _draw(self, connected: set[str]) -> str | None:
        """A random peer of the view to ask (or, alone, a join address)."""
        me = self.transport.peer_id
        taken = self.outbound.keys() | self.pending

        def fits(peer_id: str) -> bool:
            return peer_id != me and peer_id not in taken and not self._avoided(peer_id)

        known = self.keeper.sample(self.rng, fits)
        if known is not None:
            return known
        if not self.outbound and not self.inbound:  # alone: back to where we joined
            seeds = [p for p in sorted(self.keeper.seeds) if fits(p) and p not in connected]
            return self.rng.choice(seeds) if seeds else None
        return None

    def _avoided(self, peer_id: str) -> bool:
        """Refused or unreachable lately, at the addresses it still advertises (a peer behind NAT
        first lists its LAN addresses, then its relayed one: that one is tried at once)."""
        avoided = self.avoid.get(peer_id)
        return avoided is not None and avoided[0] > trio.current_time() and avoided[1] == self.keeper.addrs(peer_id)

    def _avoid(self, peer_id: str, answer: int | None) -> None:
        """Do not draw `peer_id` for a while: it refused our ask (full), or the link failed (None)."""
        cap = MAX_SEED_BACKOFF if peer_id in self.keeper.seeds else REFUSED_BACKOFF
        if answer is None:
            last = self.failures.pop(peer_id, None)
            wait = FAILED_BACKOFF if last is None else min(cap, 2 * last)
            self.failures[peer_id] = wait  # (re-inserted: the oldest streaks are dropped first)
            backoff = min(cap, wait * (1.0 + 0.5 * self.rng.random()))
        else:
            backoff = REFUSED_BACKOFF
        self.avoid[peer_id] = (trio.current_time() + backoff, self.keeper.addrs(peer_id))
        for table in (self.avoid, self.failures):
            while len(table) > MAX_AVOID:
                del table[next(iter(table))]

    async def dial(self, peer_id: str) -> bool:
        """Connect to `peer_id` if we are not; True if connected."""
        if peer_id in self.transport.connected():
            return True
        addrs: Sequence[str] = self.keeper.addrs(peer_id)
        relayed = any("/p2p-circuit" in a for a in addrs[:4])  # (peer/net/nat/relay.py is_circuit_addr)
        with trio.move_on_after(RELAYED_CONNECT_TIMEOUT if relayed else CONNECT_TIMEOUT):
            for addr in addrs[:4]:  # a peer lists its interfaces; the first usually works
                try:
                    if await self.transport.connect(addr) == peer_id:
                        self.opened.setdefault(peer_id, trio.current_time())
                        self.on_connect(peer_id)
                        return True
                except PeerError:
                    continue
        return False

    async def _ask(self, peer_id: str) -> None:
        try:
            answer = await self.link(peer_id, LINK_ASK, PROBE_TIMEOUT) if await self.dial(peer_id) else None
            if answer == LINK_ACCEPT:
                self.outbound[peer_id] = trio.current_time()
                self.opened.pop(peer_id, None)
                self.failures.pop(peer_id, None)
            else:
                self._avoid(peer_id, answer)
        finally:
            self.pending.discard(peer_id)
        if peer_id not in self.outbound:
            await self.release(peer_id)

    async def _probe(self, peer_id: str, was_outbound: bool) -> None:
        """A neighbour went quiet or its connection dropped: link again (an inbound one: just
        look), or report it gone."""
        try:
            ask = LINK_ASK if was_outbound else LINK_NONE
            answer = await self.link(peer_id, ask, PROBE_TIMEOUT) if await self.dial(peer_id) else None
            if answer == LINK_ACCEPT:
                self.outbound[peer_id] = trio.current_time()
                self.opened.pop(peer_id, None)
            elif answer is None:
                self.outbound.pop(peer_id, None)
                self.inbound.pop(peer_id, None)
                self.report_gone(peer_id)
                if peer_id in self.transport.connected() and not self.protected(peer_id):
                    await self.transport.disconnect(peer_id)  # a silent peer's connection is dead weight
        finally:
            self.pending.discard(peer_id)

    async def _drop(self, peer_id: str) -> None:
        """Stop being `peer_id`'s neighbour (the sample's refresh); the connection closes when idle."""
        if self.outbound.pop(peer_id, None) is None:
            return
        if peer_id not in self.inbound:  # (if it chose us too, the connection stays its link)
            self.opened[peer_id] = trio.current_time() - IDLE_CLOSE  # closed at the next tick if idle
        await self.link(peer_id, LINK_BYE, PROBE_TIMEOUT)

    async def _probe_grave(self, peer_id: str) -> None:
        """Dial a peer reported gone; if it answers, an exchange shows it the report (it refutes)."""
        try:
            alive = await self.dial(peer_id) and await self.link(peer_id, LINK_NONE, PROBE_TIMEOUT) is not None
            self.keeper.grave_probed(peer_id, alive, trio.current_time())
        finally:
            self.pending.discard(peer_id)


__all__ = ["Membership", "MemberView", "OUTBOUND", "MAX_INBOUND", "MAX_NEIGHBOURS", "MAX_CONNECTIONS", "REFRESH_PERIODS", "IDLE_CLOSE",
           "CONNECT_TIMEOUT", "RELAYED_CONNECT_TIMEOUT", "PROBE_TIMEOUT", "GRAVE_PROBE_PERIODS", "MAX_SEED_BACKOFF",
           "REFUSED_BACKOFF", "FAILED_BACKOFF"]
