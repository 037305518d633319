"""py-libp2p's circuit relay v2 and DCUtR, wired into one host (used by `peer/libp2p_transport.py`).

Every Tessera host runs the same relay stack; what it does depends on what the
NAT policy (`peer/net/nat/reachability.py`) decides:

- STOP (always): accept connections that reach us through a relay.
- dialling `<relay>/p2p-circuit/p2p/<peer>` addresses (always). py-libp2p's swarm
  skips circuit addresses when it dials by itself, so `Libp2pTransport` sends them
  here.
- HOP (only once a dial-back check found us publicly reachable): relay for others,
  within `RELAY_LIMITS`.
- reservations (private peers): `reserve()` asks a relay to keep a slot for us; the
  policy renews it before it expires.
- DCUtR (always): when two peers meet over a relay, py-libp2p's service tries a
  hole punch (TCP simultaneous open from both listen ports). `HolePuncher`
  subclasses it only to remember which direct connections a punch produced — so
  that `connection_kind` can say PUNCHED rather than DIRECT — to report each
  outcome, and to keep its dials short and away from addresses that cannot work.

What was measured on these machines (DEVELOPERS.md, shared/notes/libp2p-nat.md):
the punch works through a NAT that drops unsolicited SYNs and fails through one
that answers RST; a direct dial to a private address otherwise waits out
py-libp2p's 10 s default first.
"""

from __future__ import annotations

import logging
import time
import weakref
from contextlib import AsyncExitStack, asynccontextmanager
from typing import AsyncIterator, Callable

import multiaddr
import trio
from libp2p.connection_types import ConnectionType
from libp2p.host.basic_host import BasicHost
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.dcutr import MAX_HOLE_PUNCH_ATTEMPTS, DCUtRProtocol
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.tools.anyio_service import background_trio_service

log = logging.getLogger(__name__)

# What a public peer gives each private peer that reserves a slot with it. A relay
# carries only what hole punching could not move to a direct connection: gossip,
# pings and, for peers behind RST-answering NATs, whole sessions (SmolLM2-135M moves
# ~2.3 KB per token per hop; a 4096-token prefill ~9.4 MB). The caps keep one
# volunteer's uplink from being eaten by strangers: 16 circuits per reserved peer,
# 32 reservations, 1 GiB and 2 hours per circuit (libp2p's own defaults are
# 128 KiB / 2 min, sized for signalling only, which would cut a relayed session).
RELAY_LIMITS = RelayLimits(
    duration=2 * 3600,
    data=1 << 30,
    max_circuit_conns=16,
    max_reservations=32,
    reservation_ttl=3600,  # the spec's 1 h; the policy renews at half of it
)
# Dial timeout of DCUtR's own dials: both the unilateral "maybe it is public" dial and
# each hole-punch dial. A punched TCP simultaneous open completes within one SYN
# retransmission (1 s on Linux) once both SYNs are out; 3 s leaves two. py-libp2p's
# default of 10 s is what made a dial to an unroutable private address stall the
# whole upgrade.
PUNCH_DIAL_TIMEOUT = 3
# How long one relayed dial (relay CONNECT + Noise + yamux over the circuit) may take:
# three round trips through the relay, plus the relay's own connect to the target.
RELAY_DIAL_TIMEOUT = 10.0
RESERVE_TIMEOUT = 10.0  # one RESERVE round trip to the relay (py-libp2p reads for 15 s)
# How often relayed connections are looked for, to punch them (py-libp2p's own period).
AUTO_DRIVE_INTERVAL = 2.0

PunchListener = Callable[[str, bool], None]  # (peer id, succeeded)


def is_relayed(conn) -> bool:
    """Whether a py-libp2p connection runs through a relay (circuit v2)."""
    muxed = getattr(conn, "muxed_conn", conn)
    try:
        if muxed.get_connection_type() == ConnectionType.RELAYED:
            return True
    except (AttributeError, NotImplementedError):
        pass
    try:
        addrs = muxed.get_transport_addresses()
    except (AttributeError, NotImplementedError):
        return False
    return any("p2p-circuit" in str(a) for a in addrs)


def is_circuit_addr(addr: str) -> bool:
    return "/p2p-circuit" in addr


