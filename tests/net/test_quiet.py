"""Quiet by default (issue 34, item 6): a peer that left gracefully is not re-dialled twice a second
(a join address whose peer said it was leaving backs off, doubling, capped; any other leaving peer
is let go), and a plain direct link is no line on stdout."""

from __future__ import annotations

from libp2p.peer.id import ID

from tessera.peer.net.gossip import GOSSIP_INTERVAL, MAX_REDIAL_BACKOFF, ViewKeeper
from tessera.protocol.crypto import sign_record
from tessera.protocol.keys import Identity
from tessera.protocol.records import PeerRecord

TTL = 15.0


def record(identity: Identity, state: str, now: float, seq: int) -> object:
    return sign_record(identity, PeerRecord(
        peer_id=identity.peer_id, name="", model_id="m", start=0, end=4, shard_index=0, shard_count=1,
        shard_group="", throughput=100.0, free_memory=0, load=0.0, max_sessions=16, state=state,
        reachability="public", addrs=("/ip4/127.0.0.1/tcp/4001",), neighbours=(), issued_at=now,
        expires_at=now + TTL, seq=seq))


def test_a_join_address_that_left_backs_off_and_comes_back_when_it_advertises_again():
    now = [1000.0]
    keeper = ViewKeeper(model_id="m", num_layers=4, clock=lambda: now[0])
    seed, other = Identity.from_seed(b"s" * 32), Identity.from_seed(b"o" * 32)
    seed_id, other_id = (ID(i.peer_id).to_base58() for i in (seed, other))
    keeper.remember(f"/ip4/127.0.0.1/tcp/4001/p2p/{seed_id}")
    keeper.merge([record(seed, "serving", now[0], 1), record(other, "serving", now[0], 1)])
    assert {pid for pid, _ in keeper.dial_targets("me", [])} == {seed_id, other_id}
    now[0] += 1.0
    keeper.merge([record(seed, "leaving", now[0], 2), record(other, "leaving", now[0], 2)])
    dials = []
    while now[0] < 1000.0 + 3600.0:  # an hour of gossip ticks
        if any(pid == seed_id for pid, _ in keeper.dial_targets("me", [])):
            dials.append(now[0])
        assert all(pid != other_id for pid, _ in keeper.dial_targets("me", []))
        now[0] += GOSSIP_INTERVAL
    gaps = [b - a for a, b in zip(dials, dials[1:])]
    assert len(dials) < 25, len(dials)  # not 1800 (one a tick), let alone twice a second
    assert gaps == sorted(gaps) and max(gaps) <= MAX_REDIAL_BACKOFF + GOSSIP_INTERVAL and gaps[0] <= 2 * GOSSIP_INTERVAL
    assert other_id not in keeper.book  # its record expired: forgotten
    keeper.merge([record(seed, "serving", now[0], 3)])  # it restarted and advertises again
    assert any(pid == seed_id for pid, _ in keeper.dial_targets("me", []))


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
