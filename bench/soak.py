"""A soak: a 3-peer swarm for a stated time, a requester every minute, one peer killed and
restarted and one stopped (SIGSTOP) and resumed while answers run; every answer checked
against the local engine, and each peer's RSS followed.

The swarm: peer0 serves layers [0, 15), peer1 [15, 30), peer2 all 30 (a replica of both,
so that a peer lost mid-answer has a replacement and the answer goes on). Each minute a
fresh requester (its own identity and host) joins and generates greedily; a third of the
way in, peer1 is killed (SIGKILL) a second into that minute's answer and restarted 5 s
later; two thirds of the way in, peer0 is stopped (SIGSTOP) a second into the answer and
resumed (SIGCONT) 20 s later. An answer is *identical* when its tokens are the local
engine's, *failed* when it raised.

RSS growth: each peer's resident memory at the end less its resident memory after its
first answer (the warm-up: code paths, allocator arenas and the first KV caches); for the
restarted peer, after its first answer since the restart. Growth here means memory kept
across answers that should have given it back.

    .venv/bin/python bench/soak.py [--minutes 20]

Prints a line per answer, each peer's RSS, and last:

    soak: 20/20 identical, 0 failed, RSS growth max 3.1 MB
"""

from __future__ import annotations

import argparse
import logging
import signal
import time

import torch
import trio

from tessera.peer.cli.demo import LocalSwarm
from tessera.peer.request.client import Swarm
from tessera.stages.weights import registry
from tessera.stages.decoding.generate import LocalEngine, prompt_ids

SPANS = [(0, 15), (15, 30), (0, 30)]
KILLED, STOPPED = 1, 0  # peer1 is killed and restarted, peer0 stopped and resumed
PROMPTS = ["What is the capital of France?", "Name three colours.", "Write a haiku about the sea.",
           "What is 2 + 2?", "Why is the sky blue?"]
TOKENS = 48
DISRUPT_AFTER = 1.0  # s into an answer
RESTART_AFTER = 5.0  # s after the kill
STOP_FOR = 20.0  # s of SIGSTOP
ROUTE_WAIT = 60.0


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


async def answer(peers: LocalSwarm, ids: list[int], disrupt) -> tuple[list[int], float]:
    """One requester's answer (a fresh Swarm), with `disrupt` run beside it (or None)."""
    started = time.perf_counter()
    join = [a for i, a in enumerate(peers.addrs) if i not in (KILLED, STOPPED)] or peers.addrs[:1]
    async with Swarm.join(join) as swarm:
        await swarm.wait_for_route(ROUTE_WAIT)
        out: list[int] = []
        async with trio.open_nursery() as nursery:
            if disrupt is not None:
                nursery.start_soon(disrupt)
            async for token in swarm.generate_ids(ids, max_new_tokens=TOKENS, route_wait=ROUTE_WAIT):
                out.append(token)
    return out, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=int, default=20, help="how long, and how many answers (one a minute)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)  # it logs every refused dial
    folder = registry.resolve("smollm2-135m")
    engine = LocalEngine(folder, device="cpu", dtype="float32")
    prompts = [prompt_ids(engine.tokenizer, p, raw=False) for p in PROMPTS]
    expected = [engine.generate_ids(ids, max_new_tokens=TOKENS) for ids in prompts]
    peers = LocalSwarm(len(SPANS), extra_args=[["--layers", f"{a}:{b}"] for a, b in SPANS])
    identical = failed = 0
    baseline: dict[int, float] = {}
    restarted: set[int] = set()
    kill_at, stop_at = max(1, args.minutes // 3), max(2, 2 * args.minutes // 3)
    try:
        peers.start(together=True)
        began = time.monotonic()
        for minute in range(args.minutes):
            await_minute = began + 60 * minute - time.monotonic()
            if await_minute > 0:
                time.sleep(await_minute)
            disrupt, note = None, ""
            if minute == kill_at:
                async def disrupt() -> None:
                    await trio.sleep(DISRUPT_AFTER)
                    peers.kill(KILLED)
                    await trio.sleep(RESTART_AFTER)
                    join = [a for i, a in enumerate(peers.addrs) if i != KILLED][:1]
                    await trio.to_thread.run_sync(peers.start_peer, KILLED, join)
                    baseline.pop(KILLED, None)
                    restarted.add(KILLED)  # measured again after the next answer, which it may serve
                note = f" (peer{KILLED} killed at {DISRUPT_AFTER:g} s, restarted {RESTART_AFTER:g} s later)"
            elif minute == stop_at:
                async def disrupt() -> None:
                    await trio.sleep(DISRUPT_AFTER)
                    peers.procs[STOPPED].send_signal(signal.SIGSTOP)
                    await trio.sleep(STOP_FOR)
                    peers.procs[STOPPED].send_signal(signal.SIGCONT)
                note = f" (peer{STOPPED} stopped at {DISRUPT_AFTER:g} s for {STOP_FOR:g} s)"
            k = minute % len(prompts)
            try:
                tokens, seconds = trio.run(answer, peers, prompts[k], disrupt)
            except Exception as error:  # a failed answer is counted, and the soak goes on
                failed += 1
                print(f"minute {minute}: FAILED {type(error).__name__}: {error}{note}", flush=True)
                continue
            same = tokens == expected[k]
            identical += same
            print(f"minute {minute}: {'identical' if same else 'DIFFERENT'} ({len(tokens)} tokens, {seconds:.1f} s)"
                  f"{note}", flush=True)
            for i, proc in enumerate(peers.procs):
                if proc.poll() is None and i not in baseline and i not in restarted:
                    baseline[i] = rss_mb(proc.pid)
            restarted.clear()
        growth = {i: rss_mb(peers.procs[i].pid) - baseline[i] for i in sorted(baseline)
                  if peers.procs[i].poll() is None}
    finally:
        peers.stop()
    for i, grew in growth.items():
        print(f"peer{i} [{SPANS[i][0]}, {SPANS[i][1]}): RSS growth {grew:+.1f} MB")
    total = args.minutes
    print(f"soak: {identical}/{total} identical, {failed} failed, RSS growth max {max(growth.values(), default=0):.1f} MB")


if __name__ == "__main__":
    main()