class HolePuncher(DCUtRProtocol):
    """py-libp2p's DCUtR service, remembering which connections a punch made."""

    def __init__(self, host: BasicHost, *, on_result: PunchListener | None = None) -> None:
        super().__init__(host, dial_timeout=PUNCH_DIAL_TIMEOUT)
        self.punched: weakref.WeakSet = weakref.WeakSet()  # connections a punch produced
        # Peers being punched now -> ids of their direct connections before the punch: a
        # connection that appears meanwhile is the punch's (the dial lands a moment before
        # py-libp2p's punch returns, and the kind must not flicker to DIRECT in between).
        # (Both ends may run a punch session at once: the first one's "before" counts.)
        self.punching: dict[ID, set[int]] = {}
        self._sessions: dict[ID, int] = {}
        self.attempts: dict[str, int] = {}
        self.failures: dict[str, int] = {}
        self.on_result = on_result
        # Whether a peer may be dialable directly after all (DCUtR's step 0); the NAT policy
        # answers from the swarm view: a peer that says it is behind NAT is not (saves a timeout).
        self.may_be_dialable: Callable[[str], bool] = lambda peer_id: True
        self._driving: set[ID] = set()

    def _direct_conns(self, peer_id: ID) -> list:
        conns = self.host.get_network().connections.get(peer_id) or []
        conns = conns if isinstance(conns, list) else [conns]
        return [c for c in conns if not is_relayed(c)]

    async def _perform_hole_punch(self, peer_id: ID, addrs: list, as_responder: bool = False) -> bool:
        # Both the initiator and the responder end here, once the CONNECT/SYNC exchange
        # over the relay is done; what follows is the simultaneous dial.
        before = set(map(id, self._direct_conns(peer_id)))
        pid = peer_id.to_base58()
        self.attempts[pid] = self.attempts.get(pid, 0) + 1
        started = time.monotonic()
        before = self.punching.setdefault(peer_id, before)
        self._sessions[peer_id] = self._sessions.get(peer_id, 0) + 1
        try:
            ok = await super()._perform_hole_punch(peer_id, addrs, as_responder)
        finally:
            self._sessions[peer_id] -= 1
            if not self._sessions[peer_id]:
                del self._sessions[peer_id], self.punching[peer_id]
        if ok:
            for conn in self._direct_conns(peer_id):
                if id(conn) not in before:
                    self.punched.add(conn)
        else:
            self.failures[pid] = self.failures.get(pid, 0) + 1
        log.info("hole punch to %s %s after %.2f s", pid, "succeeded" if ok else "failed", time.monotonic() - started)
        if self.on_result is not None:
            self.on_result(pid, ok)
        return ok

    async def _auto_drive_loop(self) -> None:
        # py-libp2p's loop punches one relayed peer after another, so one hopeless peer (a
        # requester listening on loopback: three attempts of ~20 s) holds up all the others.
        # Same choice of peers, one task each.
        while True:
            await trio.sleep(AUTO_DRIVE_INTERVAL)
            for peer_id, conns in list(self.host.get_network().connections.items()):
                conns = conns if isinstance(conns, list) else [conns]
                relayed_only = bool(conns) and all(is_relayed(c) for c in conns)
                if (not relayed_only or peer_id in self._driving or peer_id in self._in_progress
                        or self._hole_punch_attempts.get(peer_id, 0) >= MAX_HOLE_PUNCH_ATTEMPTS
                        or self._nursery is None):
                    continue
                self._driving.add(peer_id)
                self._nursery.start_soon(self._drive, peer_id)

    async def _drive(self, peer_id: ID) -> None:
        try:
            await self.initiate_hole_punch(peer_id)
        except Exception as error:  # py-libp2p's own loop swallows these too: a failed punch must not stop the service
            log.info("hole punch to %s stopped: %s: %s", peer_id, type(error).__name__, error)
        finally:
            self._driving.discard(peer_id)

    def made_by_punch(self, conn, peer_id: ID) -> bool:
        """Whether a direct connection came from a hole punch (finished or running)."""
        before = self.punching.get(peer_id)
        return conn in self.punched or (before is not None and id(conn) not in before)

    async def _try_unilateral_upgrade(self, peer_id: ID) -> bool:
        # DCUtR's step 0 dials every direct address the peerstore holds for the peer,
        # which identify fills with its *listen* addresses: a NATed peer's private
        # one, or a loopback one, that from here reach nothing (a drop: the full
        # dial timeout) or ourselves. Skip loopback addresses unless we are on
        # loopback too, and keep every dial short (PUNCH_DIAL_TIMEOUT).
        if not self.may_be_dialable(peer_id.to_base58()):
            return False
        store = self.host.get_peerstore()
        try:
            known = list(store.addrs(peer_id))
        except Exception:  # py-libp2p raises PeerStoreError (and others) for an unknown peer
            return False
        on_loopback = any(_is_loopback(a) for a in self.host.get_transport_addrs())
        usable = [a for a in known if "/p2p-circuit" not in str(a) and (on_loopback or not _is_loopback(a))]
        if not usable:
            return False
        try:
            with trio.move_on_after(self.dial_timeout):
                async with trio.open_nursery() as nursery:
                    for addr in usable:
                        nursery.start_soon(self._dial_peer, peer_id, addr)
        except Exception as error:  # a failed dial only means "not reachable directly"
            log.debug("unilateral upgrade to %s failed: %s", peer_id, error)
        return await self._verify_direct_connection(peer_id)


