"""Tensor shards over real libp2p processes on loopback, on SmolLM2: a group of 3 between
plain peers and over every layer — exact, audited — and a rank killed mid-answer."""

from __future__ import annotations

import pytest

from peer.client import Swarm
from peer.demo import LocalSwarm
from peer.recovery import ResilientSession
from peer.routing import Hop, Route
from peer.shard_audit import check
from peer.shard_route import SegmentedSession
from store.trace import MemoryTracer

from .shard_helpers import (
    DECODE_STEPS, LOGITS_TOLERANCE, collect_audit, greedy_run, group_hop, network_greedy, rank_args, wait_for_peers,
)

pytestmark = pytest.mark.slow

PROMPT = [1, 504, 3458, 282, 4649, 30, 216, 10, 45, 99, 7, 1000]
# peer0 [0, 10) | group "a" (peer1-3) [10, 20) | peer4 [20, 30) | group "b" (peer5-7) [0, 30)
A, B = ["peer1", "peer2", "peer3"], ["peer5", "peer6", "peer7"]
NAMES = [f"peer{i}" for i in range(8)]


@pytest.fixture(scope="module")
def procs(smol_dir):
    args = [["--layers", "0:10"], *rank_args((10, 20), "a", 3), ["--layers", "20:30"], *rank_args((0, 30), "b", 3)]
    swarm = LocalSwarm(len(args), extra_args=args)
    try:
        swarm.start(together=True)
        yield swarm
    finally:
        swarm.stop(timeout=15)


@pytest.fixture(scope="module")
def reference(smol_stage):
    return greedy_run(smol_stage, [smol_stage], PROMPT, session="reference")


def assert_matches(reference, got) -> float:
    assert got[0] == reference[0]
    worst = max(float((a - b).abs().max()) for a, b in zip(reference[1], got[1]))
    assert worst <= LOGITS_TOLERANCE, worst
    return worst


async def run_forced(procs, hops, group_peers):
    tracer = MemoryTracer(peer="requester")
    async with Swarm.join(procs.addrs[:1], tracer=tracer) as swarm:
        ids = await wait_for_peers(swarm, NAMES)
        route = Route(tuple(hops(ids)), 0.0)
        session = SegmentedSession(swarm.ctx, route, max_length=64)
        await session.open()
        try:
            got = await network_greedy(swarm, session, PROMPT)
        finally:
            await session.close()
        sessions = [s.session_id.hex() for s in session.segments if hasattr(s, "members")]
    indices = [NAMES.index(n) for n in group_peers]
    logs = collect_audit(procs, indices, tracer, sessions, expected=(DECODE_STEPS + 1) * (len(group_peers) + 1))
    return got, check(logs)


async def test_a_group_of_three_between_plain_peers(procs, reference):
    def hops(ids):
        return [Hop(ids["peer0"], 0, 10), group_hop(ids, A, "a", 10, 20), Hop(ids["peer4"], 20, 30)]

    got, report = await run_forced(procs, hops, A)
    worst = assert_matches(reference, got)
    print(f"plain [0,10) -> group of 3 [10,20) -> plain [20,30): max |logits diff| {worst:.2e}; {report.summary()}")
    assert report.ok, report.summary()
    assert report.closure == f"{DECODE_STEPS + 1}/{DECODE_STEPS + 1}"


async def test_a_group_of_three_over_every_layer(procs, reference):
    got, report = await run_forced(procs, lambda ids: [group_hop(ids, B, "b", 0, 30)], B)
    worst = assert_matches(reference, got)
    print(f"group of 3 over [0,30): max |logits diff| {worst:.2e}; {report.summary()}")
    assert report.ok, report.summary()
    assert report.closure == f"{DECODE_STEPS + 1}/{DECODE_STEPS + 1}"


async def test_a_rank_killed_mid_answer_moves_the_span_to_another_group(procs, reference):
    """Rank 1 of group "a" dies after 12 tokens; [10, 20) moves to group "b" (entered at layer
    10), its caches are rebuilt from the requester's inputs, and the answer is unchanged."""
    tracer = MemoryTracer(peer="requester")
    async with Swarm.join(procs.addrs[:1], tracer=tracer) as swarm:
        ids = await wait_for_peers(swarm, NAMES)
        route = Route((Hop(ids["peer0"], 0, 10), group_hop(ids, A, "a", 10, 20), Hop(ids["peer4"], 20, 30)), 0.0)
        resilient = ResilientSession(swarm, max_length=64, route_wait=30.0)
        resilient.current = SegmentedSession(swarm.ctx, route, max_length=64)
        await resilient.current.open()
        resilient.routes.append(route)

        class KillAfter:
            """A step function that kills a rank once 12 tokens have been produced."""

            calls = 0

            async def step(self, hidden, start_pos):
                KillAfter.calls += 1
                if KillAfter.calls == 13:
                    procs.kill(NAMES.index("peer2"))
                return await resilient.step(hidden, start_pos)

        try:
            got = await network_greedy(swarm, KillAfter(), PROMPT)
        finally:
            await resilient.close()
        final = resilient.routes[-1]
        replacement = [s.session_id.hex() for s in resilient.current.segments if hasattr(s, "members")]
    assert_matches(reference, got)
    assert resilient.failovers == 1
    assert [(h.start, h.end, h.members) for h in final.hops][1] == (10, 20, tuple(ids[n] for n in B))
    # the replacement group's steps (the replay and every step after it) audit clean
    logs = collect_audit(procs, [NAMES.index(n) for n in B], tracer, replacement, expected=4 * (DECODE_STEPS - 11))
    report = check(logs)
    assert report.ok, report.summary()
    print(f"after the kill: {report.summary()}")
