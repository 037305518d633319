"""Dial-back: "please dial me at these addresses" — how a peer learns whether others can reach it.

py-libp2p's AutoNAT stayed UNKNOWN in our NAT topology, so peers run this small
protocol instead, over the `Transport` interface:

    asker                                   helper
      | -- DialBackRequest(nonce, addrs) -->  |   on DIALBACK_PROTOCOL
      |                                       |   takes the asker's address as it sees it,
      |                                       |   keeps only the listen PORTS from `addrs`,
      |                                       |   and dials observed-IP:port from a fresh,
      |  <== new connection from a stranger ==|   throwaway identity (our existing connection
      |  <-- DialBackProbe(nonce) -----------  |   proves nothing), then opens a stream on
      |  --- DialBackProbe(nonce) ---------->  |   DIALBACK_PROBE_PROTOCOL and sends the nonce
      |  <-- DialBackResult(nonce, observed, reached) --
      |
    The asker believes "reached" only for addresses on which its own probe handler
    saw its nonce: a helper cannot talk it into advertising an address.

Dialling only the IP the helper observed (not whatever the asker lists) is what
libp2p's AutoNAT does too: a helper cannot be used to aim connections at a third
party, and a peer behind NAT learns what its router does to an unsolicited SYN on
its listen port (dropped or refused: private; answered: public).
"""

from __future__ import annotations

import logging
import os
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Callable

import multiaddr
import trio

from tessera.protocol.codec import message
from tessera.protocol.errors import WireError
from tessera.protocol.framing import DEFAULT_MAX_FRAME
from tessera.protocol.schema import wire

from tessera.peer.base.protocols import DIALBACK_PROBE_PROTOCOL, DIALBACK_PROTOCOL
from tessera.peer.base.errors import PeerError
from tessera.peer.net.transport import Channel, Stream, Transport

log = logging.getLogger(__name__)

NONCE_SIZE = 16
MAX_ADDRS = 8  # listen addresses an asker may name (ports are what the helper uses)
# One dial-back dial: a TCP + Noise + yamux handshake and one stream, a few RTTs on the
# Internet. A NAT that drops the SYN gives no answer at all, so this is also how long a
# private verdict takes; 3 s covers one SYN retransmission (1 s) and a slow link.
DIALBACK_DIAL_TIMEOUT = 3.0
# The asker's whole wait: the helper's dials run in parallel, plus starting its probe host.
CHECK_TIMEOUT = DIALBACK_DIAL_TIMEOUT + 5.0
MAX_CONCURRENT_DIALBACKS = 4  # a helper runs at most this many dial-backs at once (others are refused)
# The largest frames a helper and an asker read before they know the other: a DialBackRequest at
# its limits (8 addresses of 256 four-byte characters) is 8,262 bytes encoded, a DialBackProbe 41.
REQUEST_FRAME_LIMIT = 9 * 1024
PROBE_FRAME_LIMIT = 64


@message("dialback-req")
@dataclass(frozen=True)
class DialBackRequest:
    """Asker -> helper: dial me back.

    Attributes:
        nonce: 16 fresh random bytes; the dial-back must carry them.
        addrs: the asker's listen multiaddrs; only their TCP ports are used.
    """

    nonce: bytes = wire(size=NONCE_SIZE)
    addrs: tuple[str, ...] = wire(max_items=MAX_ADDRS, max_len=256)


@message("dialback-probe")
@dataclass(frozen=True)
class DialBackProbe:
    """The dial-back itself (helper's fresh host -> asker), echoed by the asker.

    Attributes:
        nonce: the asker's nonce from the request.
    """

    nonce: bytes = wire(size=NONCE_SIZE)


