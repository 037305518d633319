"""Behind NAT: time to the first hole-punched connection, and decode speed punched vs relayed.

Root only: builds the namespace topology of tests/netns.py with four home networks —
a and b behind routers that drop unsolicited SYNs (their peers get hole-punched),
c and d behind routers that answer RST (their peers stay relayed) — and starts a
bootstrap/relay peer on the public side plus A [0,15) B [15,30) and C [0,15) D [15,30).

1. Time to first direct connection: from starting A and B to A logging its link to
   B as punched, and from that link first coming up (relayed) to the punch.
2. Decode tokens/s through A -> B (punched) and C -> D (relayed) in the same run:
   a requester on the public side (listening there, so that every private peer
   dials it directly and only the middle link differs) alternates the two routes
   (the other pair banned), rounds interleaved so machine noise hits both alike.

    sudo .venv/bin/python bench/nat.py [--tokens 32] [--rounds 3]

Prints the figures last.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PY = sys.executable
PROMPT = "Once upon a time, in a village by the sea,"
PEER_START = 120.0
SETTLE = 90.0


class LogWatch:
    """Remembers when each line of some log files first appeared (polled every 50 ms)."""

    def __init__(self, paths: dict[str, Path]) -> None:
        self.paths = paths
        self.seen: dict[str, list[tuple[float, str]]] = {name: [] for name in paths}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.is_set():
            for name, path in self.paths.items():
                lines = path.read_text().splitlines() if path.exists() else []
                for line in lines[len(self.seen[name]):]:
                    self.seen[name].append((time.monotonic(), line))
            time.sleep(0.05)

    def wait(self, name: str, pattern: str, timeout: float) -> tuple[float, re.Match]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for at, line in list(self.seen[name]):
                found = re.search(pattern, line)
                if found:
                    return at, found
            time.sleep(0.05)
        tail = "\n".join(line for _, line in self.seen[name][-30:])
        raise SystemExit(f"{pattern!r} did not appear in {name}'s log within {timeout} s:\n{tail}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def peer_cmd(topo, role: str, name: str, layers: str, base: Path, join: str | None) -> list[str]:
    cmd = [PY, "-m", "tessera.peer.cli.main", "peer", "--threads", "1", "--listen", f"/ip4/{topo.ip(role)}/tcp/4001",
           "--layers", layers, "--name", name, "--data-dir", str(base / name)]
    return cmd + (["--join", join] if join else [])


def run_topology(args: argparse.Namespace) -> None:
    from tests import netns

    reason = netns.skip_reason()
    if reason:
        raise SystemExit(f"bench/nat.py: {reason}")
    base = Path(tempfile.mkdtemp(prefix="tessera-nat-bench-"))
    env = {"PYTHONUNBUFFERED": "1"}
    homes = {"a": "drop", "b": "drop", "c": "reject", "d": "reject"}
    with netns.nat_topology(homes) as topo:
        logs = {name: base / f"{name}.log" for name in ("relay", "A", "B", "C", "D")}
        watch = LogWatch(logs)
        try:
            topo.spawn("pub", peer_cmd(topo, "pub", "relay", "29:30", base, None), log_path=str(logs["relay"]), env=env)
            _, found = watch.wait("relay", r"listening on (/\S+)", PEER_START)
            relay = found.group(1)
            started = time.monotonic()
            spans = {"A": ("a", "0:15"), "B": ("b", "15:30"), "C": ("c", "0:15"), "D": ("d", "15:30")}
            for name, (role, layers) in spans.items():
                topo.spawn(role, peer_cmd(topo, role, name, layers, base, relay), log_path=str(logs[name]), env=env)
            ids = {name: watch.wait(name, r"listening on \S+/p2p/(\w+)", PEER_START)[1].group(1) for name in spans}
            relayed_at, _ = watch.wait("A", rf"link {ids['B']}: relayed$", SETTLE)
            punched_at, _ = watch.wait("A", rf"link {ids['B']}: relayed -> punched", SETTLE)
            watch.wait("C", rf"hole punch with {ids['D']}: failed", SETTLE)
            for name in spans:
                watch.wait(name, r"serving layers", PEER_START)
            print(f"A-B link relayed {relayed_at - started:.2f} s after A and B started, punched "
                  f"{punched_at - started:.2f} s after ({punched_at - relayed_at:.2f} s after the relayed link)")
            print("C-D link: punch failed (routers answer RST); stays relayed")
            requester = topo.output("pub", [PY, str(Path(__file__).resolve()), "--requester", "--join", relay,
                                            "--punched", f"{ids['A']},{ids['B']}", "--relayed", f"{ids['C']},{ids['D']}",
                                            "--tokens", str(args.tokens), "--rounds", str(args.rounds)],
                                    timeout=600, env=env)
            if requester.returncode != 0:
                raise SystemExit(f"requester failed:\n{requester.stdout[-2000:]}\n{requester.stderr[-4000:]}")
            result = json.loads(requester.stdout.strip().splitlines()[-1])
        finally:
            watch.close()
    for kind in ("punched", "relayed"):
        print(f"{kind:>8}: tokens/s per round {[round(x, 2) for x in result[kind]]}, "
              f"middle-link RTT {result['rtt'][kind]:.2f} ms, route {result['routes'][kind]}")
    punched, relayed = statistics.median(result["punched"]), statistics.median(result["relayed"])
    print(f"nat/time to first direct (punched) connection: {punched_at - started:.2f} s from start, "
          f"{punched_at - relayed_at:.2f} s after the relayed link")
    print(f"nat/middle-link RTT ms punched {result['rtt']['punched']:.2f} relayed {result['rtt']['relayed']:.2f} "
          f"ratio relayed/punched {result['rtt']['relayed'] / result['rtt']['punched']:.2f}")
    print(f"nat/decode tokens/s punched {punched:.2f} relayed {relayed:.2f} ratio punched/relayed {punched / relayed:.2f}")


async def requester(args: argparse.Namespace) -> dict:
    """Inside the pub namespace: alternate the punched and the relayed route, timing decode."""
    import trio

    from tessera.peer.request.client import Swarm
    from tessera.peer.net.transport import RELAYED
    from tessera.stages.decoding.generate import prompt_ids
    from tests.netns import PUB_IP

    pairs = {"punched": args.punched.split(","), "relayed": args.relayed.split(",")}
    out: dict = {"punched": [], "relayed": [], "routes": {}, "rtt": {}}
    async with Swarm.join([args.join], listen=[f"/ip4/{PUB_IP}/tcp/0"]) as swarm:
        ids = prompt_ids(swarm.tokenizer, PROMPT, raw=True)
        everyone = pairs["punched"] + pairs["relayed"]
        with trio.fail_after(SETTLE):  # every private peer has dialled us directly
            while not all(p in swarm.transport.connected() and swarm.transport.connection_kind(p) != RELAYED
                          for p in everyone):
                await swarm.refresh()
                await trio.sleep(0.5)
        for _ in range(args.rounds):
            for kind, other in (("punched", "relayed"), ("relayed", "punched")):
                swarm.bans.clear()
                for p in pairs[other]:
                    swarm.bans.ban_until(p, math.inf)
                await swarm.wait_for_route(30)
                info: dict = {}
                stamps = []
                async for _token in swarm.generate_ids(ids, max_new_tokens=args.tokens, info=info):
                    stamps.append(time.perf_counter())
                out[kind].append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
                out["routes"][kind] = [f"{h['peer'][-6:]}[{h['start']},{h['end']})" for h in info["route"]]
        view = swarm.keeper.snapshot()
        for kind, (first, second) in pairs.items():
            out["rtt"][kind] = view.get(first).rtt_ms.get(second, float("nan"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requester", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--join", help=argparse.SUPPRESS)
    parser.add_argument("--punched", help=argparse.SUPPRESS)
    parser.add_argument("--relayed", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.requester:
        import torch
        import trio

        torch.set_num_threads(1)
        print(json.dumps(trio.run(requester, args)))
    else:
        run_topology(args)


if __name__ == "__main__":
    main()
