"""Aggregate decode tokens/s of 1, 4 and 8 concurrent sessions on one peer, each session exact.

Two figures per count of sessions, both as ratios to one session measured in the same run:

- stage: what the peer's compute delivers. N sessions (prompts of different lengths,
  so at different positions) decode in lockstep: one `Stage.forward_batch` of N rows
  a token (a stack of one is exactly `Stage.forward`). Only the forward is timed:
  the head and sampling run at the requesters in a swarm.
- server: a real `StageServer` (encryption, the step batcher, a worker thread) over
  the in-memory transport, N requester sessions at once in this process, wall clock.
  The requesters' heads run here too, one session at a time, so this ratio is lower.
- server-peer: the same, with the requesters' heads off the clock, as in a swarm, where each
  requester computes its head on its own machine: each session feeds the tokens of its solo
  run (teacher forcing) and its outputs go through the head after the timed phase; the
  argmax of every output must be the solo run's next token, which is the same check (a
  free-running greedy session that matches at every step is the solo run). Profiled on
  SmolLM2 with 8 sessions (2 loaded cores, one torch thread): in `server` the 8 heads
  (a 49152 x 576 matmul per session and token, 25 ms alone) took 18 s of thread time
  against 11 s for the peer's batched forwards in a 9.8 s decode, contending for the same
  cores (142 ms a head call), and a batch averaged 3.7 of 8 sessions: sessions come back to
  the peer as their heads finish, spread over far more than the 2 ms batch wait.

Every session's tokens are checked against its solo run (greedy); a mismatch fails loudly.
Each round measures every count; a ratio is taken within a round (so that machine noise
hits both sides alike) and the median over rounds is printed last. Before them, the machine,
each configuration's rounds (min / median / max) and what other processes did meanwhile
(bench/rounds.py); a kind's ratios are not printed when one of its configurations' rounds
spread over 15% or other processes kept the cores busy (one line says why instead).

`--compile auto` compiles the span's decode steps as a peer does by default (its --compile):
one session then decodes through the compiled one-row graph, a stack through the graph of
its row bucket (1, 2, 4, 8).

    .venv/bin/python bench/batching.py [--threads 1] [--tokens 16] [--rounds 3] [--compile off]

`concurrent_sessions_figures(...)` returns the figures for bench/capacity.py to print.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
import trio

from rounds import CoreWatch, figure_line, machine_lines, refusal, spread_line, watch_line

from tessera.peer.serve.batcher import MAX_BATCH_WAIT
from tessera.stages.engine.compiled.build import compile_decode, row_buckets
from tessera.stages.weights import registry
from tessera.stages.engine.stage import Stage
from tessera.stages.assembly.stage import load_stage

COUNTS = (1, 4, 8)
KINDS = ("stage", "server", "server-peer")
# Prompts of different lengths (token ids of the model's vocabulary; any will do for speed,
# and greedy continuation of each is checked against its own solo run).
PROMPT_LENGTHS = (5, 9, 14, 20, 27, 33, 40, 48)


def prompts(count: int) -> list[list[int]]:
    return [[(17 * i + 31 * j) % 4000 + 100 for j in range(PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)])]
            for i in range(count)]


def lockstep(stage: Stage, batch: Sequence[list[int]], n: int) -> tuple[list[list[int]], float]:
    """Greedy-decode n tokens for every prompt, all sessions stacked in each step.
    Returns the tokens of each and the seconds spent in the decode forwards."""
    names = [("bench", i) for i in range(len(batch))]
    for name, prompt in zip(names, batch):
        stage.open(name, capacity=len(prompt) + n + 1)
    try:
        hidden = [stage.forward(name, stage.embed(p), 0)[-1:] for name, p in zip(names, batch)]
        tokens = [[int(stage.logits(h).argmax())] for h in hidden]
        spent = 0.0
        for k in range(n - 1):
            steps = [(name, stage.embed(t[-1:]), len(p) + k) for name, p, t in zip(names, batch, tokens)]
            started = time.perf_counter()
            if len(steps) == 1:
                outputs = [stage.forward(*steps[0])]
            else:
                outputs = stage.forward_batch(steps)
            spent += time.perf_counter() - started
            for t, out in zip(tokens, outputs):
                assert isinstance(out, torch.Tensor), out
                t.append(int(stage.logits(out).argmax()))
        return tokens, spent
    finally:
        for name in names:
            stage.close(name)


async def through_server(
    stage: Stage, head: Stage, batch: Sequence[list[int]], n: int, batch_wait: float,
    teacher: Sequence[list[int]] | None = None,
) -> tuple[list[list[int]], float, float]:
    """The same decode through a real StageServer over the in-memory transport. Returns the
    tokens of each session, the wall seconds of the decode phase and the mean batch size.
    With `teacher` (each session's solo tokens), the heads run after the timed phase: a session
    feeds its teacher's tokens and its tokens are the argmax of each output, computed afterwards."""
    from libp2p.peer.id import ID

    from tessera.peer.net.gossip import ViewKeeper
    from tessera.peer.net.memory_stream import LinkSpec
    from tessera.peer.net.memory import MemoryNetwork, open_memory_transport
    from tessera.peer.request.chain_state import RequesterContext
    from tessera.peer.request.chain import RouteSession
    from tessera.peer.plan.routing import Hop, Route
    from tessera.peer.serve.server import StageServer
    from tessera.peer.serve.limits import ServerLimits
    from tessera.protocol.keys import Identity

    def pid(identity: Identity) -> str:
        return ID(identity.peer_id).to_base58()

    peer, requester = Identity.from_seed(b"\x51" * 32), Identity.from_seed(b"\x52" * 32)
    network = MemoryNetwork(LinkSpec(latency=0.0, bandwidth=1e12))
    layers = stage.spec.num_layers
    tokens: list[list[int]] = [[] for _ in batch]
    server: StageServer | None = None
    prefilled = 0
    all_prefilled = trio.Event()
    done_outputs: list[list] = [[] for _ in batch]
    async with open_memory_transport(network, pid(peer)) as tp, open_memory_transport(network, pid(requester)) as tr:
        server = StageServer(tp, peer, stage, limits=ServerLimits(batch_wait=batch_wait))
        async with trio.open_nursery() as nursery:
            ctx = RequesterContext(transport=tr, identity=requester, nursery=nursery, num_layers=layers,
                                   hidden_size=stage.spec.hidden_size,
                                   keeper=ViewKeeper(model_id="m", num_layers=layers, clock=trio.current_time))

            async def one(i: int) -> None:
                nonlocal prefilled
                session = RouteSession(ctx, Route((Hop(pid(peer), 0, layers),), 0.0),
                                       max_length=len(batch[i]) + n + 1, keep_history=False)
                await session.open()
                out = await session.step(head.embed(batch[i]), 0)
                tokens[i].append(int((await trio.to_thread.run_sync(head.logits, out[-1:])).argmax()))
                prefilled += 1
                if prefilled == len(batch):
                    all_prefilled.set()
                await all_prefilled.wait()
                outputs = []
                for k in range(n - 1):
                    fed = teacher[i][k:k + 1] if teacher is not None else tokens[i][-1:]
                    out = await session.step(head.embed(fed), len(batch[i]) + k)
                    if teacher is not None:
                        outputs.append(out)
                    else:
                        tokens[i].append(int((await trio.to_thread.run_sync(head.logits, out)).argmax()))
                await session.close()
                done_outputs[i] = outputs

            async with trio.open_nursery() as sessions:
                for i in range(len(batch)):
                    sessions.start_soon(one, i)
                await all_prefilled.wait()
                started = time.perf_counter()
            elapsed = time.perf_counter() - started
            nursery.cancel_scope.cancel()
    assert server is not None
    for t, outputs in zip(tokens, done_outputs):  # teacher forcing: the heads, off the clock
        t.extend(int(head.logits(out).argmax()) for out in outputs)
    stats = server.compute.batcher.stats
    return tokens, elapsed, stats.steps / max(stats.batches, 1)


def concurrent_sessions_rounds(
    folder: Path, *, counts: Sequence[int] = COUNTS, tokens: int = 16, rounds: int = 3,
    batch_wait: float = MAX_BATCH_WAIT, compile: str = "off", log: Callable[[str], None] = print,
) -> dict[str, dict[int, list[float]]]:
    """Aggregate decode tok/s of each round, per kind ('stage', 'server', 'server-peer') and count
    of sessions; the configurations alternate within each round. Every session is checked exact
    against its solo run; raises AssertionError on a mismatch. `counts` must include 1.
    `compile`: the span's decode steps compiled as a peer's --compile asks ('off': eager)."""
    assert 1 in counts, "ratios are to one session"
    stage = load_stage(folder)
    head = load_stage(folder, start=0, end=0, embed=True, head=True)
    whole = Stage(stage.spec, 0, list(stage.blocks), embedding=head.embedding, norm=head.norm, head=head.head)
    if compile != "off":  # as a peer compiles its span (peer/node/torch_compute.py), both stages that run it
        for s in (stage, whole):
            plan = compile_decode(s, compile, buckets=row_buckets(max(counts)))
        log(f"compiled decode: {plan.backend or 'none'} ({plan.reason})")
    batch = prompts(max(counts))
    solo = [lockstep(whole, [p], tokens)[0][0] for p in batch]
    rates: dict[str, dict[int, list[float]]] = {kind: {c: [] for c in counts} for kind in KINDS}
    for r in range(rounds):
        for c in counts:
            got, spent = lockstep(whole, batch[:c], tokens)
            assert got == solo[:c], f"stage: {c} stacked sessions differ from their solo runs"
            rates["stage"][c].append(c * (tokens - 1) / spent)
            got, wall, mean_batch = trio.run(through_server, stage, head, batch[:c], tokens, batch_wait)
            assert got == solo[:c], f"server: {c} concurrent sessions differ from their solo runs"
            rates["server"][c].append(c * (tokens - 1) / wall)
            got, wall, peer_batch = trio.run(through_server, stage, head, batch[:c], tokens, batch_wait, solo[:c])
            assert got == solo[:c], f"server-peer: {c} concurrent sessions differ from their solo runs"
            rates["server-peer"][c].append(c * (tokens - 1) / wall)
            log(f"round {r}, {c} session(s): stage {rates['stage'][c][-1]:.1f} tok/s, "
                f"server {rates['server'][c][-1]:.1f} tok/s (mean batch {mean_batch:.1f}), "
                f"server-peer {rates['server-peer'][c][-1]:.1f} tok/s (mean batch {peer_batch:.1f}), all exact")
    return rates


def summarise(rates: dict[str, dict[int, list[float]]]) -> dict[str, dict[int, float]]:
    """Per kind, the median tok/s of each count ('stage', ...) and the median of each round's
    ratio to one session, both measured in that round ('stage ratio', ...)."""
    figures: dict[str, dict[int, float]] = {}
    for kind, by in rates.items():
        figures[kind] = {c: statistics.median(v) for c, v in by.items()}
        figures[f"{kind} ratio"] = {c: statistics.median(a / b for a, b in zip(v, by[1])) for c, v in by.items()}
    return figures


def concurrent_sessions_figures(folder: Path, **kwargs) -> dict[str, dict[int, float]]:
    """`summarise(concurrent_sessions_rounds(folder, **kwargs))` (bench/capacity.py prints them)."""
    return summarise(concurrent_sessions_rounds(folder, **kwargs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-wait-ms", type=float, default=MAX_BATCH_WAIT * 1000,
                        help="the server's wait for the sessions of its last batch (the peer's --batch-wait-ms)")
    parser.add_argument("--compile", default="off", choices=("off", "auto", "inductor"),
                        help="the span's decode steps compiled as a peer's --compile (default off: eager)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with CoreWatch() as watch:
        rates = concurrent_sessions_rounds(registry.resolve(args.model), tokens=args.tokens, rounds=args.rounds,
                                           batch_wait=args.batch_wait_ms / 1000, compile=args.compile)
    figures = summarise(rates)
    for line in machine_lines(args.threads):
        print(line)
    print(f"threads: {args.threads}, dtype: float32, compile: {args.compile}, tokens per session: {args.tokens}, "
          f"rounds: {args.rounds}, server batch wait: {args.batch_wait_ms:g} ms")
    for kind in KINDS:
        for c, v in rates[kind].items():
            print(spread_line(f"{kind}, {c} session(s)", v, "tok/s aggregate", 1))
    print(watch_line(watch))
    for kind in KINDS:
        reason = refusal({f"{kind}, {c} session(s)": v for c, v in rates[kind].items()}, watch.others)
        print(figure_line(f"{kind} batching ratios to 1 session",
                          ", ".join(f"{c}: {ratio:.2f}" for c, ratio in figures[f"{kind} ratio"].items() if c != 1),
                          reason))


if __name__ == "__main__":
    main()
