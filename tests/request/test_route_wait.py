"""Coverage means routable: `swarm status` counts only peers a route could use (one definition,
routing.unusable_reason), and a requester waiting for a route says what it waits for, then why
it gave up; it traces its join once, when its first view is pulled (a replay starts it then)."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from tessera.peer.request.client import Swarm
from tessera.peer.request.requester_model import RequesterModel
from tessera.peer.base.errors import NoRoute, PeerUnreachable
from tessera.peer.net.gossip import Gossip, ViewKeeper
from tessera.peer.net.memory_stream import LinkSpec
from tessera.peer.net.memory import MemoryNetwork, open_memory_transport
from tessera.peer.plan.cost import FULL_LOAD
from tessera.peer.plan.routing import route, unusable_reason, why_no_route
from tessera.peer.sim.stage import sim_spec
from tessera.peer.cli.status import format_status
from tessera.peer.plan.coverage import swarm_coverage
from tessera.peer.plan.view import DRAINING, LEAVING, LOADING, SERVING, PeerInfo, SwarmView
from tessera.protocol.crypto import sign_record
from tessera.protocol.keys import Identity
from tessera.protocol.records import PeerRecord
from tessera.store.events import Join
from tessera.store.trace import MemoryTracer


def peer(pid: str, start: int, end: int, *, state: str = SERVING, load: float = 0.0, name: str = "") -> PeerInfo:
    return PeerInfo(peer_id=pid, model_id="m", start=start, end=end, throughput=100.0, state=state, load=load,
                    name=name or pid)


def test_each_reason_a_peer_takes_no_sessions() -> None:
    assert unusable_reason(peer("a", 0, 10)) is None
    assert unusable_reason(peer("a", 0, 10, state=DRAINING)) == "draining"
    assert unusable_reason(peer("a", 0, 10, state=LEAVING)) == "leaving"
    assert unusable_reason(peer("a", 0, 10, state=LOADING)) == "loading"
    assert unusable_reason(peer("a", 0, 10, load=FULL_LOAD)) == "busy"
    assert unusable_reason(peer("a", 0, 10), {"a"}) == "banned"


@pytest.mark.parametrize("state", [DRAINING, LEAVING, LOADING])
def test_status_gaps_are_the_layers_routing_cannot_cover(state: str) -> None:
    view = SwarmView.of(30, [peer("a", 0, 15), peer("b", 15, 30, state=state), peer("c", 10, 20)])
    coverage = swarm_coverage(view)
    assert coverage.replicas == (1,) * 10 + (2,) * 5 + (1,) * 5 + (0,) * 10
    assert coverage.gaps == ((20, 30),) and coverage.aside == (("b", state),)
    assert not route(view, source="r").ok  # routing agrees: nothing through [20, 30)
    assert view.coverage()[25] == (0 if state == LEAVING else 1)  # the claim is still there
    whole = SwarmView.of(30, [peer("a", 0, 15), peer("b", 15, 30), peer("c", 10, 20)])
    assert swarm_coverage(whole).gaps == () and route(whole, source="r").ok


def test_status_lists_the_peers_it_does_not_count() -> None:
    report = {
        "model_id": "m" * 16, "num_layers": 4, "coverage": [1, 1, 0, 0], "gaps": [[2, 4]],
        "peers": [
            {"peer_id": "A" * 20, "name": "attic", "span": [0, 2], "shard": [0, 1], "state": "serving",
             "free_memory": 0, "throughput": 1.0, "load": 0.0, "reachability": "public", "connection": None,
             "last_seen_s": 0.0, "links": {}, "not_routable": None},
            {"peer_id": "B" * 20, "name": "cellar", "span": [2, 4], "shard": [0, 1], "state": "draining",
             "free_memory": 0, "throughput": 1.0, "load": 0.0, "reachability": "public", "connection": None,
             "last_seen_s": 0.0, "links": {}, "not_routable": "draining"},
        ],
    }
    text = format_status(report)
    assert "not taking sessions (not counted): cellar [2,4) draining" in text
    assert "[2,4) UNCOVERED" in text
    assert text.startswith(f"model {'m' * 16}…  4 layers  2 peers\n")
    assert format_status({**report, "peers": report["peers"][:1]}).startswith(f"model {'m' * 16}…  4 layers  1 peer\n")


def test_why_no_route_names_the_blocking_peers() -> None:
    view = SwarmView.of(30, [peer("a", 0, 15), peer("b", 15, 30, state=DRAINING, name="bee"),
                             peer("c", 15, 30, name="sea"), peer("d", 15, 30, load=1.0, name="dee")])
    gaps, text = why_no_route(view, banned={"c"})
    assert gaps == [(15, 30)]
    assert text == ("uncovered layers: [15, 30); not taking sessions: bee [15,30) draining, sea [15,30) banned, "
                    "dee [15,30) busy")
    gaps, text = why_no_route(SwarmView.of(30, [peer("a", 0, 15)]), unreachable=set())
    assert text == "uncovered layers: [15, 30) (no peer claims them)"
    gaps, text = why_no_route(view, unreachable={"c"}, start=0, end=15)
    assert gaps == [] and text.startswith("uncovered layers: none")


def test_waiting_for_a_route_reports_each_second_and_ends_with_the_reason() -> None:
    """The requester's wait, on the memory transport under MockClock (Swarm without its model)."""
    me, other = Identity.from_seed(b"\x01" * 32), Identity.from_seed(b"\x02" * 32)
    lines: list[str] = []

    async def main() -> None:
        network = MemoryNetwork(LinkSpec(latency=0.01))
        async with open_memory_transport(network, "requester") as transport, trio.open_nursery() as nursery:
            # the real Swarm on a weightless model (what a simulated requester is), on trio's clock
            swarm = Swarm(transport, nursery, identity=Identity.from_seed(b"\x03" * 32),
                          model=RequesterModel(sim_spec(30), "m"), clock=trio.current_time,
                          ban_clock=trio.current_time)
            swarm.on_route_wait = lines.append
            now = trio.current_time()
            for ident, span, state in ((me, (0, 15), SERVING), (other, (15, 30), DRAINING)):
                swarm.keeper.merge([sign_record(ident, PeerRecord(
                    peer_id=ident.peer_id, name=f"p{span[0]}", model_id="m", start=span[0], end=span[1], shard_index=0,
                    shard_count=1, throughput=100.0, free_memory=0, load=0.0, max_sessions=16, state=state,
                    reachability="public", addrs=(), neighbours=(), issued_at=now, expires_at=now + 3600, seq=1))])
            with pytest.raises(NoRoute) as failed:
                await swarm.wait_for_route(5.0)
            nursery.cancel_scope.cancel()
        assert str(failed.value) == ("no route through the swarm after 5 s: uncovered layers: [15, 30); "
                                     "not taking sessions: p15 [15,30) draining")
        assert failed.value.missing == [(15, 30)]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert len(lines) == 4  # at 1, 2, 3 and 4 s of the 5
    assert lines[0] == "waiting for a route (1 s of 5 s): uncovered layers: [15, 30); not taking sessions: p15 [15,30) draining"


