"""The swarm view converges: random sequences of joins, leaves, crashes, moves, memory changes
and partitions over simulated peers running the real gossip (peer/sim/convergence.py), and the
bound stated in peer/net/gossip.py — B(N), a function of the swarm's size — checked after the
last change, at 3 to 64 peers.

bench/convergence.py runs more sequences and prints the figures; bench/scale.py goes to 10,000.
"""

from __future__ import annotations

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tessera.peer.base.ids import peer_id_text
from tessera.peer.net.gossip import DEPARTURE_TTL, GOSSIP_INTERVAL, REDIAL_WINDOW, Gossip, ViewKeeper, material
from tessera.peer.net.verified import verified_entry
from tessera.peer.net.memory_stream import LinkSpec
from tessera.peer.net.memory import MemoryNetwork, open_memory_transport
from tessera.peer.sim.convergence import CONVERGENCE_TIMINGS, bound_periods, EVENT_KINDS, Event, run_sequence
from tessera.protocol.crypto import sign_record
from tessera.protocol.keys import Identity
from tessera.protocol.errors import ExpiredRecord, InconsistentFields
from tessera.protocol.records import Departure, LayerSpan, PeerRecord

events = st.builds(
    Event,
    kind=st.sampled_from(EVENT_KINDS),
    after=st.floats(0.0, 3.0 * CONVERGENCE_TIMINGS.gossip_interval),
    target=st.integers(0, 1000),
    value=st.integers(0, 1000),
)


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(peers=st.integers(3, 16), sequence=st.lists(events, min_size=1, max_size=8), seed=st.integers(0, 2**16))
def test_every_sequence_converges_within_the_bound(peers: int, sequence: list[Event], seed: int) -> None:
    check(run_sequence(peers, sequence, seed=seed))


