"""Weights from peers on loopback: fetch throughput from 1, 2 and 3 holders vs a raw file copy,
and the time from join to first served token for a peer that starts with no files.

1. Throughput. Three `tessera peer` processes hold SmolLM2-135M (each serves one layer, so
   loading is quick; every one holds the whole folder on disk). This process runs a
   fetcher over its own libp2p host and fetches layers [0, L) (default 10, ~142 MB) into
   an empty folder from the first k holders, k = 1, 2, 3 (each run from scratch), and
   copies the same bytes with a raw read + write + fsync (the floor nothing beats).
   Then the same with every holder's upload capped at `--uplink-mbps` (a volunteer's
   uplink: the case that parallel fetching is for). Unlimited, on one machine, the
   fetcher's own CPU bounds the rate and more holders cannot add much; capped, the
   rate should grow with the holders until the fetcher's CPU binds again.
2. Join to first token. One holder serves [0, 15); a newcomer with an empty
   TESSERA_MODELS joins it, is forced to [15, 30), fetches those layers, loads and
   serves; a requester waiting on the swarm times its first token. The goal: the
   first token within the download time + 10 s (the download time is read from the
   newcomer's last progress line).

    .venv/bin/python bench/weights.py [--layers 10] [--rounds 1] [--uplink-mbps 15]

Ratios last. On a shared, loaded machine absolute MB/s mean little; the ratios, measured
side by side in one run, are the figures. The CPU seconds each side spends per 100 MB say
which end bounds the rate (py-libp2p's Noise and yamux run in Python): with fewer free
cores than processes, more holders cannot add speed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import trio

from tessera.peer.cli.demo import LocalSwarm, wait_for_line
from tessera.peer.net.libp2p import open_libp2p_transport
from tessera.peer.request.client import Swarm
from tessera.peer.weights.bootstrap import bootstrap_model
from tessera.peer.weights.fetcher import Fetcher
from tessera.stages.weights import registry
from tessera.stages.decoding.generate import prompt_ids

MODEL = "smollm2-135m"


def cpu_seconds(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def raw_copy_rate(folder: Path, names: list[str], manifest: dict) -> float:
    """Bytes/s of reading those tensors' bytes from the file and writing them to a new file, fsynced."""
    entries = manifest["tensors"]["entries"]
    data_at, _ = registry.read_header(folder / "model.safetensors")
    total = 0
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        with open(folder / "model.safetensors", "rb") as src, open(Path(tmp) / "copy", "wb") as dst:
            for name in names:
                e = entries[name]
                src.seek(data_at + e["begin"])
                left = e["end"] - e["begin"]
                while left:
                    data = src.read(min(1 << 20, left))
                    dst.write(data)
                    left -= len(data)
                    total += len(data)
            dst.flush()
            os.fsync(dst.fileno())
        return total / (time.perf_counter() - started)


async def fetch_rate(addrs: list[str], layers: int) -> tuple[float, dict[str, int]]:
    """Bytes/s of fetching layers [0, layers) from the holders at `addrs` into an empty folder."""
    with tempfile.TemporaryDirectory() as tmp:
        async with open_libp2p_transport(os.urandom(32), relay=False) as transport:
            peers = [await transport.connect(a) for a in addrs]
            folder = await bootstrap_model(transport, peers, MODEL, Path(tmp))
            fetcher = Fetcher(transport, folder, registry.read_manifest(folder))
            started = trio.current_time()
            progress = await fetcher.fetch_groups(peers, {f"layer.{i}" for i in range(layers)}, label="bench")
            return progress.total / (trio.current_time() - started), progress.by_peer


async def first_token(holder: str, base: Path) -> tuple[float, float]:
    """(seconds from starting a file-less newcomer to the first token through it, its download seconds)."""
    log = base / "newcomer.log"
    cmd = [sys.executable, "-m", "tessera.peer.cli.main", "peer", "--model", MODEL, "--name", "newcomer",
           "--data-dir", str(base / "data"), "--threads", "1", "--layers", "15:30", "--join", holder]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TESSERA_MODELS": str(base / "models")}
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    try:
        async with Swarm.join([holder]) as swarm:
            await swarm.wait_for_route(300)
            ids = prompt_ids(swarm.tokenizer, "What is the capital of France?", raw=False)
            async for _ in swarm.generate_ids(ids, max_new_tokens=1):
                break
        elapsed = time.perf_counter() - started
        wait_for_line(log, proc, "serving layers", prefix="listening on ")
        line = re.search(r"fetching layers \[15, 30\): ([\d.]+)/[\d.]+ MB \(100%\), ([\d.]+) MB/s", log.read_text())
        download = float(line.group(1)) / float(line.group(2)) if line and float(line.group(2)) > 0 else float("nan")
        return elapsed, download
    finally:
        proc.terminate()
        proc.wait(30)


