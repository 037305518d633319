"""Why the swarm view does not ride on py-libp2p's gossipsub: what it delivers, measured.

    .venv/bin/python bench/gossipsub.py                  # 8 hosts on loopback, Noise, one topic

Eight real py-libp2p 0.8.1 hosts in one process, connected in a ring, all subscribed to one
topic with GossipSub's defaults (D=6, heartbeat 120 s). Host 0 publishes what a swarm's
view would carry; the last lines print what reached the other seven:

- a burst of 40 records of 700 bytes at once (a swarm of 10,000 with 2 % churn a minute
  changes about 10 records a second, a burst of joins or a partition healing far more);
- the same again, paced at 8 a second;
- one 1.5 MiB message (a newcomer's whole view at 2,000 peers).

What gossipsub cannot do for the view at all, measured or not: a newcomer must pull the
whole view (gossipsub keeps a few heartbeats of history, not the set); it runs only on a
libp2p host, so the simulator (memory transport, MockClock) could not run it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from libp2p.peer.peerinfo import info_from_p2p_addr  # noqa: E402
from libp2p.pubsub.gossipsub import PROTOCOL_ID, GossipSub  # noqa: E402
from libp2p.pubsub.pubsub import Pubsub  # noqa: E402
from libp2p.tools.anyio_service import background_trio_service  # noqa: E402
from multiaddr import Multiaddr  # noqa: E402

from tessera.peer.net.libp2p import make_host  # noqa: E402

HOSTS = 8
TOPIC = "tessera-view"
RECORD = 700
WAIT_S = 10.0


async def main() -> None:
    hosts = [make_host(bytes([i + 1]) * 32) for i in range(HOSTS)]
    routers = [GossipSub(protocols=[PROTOCOL_ID], degree=6, degree_low=4, degree_high=12) for _ in hosts]
    pubsubs = [Pubsub(h, r) for h, r in zip(hosts, routers)]
    received: list[list[tuple[float, int]]] = [[] for _ in hosts]
    async with trio.open_nursery() as nursery:
        for host in hosts:
            await nursery.start(_run_host, host)
        for ps, router in zip(pubsubs, routers):
            await nursery.start(_run_service, ps)
            await nursery.start(_run_service, router)
        for ps in pubsubs:
            await ps.wait_until_ready()
        for i, host in enumerate(hosts):  # a ring, as a partial view would connect them
            nxt = hosts[(i + 1) % HOSTS]
            await host.connect(info_from_p2p_addr(Multiaddr(f"{nxt.get_addrs()[0]}")))
        subs = [await ps.subscribe(TOPIC) for ps in pubsubs]
        for i, sub in enumerate(subs[1:], start=1):
            nursery.start_soon(_receive, sub, received[i])
        await trio.sleep(2.0)  # mesh formation (heartbeat's initial delay is 0.1 s)

        async def round_(label: str, payloads: list[bytes], pace: float) -> str:
            for r in received:
                r.clear()
            began = time.monotonic()
            for data in payloads:
                await pubsubs[0].publish(TOPIC, data)
                if pace:
                    await trio.sleep(pace)
            await trio.sleep(WAIT_S)
            got = [len(r) for r in received[1:]]
            late = max((t - began for r in received[1:] for t, _ in r), default=float("nan"))
            return (f"gossipsub {label}: sent {len(payloads)}, delivered per host {got} "
                    f"({sum(got)}/{len(payloads) * (HOSTS - 1)}), last arrival {late:.2f} s")

        lines = [
            await round_(f"burst of 40 x {RECORD} B", [bytes([k]) * RECORD for k in range(40)], 0.0),
            await round_(f"40 x {RECORD} B at 8/s", [bytes([k + 64]) * RECORD for k in range(40)], 1 / 8),
            await round_("one 1.5 MiB message", [b"\x01" * (3 << 19)], 0.0),
        ]
        nursery.cancel_scope.cancel()
    for line in lines:
        print(line)


async def _run_host(host, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    async with host.run(listen_addrs=[Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        task_status.started()
        await trio.sleep_forever()


async def _run_service(service, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    async with background_trio_service(service):
        task_status.started()
        await trio.sleep_forever()


async def _receive(sub, into: list[tuple[float, int]]) -> None:
    while True:
        msg = await sub.get()
        into.append((time.monotonic(), len(msg.data)))


if __name__ == "__main__":
    trio.run(main)