def _is_loopback(addr: multiaddr.Multiaddr) -> bool:
    text = str(addr)
    return text.startswith("/ip4/127.") or text.startswith("/ip6/::1/")


class RelayStack:
    """The circuit relay v2 and DCUtR services of one running host."""

    def __init__(self, host: BasicHost) -> None:
        self.host = host
        self.protocol = CircuitV2Protocol(host, limits=RELAY_LIMITS, allow_hop=False)
        # STOP only: with CLIENT, py-libp2p makes a reservation on every relayed dial.
        # Reservations are the NAT policy's business (see `reserve`).
        self.circuits = CircuitV2Transport(host, self.protocol, RelayConfig(roles=RelayRole.STOP, limits=RELAY_LIMITS))
        self.puncher = HolePuncher(host)
        self.reservations: dict[str, float] = {}  # relay peer id -> expiry (epoch seconds)

    @property
    def hop_enabled(self) -> bool:
        return self.protocol.allow_hop

    def enable_hop(self) -> None:
        """Start relaying for others (a public peer); idempotent."""
        if not self.protocol.allow_hop:
            self.protocol.allow_hop = True
            self.host.set_stream_handler(HOP_PROTOCOL_ID, self.protocol._handle_hop_stream)

    def disable_hop(self) -> None:
        if self.protocol.allow_hop:
            self.protocol.allow_hop = False
            self.host.remove_stream_handler(HOP_PROTOCOL_ID)

    async def dial(self, addr: str):
        """Connect through a relay: `addr` is `<relay multiaddr>/p2p-circuit/p2p/<peer>`."""
        with trio.fail_after(RELAY_DIAL_TIMEOUT):
            return await self.circuits.dial(multiaddr.Multiaddr(addr))

    async def reserve(self, relay_peer_id: str) -> float:
        """Reserve (or renew) a slot on a connected relay; the expiry, or 0.0 if refused."""
        pid = ID.from_base58(relay_peer_id)
        with trio.fail_after(RESERVE_TIMEOUT):
            stream = await self.host.new_stream(pid, [HOP_PROTOCOL_ID])
            try:
                ok = await self.circuits._make_reservation(stream, pid)
            finally:
                await stream.close()
        if not ok:
            self.reservations.pop(relay_peer_id, None)
            return 0.0
        expires = float(self.circuits._reservations.get(pid, 0))
        self.reservations[relay_peer_id] = expires
        return expires

    def drop_reservation(self, relay_peer_id: str) -> None:
        self.reservations.pop(relay_peer_id, None)
        pid = ID.from_base58(relay_peer_id)
        self.circuits._reservations.pop(pid, None)
        self.circuits._reservation_proofs.pop(pid, None)


@asynccontextmanager
async def run_relay_stack(host: BasicHost) -> AsyncIterator[RelayStack]:
    """Start the relay (STOP) and DCUtR services on a running host for the block."""
    stack = RelayStack(host)
    async with AsyncExitStack() as services:
        await services.enter_async_context(background_trio_service(stack.protocol))
        await services.enter_async_context(background_trio_service(stack.puncher))
        yield stack
