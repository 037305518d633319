"""PeerNode and Swarm stand on what they are given (peer/node/parts.py, request/client.py): the
composition root wires libp2p + sqlite + torch; the simulator's peers and requesters are the
same classes on the memory transport, trio's MockClock and a cost-model stage."""

from __future__ import annotations

import trio
import trio.testing

from tessera.peer.net.memory import MemoryNetwork, open_memory_transport
from tessera.peer.net.memory_stream import LinkSpec
from tessera.peer.node.peer_node import PeerNode
from tessera.peer.request.client import Swarm
from tessera.peer.sim.peer import SimPeer
from tessera.peer.sim.policies import get_policy
from tessera.peer.sim.report import Recorder
from tessera.peer.sim.requester import SimRequester
from tessera.peer.sim.scenario import PeerPlan, RequestPlan
from tessera.peer.sim.stage import SimStage, sim_model_id, sim_spec
from tessera.peer.sim.world import Timings, World, assign_identities

from ..test_layers import import_graph
from ..waiting import await_until

HEAVY = ("torch", "libp2p", "sqlite3", "sqlite_utils", "psutil", "tessera.store.db", "tessera.store.keyfile",
         "tessera.peer.net.libp2p", "tessera.stages.weights.registry", "tessera.stages.engine.stage", "tessera.stages.engine.speed")


def test_only_the_composition_root_wires_libp2p_sqlite_and_torch() -> None:
    graph = import_graph()

    def heavy(module: str) -> set[str]:
        return {t for t in graph[module] if any(t == h or t.startswith(h + ".") for h in HEAVY)}

    assert heavy("tessera.peer.node.peer_node") == set()
    assert heavy("tessera.peer.node.parts") == set()
    assert {"tessera.peer.net.libp2p", "tessera.store.db", "tessera.store.keyfile"} <= heavy("tessera.peer.node.compose")
    assert {"torch", "tessera.stages.engine.stage", "tessera.stages.engine.speed"} <= heavy("tessera.peer.node.torch_compute")


def test_a_simulated_peer_and_requester_are_the_real_classes_on_simulated_parts() -> None:
    """Two SimPeers join over gossip, claim the two halves, serve; a SimRequester's request goes
    through both; a peer leaves gracefully. Records are dated on trio's clock; no store is kept."""
    spec = sim_spec(30)
    timings = Timings(load_seconds_per_layer=0.01)
    seen: dict[str, object] = {}

    async def main() -> None:
        world = World(network=MemoryNetwork(LinkSpec(latency=0.005)), spec=spec, model_id=sim_model_id(spec),
                      timings=timings, policy=get_policy("default"), view_mode="gossip", seed=3,
                      recorder=Recorder(spec.num_layers, trio.current_time))
        ids = assign_identities(["a", "b"], 3)
        async with trio.open_nursery() as nursery:
            world.nursery = nursery
            peers = []
            for label in ("a", "b"):
                peer = SimPeer(world, PeerPlan(label, join_at=0.0, throughput=100.0, capacity_layers=15), ids[label])
                world.peers[label], world.labels[peer.peer_id] = peer, label
                peers.append(peer)
                nursery.start_soon(peer.run)
                await await_until(lambda: peer.serving, 60.0, f"{label} serving")
            a, b = peers
            await await_until(lambda: sorted((a.span, b.span)) == [(0, 15), (15, 30)], 60.0, "the halves claimed")
            assert type(a.node) is PeerNode and isinstance(a.node.stage, SimStage)
            assert a.node.store is None and a.node.nat is None and a.node.gossip is not None
            own = a.keeper.known[a.peer_id].record
            assert 0.0 < own.issued_at <= trio.current_time()  # simulated time, not the wall clock's 1.7e9

            requester_id = assign_identities(["r"], 3, kind="requester")["r"]
            async with open_memory_transport(world.network, "requester") as transport:
                requester = SimRequester(world, "r", requester_id, transport, nursery)
                assert type(requester.swarm) is Swarm and requester.swarm.head is None
                await requester.connect(world.bootstrap_addrs())
                await requester.run_request(RequestPlan(id=0, at=trio.current_time(), requester="r",
                                                        prompt_tokens=8, new_tokens=3))
                outcome = world.recorder.requests[0]
                seen["outcome"] = (outcome.completed, outcome.error, outcome.routes)

            a.stop()
            await await_until(lambda: not a.alive, 60.0, "a gone")
            seen["exit"] = a.exit
            seen["left_state"] = world.recorder.peer_log["a"]["how"]
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    completed, error, routes = seen["outcome"]
    assert completed, error
    assert sorted(routes[0]) == [("a", 0, 15), ("b", 15, 30)] or sorted(routes[0]) == [("a", 15, 30), ("b", 0, 15)]
    assert seen["exit"] == "left" and seen["left_state"] == "left"
