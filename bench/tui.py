"""Does the operator's TUI slow the peer down? Decode speed with the UI open vs without.

One in-process peer serves every layer of the model behind a `tessera.tui.bridge.PeerHandle`
(its trio loop in its own thread, as `tessera peer --tui` runs it), so every step of
the generation is this peer's compute and anything the UI steals shows in full. A
requester in another thread asks for the same greedy answer each round; rounds
alternate between the UI closed and the UI open (Textual's headless driver, which
lays out and renders every frame but draws nothing: the terminal's own cost is left
out), swapping which goes first every round, so machine noise hits both alike. The
handle's snapshot task (a dict every 0.5 s) runs in both: it is microseconds.

Prints each round (decode tokens/s, and this process's CPU seconds per token — the
peer's compute, the requester's and, when open, the UI's: steadier than speed on a
crowded machine), then the medians, and the decode-speed ratio last.

    .venv/bin/python bench/tui.py [--rounds 8] [--tokens 32] [--size 120x40]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, this file's folder leads sys.path and "tui" would import this very
# file (bench/tui.py) instead of the package: the repository root leads instead.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

import torch  # noqa: E402
import trio  # noqa: E402

from tessera.peer.request.client import Swarm  # noqa: E402
from tessera.peer.node.config import PeerConfig  # noqa: E402
from tessera.peer.node.compose import build_peer  # noqa: E402
from tessera.stages.weights import registry  # noqa: E402
from tessera.stages.decoding.generate import prompt_ids  # noqa: E402
from tessera.stages.families.catalog import spec_from_file  # noqa: E402
from tessera.tui.app import TesseraApp  # noqa: E402
from tessera.tui.bridge import PeerHandle  # noqa: E402

PROMPT = "Once upon a time, in a village by the sea,"
STARTUP = 120.0


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread: peer, requester, UI
    return usage.ru_utime + usage.ru_stime


def decode(addr: str, tokens: int) -> tuple[float, float]:
    """One greedy answer through the peer (a requester in this thread's own trio loop).

    Returns decode tokens/s and CPU seconds per decoded token, both from the first token on.
    """
    async def go() -> tuple[float, float]:
        async with Swarm.join([addr]) as swarm:
            await swarm.wait_for_route(60)
            ids = prompt_ids(swarm.tokenizer, PROMPT, raw=True)
            stamps = [(time.perf_counter(), cpu_seconds()) async for _ in swarm.generate_ids(ids, max_new_tokens=tokens)]
        if len(stamps) < 3:
            raise RuntimeError(f"the answer stopped after {len(stamps)} tokens; ask for a longer one")
        (t0, c0), (t1, c1) = stamps[0], stamps[-1]
        return (len(stamps) - 1) / (t1 - t0), (c1 - c0) / (len(stamps) - 1)

    return trio.run(go)


async def with_ui(handle: PeerHandle, addr: str, tokens: int, size: tuple[int, int]) -> tuple[float, float]:
    app = TesseraApp(handle)
    async with app.run_test(size=size) as pilot:
        await pilot.pause(2.0)  # past start-up: the first trace and ledger reads, the first snapshots
        result = await asyncio.to_thread(decode, addr, tokens)
        await pilot.pause(0.1)
    return result


async def bench(handle: PeerHandle, rounds: int, tokens: int, size: tuple[int, int]) -> dict[str, list]:
    addr = handle.latest()["addrs"][0]
    await asyncio.to_thread(decode, addr, 4)  # warm-up: first connections, caches
    results: dict[str, list[tuple[float, float]]] = {"without": [], "with": []}
    for r in range(rounds):
        order = ("without", "with") if r % 2 == 0 else ("with", "without")
        for which in order:
            if which == "with":
                rate, cpu = await with_ui(handle, addr, tokens, size)
            else:
                rate, cpu = await asyncio.to_thread(decode, addr, tokens)
            results[which].append((rate, cpu))
            print(f"round {r + 1} {which:>7} TUI: {rate:6.1f} tok/s, {cpu * 1000:6.1f} CPU ms/token", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the peer (and requester)")
    parser.add_argument("--size", default="120x40", help="the UI's terminal size, COLSxROWS")
    args = parser.parse_args()
    size = tuple(int(x) for x in args.size.lower().split("x"))
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="tessera-bench-tui-") as tmp:
        spec = spec_from_file(registry.resolve(args.model) / "config.json")
        node = build_peer(PeerConfig(model=args.model, layers=(0, spec.num_layers), data_dir=Path(tmp),
                                   threads=args.threads, name="bench", listen=["/ip4/127.0.0.1/tcp/0"]))
        handle = PeerHandle(node)
        handle.start()
        try:
            if not handle.wait_ready(STARTUP):
                raise SystemExit(f"the peer did not start: {handle.error!r}")
            results = asyncio.run(bench(handle, args.rounds, args.tokens, size))
        finally:
            handle.leave()
            handle.join(30)
    rate = {k: statistics.median(r for r, _ in v) for k, v in results.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in results.items()}
    paired = statistics.median(w[0] / o[0] for w, o in zip(results["with"], results["without"]))
    print(f"median decode: without TUI {rate['without']:.1f} tok/s, with TUI {rate['with']:.1f} tok/s; "
          f"median of per-round ratios {paired:.2f} ({args.size}, {args.rounds} rounds of {args.tokens} tokens)")
    print(f"tui/cpu per token ratio (with TUI / without): {cpu['with'] / cpu['without']:.2f}")
    print(f"tui/decode ratio (with TUI / without): {rate['with'] / rate['without']:.2f}")


if __name__ == "__main__":
    main()
