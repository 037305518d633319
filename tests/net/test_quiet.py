"""Quiet by default (issue 34, item 6): a peer that left gracefully is not re-dialled twice a second
(a leaving peer is never drawn as a neighbour; a join address that does not answer backs off,
doubling, capped; a peer without an address is never drawn), and a plain direct link is no line on
stdout."""

from __future__ import annotations

import random

import trio
import trio.testing
from libp2p.peer.id import ID

from tessera.peer.net.gossip import GOSSIP_INTERVAL, Gossip, ViewKeeper
from tessera.peer.base.errors import PeerUnreachable
from tessera.peer.net.membership import FAILED_BACKOFF, MAX_SEED_BACKOFF, REFUSED_BACKOFF
from tessera.peer.net.memory import MemoryNetwork, open_memory_transport
from tessera.peer.net.memory_stream import LinkSpec
from tessera.protocol.crypto import sign_record
from tessera.protocol.keys import Identity
from tessera.protocol.records import PeerRecord

TTL = 15.0


def record(identity: Identity, state: str, now: float, seq: int, addr: str | None) -> object:
    """A signed record; `addr` None: one that names no address (a requester's, an observer's)."""
    return sign_record(identity, PeerRecord(
        peer_id=identity.peer_id, name="", model_id="m", start=0, end=4, shard_index=0, shard_count=1,
        shard_group="", throughput=100.0, free_memory=0, load=0.0, max_sessions=16, state=state,
        reachability="public", addrs=(addr,) if addr is not None else (), neighbours=(), issued_at=now,
        expires_at=now + TTL, seq=seq))


def test_a_leaving_peer_is_never_drawn_as_a_neighbour():
    now = [1000.0]
    keeper = ViewKeeper(model_id="m", num_layers=4, clock=lambda: now[0])
    ids = [Identity.from_seed(bytes([i + 1]) * 32) for i in range(3)]
    pids = [ID(i.peer_id).to_base58() for i in ids]
    keeper.merge([record(i, "serving", now[0], 1, f"/memory/{p}/p2p/{p}") for i, p in zip(ids, pids)])
    rng = random.Random(0)
    assert {keeper.sample(rng, lambda p: True) for _ in range(50)} == set(pids)
    keeper.merge([record(i, "leaving", now[0], 2, f"/memory/{p}/p2p/{p}") for i, p in zip(ids[:2], pids[:2])])
    # (a draw may come back empty: it gives up after a few tries that hit leaving peers)
    assert {keeper.sample(rng, lambda p: True) for _ in range(50)} - {None} == {pids[2]}