@message("dialback-res")
@dataclass(frozen=True)
class DialBackResult:
    """Helper -> asker: what the dial-back found.

    Attributes:
        nonce: the asker's nonce.
        observed: the asker's address as the helper sees it ("" over a relay: unknown).
        reached: the addresses the helper dialled and got the nonce echoed on.
        tried: every address the helper dialled.
    """

    nonce: bytes = wire(size=NONCE_SIZE)
    observed: str = wire(max_len=256)
    reached: tuple[str, ...] = wire(max_items=MAX_ADDRS, max_len=256)
    tried: tuple[str, ...] = wire(max_items=MAX_ADDRS, max_len=256)


@dataclass(frozen=True)
class DialBackOutcome:
    """What one helper told us, checked against what our probe handler saw.

    helper:   the helper's peer id.
    observed: our address as the helper saw it ("" when it saw us through a relay).
    reached:  addresses the helper reached — empty unless our probe handler saw our nonce.
    tried:    what the helper dialled.
    """

    helper: str
    observed: str
    reached: tuple[str, ...]
    tried: tuple[str, ...]

    @property
    def conclusive(self) -> bool:
        """A helper that saw our real address and dialled it tells us something."""
        return bool(self.observed and self.tried)


ProbeFactory = Callable[[], AbstractAsyncContextManager[Transport]]


def dialback_addrs(observed: str, listen: tuple[str, ...], asker: str) -> list[str]:
    """The addresses a helper dials: the observed IP at each listen port the asker named.

    >>> dialback_addrs("/ip4/203.0.113.11/tcp/51234", ("/ip4/192.0.2.2/tcp/4001/p2p/Qm",), "Qm")
    ['/ip4/203.0.113.11/tcp/4001/p2p/Qm']
    """
    try:
        seen = multiaddr.Multiaddr(observed)
        family = "ip6" if "/ip6/" in observed else "ip4"
        ip = seen.value_for_protocol(family)
    except (ValueError, multiaddr.exceptions.Error):
        return []
    out: list[str] = []
    for addr in listen[:MAX_ADDRS]:
        try:
            port = int(multiaddr.Multiaddr(addr).value_for_protocol("tcp"))
        except (ValueError, TypeError, multiaddr.exceptions.Error):
            continue  # not a TCP address (or garbage): nothing to dial
        if 0 < port < 65536:
            out.append(f"/{family}/{ip}/tcp/{port}/p2p/{asker}")
    return list(dict.fromkeys(out))


