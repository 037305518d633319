"""Where a decode step's milliseconds go through a 3-peer loopback chain, read off the traces.

No profiler runs: the peers work as they always do and write their trace (store/events.py:
`Receive` when a frame arrives, `Forward` with its compute time, `Push` stamped as a send
starts); the requester traces into memory. Every process on one machine stamps with the
same monotonic clock, so one step's path is read off the stamps:

    requester out   token out -> its push to peer 0 (embedding, seal, the send starts)
    wire            a push -> the receive at the other end (send, yamux, Noise, the read, CBOR)
    peer i          its receive -> its push onward = its compute (`Forward.duration`)
                    + the rest (queue, hand-off to the compute thread, open, check, seal, back)
    requester in    its receive of the last peer's result -> the step's result (open, check)
    head            the result -> the next token out (head, sampling)

Beside it, one process's decode step over the same prompt (LocalEngine, one thread):
the swarm step less one process's step is the chain's overhead, and the slices above say
which part of a hop it is. Decode steps only (the prefill step is left out); medians over
every step of `--rounds` answers.

Two swarms side by side, their rounds alternating: one whose sessions and links run on
dedicated connections (peer/net/dedicated/, the default) and one on libp2p (yamux)
streams only (`--no-dedicated`). Peers, requesters' heads and the one process decode as
`--compile` says (default auto: compiled on a CPU).

    .venv/bin/python bench/hop_budget.py [--tokens 32] [--rounds 3] [--synth-1b] [--dedicated-only] [--compile auto|off]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import trio

from swarm import STREAMS, even_spans, synth_1b  # bench/swarm.py, beside this script

from tessera.peer.cli.demo import LocalSwarm
from tessera.peer.request.client import Swarm
from tessera.stages.weights import registry
from tessera.stages.decoding.generate import LocalEngine
from tessera.stages.families.catalog import spec_from_file
from tessera.store.db import PeerStore
from tessera.store.events import Forward, Push, Receive, Result, Stamped
from tessera.store.trace import MemoryTracer

PROMPT = "The history of the city begins in the year"
HOPS = 4  # requester -> p0 -> p1 -> p2 -> requester


@dataclass
class Answer:
    """One traced answer: its route, its tokens' arrival times and every event of its session."""

    route: list[str]  # peer ids in chain order
    token_ns: list[int]  # [sent, token 1, token 2, ...] on the monotonic clock
    requester: list[Stamped]
    peers: dict[str, list[Stamped]] = field(default_factory=dict)


def by_step(rows: list[Stamped], session: str) -> dict[int, list[Stamped]]:
    steps: dict[int, list[Stamped]] = defaultdict(list)
    for row in rows:
        if row.event.session == session and row.event.step is not None:
            steps[row.event.step].append(row)
    return steps


def one(rows: list[Stamped], kind: type, remote: str | None = None) -> Stamped:
    found = [r for r in rows if isinstance(r.event, kind) and (remote is None or r.event.remote == remote)]
    if len(found) != 1:
        raise ValueError(f"expected one {kind.__name__} (remote {remote}), found {len(found)}")
    return found[0]


def slices(answer: Answer) -> list[dict[str, float]]:
    """Per decode step, its slices in ms (names in chain order; they add up to the step)."""
    session = next(r.event.session for r in answer.requester if isinstance(r.event, Push))
    mine = by_step(answer.requester, session)
    theirs = {peer: by_step(rows, session) for peer, rows in answer.peers.items()}
    route, out = answer.route, []
    for step in sorted(mine):
        if step < 2 or step >= len(answer.token_ns):
            continue  # step 1 is the prefill; token k arrives after step k
        ms: dict[str, float] = {}
        last = answer.token_ns[step - 1]
        push = one(mine[step], Push).mono_ns
        ms["requester out"] = (push - last) / 1e6
        sender = "requester"
        for i, peer in enumerate(route):
            rows = theirs[peer][step]
            received = one(rows, Receive).mono_ns
            ms[f"wire {sender} -> peer{i}"] = (received - push) / 1e6
            forward = one(rows, Forward).event.duration * 1e3
            after = route[i + 1] if i + 1 < len(route) else None
            push = one(rows, Push, remote=after).mono_ns if after else max(
                r.mono_ns for r in rows if isinstance(r.event, Push))  # the last peer pushes only its result
            ms[f"peer{i} compute"] = forward
            ms[f"peer{i} rest"] = (push - received) / 1e6 - forward
            sender = f"peer{i}"
        received = one(mine[step], Receive, remote=route[-1]).mono_ns
        ms[f"wire {sender} -> requester"] = (received - push) / 1e6
        result = one(mine[step], Result).mono_ns
        ms["requester in"] = (result - received) / 1e6
        ms["head, sampling"] = (answer.token_ns[step] - result) / 1e6
        ms["step"] = (answer.token_ns[step] - last) / 1e6
        out.append(ms)
    return out


