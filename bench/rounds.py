"""What a bench prints beside its figures, so that a figure says where it was measured and whether it holds.

A ratio measured side by side holds only while nothing else moves the machine under it. Rounds of
one configuration that spread widely, or another process busy on the cores (a neighbour slows
memory and shares the caches, not only time slices; the thread clock hides only the slices), mean
the figure says more about the machine than about the code. So every bench that prints a fraction:

- alternates its configurations' rounds in one run (noise hits them alike),
- prints each configuration's rounds as min / median / max (`spread_line`),
- prints the machine (`machine_lines`: the processor, the instruction sets torch's kernels and
  inductor's code use, the BLAS, the last-level cache, the load when it started),
- watches the cores while it measures (`CoreWatch`: every CPU's busy time, hypervisor steal
  included, less this process tree's own CPU time),
- and prints a fraction only when `refusal` finds no reason against it; otherwise one line says
  why (`figure_line`): `memory-bound fraction: not printed: rounds of compiled spread 23% (> 15%)`.

Imported by the scripts beside it (`from rounds import ...`: a script's folder is on its path).
"""

from __future__ import annotations

import os
import platform
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

SPREAD_LIMIT = 0.15  # (max - min) / median of one configuration's rounds (issue 47: "within 15%")
# Cores that other processes kept busy, on average over the measurement. A quiet Linux box idles
# at a few hundredths of a core (daemons, the kernel's own threads); a neighbour spinning on one
# core is 1.0. A fifth of a core already moves a memory-bound figure by several percent here.
OTHERS_LIMIT = 0.2
SAMPLE_EVERY = 0.25  # s between CoreWatch samples (a descendant that exits loses at most this much)


@dataclass(frozen=True)
class Spread:
    """A configuration's rounds: min, median, max, and (max - min) / median."""

    low: float
    median: float
    high: float

    @property
    def fraction(self) -> float:
        return (self.high - self.low) / self.median if self.median else float("inf")


def spread(values: Sequence[float]) -> Spread:
    if not values:
        raise ValueError("no rounds to spread")
    return Spread(min(values), statistics.median(values), max(values))


def refusal(rounds: Mapping[str, Sequence[float]], others: float | None, *,
            spread_limit: float = SPREAD_LIMIT, others_limit: float = OTHERS_LIMIT) -> str | None:
    """Why a figure made of `rounds` (configuration -> its per-round values) must not be printed,
    or None when nothing speaks against it. `others`: the cores other processes kept busy meanwhile
    (CoreWatch.others; None when it could not be read). The widest spread is named."""
    if others is not None and others > others_limit:
        return f"other processes kept {others:.2f} cores busy (> {others_limit:g})"
    widest = max(((spread(v).fraction, name) for name, v in rounds.items() if v), default=None)
    if widest is not None and widest[0] > spread_limit:
        return f"rounds of {widest[1]} spread {widest[0]:.0%} (> {spread_limit:.0%})"
    return None


def figure_line(label: str, text: str, reason: str | None) -> str:
    """`label: text`, or `label: not printed: reason`."""
    return f"{label}: {text}" if reason is None else f"{label}: not printed: {reason}"


def spread_line(name: str, values: Sequence[float], unit: str = "", digits: int = 2) -> str:
    """'compiled rounds: min 24.10, median 24.60, max 25.02 tok/s (spread 4%)'."""
    s = spread(values)
    unit = f" {unit}" if unit else ""
    return (f"{name} rounds: min {s.low:.{digits}f}, median {s.median:.{digits}f}, max {s.high:.{digits}f}{unit} "
            f"(spread {s.fraction:.0%}, {len(values)} rounds)")


# -- the machine -------------------------------------------------------------------------------

def processor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def last_level_cache() -> str:
    """'L3 480 MiB' from sysfs (what a matrix must exceed to be read from memory), or 'unknown'."""
    caches = sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"))
    best = None
    for index in caches:
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        if best is None or level > best[0]:
            best = (level, size)
    if best is None:
        return "last-level cache unknown"
    level, size = best
    kib = int(size[:-1]) if size.endswith("K") and size[:-1].isdigit() else None
    return f"L{level} {kib / 1024:.0f} MiB" if kib else f"L{level} {size}"


