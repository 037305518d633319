"""Tessera vs Petals, side by side: the same model, split and threads (optional; not in `make test`).

Two peers each (layers 0:15 and 15:30 of SmolLM2-135M-Instruct, one torch thread
each), greedy decoding of the same chat prompt, decode tokens/s (steps after the
first). Tessera's peers, its requester's head and its one-process engine decode as
`--compile` says (default auto: compiled on a CPU; stages/engine/compiled/). Petals
2.2.0.post1 runs from its own venv (it pins old transformers and a hivemind that
builds from an sdist): build it once with the script in
docs/pages/benchmarks.md ("Petals"), which also writes the run script this bench calls.
Without it, this bench says so and exits 0.

    .venv/bin/python bench/petals.py [--tokens 48] [--compile auto|off] [--petals-root ~/.cache/petals-bench]

Printed with the figures (bench/rounds.py): the machine, each side's answers as min / median / max,
and the cores other processes kept busy while it measured (the peers and Petals' servers are this
run's own children); the ratios are not printed when a side's answers spread over 15% or others
held a fifth of a core or more.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import trio

from rounds import CoreWatch, figure_line, machine_lines, refusal, spread_line, watch_line

from tessera.peer.request.client import Swarm
from tessera.peer.cli.demo import LocalSwarm
from tessera.stages.weights import registry
from tessera.stages.decoding.generate import LocalEngine, prompt_ids

SPANS = [(0, 15), (15, 30)]
PROMPT = "What is the capital of France?"
RESULT = re.compile(r"RESULT decode_tok_s=([0-9.]+)")


def petals_ready(root: Path) -> str | None:
    """None if the Petals venv and run script are there; else what is missing."""
    python = root / "venv" / "bin" / "python"
    if not python.exists():
        return f"no Petals venv at {root / 'venv'}"
    check = subprocess.run([str(python), "-c", "import petals"], capture_output=True, text=True)
    if check.returncode != 0:
        return f"petals does not import in {root / 'venv'}: {check.stderr.strip()[-200:]}"
    return None


RUNS = 3  # answers per side; each side's figure is their median


def petals_rates(run_script: Path, root: Path, tokens: int) -> list[float]:
    """Decode tok/s of each of the Petals run script's RESULT lines (one per client run)."""
    env = {**os.environ, "PETALS_ROOT": str(root), "NEW_TOKENS": str(tokens), "RUNS": str(RUNS)}
    run = subprocess.run(["bash", str(run_script)], capture_output=True, text=True, env=env, timeout=1800)
    rates = [float(m.group(1)) for m in RESULT.finditer(run.stdout)]
    print(f"  petals runs: {', '.join(f'{r:.2f}' for r in rates) or 'none'} tok/s")
    if len(rates) < RUNS:  # a half-finished run would bias the median: say so and stop
        raise SystemExit(f"{len(rates)} of {RUNS} Petals client runs finished; the run script's output ends:\n"
                         f"{run.stdout[-2000:]}")
    return rates


def local_rates(tokens: int, compile: str) -> list[float]:
    """One process (LocalEngine, one torch thread): the ceiling of any swarm on the same compute."""
    engine = LocalEngine(registry.resolve("smollm2-135m"), device="cpu", dtype="float32", compile=compile)
    ids = prompt_ids(engine.tokenizer, PROMPT, raw=False)
    rates = []
    for _ in range(RUNS):
        stamps: list[float] = []
        engine.generate_ids(ids, max_new_tokens=tokens, on_token=lambda _: stamps.append(time.perf_counter()))
        rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))  # steps after the first, as both swarms
    return rates


def tessera_rates(tokens: int, compile: str) -> list[float]:
    peers = LocalSwarm(len(SPANS), extra_args=[["--layers", f"{a}:{b}", "--compile", compile] for a, b in SPANS])
    rates: list[float] = []
    try:
        peers.start(together=True)

        async def run() -> None:
            async with Swarm.join(peers.addrs[:1], compile=compile) as swarm:
                await swarm.wait_for_route(60)
                ids = prompt_ids(swarm.tokenizer, PROMPT, raw=False)
                for _ in range(RUNS):
                    stamps = []
                    async for _token in swarm.generate_ids(ids, max_new_tokens=tokens, prefill_chunk=0):
                        stamps.append(time.perf_counter())
                    rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))  # steps after the first

        trio.run(run)
    finally:
        peers.stop()
    print(f"  tessera runs: {', '.join(f'{r:.2f}' for r in rates)} tok/s")
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--compile", default="auto", choices=("auto", "off", "inductor"),
                        help="Tessera's decode steps: peers, requester head, one process (default auto)")
    parser.add_argument("--petals-root", type=Path, default=Path(os.environ.get("PETALS_ROOT", Path.home() / ".cache/petals-bench")))
    parser.add_argument("--run-script", type=Path, default=None, help="default: PETALS_ROOT/run_p3.sh")
    args = parser.parse_args()
    missing = petals_ready(args.petals_root)
    run_script = args.run_script or args.petals_root / "run_p3.sh"
    if missing is None and not run_script.exists():
        missing = f"no Petals run script at {run_script}"
    if missing is not None:
        print(f"SKIPPED: Petals is not installed ({missing}). See docs/pages/benchmarks.md, 'Petals', to build it.")
        sys.exit(0)
    torch.set_num_threads(1)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    with CoreWatch() as watch:
        runs = {"tessera": tessera_rates(args.tokens, args.compile),
                "tessera in one process": local_rates(args.tokens, args.compile),
                "petals": petals_rates(run_script, args.petals_root, args.tokens)}
    for line in machine_lines(1):
        print(line)
    for name, rates in runs.items():
        print(spread_line(name, rates, "tok/s"))
    print(watch_line(watch))
    ours, one_process, theirs = (statistics.median(runs[k]) for k in ("tessera", "tessera in one process", "petals"))
    print(f"decode tok/s, 2 peers (0:15, 15:30), 1 thread each, tessera --compile {args.compile}: "
          f"tessera {ours:.2f}, petals {theirs:.2f}; "
          f"tessera in one process {one_process:.2f}")
    print(figure_line("tessera one process/petals decode ratio (the most any swarm on this compute can reach)",
                      f"{one_process / theirs:.2f}",
                      refusal({k: runs[k] for k in ("tessera in one process", "petals")}, watch.others)))
    print(figure_line("tessera/petals decode ratio", f"{ours / theirs:.2f}",
                      refusal({k: runs[k] for k in ("tessera", "petals")}, watch.others)))


if __name__ == "__main__":
    main()
