"""A frame's round trip between two processes, per kind of stream, side by side in one run.

An echo server runs in a second process; the client sends a 2.4 KB frame (one decode
step's hidden state of SmolLM2, sealed) and waits for it to come back, over

- a libp2p stream: py-libp2p's TCP + Noise + yamux, what every stream used before
  dedicated connections (peer/net/dedicated/);
- a dedicated connection: the same TCP + Noise handshake and identities, one stream,
  no muxer (what sessions and links use now);
- bare TCP with a length prefix: the floor, no security at all.

Each is timed back to back and after an idle wait before every round trip (default
10 ms), as a pipeline stage waits between its steps: a shared machine takes the idle
core's caches away, and the per-frame code runs cold. Medians; ratios printed last.

    .venv/bin/python bench/streams.py [--trips 2000] [--idle-ms 10] [--size 2400]
"""

from __future__ import annotations

import argparse
import os
import statistics
import struct
import subprocess
import sys
import time

import trio

from tessera.peer.base.protocols import GOSSIP_PROTOCOL, SESSION_PROTOCOL
from tessera.peer.net.libp2p import open_libp2p_transport

KINDS = {"libp2p stream": GOSSIP_PROTOCOL, "dedicated connection": SESSION_PROTOCOL}
SEED = b"bench/streams.py echo server key"  # 32 bytes: the server's identity, known to the client
_LEN = struct.Struct(">I")


async def echo(stream) -> None:
    while data := await stream.read(1 << 16):
        await stream.write(data)
    await stream.close()


async def serve(raw_port: int, ready_file: str) -> None:
    async with open_libp2p_transport(SEED) as transport:
        for protocol in KINDS.values():
            transport.set_handler(protocol, echo)

        async def raw_echo(stream: trio.SocketStream) -> None:
            buffer = bytearray()
            try:
                while data := await stream.receive_some(1 << 16):
                    buffer += data
                    while len(buffer) >= 4 and len(buffer) >= 4 + _LEN.unpack_from(buffer)[0]:
                        size = _LEN.unpack_from(buffer)[0]
                        await stream.send_all(bytes(buffer[: 4 + size]))
                        del buffer[: 4 + size]
            except trio.BrokenResourceError:
                pass

        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(trio.serve_tcp, raw_echo, raw_port)
            with open(ready_file, "w") as f:
                f.write(f"{transport.addrs()[0]}\n{listeners[0].socket.getsockname()[1]}\n")
            await trio.sleep_forever()


async def timed(round_trip, trips: int, idle: float) -> float:
    for _ in range(50):
        await round_trip()
    times = []
    for _ in range(trips):
        if idle:
            await trio.sleep(idle)
        began = time.perf_counter()
        await round_trip()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


async def client(addr: str, raw_port: int, trips: int, idle: float, size: int) -> dict[tuple[str, bool], float]:
    payload = os.urandom(size)
    out: dict[tuple[str, bool], float] = {}
    async with open_libp2p_transport(os.urandom(32), dedicated_listen=False) as transport:
        server = await transport.connect(addr)
        for kind, protocol in KINDS.items():
            stream = await transport.open_stream(server, protocol)

            async def round_trip(stream=stream) -> None:
                await stream.write(payload)
                got = 0
                while got < size:
                    got += len(await stream.read(1 << 16))

            for cold in (False, True):
                out[kind, cold] = await timed(round_trip, trips if not cold else trips // 4, idle if cold else 0.0)
            await stream.close()
    raw = await trio.open_tcp_stream("127.0.0.1", raw_port)
    frame = _LEN.pack(size) + payload

    async def raw_round_trip() -> None:
        await raw.send_all(frame)
        got = 0
        while got < len(frame):
            got += len(await raw.receive_some(1 << 16))

    for cold in (False, True):
        out["bare TCP", cold] = await timed(raw_round_trip, trips if not cold else trips // 4, idle if cold else 0.0)
    await raw.aclose()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trips", type=int, default=2000)
    parser.add_argument("--idle-ms", type=float, default=10.0)
    parser.add_argument("--size", type=int, default=2400)
    parser.add_argument("--serve", nargs=2, metavar=("RAW_PORT", "READY_FILE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        trio.run(serve, int(args.serve[0]), args.serve[1])
        return
    ready = f"/tmp/tessera-bench-streams-{os.getpid()}"
    server = subprocess.Popen([sys.executable, __file__, "--serve", "0", ready])
    try:
        for _ in range(600):
            if os.path.exists(ready) and len(open(ready).read().split()) == 2:
                break
            time.sleep(0.05)
        addr, raw_port = open(ready).read().split()
        results = trio.run(client, addr, int(raw_port), args.trips, args.idle_ms / 1000, args.size)
    finally:
        server.kill()
        if os.path.exists(ready):
            os.unlink(ready)
    print(f"\n{args.size}-byte frame, round trip between two processes (median ms):")
    for (kind, cold), seconds in results.items():
        print(f"  {kind:22s} {'after ' + str(args.idle_ms) + ' ms idle' if cold else 'back to back':>20s}  {seconds * 1e3:.3f}")
    for cold in (False, True):
        when = f"after {args.idle_ms:g} ms idle" if cold else "back to back"
        ratio = results["dedicated connection", cold] / results["libp2p stream", cold]
        print(f"dedicated / libp2p stream round trip ({when}): {ratio:.2f}")


if __name__ == "__main__":
    main()