def last_level_cache_bytes() -> int | None:
    text = last_level_cache()
    try:
        return int(float(text.split()[1]) * 2**20) if text.endswith("MiB") else None
    except (IndexError, ValueError):
        return None


def machine_lines(threads: int | None = None) -> list[str]:
    """The processor, cores, cache and load; torch's kernels' and inductor's instruction sets; the BLAS."""
    import torch

    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else ["?"]
    config = torch.__config__.show()
    blas = next((part.split("=", 1)[1] for line in config.splitlines() for part in line.split(", ")
                 if part.strip().startswith("BLAS_INFO=")), "unknown")
    try:  # the vector ISA inductor writes its C++ for (what the compiled step runs)
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        inductor = str(pick_vec_isa()) or "none (scalar C++)"
    except Exception as bad:  # noqa: BLE001 - a missing compiler is worth a line, not a failure
        inductor = f"unknown ({type(bad).__name__})"
    lines = [f"machine: {processor()}, {os.cpu_count()} logical CPUs, {last_level_cache()}, "
             f"load average at start {' '.join(load)}",
             f"torch {torch.__version__}: kernels {torch.backends.cpu.get_cpu_capability()}, inductor {inductor}, "
             f"BLAS {blas}, mkldnn {torch.backends.mkldnn.is_available()}, threads {threads or torch.get_num_threads()}"]
    return lines


# -- the cores while it ran --------------------------------------------------------------------

class CoreWatch:
    """Cores kept busy by other processes while a `with` block ran (`others`, in cores, averaged).

    Busy = every CPU's time less idle and iowait (steal included: a hypervisor's other guests);
    this process's own = its CPU time and that of every descendant (peers, servers, compilers),
    live ones as last sampled and waited-for ones through their parents' children times."""

    def __init__(self, every: float = SAMPLE_EVERY) -> None:
        self.every = every
        self.others: float | None = None
        self.busiest: float | None = None  # the largest `others` of one sample interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "CoreWatch":
        try:
            import psutil  # noqa: F401 - a dependency of the package; checked here so a bench still runs without
        except ImportError:
            return self
        self._first = self._last = self._sample()
        self._worst = 0.0
        self._thread = threading.Thread(target=self._run, name="core-watch", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        end = self._sample()
        self._interval(self._last, end)
        self.others = others_busy(self._first, end)
        self.busiest = max(self._worst, self.others)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            now = self._sample()
            self._interval(self._last, now)
            self._last = now

    def _interval(self, a: tuple[float, float, float], b: tuple[float, float, float]) -> None:
        self._worst = max(self._worst, others_busy(a, b))

    def _sample(self) -> tuple[float, float, float]:
        """(wall s, every CPU's busy s, this process tree's CPU s)."""
        return time.monotonic(), busy_seconds(), tree_cpu_seconds()


def busy_seconds() -> float:
    """Every CPU's busy time since boot, s: all but idle and iowait (steal counts as busy)."""
    import psutil

    times = psutil.cpu_times()
    total = sum(getattr(times, f) for f in times._fields if f not in ("guest", "guest_nice"))  # guest is in user
    return total - times.idle - getattr(times, "iowait", 0.0)


def tree_cpu_seconds() -> float:
    """CPU time of this process and its descendants, s: each live one's own and its waited-for
    children's (a child waited for adds its whole tree's time to its parent's children times)."""
    import psutil

    me = psutil.Process()
    ours = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        ours += t.user + t.system + t.children_user + t.children_system
    return ours


def others_busy(a: tuple[float, float, float], b: tuple[float, float, float]) -> float:
    """Cores kept busy by others between samples a and b (wall, busy, ours): never below 0."""
    wall = b[0] - a[0]
    if wall <= 0:
        return 0.0
    return max(0.0, ((b[1] - a[1]) - (b[2] - a[2])) / wall)


def watch_line(watch: CoreWatch) -> str:
    if watch.others is None:
        return "other processes: not watched (psutil missing)"
    return (f"other processes while measuring: {watch.others:.2f} cores busy on average "
            f"(the busiest {SAMPLE_EVERY:g} s: {watch.busiest:.2f})")
