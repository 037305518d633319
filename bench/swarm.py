"""Swarm vs local, side by side in one run: decode speed, per-hop overhead, and pipelined prefill.

1. Decode speed of a 3-peer loopback swarm vs the local engine, same model: for
   SmolLM2-135M and for a seeded random-weight ~1B model (hidden 2048, 24 layers,
   16/8 heads; compute cost does not depend on the weights). Each peer and the
   local engine get one torch thread: with one session the pipeline runs one peer
   at a time, so both sides compute on one core and the ratio shows what the
   network, the encryption and the hops cost. Two swarms side by side: one whose
   sessions and links run on dedicated connections (peer/net/dedicated/, the
   default) and one whose every stream is a libp2p (yamux) stream (`--no-dedicated`).
   Rounds alternate (local, dedicated, libp2p streams, ...). Per-hop overhead =
   (swarm step time - local step time) / 4 network hops (requester -> p0 -> p1 ->
   p2 -> requester). Peers, the requesters' heads and the local engine decode as `--compile`
   says (default auto: compiled on a CPU; `--compile off` for the eager figures).
   Beside them, what this machine does to a stage that waits: one span's forward in
   one process after an idle wait as long as a pipeline stage's, against back to
   back (shared hosts lose a waiting core's caches; the local engine never waits).
2. Time to first token of a long prompt (default 2,000 tokens) over 4 SmolLM2 peers
   on an emulated WAN (`--emulate-link`, as bench/wan.py: 40-75 ms a hop, 100 Mbit/s
   uplinks), the prompt sent whole vs pipelined in chunks (peer/request/prefill.py).

    .venv/bin/python bench/swarm.py [--tokens 32] [--rounds 3] [--skip-1b] [--prompt-tokens 2000] [--compile auto|off]
    .venv/bin/python bench/swarm.py --quick     # 1 round, SmolLM2 only, a 600-token prompt
    .venv/bin/python bench/swarm.py --skip-1b --skip-ttft   # SmolLM2 decode only (before/after a change)

Printed with the figures (bench/rounds.py): the machine, each configuration's rounds as min / median /
max, and the cores other processes kept busy while they ran (the peers are this run's own children);
a ratio or overhead is not printed when its configurations' rounds spread over 15% or others held a
fifth of a core or more.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import trio

from rounds import CoreWatch, figure_line, machine_lines, refusal, spread_line, watch_line

from tessera.peer.request.client import Swarm
from tessera.peer.cli.demo import LocalSwarm
from tessera.stages.weights import registry
from tessera.stages.decoding.generate import LocalEngine
from tessera.stages.families.catalog import spec_from_file
from tessera.stages.engine.compiled.build import compile_decode
from tessera.stages.assembly.stage import load_stage
from tessera.peer.net.emulated import LinkEmulation

SYNTH_1B = dict(hidden=2048, layers=24, heads=16, kv_heads=8, intermediate=5632, vocab=32000, seed=0)


def synth_1b() -> Path:
    from tessera.peer.cli.model_files import synthesise

    out = registry.models_root().parent / "bench" / "synth-1b"
    if not (out / "manifest.json").exists():
        print(f"writing the synthetic 1B model to {out} (once)")
        synthesise(out, **SYNTH_1B)
    return out


def even_spans(layers: int, n: int) -> list[tuple[int, int]]:
    cuts = [round(i * layers / n) for i in range(n + 1)]
    return list(zip(cuts, cuts[1:]))


def local_rate(engine: LocalEngine, ids: list[int], tokens: int) -> float:
    started = time.perf_counter()
    out = engine.generate_ids(ids, max_new_tokens=tokens)
    return len(out) / (time.perf_counter() - started)


async def swarm_rate(swarm: Swarm, ids: list[int], tokens: int) -> float:
    started = time.perf_counter()
    out = [t async for t in swarm.generate_ids(ids, max_new_tokens=tokens)]
    return len(out) / (time.perf_counter() - started)


HOPS = 4  # requester -> p0 -> p1 -> p2 -> requester
WAN_SPANS = [(0, 8), (8, 15), (15, 23), (23, 30)]
WAN_PEER_DELAYS_MS = [40, 60, 75, 50]
WAN_REQUESTER_DELAY_MS = 25
WAN_RATE = "100mbit"


STREAMS = {"dedicated": [], "libp2p streams": ["--no-dedicated"]}  # swarm kind -> extra peer flags


@dataclass(frozen=True)
class Decode:
    """One model's decode rounds, tokens/s: each swarm kind's and the local engine's, alternating,
    and the cores other processes kept busy meanwhile (rounds.CoreWatch)."""

    swarm: dict[str, list[float]]
    local: list[float]
    others: float | None

    def median(self, kind: str) -> float:
        return statistics.median(self.local if kind == "local" else self.swarm[kind])

    def refusal(self, kind: str) -> str | None:
        """Why a figure of `kind` against local must not be printed (rounds.refusal)."""
        return refusal({"local": self.local, kind: self.swarm[kind]}, self.others)


def measure(model: str, label: str, tokens: int, rounds: int, kinds: list[str], compile: str) -> Decode:
    """Each swarm kind's and the local engine's decode tokens/s over `rounds`, alternating."""
    spec = spec_from_file(registry.resolve(model) / "config.json")
    engine = LocalEngine(registry.resolve(model), device="cpu", dtype="float32", compile=compile)
    # a prompt whose answer does not stop early: greedy continuation of a plain text
    ids = engine.tokenizer.encode("The history of the city begins in the year")[:16] or [5] * 16
    spans = even_spans(spec.num_layers, 3)
    swarms = {kind: LocalSwarm(3, model=model, extra_args=[["--layers", f"{a}:{b}", "--compile", compile, *STREAMS[kind]]
                                                          for a, b in spans])
              for kind in kinds}
    local: list[float] = []
    rates: dict[str, list[float]] = {kind: [] for kind in kinds}
    try:
        for peers in swarms.values():
            peers.start(together=True)

        async def rounds_() -> None:
            async with contextlib.AsyncExitStack() as stack:
                joined = {kind: await stack.enter_async_context(
                    Swarm.join(swarms[kind].addrs[:1], model=model, dedicated=kind == "dedicated", compile=compile))
                    for kind in kinds}
                for swarm in joined.values():
                    await swarm.wait_for_route(60)
                    await swarm_rate(swarm, ids, 4)  # warm-up
                local_rate(engine, ids, 4)
                for r in range(rounds):
                    local.append(local_rate(engine, ids, tokens))
                    for kind, swarm in joined.items():
                        rates[kind].append(await swarm_rate(swarm, ids, tokens))
                    print(f"  {label} round {r}: local {local[-1]:.2f} tok/s, "
                          + ", ".join(f"{kind} {rates[kind][-1]:.2f}" for kind in kinds))

        with CoreWatch() as watch:
            trio.run(rounds_)
    finally:
        for peers in swarms.values():
            peers.stop()
    decode = Decode(rates, local, watch.others)
    print(f"{label}: " + ", ".join(f"swarm ({kind}) {decode.median(kind):.2f} tok/s" for kind in kinds)
          + f", local {decode.median('local'):.2f} tok/s")
    for kind in ["local", *kinds]:
        print(spread_line(f"{label} {kind}", decode.local if kind == "local" else rates[kind], "tok/s"))
    print(watch_line(watch))
    return decode


def idle_penalty(model: str, idle: float, compile: str, steps: int = 40) -> float:
    """One span's decode forward (a third of the layers, one thread) after `idle` seconds of
    waiting, as a pipeline stage waits for its next frame, over back to back: medians."""
    folder = registry.resolve(model)
    spec = spec_from_file(folder / "config.json")
    start, end = even_spans(spec.num_layers, 3)[0]
    stage = load_stage(folder, start=start, end=end)
    compile_decode(stage, compile, buckets=(1,))
    stage.open("s", capacity=16 + 2 * steps + 2, start=start, end=end)
    stage.forward("s", torch.randn(16, spec.hidden_size), 0)
    times: dict[float, list[float]] = {0.0: [], idle: []}
    for i in range(2 * steps):
        wait = idle if i % 2 else 0.0
        time.sleep(wait)
        began = time.perf_counter()
        stage.forward("s", torch.randn(1, spec.hidden_size), 16 + i)
        times[wait].append(time.perf_counter() - began)
    return statistics.median(times[idle]) / statistics.median(times[0.0])


async def first_token_seconds(swarm: Swarm, ids: list[int], chunk: int | None) -> float:
    started = time.perf_counter()
    async for _ in swarm.generate_ids(ids, max_new_tokens=1, prefill_chunk=chunk):
        break
    return time.perf_counter() - started


@dataclass(frozen=True)
class FirstToken:
    """Time to first token over the emulated WAN, s a round: the prompt whole and in chunks (of
    `chunk` tokens), alternating, and the cores other processes kept busy meanwhile."""

    whole: list[float]
    chunked: list[float]
    chunk: int
    others: float | None


def measure_ttft(prompt_tokens: int, rounds: int, rate: str = WAN_RATE) -> FirstToken:
    """Time to first token over the emulated WAN, whole and chunked, `rounds` of each."""
    extra = [["--layers", f"{a}:{b}", "--emulate-link", f"delay={d}ms,rate={rate}"]
             for (a, b), d in zip(WAN_SPANS, WAN_PEER_DELAYS_MS)]
    peers = LocalSwarm(len(WAN_SPANS), extra_args=extra)
    whole, chunked = [], []
    chunk_used = 0
    try:
        peers.start(together=True)

        async def rounds_() -> None:
            nonlocal chunk_used
            link = LinkEmulation.parse(f"delay={WAN_REQUESTER_DELAY_MS}ms,rate={rate}")
            async with Swarm.join(peers.addrs[:1], emulate_link=link) as swarm:
                await swarm.wait_for_route(60)
                text = " ".join(f"Line {i}: the history of the city begins in the year {1000 + i}." for i in range(400))
                ids = swarm.tokenizer.encode(text)[:prompt_tokens]
                await first_token_seconds(swarm, ids[:64], 0)  # warm-up
                for r in range(rounds):
                    whole.append(await first_token_seconds(swarm, ids, 0))
                    chunk_used = swarm.prefill_chunk(len(ids), _RouteOnly(swarm))  # what None picks
                    chunked.append(await first_token_seconds(swarm, ids, None))
                    print(f"  ttft round {r} ({len(ids)} tokens): whole {whole[-1]:.2f} s, "
                          f"chunked (chunk {chunk_used}) {chunked[-1]:.2f} s")

        with CoreWatch() as watch:
            trio.run(rounds_)
    finally:
        peers.stop()
    print(spread_line("ttft whole", whole, "s"))
    print(spread_line("ttft chunked", chunked, "s"))
    print(watch_line(watch))
    return FirstToken(whole, chunked, chunk_used, watch.others)


class _RouteOnly:
    """Just enough of a session for `Swarm.prefill_chunk`: the route it would take."""

    def __init__(self, swarm: Swarm) -> None:
        self.routes = [swarm.plan()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-1b", action="store_true")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="1 round, SmolLM2 only, a 600-token prompt")
    parser.add_argument("--wan-rate", default=WAN_RATE, help="uplink of every emulated WAN stage (e.g. 10mbit)")
    parser.add_argument("--only-ttft", action="store_true", help="skip the decode comparisons")
    parser.add_argument("--skip-ttft", action="store_true", help="skip the time-to-first-token comparison")
    parser.add_argument("--dedicated-only", action="store_true",
                        help="decode through the default swarm only (no libp2p-streams swarm beside it)")
    parser.add_argument("--compile", default="auto", choices=("auto", "off"),
                        help="peers, requester heads and the local engine (default auto)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.skip_1b, args.prompt_tokens, args.tokens = 1, True, min(args.prompt_tokens, 600), 16
    torch.set_num_threads(1)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)  # it logs every refused dial
    for line in machine_lines(1):
        print(line)
    kinds = ["dedicated"] if args.dedicated_only else list(STREAMS)
    rates: dict[str, Decode] = {}
    penalties = {}
    if not args.only_ttft:
        rates["smollm2-135m"] = measure("smollm2-135m", "smollm2-135m", args.tokens, args.rounds, kinds, args.compile)
        if not args.skip_1b:
            rates["synthetic-1b"] = measure(str(synth_1b()), "synthetic-1b", max(8, args.tokens // 4), args.rounds,
                                            kinds, args.compile)
        for label, model in (("smollm2-135m", "smollm2-135m"), ("synthetic-1b", str(synth_1b()) if "synthetic-1b" in rates else "")):
            if model:
                # a stage of three waits about two thirds of a step: the swarm's step less its own compute
                idle = (2 / 3) / rates[label].median(kinds[0])
                penalties[label] = (idle, idle_penalty(model, idle, args.compile))
    ttft = None if args.skip_ttft else measure_ttft(args.prompt_tokens, args.rounds, args.wan_rate)
    print("\n-- side by side (one run; noisy on a shared machine) --")
    for label, (idle, penalty) in penalties.items():
        print(f"one span's forward after {idle * 1e3:.0f} ms idle / back to back ({label}, one process): {penalty:.2f}")
    for label, decode in rates.items():
        for kind in kinds:
            overhead_ms = (1 / decode.median(kind) - 1 / decode.median("local")) / HOPS * 1e3
            print(figure_line(f"per-hop overhead ({label}, 3 peers, loopback, {kind})", f"{overhead_ms:.2f} ms",
                              decode.refusal(kind)))
    for label, decode in rates.items():
        for kind in kinds:
            print(figure_line(f"swarm/local decode ratio ({label}, 3 peers, loopback, {kind})",
                              f"{decode.median(kind) / decode.median('local'):.2f}", decode.refusal(kind)))
    if ttft is not None:
        whole, chunked = statistics.median(ttft.whole), statistics.median(ttft.chunked)
        print(figure_line(f"time to first token, {args.prompt_tokens}-token prompt, 4 emulated WAN stages ({args.wan_rate})",
                          f"chunked (chunk {ttft.chunk}) {chunked:.2f} s / unchunked {whole:.2f} s = {chunked / whole:.2f}",
                          refusal({"whole": ttft.whole, "chunked": ttft.chunked}, ttft.others)))


if __name__ == "__main__":
    main()
