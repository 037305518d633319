"""A peer that lies in the view exchange (peer/net/gossip.py) cannot stop another from gossiping:
a false report of its death is answered with a newer record, a descent that never ends is cut
off, an over-long turn is refused, and the victim goes on agreeing with an honest neighbour."""

from __future__ import annotations

import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.peer.base.ids import peer_id_text
from tessera.peer.base.protocols import GOSSIP_PROTOCOL
from tessera.peer.net.gossip import Gossip, ViewKeeper
from tessera.peer.net.memory import MemoryNetwork, open_memory_transport
from tessera.peer.net.memory_stream import LinkSpec
from tessera.peer.net.reconcile import MAX_TURNS
from tessera.peer.net.transport import Channel
from tessera.protocol.crypto import MAX_CLOCK_SKEW, sign_record
from tessera.protocol.keys import Identity
from tessera.protocol.records import MAX_DEPARTURE_TTL, Departure, PeerRecord, RangeDigest, ViewTurn

IDS = [Identity.from_seed(bytes([i + 1]) * 32) for i in range(3)]


def record(identity: Identity, seq: int, now: float):
    return sign_record(identity, PeerRecord(
        peer_id=identity.peer_id, name="p", model_id="m", start=0, end=10, shard_index=0, shard_count=1,
        throughput=100.0, free_memory=0, load=0.0, max_sessions=16, state="serving", reachability="public",
        addrs=(), neighbours=(), issued_at=now, expires_at=now + 600.0, seq=seq))


def run(main) -> None:
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_false_report_of_a_peers_death_is_answered_with_a_newer_record() -> None:
    async def main() -> None:
        network = MemoryNetwork(LinkSpec(latency=0.01))
        own = {"rec": record(IDS[0], 5, trio.current_time())}
        refuted: list[int] = []
        keepers = [ViewKeeper(model_id="m", num_layers=30, clock=trio.current_time) for _ in range(2)]
        victim_id = peer_id_text(IDS[0].peer_id)
        async with open_memory_transport(network, victim_id) as tv, open_memory_transport(network, "liar") as tl:
            Gossip(tv, keepers[0], own_record=lambda: own["rec"], refute=refuted.append)
            liar = Gossip(tl, keepers[1])
            keepers[0].merge([own["rec"]])
            keepers[1].merge([own["rec"]])
            assert keepers[1].report_gone(victim_id) is not None  # the lie
            await tl.connect(tv.addrs()[0])
            assert await liar.exchange(victim_id)
            assert refuted == [5]  # the victim heard of its own death, and answers it
            own["rec"] = record(IDS[0], 6, trio.current_time())
            assert await liar.exchange(victim_id)
            assert keepers[1].get(victim_id) is not None and keepers[1].get(victim_id).record.seq == 6

    run(main)


async def _liar_handler(stream, turns: list[ViewTurn]) -> None:
    """Answers every turn with another range digest to compare, forever."""
    channel = Channel(stream)
    try:
        while True:
            msg = await channel.receive()
            turns.append(msg)
            await channel.send(ViewTurn(ranges=(RangeDigest(depth=1, prefix=len(turns) % 16, count=99,
                                                            hash=bytes([len(turns) % 256]) * 16),)))
    except Exception:
        await channel.reset()


def test_a_descent_that_never_ends_is_cut_off_and_the_victim_goes_on() -> None:
    async def main() -> None:
        network = MemoryNetwork(LinkSpec(latency=0.01))
        now = trio.current_time()
        victim_keeper = ViewKeeper(model_id="m", num_layers=30, clock=trio.current_time)
        honest_keeper = ViewKeeper(model_id="m", num_layers=30, clock=trio.current_time)
        victim_keeper.merge([record(IDS[0], 1, now)])
        honest_keeper.merge([record(IDS[1], 1, now)])
        turns: list[ViewTurn] = []
        async with open_memory_transport(network, "victim") as tv, open_memory_transport(network, "liar") as tl, \
                open_memory_transport(network, "honest") as th:
            victim = Gossip(tv, victim_keeper)
            Gossip(th, honest_keeper)
            tl.set_handler(GOSSIP_PROTOCOL, lambda stream: _liar_handler(stream, turns))
            await tv.connect(tl.addrs()[0])
            await tv.connect(th.addrs()[0])
            assert not await victim.exchange("liar")  # refused after MAX_TURNS turns
            assert len(turns) <= MAX_TURNS + 1
            assert await victim.exchange("honest")
            assert victim_keeper.root is honest_keeper.root  # and it still agrees with the honest one

    run(main)


@settings(max_examples=25, deadline=None)
@given(frames=st.lists(st.builds(
    ViewTurn,
    ranges=st.lists(st.builds(RangeDigest, depth=st.integers(0, 3), prefix=st.just(0), count=st.integers(0, 10**6),
                              hash=st.binary(min_size=16, max_size=16)), max_size=4).map(tuple),
    want=st.lists(st.binary(min_size=1, max_size=40), max_size=4).map(tuple),
    departures=st.lists(st.builds(Departure, peer_id=st.binary(min_size=1, max_size=40), seq=st.integers(0, 10**12),
                                  gone_until=st.floats(0.0, 1e6)), max_size=3).map(tuple),
    more=st.booleans()), min_size=1, max_size=6))
def test_whatever_a_peer_sends_the_responder_ends_cleanly_and_serves_the_next(frames) -> None:
    async def main() -> None:
        network = MemoryNetwork(LinkSpec(latency=0.01))
        keeper = ViewKeeper(model_id="m", num_layers=30, clock=trio.current_time)
        keeper.merge([record(IDS[2], 1, trio.current_time())])
        honest = ViewKeeper(model_id="m", num_layers=30, clock=trio.current_time)
        async with open_memory_transport(network, "r") as tr, open_memory_transport(network, "x") as tx, \
                open_memory_transport(network, "h") as th:
            Gossip(tr, keeper)
            h = Gossip(th, honest)
            channel = Channel(await tx.open_stream("r", GOSSIP_PROTOCOL))
            try:
                for frame in frames:
                    await channel.send(frame)
                with trio.move_on_after(30):
                    while await channel.receive_or_none() is not None:
                        pass
            except Exception:
                pass  # the responder may reset: that is its answer
            await th.connect(tr.addrs()[0])
            assert await h.exchange("r")
            assert honest.root is not None and honest.root.count >= 1
            assert network.handler_errors == 0  # a typed error and a reset, never a crash

    run(main)


def test_a_departure_that_would_outlive_any_honest_one_is_refused() -> None:
    # A liar's departure ending far in the future would hide a peer from the view for that long
    # (until it refutes): one ending past MAX_DEPARTURE_TTL (plus skew and the minute grid) is
    # refused and counted.
    async def main() -> None:
        keeper = ViewKeeper(model_id="m", num_layers=30, clock=trio.current_time)
        now = trio.current_time()
        keeper.merge([record(IDS[1], 1, now)])
        far = now + MAX_DEPARTURE_TTL + MAX_CLOCK_SKEW + 61.0
        assert keeper.depart([Departure(IDS[1].peer_id, 1, far)]) == []
        assert keeper.rejected == 1 and keeper.get(peer_id_text(IDS[1].peer_id)) is not None
        assert keeper.depart([Departure(IDS[1].peer_id, 1, now + MAX_DEPARTURE_TTL)]) == [peer_id_text(IDS[1].peer_id)]

    run(main)
