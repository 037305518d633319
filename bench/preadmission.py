"""What strangers can make a peer hold before it admits anything: peak RSS under a first-frame flood.

One real `tessera peer` (a small synthesised model, its whole span, serving weights) and 8
throwaway identities, each its own libp2p host. Every identity opens streams on every protocol
the peer serves at once — session, link, ping, gossip, reports, weights, links, dial-back,
dial-back probe, dedicated — and on each sends the largest first frame that protocol allows
(its length prefix announcing exactly the protocol's limit: peer/net/intake.py and the limits
beside each protocol's messages), all of it but the last byte, and holds the stream there, so
that the peer buffers as much as it can; plus one stream per protocol whose prefix claims
64 MiB. A stream the peer ends is opened again at once, for `--seconds`. The peer's RSS is
sampled every 50 ms; the growth over its resting RSS (the median of a second before the flood)
is the figure. Before the intake, 64 MiB first frames on the weights protocol alone took a peer
from 670 MB to 2.6 GB (issue 45); the bound it answers to is 64 MB.

    .venv/bin/python bench/preadmission.py [--seconds 20] [--identities 8] [--streams 3]
    .venv/bin/python bench/preadmission.py --against ../main/.venv/bin/python --identities 2 --streams 1

Prints, last: `pre-admission: peak RSS growth X MB over N streams`.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import trio

from tessera.peer.base.errors import PeerError
from tessera.peer.base.protocols import (
    DEDICATED_PROTOCOL, DIALBACK_PROBE_PROTOCOL, DIALBACK_PROTOCOL, GOSSIP_PROTOCOL, LINK_PROTOCOL, LINKS_PROTOCOL,
    PING_PROTOCOL, REPORT_PROTOCOL, SESSION_PROTOCOL, WEIGHTS_PROTOCOL,
)
from tessera.peer.cli.demo import LocalSwarm
from tessera.peer.cli.model_files import synthesise
from tessera.peer.net import intake
from tessera.peer.net.libp2p import open_libp2p_transport
from tessera.peer.net.nat import dialback, links
from tessera.protocol.admission import LINK_FRAME_LIMIT, OPEN_FRAME_LIMIT
from tessera.protocol.attest import REPORT_FRAME_LIMIT
from tessera.protocol.records import GOSSIP_FRAME_LIMIT, HEARTBEAT_FRAME_LIMIT
from tessera.protocol.weights import REQUEST_FRAME_LIMIT

# Each protocol the peer serves, and the largest first frame it reads from a stranger.
LIMITS = {
    SESSION_PROTOCOL: OPEN_FRAME_LIMIT,
    LINK_PROTOCOL: LINK_FRAME_LIMIT,
    PING_PROTOCOL: HEARTBEAT_FRAME_LIMIT,
    GOSSIP_PROTOCOL: GOSSIP_FRAME_LIMIT,
    REPORT_PROTOCOL: REPORT_FRAME_LIMIT,
    WEIGHTS_PROTOCOL: REQUEST_FRAME_LIMIT,
    LINKS_PROTOCOL: links.REQUEST_FRAME_LIMIT,
    DIALBACK_PROTOCOL: dialback.REQUEST_FRAME_LIMIT,
    DIALBACK_PROBE_PROTOCOL: dialback.PROBE_FRAME_LIMIT,
    DEDICATED_PROTOCOL: 1024,  # peer/net/dedicated/service.py HANDSHAKE_FRAME
}
HUGE = 64 << 20  # what every protocol but session, link and dedicated read before
# What a peer before the intake read (`--against`): 16 KiB opens and hellos, 1 KiB dedicated
# handshakes, and 64 MiB on every other protocol.
BEFORE = {protocol: HUGE for protocol in LIMITS} | {SESSION_PROTOCOL: OPEN_FRAME_LIMIT, LINK_PROTOCOL: OPEN_FRAME_LIMIT,
                                                   DEDICATED_PROTOCOL: 1024}
SAMPLE = 0.05  # seconds between RSS samples
WRITE = 1 << 16  # the flood writes in pieces of this size
REOPEN_PAUSE = 0.05  # between a stream the peer ended and the next (a busy loop would only load this machine)


def uvarint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


class Flood:
    """What the identities opened and how it ended."""

    def __init__(self) -> None:
        self.opened = 0
        self.ended = 0
        self.failed_opens = 0  # streams the peer did not accept (negotiation failed or timed out)
        self.sent = 0  # bytes written
        self.by_protocol: dict[str, list[int]] = {}  # protocol -> [streams, bytes written]


async def hold(transport, peer: str, protocol: str, claim: int, body: int, flood: Flood, until: float) -> None:
    """One stream after another on `protocol`: a prefix claiming `claim` bytes, then `body` of them, held open."""
    while trio.current_time() < until:
        try:
            stream = await transport.open_stream(peer, protocol)
        except PeerError:  # the peer's stream negotiation gave up under the flood: again
            flood.failed_opens += 1
            await trio.sleep(REOPEN_PAUSE)
            continue
        flood.opened += 1
        mine = flood.by_protocol.setdefault(protocol, [0, 0])
        mine[0] += 1
        try:
            with trio.move_on_at(until):
                await stream.write(uvarint(claim))
                sent = 0
                while sent < body:
                    piece = min(WRITE, body - sent)
                    await stream.write(b"\xa5" * piece)
                    sent += piece
                    flood.sent += piece
                    mine[1] += piece
                while await stream.read(1 << 16):  # held until the peer ends it
                    pass
        except PeerError:
            pass
        flood.ended += 1
        await stream.reset()
        await trio.sleep(REOPEN_PAUSE)


async def attack(addr: str, limits: dict[str, int], identities: int, streams: int, seconds: float,
                 flood: Flood) -> None:
    peer = addr.rsplit("/p2p/", 1)[1]
    until = trio.current_time() + seconds
    async with trio.open_nursery() as nursery:
        for _ in range(identities):
            nursery.start_soon(one_identity, addr, peer, limits, streams, until, flood)


async def one_identity(addr: str, peer: str, limits: dict[str, int], streams: int, until: float, flood: Flood) -> None:
    async with open_libp2p_transport(os.urandom(32), relay=False, dedicated=False) as transport:
        await transport.connect(addr)
        async with trio.open_nursery() as nursery:
            for protocol, limit in limits.items():
                for _ in range(streams):  # the largest frame it allows, all but its last byte
                    nursery.start_soon(hold, transport, peer, protocol, limit, limit - 1, flood, until)
                nursery.start_soon(hold, transport, peer, protocol, HUGE, WRITE, flood, until)  # over the limit


class PeerUnderTest(LocalSwarm):
    """The peer, run by `python` (this checkout's, or another's with `--against`)."""

    python = sys.executable

    def launcher(self, i: int) -> list[str]:
        return [self.python]


def rss(process: psutil.Process) -> int:
    return process.memory_info().rss


async def sample(process: psutil.Process, peaks: list[int], stop: trio.Event) -> None:
    while not stop.is_set():
        peaks.append(rss(process))
        await trio.sleep(SAMPLE)


async def run(addr: str, process: psutil.Process, args: argparse.Namespace) -> tuple[int, list[int], Flood]:
    resting = []
    for _ in range(int(1 / SAMPLE)):
        resting.append(rss(process))
        await trio.sleep(SAMPLE)
    flood = Flood()
    samples: list[int] = []
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample, process, samples, stop)
        await attack(addr, BEFORE if args.against else LIMITS, args.identities, args.streams, args.seconds, flood)
        await trio.sleep(1.0)  # what it still holds just after
        stop.set()
    return int(statistics.median(resting)), samples, flood


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0, help="how long the flood lasts (default 20)")
    parser.add_argument("--identities", type=int, default=8, help="throwaway identities (default 8)")
    parser.add_argument("--streams", type=int, default=3,
                        help="streams each identity holds per protocol with its largest frame (default 3)")
    parser.add_argument("--against", metavar="PYTHON", default=None,
                        help="run the peer with this Python instead (another checkout's venv: the code before the "
                             "intake), flooded with the frames it accepted (64 MiB on most protocols: mind the memory)")
    args = parser.parse_args()
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)  # a stream the peer refuses is the point, not news

    with tempfile.TemporaryDirectory(prefix="tessera-preadmission-") as tmp:
        folder = synthesise(Path(tmp) / "model", hidden=256, layers=4, heads=4, kv_heads=2, intermediate=512,
                            vocab=512, seed=1)
        (Path(tmp) / "peers").mkdir()
        swarm = PeerUnderTest(1, model=str(folder), base_dir=Path(tmp) / "peers", extra_args=[["--layers", "0:4"]])
        swarm.python = args.against or sys.executable
        try:
            addr = swarm.start()[0]
            process = psutil.Process(swarm.procs[0].pid)
            time.sleep(3.0)  # its first gossip rounds and measurements settle
            resting, samples, flood = trio.run(run, addr, process, args)
            alive = swarm.procs[0].poll() is None
        finally:
            swarm.stop(timeout=15)
    peak = max(samples)
    mb = 1e6
    print(f"peer RSS: resting {resting / mb:.0f} MB, peak {peak / mb:.0f} MB, after {samples[-1] / mb:.0f} MB; "
          f"the peer {'kept running' if alive else 'DIED'}")
    print(f"streams: {flood.opened} opened by {args.identities} identities on {len(LIMITS)} protocols "
          f"({flood.ended} ended by the peer or the flood's end, {flood.failed_opens} opens failed), {flood.sent / mb:.0f} MB sent; unadmitted budget {intake.BUDGET / mb:.0f} MB, "
          f"at most {intake.TOTAL} streams, {intake.PER_IDENTITY} per identity")
    for protocol, (count, sent) in sorted(flood.by_protocol.items()):
        print(f"  {protocol:32} {count:5} streams, {sent / mb:8.1f} MB sent")
    print(f"pre-admission: peak RSS growth {(peak - resting) / mb:.0f} MB over {flood.opened} streams")


if __name__ == "__main__":
    main()