def traced_answers(model: str, spans: list[tuple[int, int]], tokens: int, rounds: int,
                   kinds: list[str], compile: str) -> dict[str, list[Answer]]:
    """`rounds` traced answers through a swarm of each kind, the kinds' rounds alternating."""
    swarms = {kind: LocalSwarm(len(spans), model=model,
                               extra_args=[["--layers", f"{a}:{b}", "--compile", compile, *STREAMS[kind]]
                                           for a, b in spans])
              for kind in kinds}
    answers: dict[str, list[Answer]] = {kind: [] for kind in kinds}
    try:
        for peers in swarms.values():
            peers.start(together=True)
        dbs = {kind: [PeerStore(peers.base_dir / f"peer{i}" / "tessera.db", readonly=True) for i in range(len(spans))]
               for kind, peers in swarms.items()}

        async def answer(swarm: Swarm, tracer: MemoryTracer, kind: str, ids: list[int]) -> None:
            await trio.sleep(0.5)
            marks = [max((r.id for r in db.events()), default=0) for db in dbs[kind]]
            mark = len(tracer.events)
            info: dict = {}
            token_ns = [time.monotonic_ns()]
            async for _ in swarm.generate_ids(ids, max_new_tokens=tokens, info=info):
                token_ns.append(time.monotonic_ns())
            steps = len(token_ns) - 1
            rows = {}
            for _ in range(100):  # the peers' writers commit every second or so
                await trio.sleep(0.1)
                rows = {i: db.events(after_id=marks[i], kinds=(Receive, Forward, Push)) for i, db in enumerate(dbs[kind])}
                if all(sum(isinstance(r.event, Forward) for r in got) >= steps for got in rows.values()):
                    break
            ids_of = {rs[0].peer: rs for rs in rows.values() if rs}
            answers[kind].append(Answer([hop["peer"] for hop in info["route"]], token_ns, tracer.events[mark:], ids_of))

        async def run() -> None:
            async with contextlib.AsyncExitStack() as stack:
                joined = {}
                for kind in kinds:
                    tracer = MemoryTracer(peer="requester")
                    swarm = await stack.enter_async_context(
                        Swarm.join(swarms[kind].addrs[:1], model=model, tracer=tracer, dedicated=kind == "dedicated",
                                   compile=compile))
                    await swarm.wait_for_route(60)
                    ids = swarm.tokenizer.encode(PROMPT)[:16]
                    [t async for t in swarm.generate_ids(ids, max_new_tokens=4)]  # warm-up
                    joined[kind] = swarm, tracer, ids
                for _ in range(rounds):
                    for kind, (swarm, tracer, ids) in joined.items():
                        await answer(swarm, tracer, kind, ids)

        trio.run(run)
    finally:
        for peers in swarms.values():
            peers.stop()
    return answers


def local_decode_ms(model: str, tokens: int, rounds: int, compile: str) -> float:
    """One process's decode step (median over `rounds` answers; the prefill step left out)."""
    engine = LocalEngine(registry.resolve(model), device="cpu", dtype="float32", compile=compile)
    ids = engine.tokenizer.encode(PROMPT)[:16]
    engine.generate_ids(ids, max_new_tokens=4)  # warm-up
    steps: list[float] = []
    for _ in range(rounds):
        stamps = [time.perf_counter()]
        engine.generate_ids(ids, max_new_tokens=tokens, on_token=lambda _: stamps.append(time.perf_counter()))
        steps += [(b - a) * 1e3 for a, b in zip(stamps[1:], stamps[2:])]
    return statistics.median(steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--synth-1b", action="store_true", help="the synthetic 1B shape of bench/swarm.py")
    parser.add_argument("--dedicated-only", action="store_true",
                        help="the default swarm only (no libp2p-streams swarm beside it)")
    parser.add_argument("--compile", default="auto", choices=("auto", "off"),
                        help="peers, requester heads and the one process (default auto)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    model = str(synth_1b()) if args.synth_1b else "smollm2-135m"
    layers = spec_from_file(registry.resolve(model) / "config.json").num_layers
    kinds = ["dedicated"] if args.dedicated_only else list(STREAMS)
    answers = traced_answers(model, even_spans(layers, 3), args.tokens, args.rounds, kinds, args.compile)
    local_ms = local_decode_ms(model, args.tokens, args.rounds, args.compile)
    medians, overheads = {}, {}
    for kind in kinds:
        steps = [ms for answer in answers[kind] for ms in slices(answer)]
        medians[kind] = {name: statistics.median(s[name] for s in steps) for name in steps[0]}
        # per step, its time less its own compute: slices add up within a step, medians of slices do not
        overheads[kind] = statistics.median(
            s["step"] - sum(v for k, v in s.items() if k.endswith("compute")) - s["head, sampling"] for s in steps)
    label = "synthetic-1b" if args.synth_1b else model
    print(f"\none decode step through 3 peers ({label}, loopback), medians over {len(steps)} steps, in ms:")
    print(f"  {'':32s} " + " ".join(f"{kind:>15s}" for kind in kinds))
    for name in medians[kinds[0]]:
        print(f"  {name:32s} " + " ".join(f"{medians[kind][name]:15.2f}" for kind in kinds))
    print("\n-- side by side --")
    print(f"one process's decode step: {local_ms:.2f} ms")
    for kind in kinds:
        median = medians[kind]
        compute = sum(v for k, v in median.items() if k.endswith("compute")) + median["head, sampling"]
        wire = [v for k, v in median.items() if k.startswith("wire")]
        rest = [v for k, v in median.items() if k.endswith(" rest")]
        step = median["step"]
        print(f"{kind}: swarm step {step:.2f} ms, its compute (peers' forwards + head) {compute:.2f} ms; a hop: wire "
              f"{statistics.mean(wire):.2f} ms (mean of {len(wire)}), in a peer besides its compute "
              f"{statistics.mean(rest):.2f} ms (mean of {len(rest)}); requester out {median['requester out']:.2f} ms, "
              f"in {median['requester in']:.2f} ms")
    for kind in kinds:
        step = medians[kind]["step"]
        print(f"per-hop overhead ({label}, {kind}): (swarm step - one process's) / {HOPS} = {(step - local_ms) / HOPS:.2f} ms; "
              f"(each step - its own compute) / {HOPS} = {overheads[kind] / HOPS:.2f} ms")


if __name__ == "__main__":
    main()