def test_a_requester_traces_one_join_after_pulling_every_bootstrap_peers_view() -> None:
    """A replay starts the requester at its traced join (peer/sim/replay.py), so the join is
    traced once, when the views are pulled, and not at all when no bootstrap peer answers."""
    joins: list[tuple[Join, int]] = []  # each traced join, and how many records the view held then

    async def main() -> None:
        network = MemoryNetwork(LinkSpec(latency=0.01))
        async with open_memory_transport(network, "a") as a, open_memory_transport(network, "b") as b, \
                open_memory_transport(network, "requester") as transport, trio.open_nursery() as nursery:
            now = trio.current_time()
            for seed, there, span in ((b"\x01", a, (0, 15)), (b"\x02", b, (15, 30))):
                ident = Identity.from_seed(seed * 32)  # each bootstrap peer knows its own record only
                keeper = ViewKeeper(model_id="m", num_layers=30, clock=trio.current_time)
                keeper.merge([sign_record(ident, PeerRecord(
                    peer_id=ident.peer_id, name=f"p{span[0]}", model_id="m", start=span[0], end=span[1],
                    shard_index=0, shard_count=1, throughput=100.0, free_memory=0, load=0.0, max_sessions=16,
                    state=SERVING, reachability="public", addrs=(), neighbours=(), issued_at=now,
                    expires_at=now + 3600, seq=1))])
                Gossip(there, keeper)
            tracer = MemoryTracer(peer="requester")
            swarm = Swarm(transport, nursery, identity=Identity.from_seed(b"\x03" * 32),
                          model=RequesterModel(sim_spec(30), "m"), clock=trio.current_time,
                          ban_clock=trio.current_time, tracer=tracer, reports=False)
            emit = tracer.emit

            def spy(event, **kwargs) -> None:
                if isinstance(event, Join):
                    joins.append((event, len(swarm.keeper.live())))
                emit(event, **kwargs)

            tracer.emit = spy  # type: ignore[method-assign]
            with pytest.raises(PeerUnreachable):
                await swarm.connect(["/memory/99/p2p/nobody"])
            assert joins == []
            await swarm.connect(["/memory/99/p2p/nobody", a.addrs()[0], b.addrs()[0]])
            nursery.cancel_scope.cancel()
        assert joins == [(Join(addrs=transport.addrs(), model="m"), 2)]

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
