"""Behind NAT: learn whether others can dial us, reserve relays if not, report every link's kind.

A peer's NAT policy, run by `PeerNode` next to its gossip (py-libp2p's services that
do the work sit in `peer/net/nat/relay.py`; the dial-back protocol in
`peer/net/nat/dialback.py`):

1. Reachability. Ask up to `CHECK_HELPERS` directly connected peers of the swarm view
   (not requesters, which serve no dial-backs) to dial us back (`DialBack`). Any
   confirmed dial-back: PUBLIC, and we advertise exactly the addresses that were
   reached. Helpers that saw our address but could not reach it: PRIVATE. Nobody to ask
   (the first peer of a swarm): UNKNOWN, advertise our listen addresses, and ask again
   as soon as someone connects. Checked again every `RECHECK_INTERVAL` (a laptop changes
   networks).
2. Relay service. A PUBLIC peer relays for others (circuit v2 HOP), within
   `nat_relay.RELAY_LIMITS` — automatically: a volunteer who can be dialled is
   what the swarm's NATed members need, and the limits keep it cheap.
3. Reservations. A PRIVATE peer reserves a slot on up to `WANTED_RELAYS` public
   peers of the swarm view (lowest RTT first), advertises
   `<relay addr>/p2p-circuit/p2p/<self>` for each, renews each reservation when half
   its lifetime is gone or its relay connection dropped, and takes up relays that
   appear later (every view change is looked at; py-libp2p's own relay discovery
   runs only at start-up and then every 5 minutes).
4. Hole punching. When two peers meet over a relay, py-libp2p's DCUtR service (on
   every host) tries a punch; new streams prefer the direct connection at once,
   and DCUtR closes the relayed one after its grace period. Every outcome and every
   change of a link's kind is logged (`link <peer>: relayed -> punched`) and traced.
   The advertised reachability summarises it for the swarm view:

       "public"        others dial it directly
       "hole-punched"  behind NAT; a punch has succeeded (meet it over a relay, expect direct)
       "relayed"       behind NAT; punches failed (a NAT that answers RST): traffic stays relayed
       "private"       behind NAT; no punch tried yet
       "unknown"       not checked yet

   Routing needs no extra term: a relayed neighbour's RTT is measured through the
   relay, so routing's RTT cost already prefers direct links.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Awaitable, Callable

import trio

from tessera.store.trace import NullTracer, Tracer
from tessera.store import events

from tessera.peer.base.errors import PeerError
from tessera.peer.net.addresses import PUBLIC as PUBLIC_SCOPE, scope
from tessera.peer.net.gossip import ViewKeeper
from tessera.peer.net.libp2p import Libp2pTransport
from tessera.peer.net.nat.dialback import DialBack, DialBackOutcome
from tessera.peer.net.nat.links import serve_links
from tessera.peer.net.nat.relay import RELAY_LIMITS, is_circuit_addr
from tessera.peer.net.transport import DIRECT, RELAYED
from tessera.peer.plan.view import LEAVING, Reachability

log = logging.getLogger(__name__)


def _is_loopback(addr: str) -> bool:
    return addr.startswith(("/ip4/127.", "/ip6/::1/"))

# Verdicts of the dial-back check.
UNKNOWN = Reachability.UNKNOWN
PUBLIC = Reachability.PUBLIC
PRIVATE = Reachability.PRIVATE
# What a private peer advertises as its reachability once punches were tried.
HOLE_PUNCHED = Reachability.HOLE_PUNCHED
RELAYED_ONLY = Reachability.RELAYED

CHECK_HELPERS = 3  # peers asked at once; one confirmed dial-back suffices
RECHECK_INTERVAL = 120.0  # a known verdict is checked again this often
# While UNKNOWN, look for a helper this often (a new connection also wakes the check).
RETRY_INTERVAL = 2.0
WANTED_RELAYS = 2  # a private peer keeps reservations on this many relays (one may leave)
# Renew a reservation when less than this share of its lifetime is left (the relay keeps
# it RELAY_LIMITS.reservation_ttl; renewing at half leaves room for a failed attempt).
RENEW_WHEN_LEFT = 0.5
RELAY_POLL = 2.0  # reservations are looked at on every view change, or this often
LINK_POLL = 1.0  # how often link kinds are compared (a punch takes ~0.2 s, a relay dial ~0.1 s)
RELAY_DIAL_TIMEOUT = 10.0  # connecting to a relay before reserving (a direct dial: one to a few RTTs)
# A relay that refused us (full, or gone) is asked again only after this long, not on every poll.
RELAY_RETRY_AFTER = 30.0


class NatService:
    """One peer's NAT policy over a `Libp2pTransport` (see module docstring)."""

    def __init__(
        self,
        transport: Libp2pTransport,
        keeper: ViewKeeper,
        *,
        out: Callable[[str], None] = print,
        tracer: Tracer | None = None,
        on_change: Callable[[], Awaitable[None]] | None = None,
        trust_loopback: bool = True,
    ) -> None:
        self.transport = transport
        self.trust_loopback = trust_loopback  # loopback-only listeners are public without asking
        self.keeper = keeper
        self.out = out
        self.tracer = tracer or NullTracer()
        self.on_change = on_change
        self.relay = transport.relay
        self.dialback = DialBack(transport, probe_factory=transport.open_probe, listen_addrs=transport.listen_addrs)
        self.verdict = UNKNOWN
        self.public_addrs: list[str] = []
        self.relay_addrs: dict[str, str] = {}  # relay peer id -> our circuit address through it
        self.punched: set[str] = set()  # peers a punch succeeded with
        self.punch_failed: set[str] = set()  # peers every punch failed with
        self.links: dict[str, str] = {}  # connected peer -> DIRECT / PUNCHED / RELAYED
        self._refused: dict[str, float] = {}  # relay peer id -> when we may ask it again (monotonic)
        self.checked_at = 0.0
        self._changed = trio.Event()
        transport.set_advertised(self.advertised)
        serve_links(transport, lambda: dict(self.links))
        if self.relay is not None:
            self.relay.puncher.on_result = self._on_punch
            self.relay.puncher.may_be_dialable = self._may_be_dialable

    # -- what the record says -----------------------------------------------------------

    def advertised(self) -> list[str]:
        """The addresses others can use: reached ones, relayed ones, or (unknown) where we listen."""
        if self.verdict == PUBLIC:
            return list(self.public_addrs)
        if self.verdict == PRIVATE:
            return sorted(self.relay_addrs.values())
        return self.transport.listen_addrs()

    @property
    def reachability(self) -> str:
        if self.verdict != PRIVATE:
            return self.verdict
        if self.punched:
            return HOLE_PUNCHED
        return RELAYED_ONLY if self.punch_failed else PRIVATE

    def status(self) -> dict:
        """For `PeerNode.status()`: reachability, relays, and every link's kind."""
        return {
            "reachability": self.reachability,
            "checked_at": self.checked_at,  # last conclusive dial-back check (epoch seconds; 0: none yet)
            "advertised": self.advertised(),
            "relays": sorted(self.relay_addrs),
            "relaying": bool(self.relay and self.relay.hop_enabled),
            "links": dict(sorted(self.links.items())),
            "punched": sorted(self.punched),
            "punch_failed": sorted(self.punch_failed - self.punched),
        }

    # -- running ------------------------------------------------------------------------

    async def run(self) -> None:
        """Until cancelled: the reachability check, relays, link kinds."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._reachability_loop)
            nursery.start_soon(self._relay_loop)
            nursery.start_soon(self._link_loop)
            nursery.start_soon(self._announce_loop)

    async def _announce_loop(self) -> None:
        while True:
            await self._changed.wait()
            self._changed = trio.Event()
            if self.on_change is not None:
                await self.on_change()

    def _mark_changed(self) -> None:
        self._changed.set()

    # -- 1. reachability ----------------------------------------------------------------

    def helpers(self) -> list[str]:
        """Peers that may dial us back: directly connected ones (over a relay they cannot see our
        address) that the swarm view holds — a requester connected to us serves no dial-backs, and
        asking one only has libp2p log a refused protocol on this peer. Only while no peer of the
        view is connected (a record not merged yet) is every connected peer asked."""
        peers = [p for p in self.transport.connected() if self.transport.connection_kind(p) not in (None, RELAYED)]
        in_view = [p for p in peers if self.keeper.get(p) is not None]
        peers = in_view or peers
        random.shuffle(peers)  # spread the asking over the swarm
        return peers[:CHECK_HELPERS]

    async def check_reachability(self) -> str:
        """Ask helpers to dial us back; update (and return) the verdict."""
        listen = self.transport.listen_addrs()
        if self.trust_loopback and listen and all(_is_loopback(a) for a in listen):
            # a peer listening on loopback only serves peers on its own host, which can
            # always dial it; asking (and, on a busy machine, timing out) would only ever
            # mislabel it private and send a local swarm through relays
            if self.verdict != PUBLIC:
                self.verdict, self.public_addrs = PUBLIC, sorted(listen)
                self._apply_verdict()
                self._mark_changed()
            return self.verdict
        outcomes: list[DialBackOutcome] = []

        async def ask(helper: str) -> None:
            outcome = await self.dialback.check(helper)
            if outcome is not None:
                outcomes.append(outcome)

        async with trio.open_nursery() as nursery:
            for helper in self.helpers():
                nursery.start_soon(ask, helper)
        conclusive = [o for o in outcomes if o.conclusive]
        if not conclusive:
            return self.verdict
        self.checked_at = time.time()
        reached = sorted({a for o in conclusive for a in o.reached})
        verdict = PUBLIC if reached else PRIVATE
        if verdict != self.verdict or reached != self.public_addrs:
            self.verdict, self.public_addrs = verdict, reached
            where = ", ".join(reached) if reached else "no dial-back got through"
            self.out(f"reachability: {verdict} ({where}; asked {', '.join(o.helper[-8:] for o in conclusive)})")
            for addr in reached:  # dialled back at a public IP: the address to give people elsewhere
                if scope(addr) == PUBLIC_SCOPE:
                    self.out(f"reachable from the internet at {addr} (others anywhere can --join it)")
            self.tracer.emit(events.Advertise(reachability=verdict, addrs=reached))
            self._apply_verdict()
            self._mark_changed()
        return self.verdict

    def _apply_verdict(self) -> None:
        if self.relay is None:
            return
        if self.verdict == PUBLIC:
            self.relay.enable_hop()
            for relay_id in list(self.relay_addrs):
                self._drop_relay(relay_id)
        else:
            self.relay.disable_hop()

    async def _reachability_loop(self) -> None:
        while True:
            await self.check_reachability()
            wait = RECHECK_INTERVAL if self.verdict != UNKNOWN else RETRY_INTERVAL
            await trio.sleep(wait * random.uniform(0.9, 1.1))

    # -- 3. reservations ----------------------------------------------------------------

    def relay_candidates(self) -> list[str]:
        """Public peers of the view, ours first, then by measured RTT (unmeasured last), then id."""
        me = self.transport.peer_id
        view = self.keeper.snapshot()
        mine = view.get(me)
        rtts = mine.rtt_ms if mine else {}
        peers = [p for p in view.peers if p.peer_id != me and p.reachability == PUBLIC and p.state != LEAVING
                 and any(not is_circuit_addr(a) for a in p.addrs)]
        peers.sort(key=lambda p: (p.peer_id not in self.relay_addrs, rtts.get(p.peer_id, float("inf")), p.peer_id))
        return [p.peer_id for p in peers]

    async def keep_reservations(self) -> None:
        """Hold reservations on up to WANTED_RELAYS relays; renew the ones getting old."""
        if self.relay is None or self.verdict != PRIVATE:
            return
        wanted = self.relay_candidates()
        changed = False
        for relay_id in list(self.relay_addrs):
            if relay_id not in wanted:  # left the swarm, or no longer public
                self._drop_relay(relay_id)
                changed = True
        for relay_id in wanted:
            if len(self.relay_addrs) >= WANTED_RELAYS and relay_id not in self.relay_addrs:
                break
            if not self._needs_renewal(relay_id) or self._refused.get(relay_id, 0.0) > time.monotonic():
                continue
            addr = await self._reserve(relay_id)
            if addr is None:
                self._refused[relay_id] = time.monotonic() + RELAY_RETRY_AFTER
                if relay_id in self.relay_addrs:
                    self._drop_relay(relay_id)
                    changed = True
                continue
            if self.relay_addrs.get(relay_id) != addr:
                self.relay_addrs[relay_id] = addr
                self.out(f"relay: reserved a slot on {relay_id[-8:]}; reachable at {addr}")
                changed = True
        if changed:
            self._mark_changed()

    def _needs_renewal(self, relay_id: str) -> bool:
        expires = self.relay.reservations.get(relay_id, 0.0)
        left = expires - time.time()
        return (relay_id not in self.relay_addrs or relay_id not in self.transport.connected()
                or left < RELAY_LIMITS.reservation_ttl * RENEW_WHEN_LEFT)

    async def _reserve(self, relay_id: str) -> str | None:
        """Connect to the relay and reserve (or renew); our circuit address through it, or None."""
        direct = [a for a in self.keeper.addrs(relay_id) if not is_circuit_addr(a)]
        try:
            with trio.fail_after(RELAY_DIAL_TIMEOUT):
                await self.transport.dial(relay_id, direct)
            expires = await self.relay.reserve(relay_id)
        except (PeerError, trio.TooSlowError) as error:
            log.info("relay %s unusable: %s", relay_id, error)
            return None
        except Exception as error:  # py-libp2p's stream and protocol errors: the relay refused or went away
            log.info("reservation on %s failed: %s: %s", relay_id, type(error).__name__, error)
            return None
        if not expires:
            return None
        base = direct[0] if direct[0].endswith(f"/p2p/{relay_id}") else f"{direct[0]}/p2p/{relay_id}"
        return f"{base}/p2p-circuit/p2p/{self.transport.peer_id}"

    def _drop_relay(self, relay_id: str) -> None:
        self.relay_addrs.pop(relay_id, None)
        if self.relay is not None:
            self.relay.drop_reservation(relay_id)
        self.out(f"relay: dropped {relay_id[-8:]}")

    async def _relay_loop(self) -> None:
        while True:
            await self.keep_reservations()
            with trio.move_on_after(RELAY_POLL):
                await self.keeper.wait_changed()

    # -- 4. link kinds ------------------------------------------------------------------

    def _may_be_dialable(self, peer_id: str) -> bool:
        """A peer the view says is behind NAT is not worth a plain direct dial (it would only time out)."""
        info = self.keeper.snapshot().get(peer_id)
        return info is None or info.reachability in (PUBLIC, UNKNOWN)

    def _on_punch(self, peer_id: str, ok: bool) -> None:
        before, known = self.reachability, peer_id in (self.punched if ok else self.punch_failed)
        if ok:
            self.punched.add(peer_id)
            self.punch_failed.discard(peer_id)
        elif peer_id not in self.punched:
            self.punch_failed.add(peer_id)
        if not known:  # both ends of one DCUtR exchange report; say it once
            self.out(f"hole punch with {peer_id}: {'succeeded, direct now' if ok else 'failed, staying relayed'}")
        if self.reachability != before:
            self._mark_changed()

    def poll_links(self) -> None:
        """Log and trace every link whose kind appeared, changed or went away."""
        now = {p: k for p in self.transport.connected() if (k := self.transport.connection_kind(p))}
        for peer_id, kind in now.items():
            old = self.links.get(peer_id)
            if kind != old:
                line = f"link {peer_id}: {old + ' -> ' if old else ''}{kind}"
                if old is None and kind == DIRECT:
                    # a plain direct connection (every requester, every `swarm status`) is news to no
                    # operator: -v shows it; the trace keeps it either way
                    log.info(line)
                else:
                    self.out(line)  # behind NAT: relayed, punched, a link changing kind
                self.tracer.emit(events.Connect(remote=peer_id, link=kind))
        for peer_id in set(self.links) - set(now):
            self.tracer.emit(events.Disconnect(remote=peer_id))
        self.links = now

    async def _link_loop(self) -> None:
        while True:
            self.poll_links()
            await trio.sleep(LINK_POLL)