class DialBack:
    """Both sides of dial-back on one transport: asking, helping, and answering probes."""

    def __init__(self, transport: Transport, *, probe_factory: ProbeFactory,
                 listen_addrs: Callable[[], list[str]]) -> None:
        self.transport = transport
        self.probe_factory = probe_factory
        self.listen_addrs = listen_addrs
        self._pending: dict[bytes, int] = {}  # nonce -> how many dial-backs carried it
        self._helping = trio.Semaphore(MAX_CONCURRENT_DIALBACKS)
        self.helped = 0
        transport.set_handler(DIALBACK_PROTOCOL, self.handle_request)
        transport.set_handler(DIALBACK_PROBE_PROTOCOL, self.handle_probe)

    # -- asking -----------------------------------------------------------------------

    async def check(self, helper: str) -> DialBackOutcome | None:
        """Ask `helper` to dial us back; None if it did not answer in time."""
        nonce = os.urandom(NONCE_SIZE)
        self._pending[nonce] = 0
        try:
            with trio.fail_after(CHECK_TIMEOUT):
                channel = Channel(await self.transport.open_stream(helper, DIALBACK_PROTOCOL))
                await channel.send(DialBackRequest(nonce, tuple(self.listen_addrs()[:MAX_ADDRS])))
                result = await channel.receive()
                await channel.close()
        except (trio.TooSlowError, PeerError, WireError) as error:
            log.debug("dial-back via %s failed: %s", helper, error)
            return None
        finally:
            seen = self._pending.pop(nonce, 0)
        if not isinstance(result, DialBackResult) or result.nonce != nonce:
            return None
        # The helper's word counts only if a dial-back carrying our nonce did arrive.
        confirmed = result.reached if seen else ()
        return DialBackOutcome(helper, result.observed, confirmed, result.tried)

    async def handle_probe(self, stream: Stream) -> None:
        ticket = self.transport.intake.enter(stream)  # a stranger's stream (peer/net/intake.py)
        if ticket is None:
            await stream.reset()
            return
        with ticket:
            channel = Channel(stream, max_frame=PROBE_FRAME_LIMIT, on_frame=ticket.charge)
            try:
                with trio.fail_after(DIALBACK_DIAL_TIMEOUT):
                    probe = await channel.receive()
                    if not isinstance(probe, DialBackProbe) or probe.nonce not in self._pending:
                        raise WireError("dial-back probe with an unknown nonce")
                    self._pending[probe.nonce] += 1
                    await channel.send(probe)
                await channel.close()
            except (trio.TooSlowError, PeerError, WireError) as bad:
                log.debug("dial-back probe from %s refused: %s", stream.remote, bad)
                await channel.reset()  # a stranger with the wrong nonce gets nothing
        if ticket.evicted:
            await stream.reset()

    # -- helping ----------------------------------------------------------------------

    async def handle_request(self, stream: Stream) -> None:
        deadline = trio.current_time() + CHECK_TIMEOUT
        ticket = self.transport.intake.enter(stream)  # a stranger's stream until its request is read
        if ticket is None:
            await stream.reset()
            return
        request: object = None
        with ticket:
            channel = Channel(stream, max_frame=REQUEST_FRAME_LIMIT, on_frame=ticket.charge, max_send=DEFAULT_MAX_FRAME)
            try:
                with trio.fail_at(deadline):
                    request = await channel.receive()
            except (trio.TooSlowError, PeerError, WireError) as bad:
                log.debug("dial-back request from %s failed: %s", stream.remote, bad)
        if request is None:  # garbage, too slow, or its place taken by a lighter identity
            await stream.reset()
            return
        channel.on_frame = None
        try:
            with trio.fail_at(deadline):
                if not isinstance(request, DialBackRequest):
                    raise WireError(f"expected DialBackRequest, got {type(request).__name__}")
                observed = getattr(stream, "remote_addr", None) or ""
                targets = dialback_addrs(observed, request.addrs, stream.remote) if observed else []
                reached: list[str] = []
                if targets:
                    try:
                        self._helping.acquire_nowait()
                    except trio.WouldBlock:
                        targets = []  # busy: say we tried nothing (inconclusive), not "unreachable"
                    else:
                        try:
                            reached = await self._dial_back(stream.remote, targets, request.nonce)
                        finally:
                            self._helping.release()
                self.helped += 1
                await channel.send(DialBackResult(request.nonce, observed, tuple(reached), tuple(targets)))
            await channel.close()
        except (trio.TooSlowError, PeerError, WireError) as bad:
            log.debug("dial-back request from %s failed: %s", stream.remote, bad)
            await channel.reset()

    async def _dial_back(self, asker: str, targets: list[str], nonce: bytes) -> list[str]:
        reached: list[str] = []
        async with self.probe_factory() as probe:

            async def one(addr: str) -> None:
                with trio.move_on_after(DIALBACK_DIAL_TIMEOUT):
                    try:
                        await probe.connect(addr)
                        channel = Channel(await probe.open_stream(asker, DIALBACK_PROBE_PROTOCOL))
                        await channel.send(DialBackProbe(nonce))
                        echo = await channel.receive()
                        await channel.close()
                    except (PeerError, WireError) as error:
                        log.debug("dial-back to %s failed: %s", addr, error)
                        return
                    if isinstance(echo, DialBackProbe) and echo.nonce == nonce:
                        reached.append(addr)

            async with trio.open_nursery() as nursery:
                for addr in targets:
                    nursery.start_soon(one, addr)
            # Close what the probe opened before its host goes: a connection left to the
            # garbage collector would linger on the asker's side.
            await probe.disconnect(asker)
        return sorted(reached)

