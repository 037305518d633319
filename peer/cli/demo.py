"""`tessera demo`: a local swarm of peer processes answering one prompt.

Starts N `tessera peer` processes on 127.0.0.1, each offering memory for about
L/N layers so that placement splits the model between them (they join one after
another and each fills the weakest part), waits until every layer is covered,
answers the prompt through the swarm with a requester in this process — showing
the route the activations took — and stops the peers gracefully.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from tessera.stages.weights import registry
from tessera.stages.families.catalog import spec_from_file

from tessera.peer.request.client import Swarm
from tessera.peer.base.errors import PeerError
from tessera.peer.node.config import KV_RESERVE_FRACTION

# one peer: import torch, measure a layer, load its span, and compile its decode steps (--compile: up to a
# minute or two per span on a 2-core machine when inductor's disk cache is cold, seconds once it is warm)
STARTUP_TIMEOUT = 300.0
LOOPBACK_LISTEN = "/ip4/127.0.0.1/tcp/0"  # a local swarm stays on this machine


class LocalSwarm:
    """N peer processes on loopback (also used by tests and benchmarks): each is given
    `--listen /ip4/127.0.0.1/tcp/0`, since a peer listens on every interface by default."""

    def __init__(self, n: int, *, model: str = "smollm2-135m", extra_args: list[list[str]] | None = None,
                 base_dir: Path | None = None, threads: int = 1, env: dict | None = None,
                 control: bool = False) -> None:
        self.n = n
        self.model = model
        self.extra_args = extra_args or [[] for _ in range(n)]
        self.base_dir = Path(base_dir or tempfile.mkdtemp(prefix="tessera-swarm-"))
        self.threads = threads
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.control = control  # peers read commands from a pipe (`--control-stdin`; see `command`)
        self.procs: list[subprocess.Popen] = []
        self.addrs: list[str] = []
        self.logs: list[Path] = []

    def launcher(self, i: int) -> list[str]:
        """How peer i's Python starts (a benchmark runs it under a profiler)."""
        return [sys.executable]

    def spawn(self, i: int, join: list[str]) -> subprocess.Popen:
        """Start peer i's process (not waiting for it)."""
        log = self.base_dir / f"peer{i}.log"
        cmd = [*self.launcher(i), "-m", "tessera.peer.cli.main", "peer", "--model", self.model, "--name", f"peer{i}",
               "--data-dir", str(self.base_dir / f"peer{i}"), "--threads", str(self.threads),
               "--listen", LOOPBACK_LISTEN, *self.extra_args[i]]
        for addr in join:
            cmd += ["--join", addr]
        if self.control:
            cmd.append("--control-stdin")
        proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=self.env,
                                stdin=subprocess.PIPE if self.control else None)
        while len(self.procs) <= i:
            self.procs.append(proc)
            self.logs.append(log)
            self.addrs.append("")
        self.procs[i], self.logs[i] = proc, log
        return proc

    def wait_ready(self, i: int) -> str:
        """Wait until peer i serves; return its multiaddr."""
        self.addrs[i] = wait_for_line(self.logs[i], self.procs[i], "serving layers", prefix="listening on ")
        return self.addrs[i]

    def start_peer(self, i: int, join: list[str]) -> str:
        self.spawn(i, join)
        return self.wait_ready(i)

    def start(self, *, together: bool = False) -> list[str]:
        """Start every peer; the first alone, then the rest one by one (placement sees each
        claim) or, with `together` (spans forced by --layers), all at once."""
        if together:
            # the others can join as soon as the first listens (it measures and loads meanwhile)
            self.spawn(0, [])
            first = self.addrs[0] = wait_for_line(self.logs[0], self.procs[0], "listening on", prefix="listening on ")
            for i in range(1, self.n):
                self.spawn(i, [first])
            for i in range(self.n):
                self.wait_ready(i)
        else:
            first = self.start_peer(0, [])
            for i in range(1, self.n):
                self.start_peer(i, [first])
        return self.addrs

    def stop(self, i: int | None = None, sig: int = signal.SIGINT, timeout: float = 30.0) -> None:
        targets = range(len(self.procs)) if i is None else [i]
        for j in targets:
            if self.procs[j].poll() is None:
                self.procs[j].send_signal(sig)
        for j in targets:
            try:
                self.procs[j].wait(timeout)
            except subprocess.TimeoutExpired:
                self.procs[j].kill()
                self.procs[j].wait()

    def command(self, i: int, line: str) -> None:
        """Send peer i an operator command (peer/cli/control.py); its reply goes to its log."""
        assert self.control, "LocalSwarm(control=True) gives peers a command pipe"
        self.procs[i].stdin.write((line + "\n").encode())
        self.procs[i].stdin.flush()

    def kill(self, i: int) -> None:
        self.procs[i].kill()
        self.procs[i].wait()

    def log(self, i: int) -> str:
        return self.logs[i].read_text()

    def __enter__(self) -> "LocalSwarm":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_for_line(log: Path, proc: subprocess.Popen, ready: str, *, prefix: str) -> str:
    """Wait until `ready` appears in the log; return the word after `prefix` on its line
    ("listening on ADDR  (loopback: ...)" -> ADDR)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if ready in text:
            line = next(l for l in text.splitlines() if l.startswith(prefix))
            rest = line[len(prefix):].split()
            return rest[0] if rest else ""
        if proc.poll() is not None:
            raise PeerError(f"peer exited with status {proc.returncode}:\n{text[-2000:]}")
        time.sleep(0.1)
    proc.kill()
    raise PeerError(f"peer not ready after {STARTUP_TIMEOUT} s:\n{log.read_text()[-2000:]}")


def memory_for_layers(model: str, layers: int) -> float:
    """GB of --memory under which placement claims about `layers` layers of `model`."""
    spec = spec_from_file(registry.resolve(model) / "config.json")
    return (layers + 0.5) * spec.max_layer_bytes(4) / (1 - KV_RESERVE_FRACTION) / 2**30


def run_demo(*, prompt: str, peers: int, model: str, max_tokens: int) -> int:
    spec = spec_from_file(registry.resolve(model) / "config.json")
    share = math.ceil(spec.num_layers / peers)
    memory = f"{memory_for_layers(model, share):.4f}"
    print(f"starting {peers} peers on 127.0.0.1, each offering memory for ~{share} of {spec.num_layers} layers")
    # the demo answers one prompt: compiling each peer's decode steps would take longer than it saves
    swarm = LocalSwarm(peers, model=model, extra_args=[["--memory", memory, "--compile", "off"] for _ in range(peers)])
    try:
        for i in range(peers):
            addr = swarm.start_peer(i, swarm.addrs[:1])
            span = next(l for l in swarm.log(i).splitlines() if l.startswith("serving layers"))
            print(f"  peer{i} {addr.split('/p2p/')[1][-8:]}: {span}")
        trio.run(_ask, swarm.addrs[:1], model, prompt, max_tokens)
    finally:
        print("stopping the peers")
        swarm.stop()
    return 0


async def _ask(join: list[str], model: str, prompt: str, max_tokens: int) -> None:
    async with Swarm.join(join, model=model) as swarm:
        await swarm.wait_for_route(60.0)
        print(f"\n> {prompt}\n")
        info: dict = {}
        started = time.perf_counter()
        count = 0
        async for piece in swarm.generate(prompt, max_tokens=max_tokens, info=info):
            print(piece.text, end="", flush=True)
            count += 1
        seconds = time.perf_counter() - started
        print(f"\n\n{count} tokens in {seconds:.1f} s; route the activations took:")
        print("  requester")
        for hop in info.get("route", []):
            print(f"  -> peer {hop['peer'][-8:]} layers [{hop['start']}, {hop['end']})")
        print("  -> requester")
