"""Decode speed of a 3-peer loopback swarm vs the local engine, same model, one run.

For SmolLM2-135M and for a seeded random-weight ~1B model (hidden 2048, 24 layers,
16/8 heads; compute cost does not depend on the weights). Each peer and the
local engine get one torch thread: with one session the pipeline runs one peer
at a time, so both sides compute on one core and the ratio shows what the
network, the encryption and the hops cost. Rounds alternate (local, swarm, ...).

    .venv/bin/python bench/swarm.py [--tokens 32] [--rounds 3] [--skip-1b]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from pathlib import Path

import torch
import trio

from tessera.peer.request.client import Swarm
from tessera.peer.cli.demo import LocalSwarm
from tessera.stages import registry
from tessera.stages.generate import LocalEngine
from tessera.stages.spec import ModelSpec

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


def measure(model: str, label: str, tokens: int, rounds: int) -> float:
    spec = ModelSpec.from_file(registry.resolve(model) / "config.json")
    engine = LocalEngine(registry.resolve(model), device="cpu", dtype="float32")
    # a prompt whose answer does not stop early: greedy continuation of a plain text
    ids = engine.tokenizer.encode("The history of the city begins in the year")[:16] or [5] * 16
    peers = LocalSwarm(3, model=model, extra_args=[["--layers", f"{a}:{b}"] for a, b in even_spans(spec.num_layers, 3)])
    local, swarm_rates = [], []
    try:
        peers.start(together=True)

        async def rounds_() -> None:
            async with Swarm.join(peers.addrs[:1], model=model) as swarm:
                await swarm.wait_for_route(60)
                await swarm_rate(swarm, ids, 4)  # warm-up
                local_rate(engine, ids, 4)
                for r in range(rounds):
                    local.append(local_rate(engine, ids, tokens))
                    swarm_rates.append(await swarm_rate(swarm, ids, tokens))
                    print(f"  {label} round {r}: local {local[-1]:.2f} tok/s, swarm {swarm_rates[-1]:.2f} tok/s")

        trio.run(rounds_)
    finally:
        peers.stop()
    a, b = statistics.median(swarm_rates), statistics.median(local)
    print(f"{label}: swarm {a:.2f} tok/s, local {b:.2f} tok/s")
    return a / b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-1b", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)  # it logs every refused dial
    ratios = {"smollm2-135m": measure("smollm2-135m", "smollm2-135m", args.tokens, args.rounds)}
    if not args.skip_1b:
        ratios["synthetic-1b"] = measure(str(synth_1b()), "synthetic-1b", max(8, args.tokens // 4), args.rounds)
    for label, ratio in ratios.items():
        print(f"swarm/local decode ratio ({label}, 3 peers, loopback): {ratio:.2f}")


if __name__ == "__main__":
    main()
