"""Decode speed of one span served by 1 peer vs by a 3-peer tensor-shard group, on loopback.

SmolLM2-135M, layers [0, 10) by default: one `tessera peer --layers 0:10` and a group of
three `--layers 0:10 --shard i/3 --group bench` ranks, every process with one torch
thread, side by side in one run. The requester feeds each the same decode steps (one
token each) through a forced route — blocks alternate (single, group, single, ...) so
that the shared machine's noise falls on both — and reads the ranks' audit logs for the
bytes they exchanged. Per layer a group runs 4 rounds of all-to-all exchange (the norms'
scalar all-reduces ride with the q/k/v and gate/up reduce-scatters).

    .venv/bin/python bench/shards.py [--layers 10] [--tokens 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch
import trio

from tessera.peer.request.client import Swarm
from tessera.peer.cli.demo import LocalSwarm
from tessera.peer.request.chain import RouteSession
from tessera.peer.plan.routing import Hop, Route
from tessera.peer.cli.store import load_audit_logs
from tessera.peer.plan.audit import check
from tessera.peer.plan.groups import group_hop_id
from tessera.peer.request.group import GroupSession
from tessera.stages.shards.layout import ROUNDS_PER_LAYER

PROMPT = [1, 504, 3458, 282, 4649, 30, 216, 10]


async def decode_rate(swarm: Swarm, session, start_pos: int, tokens: int) -> tuple[float, int]:
    """Decode steps per second through `session` (one token each), and the next position."""
    token = PROMPT[-1]
    started = time.perf_counter()
    for k in range(tokens):
        await session.step(await swarm._embed([token]), start_pos + k)
    return tokens / (time.perf_counter() - started), start_pos + tokens


async def measure(addrs: list[str], layers: int, tokens: int, rounds: int) -> tuple[list[float], list[float], str]:
    async with Swarm.join(addrs[:1]) as swarm:
        await swarm.wait_for_route(60.0, end=layers)
        with trio.fail_after(60):
            while len([p for p in swarm.keeper.snapshot().peers if p.name.startswith("peer")]) < 4:
                await trio.sleep(0.5)
                await swarm.refresh()
        by_name = {p.name: p.peer_id for p in swarm.keeper.snapshot().peers}
        capacity = len(PROMPT) + rounds * tokens + 1
        single = RouteSession(swarm.ctx, Route((Hop(by_name["peer0"], 0, layers),), 0.0), max_length=capacity)
        members = tuple(by_name[f"peer{i}"] for i in (1, 2, 3))
        group = GroupSession(swarm.ctx, Hop(group_hop_id("bench", 0, layers, 3), 0, layers, group="bench",
                                            members=members), max_length=capacity)
        await single.open()
        await group.open()
        prefill = await swarm._embed(PROMPT)
        await single.step(prefill, 0)
        await group.step(prefill, 0)
        single_rates, group_rates = [], []
        pos_single = pos_group = len(PROMPT)
        for _ in range(rounds):
            rate, pos_single = await decode_rate(swarm, single, pos_single, tokens)
            single_rates.append(rate)
            rate, pos_group = await decode_rate(swarm, group, pos_group, tokens)
            group_rates.append(rate)
            print(f"  single peer {single_rates[-1]:6.2f} tok/s   group of 3 {group_rates[-1]:6.2f} tok/s", flush=True)
        await single.close()
        await group.close()
        return single_rates, group_rates, group.session_id.hex()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=10, help="the span [0, LAYERS) both serve")
    parser.add_argument("--tokens", type=int, default=16, help="decode steps per block")
    parser.add_argument("--rounds", type=int, default=3, help="blocks per side, alternating")
    args = parser.parse_args()
    logging.getLogger("libp2p").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    span = f"0:{args.layers}"
    extra = [["--layers", span], *[["--layers", span, "--shard", f"{i}/3", "--group", "bench"] for i in range(3)]]
    print(f"SmolLM2-135M layers [0, {args.layers}): 1 peer vs a group of 3 ranks, loopback, 1 torch thread each")
    with LocalSwarm(4, extra_args=extra) as procs:
        procs.start(together=True)
        single, group, session = trio.run(measure, procs.addrs, args.layers, args.tokens, args.rounds)
        time.sleep(1.0)  # let the ranks' trace writers commit the last steps
        logs = [log for i in (1, 2, 3) for log in load_audit_logs(procs.base_dir / f"peer{i}" / "tessera.db")
                if log.session == session]
    decode = [log for log in logs if all(r.get("rows", 1) == 1 for r in log.records)]
    report = check(logs)
    steps = len({log.step for log in decode})
    exchanged = sum(r.get("bytes", 0) for log in decode for r in log.records)
    per_token_layer = exchanged / max(steps, 1) / args.layers
    rate_single, rate_group = statistics.median(single), statistics.median(group)
    print(f"audit of the group's steps: {report.summary().splitlines()[0]}")
    print(f"rounds of exchange per layer: {ROUNDS_PER_LAYER} (each rank sends to the 2 others)")
    print(f"bytes exchanged per token per layer (all ranks, tensor payload): {per_token_layer:.0f}")
    print(f"single peer decode: {rate_single:.2f} tok/s (median of {args.rounds} blocks of {args.tokens})")
    print(f"group of 3 decode:  {rate_group:.2f} tok/s")
    print(f"shards/single decode ratio: {rate_group / rate_single:.3f}")


if __name__ == "__main__":
    main()