@settings(max_examples=2, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(peers=st.integers(17, 64), sequence=st.lists(events, min_size=1, max_size=6), seed=st.integers(0, 2**16))
def test_every_sequence_converges_within_the_bound_in_a_bigger_swarm(peers: int, sequence: list[Event],
                                                                     seed: int) -> None:
    """The bound grows with log2 N; the views of up to 64 peers still agree within it."""
    check(run_sequence(peers, sequence, seed=seed))


def check(outcome) -> None:
    assert outcome.worst_periods is not None, outcome
    assert outcome.worst_periods <= bound_periods(outcome.peers), outcome
    assert outcome.agreed_throughout, outcome
    assert outcome.stale == [], outcome


def test_a_partition_longer_than_a_record_lifetime_heals() -> None:
    """Both sides' records of the other expire during the cut; the address book re-dials."""
    t = CONVERGENCE_TIMINGS
    outcome = run_sequence(6, [Event("partition", after=2.0, value=3), Event("heal", after=3 * t.record_ttl)], seed=5)
    assert outcome.worst_periods is not None and outcome.worst_periods <= bound_periods(outcome.peers), outcome
    assert outcome.agreed_throughout and outcome.stale == [], outcome


def test_a_crashed_peers_record_disappears_everywhere_after_it_expires() -> None:
    outcome = run_sequence(4, [Event("crash", after=2.0, target=1), Event("vanish", after=0.5, target=2)], seed=9)
    assert outcome.stale == [] and outcome.agreed_throughout, outcome
    assert outcome.worst_periods is not None and outcome.worst_periods <= bound_periods(outcome.peers), outcome


def record(identity: Identity, *, seq: int, now: float, start: int = 0, end: int = 10, state: str = "serving",
           ttl: float = 15.0, addrs: tuple[str, ...] = (), held: tuple[LayerSpan, ...] = ()) -> object:
    return sign_record(identity, PeerRecord(
        peer_id=identity.peer_id, name="p", model_id="m", start=start, end=end, shard_index=0, shard_count=1,
        throughput=100.0, free_memory=0, load=0.0, max_sessions=16, state=state, reachability="public",
        addrs=addrs, neighbours=(), issued_at=now, expires_at=now + ttl, seq=seq, held=held))


def test_one_digest_exchange_leaves_both_sides_with_the_newer_of_every_record() -> None:
    ids = [Identity.from_seed(bytes([i]) * 32) for i in range(5)]

    async def main() -> None:
        network = MemoryNetwork(LinkSpec(latency=0.01))
        a_keeper = ViewKeeper(model_id="m", num_layers=30, clock=trio.current_time)
        b_keeper = ViewKeeper(model_id="m", num_layers=30, clock=trio.current_time)
        now = trio.current_time()
        # a: peer 0 new, peer 1 old; b: peer 0 old, peer 1 new; peer 2 only a; peer 3 only b; 4 expired at b
        a_keeper.merge([record(ids[0], seq=5, now=now, state="draining"), record(ids[1], seq=1, now=now),
                        record(ids[2], seq=1, now=now)])
        b_keeper.merge([record(ids[0], seq=4, now=now), record(ids[1], seq=3, now=now, start=10, end=20),
                        record(ids[3], seq=1, now=now), record(ids[4], seq=1, now=now, ttl=0.5)])
        await trio.sleep(1.0)
        async with open_memory_transport(network, "A") as ta, open_memory_transport(network, "B") as tb:
            a, _ = Gossip(ta, a_keeper), Gossip(tb, b_keeper)
            await ta.connect(tb.addrs()[0])
            assert await a.exchange("B")
        for keeper in (a_keeper, b_keeper):
            live = keeper.live()
            assert {k.record.seq for k in live.values()} == {5, 3, 1} and len(live) == 4
            assert keeper.rejected == 0
        assert a_keeper.snapshot().get(b_keeper.snapshot().peers[0].peer_id) is not None

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_refresh_replaces_only_an_older_record_of_the_same_peer() -> None:
    me = Identity.from_seed(b"\x07" * 32)

    async def main() -> None:
        keeper = ViewKeeper(model_id="m", num_layers=30, clock=trio.current_time)
        now = trio.current_time()
        assert keeper.merge([record(me, seq=2, now=now, state="draining")])
        assert keeper.merge([record(me, seq=1, now=now, state="serving")]) == []  # older: ignored
        assert keeper.snapshot().peers[0].state == "draining"
        assert keeper.merge([record(me, seq=3, now=now, state="leaving")])
        assert keeper.snapshot().peers[0].state == "leaving"

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_the_layers_a_peer_holds_on_disk_reach_the_view_merged_and_a_change_is_news() -> None:
    me = Identity.from_seed(b"\x08" * 32)

    async def main() -> None:
        keeper = ViewKeeper(model_id="m", num_layers=30, clock=trio.current_time)
        now = trio.current_time()
        assert keeper.merge([record(me, seq=1, now=now)])
        assert keeper.snapshot().peers[0].held == ()  # an older peer says nothing
        fetched = (LayerSpan(10, 20), LayerSpan(0, 5), LayerSpan(5, 8))
        assert keeper.merge([record(me, seq=2, now=now, held=fetched)])
        assert keeper.snapshot().peers[0].held == ((0, 8), (10, 20))
        assert material(record_of(keeper)) != material(PeerRecord(**{**vars(record_of(keeper)), "held": ()}))

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    with pytest.raises(InconsistentFields, match=r"\[4, 4\) is empty"):
        LayerSpan(4, 4)


def record_of(keeper: ViewKeeper) -> PeerRecord:
    (known,) = keeper.known.values()
    return known.record


def test_a_neighbour_that_vanishes_while_the_others_start_does_not_hold_up_their_refreshes() -> None:
    """Peers that start serving just after a neighbour went silent announce it to that
    neighbour too, and the exchange waits out its timeout (5 s). When advertise() waited on
    it, the refresh loop started 5 s late, 7.5 s records expired in some views and the views
    parted again (7.25 periods); advertising now announces in the background."""
    outcome = run_sequence(11, [Event("vanish", after=0.18, target=957)], seed=9186)
    assert outcome.worst_periods is not None and outcome.worst_periods <= bound_periods(outcome.peers), outcome
    assert outcome.agreed_throughout and outcome.stale == [], outcome


def test_only_a_newer_version_replaces_a_record_or_a_departure() -> None:
    # Merge rules (peer/net/record_set.py versions): an equal seq is no news, whatever the record
    # says, and a departure of the same seq with an earlier end does not shorten the one held.
    me = Identity.from_seed(b"\x09" * 32)
    pid = peer_id_text(me.peer_id)

    async def main() -> None:
        keeper = ViewKeeper(model_id="m", num_layers=30, clock=trio.current_time)
        now = trio.current_time()
        first = record(me, seq=2, now=now, state="draining")
        assert keeper.merge([first]) == [pid]
        assert keeper.merge([first]) == []
        assert keeper.merge([record(me, seq=2, now=now, state="serving")]) == []
        assert keeper.snapshot().peers[0].state == "draining"
        assert keeper.depart([Departure(me.peer_id, 2, now + 600.0)]) == [pid]
        assert keeper.depart([Departure(me.peer_id, 2, now + 600.0)]) == []
        assert keeper.depart([Departure(me.peer_id, 2, now + 300.0)]) == []
        assert keeper.entry(pid).gone_until == now + 600.0

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_record_is_refused_at_exactly_its_expiry_also_when_verified_before() -> None:
    # verified_entry checks the lifetime again on its cache's path; that check must match
    # verify_record's (`now >= expires_at` is expired), or a record lives one instant longer.
    signed = record(Identity.from_seed(b"\x0a" * 32), seq=1, now=100.0, ttl=15.0)
    with pytest.raises(ExpiredRecord):
        verified_entry(signed, 115.0)
    verified_entry(signed, 100.0)  # now cached
    with pytest.raises(ExpiredRecord):
        verified_entry(signed, 115.0)


def test_the_graveyard_redials_with_doubling_waits_and_forgets_the_returned_and_the_long_gone() -> None:
    # A departure's end is on a one-minute grid (reporters of the same death send one departure);
    # a grave's probe waits double after each failure; a newer record of the peer, or REDIAL_WINDOW
    # passing, removes its grave.
    ids = [Identity.from_seed(bytes([0x0b + i]) * 32) for i in range(2)]
    a, b = (peer_id_text(i.peer_id) for i in ids)
    now = [1000.5]
    keeper = ViewKeeper(model_id="m", num_layers=30, clock=lambda: now[0])
    keeper.merge([record(i, seq=1, now=now[0], addrs=(f"/memory/{p}",), ttl=1e5) for i, p in zip(ids, (a, b))])
    departure = keeper.report_gone(a)
    assert departure.gone_until % 60.0 == 0.0 and now[0] + DEPARTURE_TTL <= departure.gone_until < now[0] + DEPARTURE_TTL + 60
    assert keeper.graves[a].addrs == (f"/memory/{a}",)
    waits = []
    for t in (1010.0, 1020.0):
        keeper.grave_probed(a, False, t)
        waits.append(keeper.graves[a].next_probe - t)
    assert waits == [2 * GOSSIP_INTERVAL, 4 * GOSSIP_INTERVAL]
    assert keeper.merge([record(ids[0], seq=2, now=now[0], addrs=(f"/memory/{a}",), ttl=1e5)]) == [a]
    assert a not in keeper.graves  # it is back
    keeper.report_gone(b)
    now[0] += REDIAL_WINDOW + 1.0
    keeper.prune()
    assert b not in keeper.graves


def test_an_exchange_carries_our_own_record_as_re_signed_since_the_last() -> None:
    # Before each exchange a peer puts its current own record in its set (`_with_own`): a record
    # re-signed since (a higher seq, a new state) is what the other side gets, not the one held.
    me = Identity.from_seed(b"\x0d" * 32)

    async def main() -> None:
        network = MemoryNetwork(LinkSpec(latency=0.01))
        now = trio.current_time()
        own = {"rec": record(me, seq=1, now=now)}
        a_keeper = ViewKeeper(model_id="m", num_layers=30, clock=trio.current_time)
        b_keeper = ViewKeeper(model_id="m", num_layers=30, clock=trio.current_time)
        async with open_memory_transport(network, peer_id_text(me.peer_id)) as ta, \
                open_memory_transport(network, "B") as tb:
            a = Gossip(ta, a_keeper, own_record=lambda: own["rec"])
            Gossip(tb, b_keeper)
            await ta.connect(tb.addrs()[0])
            assert await a.exchange("B")
            own["rec"] = record(me, seq=2, now=now, state="draining")
            assert await a.exchange("B")
        assert [k.record.seq for k in b_keeper.live().values()] == [2]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
