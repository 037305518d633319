"""Tensor shards over real libp2p processes on loopback, on SmolLM2: a group of 3 between
plain peers — exact, audited — and a rank of it killed mid-answer (a group over every layer:
test_shards_swarm_whole.py, in its own swarm so that fewer processes share the cores)."""

from __future__ import annotations

import pytest

from tessera.peer.request.client import Swarm
from tessera.peer.cli.demo import LocalSwarm
from tessera.peer.plan.routing import Hop
from tessera.peer.plan.audit import check
from tessera.store.trace import MemoryTracer

from ..shard_helpers import (
    DECODE_STEPS, LOGITS_TOLERANCE, collect_audit, greedy_run, group_hop, group_sessions, network_greedy, open_forced,
    rank_args, wait_for_peers,
)

pytestmark = pytest.mark.slow

PROMPT = [1, 504, 3458, 282, 4649, 30, 216, 10, 45, 99, 7, 1000]
# peer0 [0, 10) | group "a" (peer1-3) [10, 20) | peer4 [20, 30) | peer5 [10, 20), a replica
A = ["peer1", "peer2", "peer3"]
NAMES = [f"peer{i}" for i in range(6)]


@pytest.fixture(scope="module")
def procs(smol_dir):
    args = [["--layers", "0:10"], *rank_args((10, 20), "a", 3), ["--layers", "20:30"], ["--layers", "10:20"]]
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


async def run_forced(procs, hops):
    tracer = MemoryTracer(peer="requester")
    async with Swarm.join(procs.addrs[:1], tracer=tracer) as swarm:
        ids = await wait_for_peers(swarm, NAMES)
        resilient = await open_forced(swarm, hops(ids))
        try:
            got = await network_greedy(swarm, resilient, PROMPT)
        finally:
            await resilient.close()
    report = check(collect_audit(procs, tracer, group_sessions(resilient.current)))
    return got, report, resilient.failovers


async def test_a_group_of_three_between_plain_peers(procs, reference):
    def hops(ids):
        return [Hop(ids["peer0"], 0, 10), group_hop(ids, A, "a", 10, 20), Hop(ids["peer4"], 20, 30)]

    got, report, failovers = await run_forced(procs, hops)
    worst = assert_matches(reference, got)
    print(f"plain [0,10) -> group of 3 [10,20) -> plain [20,30): max |logits diff| {worst:.2e}, "
          f"{failovers} failovers; {report.summary()}")
    assert report.ok, report.summary()
    assert report.steps >= DECODE_STEPS + 1


async def test_a_rank_killed_mid_answer_moves_the_span_to_a_replica(procs, reference):
    """Rank 1 of group "a" dies after 12 tokens; [10, 20) moves to the replica peer5, its cache
    is rebuilt from the requester's inputs in one step, and the answer is unchanged."""
    tracer = MemoryTracer(peer="requester")
    async with Swarm.join(procs.addrs[:1], tracer=tracer) as swarm:
        ids = await wait_for_peers(swarm, NAMES)
        resilient = await open_forced(
            swarm, [Hop(ids["peer0"], 0, 10), group_hop(ids, A, "a", 10, 20), Hop(ids["peer4"], 20, 30)])

        class KillAfter:
            """Steps through the session; kills rank 1 of group "a" once 12 tokens are out."""

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
    assert_matches(reference, got)
    assert resilient.failovers >= 1
    final = resilient.routes[-1]
    assert [(h.peer_id, h.start, h.end) for h in final.hops] == [
        (ids["peer0"], 0, 10), (ids["peer5"], 10, 20), (ids["peer4"], 20, 30)]
    # every group step the requester completed before the kill audits clean — but for the dead
    # rank's last audit events, which died with it (a kill -9 loses the trace's last quarter second)
    logs = collect_audit(procs, tracer, group_sessions(resilient.current), timeout=5.0)
    report = check(logs)
    print(f"kill mid-answer: {resilient.failovers} failovers; {report.summary()}")
    assert report.steps >= 12 and report.audited >= report.steps - 2 and not report.aborted_violations
