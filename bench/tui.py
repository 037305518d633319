"""Does the operator's TUI slow the peer down? Decode speed with the UI open vs without.

One in-process peer serves every layer of the model behind a `tui.bridge.PeerHandle`
(its trio loop in its own thread, as `tessera peer --tui` runs it), so every step of
the generation is this peer's compute and anything the UI steals shows in full. A
requester in another thread asks for the same greedy answer each round; rounds
alternate between the UI closed and the UI open (Textual's headless driver, which
lays out and renders every frame but draws nothing: the terminal's own cost is left
out), swapping which goes first every round, so machine noise hits both alike. The
handle's snapshot task (a dict every 0.5 s) runs in both: it is microseconds.

Prints each round, the median decode tokens/s of each, and their ratio last.

    .venv/bin/python bench/tui.py [--rounds 4] [--tokens 32] [--size 120x40]
"""

from __future__ import annotations

import argparse
import asyncio
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

from peer.client import Swarm  # noqa: E402
from peer.node import PeerConfig, PeerNode  # noqa: E402
from stages import registry  # noqa: E402
from stages.generate import prompt_ids  # noqa: E402
from stages.spec import ModelSpec  # noqa: E402
from tui.app import TesseraApp  # noqa: E402
from tui.bridge import PeerHandle  # noqa: E402

PROMPT = "Once upon a time, in a village by the sea,"
STARTUP = 120.0


def decode_rate(addr: str, tokens: int) -> float:
    """One greedy answer through the peer (a requester in this thread's own trio loop): decode tokens/s."""
    async def go() -> float:
        async with Swarm.join([addr]) as swarm:
            await swarm.wait_for_route(60)
            ids = prompt_ids(swarm.tokenizer, PROMPT, raw=True)
            stamps = [time.perf_counter() async for _ in swarm.generate_ids(ids, max_new_tokens=tokens)]
        if len(stamps) < 3:
            raise RuntimeError(f"the answer stopped after {len(stamps)} tokens; ask for a longer one")
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])  # from the first token: decode only

    return trio.run(go)


async def with_ui(handle: PeerHandle, addr: str, tokens: int, size: tuple[int, int]) -> float:
    app = TesseraApp(handle)
    async with app.run_test(size=size) as pilot:
        await pilot.pause(1.0)  # the first trace and ledger reads, the first snapshots
        rate = await asyncio.to_thread(decode_rate, addr, tokens)
        await pilot.pause(0.1)
    return rate


async def bench(handle: PeerHandle, rounds: int, tokens: int, size: tuple[int, int]) -> dict[str, list[float]]:
    addr = handle.latest()["addrs"][0]
    await asyncio.to_thread(decode_rate, addr, 4)  # warm-up: first connections, caches
    rates: dict[str, list[float]] = {"without": [], "with": []}
    for r in range(rounds):
        order = ("without", "with") if r % 2 == 0 else ("with", "without")
        for which in order:
            if which == "with":
                rate = await with_ui(handle, addr, tokens, size)
            else:
                rate = await asyncio.to_thread(decode_rate, addr, tokens)
            rates[which].append(rate)
            print(f"round {r + 1} {which:>7} TUI: {rate:6.1f} tok/s", flush=True)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the peer (and requester)")
    parser.add_argument("--size", default="120x40", help="the UI's terminal size, COLSxROWS")
    args = parser.parse_args()
    size = tuple(int(x) for x in args.size.lower().split("x"))
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="tessera-bench-tui-") as tmp:
        spec = ModelSpec.from_file(registry.resolve(args.model) / "config.json")
        node = PeerNode(PeerConfig(model=args.model, layers=(0, spec.num_layers), data_dir=Path(tmp),
                                   threads=args.threads, name="bench"))
        handle = PeerHandle(node)
        handle.start()
        try:
            if not handle.wait_ready(STARTUP):
                raise SystemExit(f"the peer did not start: {handle.error!r}")
            rates = asyncio.run(bench(handle, args.rounds, args.tokens, size))
        finally:
            handle.leave()
            handle.join(30)
    without, with_ = statistics.median(rates["without"]), statistics.median(rates["with"])
    print(f"median decode: without TUI {without:.1f} tok/s, with TUI {with_:.1f} tok/s ({args.size}, "
          f"{args.rounds} rounds of {args.tokens} tokens)")
    print(f"tui/decode ratio (with TUI / without): {with_ / without:.2f}")


if __name__ == "__main__":
    main()
