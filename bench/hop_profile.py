"""Where one token's time goes through a 3-peer loopback chain (SmolLM2-135M).

Three peer processes run under cProfile (their main thread: the trio loop that
reads, opens, seals and forwards frames; torch compute runs in a worker thread
and is timed by the peers' own `forward` trace events). The requester decodes
`--tokens` tokens under cProfile in this process. Printed: the step time split
into compute (peers' forward events; the requester's embedding and head) and
the rest, and for the requester and the middle peer the share of their busy
main-thread time per kind of work (crypto, CBOR, tensor codec, yamux/libp2p,
trio, signing) — shares, since the machine is shared and absolute ms are noisy.
Beside the step, one process's step over the same prompt and tokens (prefill included in
both). The profiled peers' main threads hold the GIL longer, and their compute threads
run slower for it: the peers' forwards come out 20-40% above one process's, where
unprofiled peers match it. Read the split for where the wire's time goes, not the
peers' compute.

    .venv/bin/python bench/hop_profile.py [--tokens 48] [--synth-1b]

`--synth-1b` runs bench/swarm.py's seeded random-weight 1B shape instead (written once).
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import pstats
import sys
import time
from collections import Counter

import torch
import trio

from swarm import SYNTH_1B, even_spans, local_rate, synth_1b  # bench/swarm.py, beside this script

from tessera.peer.request.client import Swarm
from tessera.peer.cli.demo import LocalSwarm
from tessera.stages.weights import registry
from tessera.stages.decoding.generate import LocalEngine
from tessera.store.db import PeerStore
from tessera.store.events import Forward

# what a function's file or name says about the kind of work it is (first match wins)
KINDS = [
    ("idle (waiting on sockets)", ("epoll", "select.", "poll'", "_io_epoll")),
    ("idle: start-up (imports, loading)", ("importlib", "<frozen", "safetensors", "weights.py", "speed.py", "<built-in method builtins.exec>", "marshal")),
    ("signing/attestation", ("attest", "signing", "crypto_sign", "ed25519")),
    ("AEAD + key handling", ("nacl", "links.py", "crypto_aead", "blake2b")),
    ("CBOR + schema", ("cbor", "schema.py", "codec.py", "messages.py", "framing.py")),
    ("tensor codec", ("tensors.py", "activations.py")),
    ("yamux/noise/libp2p", ("libp2p", "yamux", "noise", "multiaddr")),
    ("compute hand-off (threads)", ("_threads.py", "to_thread", "threading.py", "queue.py")),
    ("trio scheduler", ("trio",)),
    ("torch (main thread)", ("torch",)),
]


class ProfiledSwarm(LocalSwarm):
    """LocalSwarm whose peers run under cProfile (written when a peer exits on SIGINT)."""

    def launcher(self, i: int) -> list[str]:
        return [sys.executable, "-m", "cProfile", "-o", str(self.base_dir / f"peer{i}.prof")]


def kind_of(func: tuple[str, int, str]) -> str:
    text = f"{func[0]}:{func[2]}".lower()
    for kind, marks in KINDS:
        if any(m.lower() in text for m in marks):
            return kind
    return "other Python (tessera)" if "/work/" in func[0] or "tessera" in func[0] else "other Python"


def shares(stats: pstats.Stats) -> tuple[Counter, float]:
    """Self time per kind of work, and the busy total (idle excluded)."""
    by_kind: Counter = Counter()
    for func, (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        by_kind[kind_of(func)] += tottime
    busy = sum(v for k, v in by_kind.items() if not k.startswith("idle"))
    return by_kind, busy


def print_shares(label: str, stats: pstats.Stats, steps: int) -> None:
    by_kind, busy = shares(stats)
    print(f"{label}: busy main thread {busy / max(steps, 1) * 1e3:.2f} ms per step")
    for kind, seconds in by_kind.most_common():
        if not kind.startswith("idle"):
            print(f"    {kind:28s} {100 * seconds / busy:5.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--dump", metavar="FILE", help="also write the requester's profile here (pstats)")
    parser.add_argument("--synth-1b", action="store_true", help="the synthetic 1B shape of bench/swarm.py")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    model, layers = (str(synth_1b()), SYNTH_1B["layers"]) if args.synth_1b else ("smollm2-135m", 30)
    peers = ProfiledSwarm(3, model=model, extra_args=[["--layers", f"{a}:{b}"] for a, b in even_spans(layers, 3)])
    profile = cProfile.Profile()
    timing: dict = {}
    try:
        peers.start(together=True)

        async def run() -> None:
            async with Swarm.join(peers.addrs[:1], model=model) as swarm:
                await swarm.wait_for_route(60)
                ids = swarm.tokenizer.encode("The history of the city begins in the year")
                [t async for t in swarm.generate_ids(ids, max_new_tokens=4)]  # warm-up
                timing["first_event"] = [last_event(peers, i) for i in range(3)]
                embed, head = swarm._embed, swarm._logits
                spent = {"embed+head": 0.0}

                async def timed_embed(x):
                    t = time.perf_counter()
                    try:
                        return await embed(x)
                    finally:
                        spent["embed+head"] += time.perf_counter() - t

                async def timed_head(x):
                    t = time.perf_counter()
                    try:
                        return await head(x)
                    finally:
                        spent["embed+head"] += time.perf_counter() - t

                swarm._embed, swarm._logits = timed_embed, timed_head  # type: ignore[method-assign]
                started = time.perf_counter()
                profile.enable()
                timing["ids"] = ids
                out = [t async for t in swarm.generate_ids(ids, max_new_tokens=args.tokens)]
                profile.disable()
                timing["seconds"] = time.perf_counter() - started
                timing["tokens"] = len(out)
                timing["requester_compute"] = spent["embed+head"]

        trio.run(run)
    finally:
        peers.stop()
    steps = timing["tokens"]
    compute = [sum(e.event.duration for e in PeerStore(peers.base_dir / f"peer{i}" / "tessera.db", readonly=True)
                   .events(after_id=timing["first_event"][i], kinds=(Forward,))) for i in range(3)]
    step_ms = timing["seconds"] / steps * 1e3
    peer_ms = [c / steps * 1e3 for c in compute]
    req_ms = timing["requester_compute"] / steps * 1e3
    rest = step_ms - sum(peer_ms) - req_ms
    print(f"\none token through 3 peers ({model}): {step_ms:.1f} ms per step ({steps} steps)")
    print(f"  peers' compute (forward events): {' + '.join(f'{m:.1f}' for m in peer_ms)} ms = {100 * sum(peer_ms) / step_ms:.0f}%")
    print(f"  requester embedding + head: {req_ms:.1f} ms = {100 * req_ms / step_ms:.0f}%")
    print(f"  the rest (wire work, hops, hand-offs): {rest:.1f} ms = {100 * rest / step_ms:.0f}%"
          f" -> {rest / 4:.2f} ms per hop (4 hops: requester->p0->p1->p2->requester)")
    # measured like the swarm's step above: the same prompt and tokens, its prefill included
    engine = LocalEngine(registry.resolve(model), device="cpu", dtype="float32")
    local_rate(engine, timing["ids"], 2)  # warm-up
    local_ms = 1e3 / local_rate(engine, timing["ids"], steps)
    print(f"  for comparison, one process (LocalEngine, one thread): {local_ms:.1f} ms per step;"
          f" the peers' compute + head above: {sum(peer_ms) + req_ms:.1f} ms")
    print_shares("requester", pstats.Stats(profile), steps)
    if args.dump:
        profile.dump_stats(args.dump)
    middle = peers.base_dir / "peer1.prof"
    if middle.exists():
        print_shares("middle peer (whole run, per decode step of this run)", pstats.Stats(str(middle)), steps)
    else:
        print("middle peer: no profile written (did it exit on SIGINT?)")


def last_event(peers: LocalSwarm, i: int) -> int:
    events = PeerStore(peers.base_dir / f"peer{i}" / "tessera.db", readonly=True).events(kinds=(Forward,))
    return events[-1].id if events else 0


if __name__ == "__main__":
    main()