def test_a_join_address_that_left_backs_off_and_comes_back_when_it_advertises_again():
    """A peer alone whose join address left: tried after FAILED_BACKOFF, doubling up to
    MAX_SEED_BACKOFF (not once a tick for as long as it runs); linked again once it is back."""
    async def main() -> None:
        network = MemoryNetwork(LinkSpec(latency=0.01))
        keeper = ViewKeeper(model_id="m", num_layers=4, clock=trio.current_time)
        seed = Identity.from_seed(b"s" * 32)
        seed_id = ID(seed.peer_id).to_base58()
        async with open_memory_transport(network, "me") as me:
            keeper.remember(f"/memory/{seed_id}/p2p/{seed_id}")
            gossip = Gossip(me, keeper, rng=random.Random(1))
            dials: list[float] = []
            connect = me.connect

            async def counted(addr: str) -> str:
                if seed_id in addr:
                    dials.append(trio.current_time())
                return await connect(addr)

            me.connect = counted
            start = trio.current_time()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(gossip.run)
                await trio.sleep(3600.0)  # an hour of gossip ticks, the seed gone
                gaps = [b - a for a, b in zip(dials, dials[1:])]
                assert 5 <= len(dials) < 25, dials  # not 1800 (one a tick)
                assert gaps == sorted(gaps) and gaps[0] <= 1.5 * FAILED_BACKOFF + 2 * GOSSIP_INTERVAL, gaps
                assert max(gaps) <= MAX_SEED_BACKOFF + 2 * GOSSIP_INTERVAL, gaps
                assert dials[0] - start <= 2 * GOSSIP_INTERVAL
                async with open_memory_transport(network, seed_id) as back:  # it restarted
                    Gossip(back, ViewKeeper(model_id="m", num_layers=4, clock=trio.current_time))
                    await trio.sleep(MAX_SEED_BACKOFF + 2 * GOSSIP_INTERVAL)
                    assert seed_id in gossip.membership.outbound
                    nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_link_that_failed_once_is_tried_again_within_seconds_not_a_minute():
    """A failed dial is often a collision (two peers behind NAT dialling each other through their
    relay at once: both connections torn down), not an absence: the next try comes after
    FAILED_BACKOFF (randomly stretched), not after the minute a refusal costs."""
    async def main() -> None:
        network = MemoryNetwork(LinkSpec(latency=0.01))
        other = Identity.from_seed(b"o" * 32)
        other_id = ID(other.peer_id).to_base58()
        async with open_memory_transport(network, "me") as me, open_memory_transport(network, other_id) as there:
            Gossip(there, ViewKeeper(model_id="m", num_layers=4, clock=trio.current_time))
            keeper = ViewKeeper(model_id="m", num_layers=4, clock=trio.current_time)
            keeper.remember(f"/memory/{other_id}/p2p/{other_id}")
            gossip = Gossip(me, keeper, rng=random.Random(1))
            dials: list[float] = []
            connect = me.connect

            async def first_fails(addr: str) -> str:
                dials.append(trio.current_time())
                if len(dials) == 1:
                    raise PeerUnreachable("the two dials crossed")
                return await connect(addr)

            me.connect = first_fails
            async with trio.open_nursery() as nursery:
                nursery.start_soon(gossip.run)
                with trio.move_on_after(REFUSED_BACKOFF):
                    while other_id not in gossip.membership.outbound:
                        await gossip.keeper.wait_changed()
                assert other_id in gossip.membership.outbound, dials
                assert len(dials) == 2 and FAILED_BACKOFF <= dials[1] - dials[0] <= 1.5 * FAILED_BACKOFF + GOSSIP_INTERVAL, dials
                nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def test_a_plain_direct_link_is_said_only_with_v(caplog):
    """Issue 34, item 6: every requester and `swarm status` printed `link ...: direct` on every
    peer it touched. A new direct link is an INFO record now (-v); the trace keeps it."""
    import logging

    from tessera.peer.net.libp2p import open_libp2p_transport
    from tessera.peer.net.nat.reachability import NatService
    from tessera.store.events import Connect
    from tessera.store.trace import MemoryTracer

    async with open_libp2p_transport(Identity.generate().seed) as a, \
            open_libp2p_transport(Identity.generate().seed) as b:
        lines: list[str] = []
        tracer = MemoryTracer()
        nat = NatService(a, ViewKeeper(model_id="m", num_layers=4, clock=lambda: 0.0), out=lines.append,
                         tracer=tracer)
        await b.connect(a.addrs()[0])
        with caplog.at_level(logging.INFO, logger="tessera.peer.net.nat.reachability"):
            nat.poll_links()
        assert not [line for line in lines if line.startswith("link ")], lines
        assert f"link {b.peer_id}: direct" in caplog.text
        assert [(e.event.remote, e.event.link) for e in tracer.of_kind(Connect)] == [(b.peer_id, "direct")]


def test_a_peer_without_addresses_is_never_drawn_as_a_neighbour():
    # A record with no address (a requester's, an observer's) cannot be dialled: drawing it
    # would spend an outbound slot on a dial that cannot start.
    now = [1000.0]
    keeper = ViewKeeper(model_id="m", num_layers=4, clock=lambda: now[0])
    ids = [Identity.from_seed(bytes([i + 0x21]) * 32) for i in range(2)]
    pids = [ID(i.peer_id).to_base58() for i in ids]
    keeper.merge([record(ids[0], "serving", now[0], 1, None),
                  record(ids[1], "serving", now[0], 1, f"/memory/{pids[1]}/p2p/{pids[1]}")])
    rng = random.Random(0)
    assert {keeper.sample(rng, lambda p: True) for _ in range(50)} - {None} == {pids[1]}
