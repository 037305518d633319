"""A slow link in user space — a TEST AND BENCHMARK feature, never for real swarms.

These machines cannot shape traffic in the kernel (no sch_netem), so a peer
started with `--emulate-link "delay=40ms,jitter=10ms,rate=100mbit"` delays and
paces every frame it sends: each write is queued and released to the real
stream `delay ± jitter` after the sender's uplink (at `rate`) finished
transmitting it, never overtaking an earlier frame of the same stream. Wrapping
the sending side of every peer (and the requester) gives each hop of a ring
its own one-way delay, as a WAN would.
"""

from __future__ import annotations

import random
import re
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import AsyncIterator, Sequence

import trio

from tessera.peer.base.errors import ConfigError, PeerError, StreamClosed
from tessera.peer.net.transport import Handler, Stream, Transport

QUEUE_FRAMES = 256  # writes buffered per stream (a socket buffer's worth of frames)
UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
RATES = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8}


@dataclass(frozen=True)
class LinkEmulation:
    """delay, jitter: seconds added to every frame this side sends; rate: uplink bytes/s (None: unlimited)."""

    delay: float = 0.0
    jitter: float = 0.0
    rate: float | None = None
    seed: int = 0

    @staticmethod
    def parse(text: str) -> "LinkEmulation":
        """'delay=40ms,jitter=10ms,rate=100mbit' (any subset). Raises ConfigError."""
        fields: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            match = re.fullmatch(r"(delay|jitter|rate|seed)=([0-9.]+)([a-z]*)", part)
            if not match:
                raise ConfigError(f"--emulate-link: cannot read {part!r} (e.g. delay=40ms,jitter=10ms,rate=100mbit)")
            key, number, unit = match.group(1), float(match.group(2)), match.group(3)
            if key == "rate":
                if unit not in RATES:
                    raise ConfigError(f"--emulate-link: rate unit {unit!r} is not one of {sorted(RATES)}")
                fields[key] = number * RATES[unit]
            elif key == "seed":
                fields[key] = number
            else:
                if unit not in UNITS:
                    raise ConfigError(f"--emulate-link: time unit {unit!r} is not one of {sorted(UNITS)}")
                fields[key] = number * UNITS[unit]
        return LinkEmulation(fields.get("delay", 0.0), fields.get("jitter", 0.0), fields.get("rate"), int(fields.get("seed", 0)))


class _Uplink:
    """The shared sending side: one transmission at a time at `rate`, then the propagation delay."""

    def __init__(self, emulation: LinkEmulation) -> None:
        self.emulation = emulation
        self.rng = random.Random(emulation.seed)
        self.busy_until = 0.0

    def release_time(self, size: int, after: float) -> float:
        now = trio.current_time()
        sent = max(now, self.busy_until)
        if self.emulation.rate:
            sent += size / self.emulation.rate
        self.busy_until = sent
        jitter = self.rng.uniform(-self.emulation.jitter, self.emulation.jitter)
        return max(sent + max(0.0, self.emulation.delay + jitter), after)


class EmulatedStream:
    """Writes are queued and released on the uplink's schedule, in order; reads are untouched."""

    def __init__(self, inner: Stream, uplink: _Uplink, nursery: trio.Nursery) -> None:
        self.inner = inner
        self.remote = inner.remote
        self.via = inner.via
        self.remote_addr = getattr(inner, "remote_addr", None)  # where it comes from (peer/net/intake.py)
        self.uplink = uplink
        self.last_release = 0.0
        self.failure: str | None = None
        self._send, self._receive = trio.open_memory_channel[tuple[float, bytes | None]](QUEUE_FRAMES)
        nursery.start_soon(self._deliver)

    async def _deliver(self) -> None:
        async for release, data in self._receive:
            await trio.sleep_until(release)
            try:
                if data is None:
                    await self.inner.close()
                    return
                await self.inner.write(data)
            except PeerError as error:
                self.failure = str(error)
                return

    async def read(self, max_bytes: int) -> bytes:
        return await self.inner.read(max_bytes)

    async def write(self, data: bytes) -> None:
        if self.failure:
            raise StreamClosed(self.failure)
        self.last_release = self.uplink.release_time(len(data), self.last_release)
        try:
            await self._send.send((self.last_release, bytes(data)))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise StreamClosed(f"emulated stream to {self.remote} is closed") from None

    async def close(self) -> None:
        """Closes after every queued frame went out (as a socket's FIN would)."""
        try:
            await self._send.send((max(self.last_release, trio.current_time()), None))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # already closing
        await self._send.aclose()

    async def reset(self) -> None:
        await self._send.aclose()
        await self.inner.reset()


class EmulatedTransport:
    """A `Transport` whose every outgoing frame crosses the emulated link."""

    def __init__(self, inner: Transport, emulation: LinkEmulation, nursery: trio.Nursery) -> None:
        self.inner = inner
        self.peer_id = inner.peer_id
        self.intake = inner.intake  # the streams are the inner transport's
        self.uplink = _Uplink(emulation)
        self.nursery = nursery

    def wrap(self, stream: Stream) -> EmulatedStream:
        return EmulatedStream(stream, self.uplink, self.nursery)

    def addrs(self) -> list[str]:
        return self.inner.addrs()

    def set_handler(self, protocol: str, handler: Handler) -> None:
        async def wrapped(stream: Stream) -> None:
            await handler(self.wrap(stream))

        self.inner.set_handler(protocol, wrapped)

    async def connect(self, addr: str) -> str:
        return await self.inner.connect(addr)

    async def open_stream(self, peer_id: str, protocol: str, *, addrs: Sequence[str] = ()) -> EmulatedStream:
        return self.wrap(await self.inner.open_stream(peer_id, protocol, addrs=addrs))

    def connected(self) -> list[str]:
        return self.inner.connected()

    def connection_kind(self, peer_id: str) -> str | None:
        return self.inner.connection_kind(peer_id)

    def stream_count(self, peer_id: str) -> int:
        return self.inner.stream_count(peer_id)

    async def disconnect(self, peer_id: str) -> None:
        await self.inner.disconnect(peer_id)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)  # transport-specific extras (NAT status, ...)


@asynccontextmanager
async def emulate(transport: Transport, emulation: LinkEmulation | None) -> AsyncIterator[Transport]:
    """`transport` itself when `emulation` is None, else wrapped for the duration of the block."""
    if emulation is None:
        yield transport
        return
    async with trio.open_nursery() as nursery:
        yield EmulatedTransport(transport, emulation, nursery)
        nursery.cancel_scope.cancel()