def holder_runs(args: argparse.Namespace, folder: Path, names: list[str], manifest: dict, *,
                uplink: float) -> tuple[dict[int, list[float]], list[float]]:
    """Fetch rates from 1, 2 and 3 holders (each uploading at most `uplink` MB/s; 0: unlimited),
    and the raw copy rates, per round."""
    cap = ["--weights-upload-mbps", str(uplink)] if uplink > 0 else []
    swarm = LocalSwarm(3, model=MODEL, extra_args=[["--layers", f"{i}:{i + 1}", *cap] for i in range(3)])
    rates: dict[int, list[float]] = {1: [], 2: [], 3: []}
    raw: list[float] = []
    what = f"capped at {uplink:g} MB/s each" if uplink > 0 else "unlimited"
    try:
        swarm.start(together=True)
        for _ in range(args.rounds):
            raw.append(raw_copy_rate(folder, names, manifest))
            for k in (1, 2, 3):
                holder_cpu = sum(cpu_seconds(p.pid) for p in swarm.procs[:k])
                cpu = time.process_time()
                rate, by_peer = trio.run(fetch_rate, swarm.addrs[:k], args.layers)
                cpu = time.process_time() - cpu
                holder_cpu = sum(cpu_seconds(p.pid) for p in swarm.procs[:k]) - holder_cpu
                rates[k].append(rate)
                mb = sum(by_peer.values()) / 1e6
                share = ", ".join(f"{v / 1e6:.0f}" for v in by_peer.values())
                print(f"fetch from {k} holder{'s' if k > 1 else ''} ({what}): {rate / 1e6:.1f} MB/s "
                      f"(MB per holder: {share}); CPU per 100 MB: fetcher {100 * cpu / mb:.1f} s, "
                      f"holders {100 * holder_cpu / mb:.1f} s")
            print(f"raw copy: {raw[-1] / 1e6:.1f} MB/s")
    finally:
        swarm.stop(timeout=15)
    return rates, raw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=10, help="fetch layers [0, L) in the throughput runs")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--skip-first-token", action="store_true")
    parser.add_argument("--uplink-mbps", type=float, default=15.0,
                        help="each holder's upload cap (MB/s) in the capped runs; 0 skips them")
    args = parser.parse_args()
    folder = registry.resolve(MODEL)
    manifest = registry.read_manifest(folder)
    names = [n for n, e in manifest["tensors"]["entries"].items()
             if e["group"] in {f"layer.{i}" for i in range(args.layers)}]

    rates, raw = holder_runs(args, folder, names, manifest, uplink=0.0)
    capped = holder_runs(args, folder, names, manifest, uplink=args.uplink_mbps)[0] if args.uplink_mbps > 0 else {}

    first = download = float("nan")
    if not args.skip_first_token:
        holder = LocalSwarm(1, model=MODEL, extra_args=[["--layers", "0:15"]])
        base = Path(tempfile.mkdtemp(prefix="tessera-weights-bench-"))
        try:
            holder.start()
            first, download = trio.run(first_token, holder.addrs[0], base)
        finally:
            holder.stop(timeout=15)
            shutil.rmtree(base, ignore_errors=True)
        print(f"join to first token: {first:.1f} s, of which downloading 15 layers: {download:.1f} s")

    best = {k: max(v) for k, v in rates.items()}
    print("(measured on a shared, loaded machine: read the ratios, not the MB/s)")
    print(f"2 holders / 1 holder: {best[2] / best[1]:.2f} (goal >= 1.7)")
    print(f"3 holders / 1 holder: {best[3] / best[1]:.2f}")
    print(f"fetch from 2 holders / raw copy: {best[2] / max(raw):.2f} (goal >= 0.5)")
    if capped:
        top = {k: max(v) for k, v in capped.items()}
        print(f"uplinks capped at {args.uplink_mbps:g} MB/s: 2 holders / 1 holder: {top[2] / top[1]:.2f}, "
              f"3 holders / 1 holder: {top[3] / top[1]:.2f} ({top[1] / 1e6:.1f}, {top[2] / 1e6:.1f}, "
              f"{top[3] / 1e6:.1f} MB/s)")
    if not args.skip_first_token:
        print(f"first token - download: {first - download:.1f} s (goal <= 10)")


if __name__ == "__main__":
    main()
