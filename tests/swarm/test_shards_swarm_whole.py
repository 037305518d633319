"""A group of 3 real SmolLM2 processes over every layer: exact and audited over prefill and 32 steps."""

from __future__ import annotations

import pytest

from tessera.peer.request.client import Swarm
from tessera.peer.cli.demo import LocalSwarm
from tessera.peer.plan.audit import check
from tessera.store.trace import MemoryTracer

from ..shard_helpers import (
    DECODE_STEPS, LOGITS_TOLERANCE, collect_audit, greedy_run, group_hop, group_sessions, network_greedy, open_forced,
    rank_args, wait_for_peers,
)

pytestmark = pytest.mark.slow

PROMPT = [1, 504, 3458, 282, 4649, 30, 216, 10, 45, 99, 7, 1000]
NAMES = ["peer0", "peer1", "peer2"]


async def test_a_group_of_three_over_every_layer(smol_dir, smol_stage):
    reference = greedy_run(smol_stage, [smol_stage], PROMPT, session="reference")
    tracer = MemoryTracer(peer="requester")
    with LocalSwarm(3, extra_args=rank_args((0, 30), "b", 3)) as procs:
        procs.start(together=True)
        async with Swarm.join(procs.addrs[:1], tracer=tracer) as swarm:
            ids = await wait_for_peers(swarm, NAMES)
            resilient = await open_forced(swarm, [group_hop(ids, NAMES, "b", 0, 30)])
            try:
                tokens, logits = await network_greedy(swarm, resilient, PROMPT)
            finally:
                await resilient.close()
        report = check(collect_audit(procs, tracer, group_sessions(resilient.current)))
    assert tokens == reference[0]
    worst = max(float((a - b).abs().max()) for a, b in zip(reference[1], logits))
    assert worst <= LOGITS_TOLERANCE
    print(f"group of 3 over [0,30): max |logits diff| {worst:.2e}; {report.summary()}")
    assert report.ok, report.summary()
    assert report.closure == f"{DECODE_STEPS + 1}/{DECODE_STEPS + 1}"
