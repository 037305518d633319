"""How much a trace event costs the caller, side by side (ratios; absolute times mean little here).

    .venv/bin/python bench/store.py [N]

1. emit cost: TraceWriter.emit (validate + queue) vs NullTracer.emit (validate only).
2. hot-loop slowdown: a pure-Python loop that emits one event per iteration while the
   writer thread commits in the background, vs the same loop with a NullTracer — what the
   GIL-sharing writer thread costs a peer's event loop.
3. writer throughput: events per second the background thread commits.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tessera.store.events import Forward  # noqa: E402
from tessera.store.trace import NullTracer, TraceWriter  # noqa: E402


def emit_loop(tracer, n: int, work: int = 0) -> float:
    start = time.perf_counter()
    for i in range(n):
        for _ in range(work):  # stand-in for a step's Python-side bookkeeping
            pass
        tracer.emit(Forward(session="5e55", step=i, span=(0, 15), duration=0.001, bytes=2304))
    return time.perf_counter() - start


def main(n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        null = min(emit_loop(NullTracer(), n) for _ in range(3))
        with TraceWriter(Path(tmp) / "a.db", peer="bench") as tracer:
            real = min(emit_loop(tracer, n) for _ in range(3))
            start = time.perf_counter()
            tracer.flush()
            drain = time.perf_counter() - start
        null_work = min(emit_loop(NullTracer(), n // 10, work=2000) for _ in range(3))
        with TraceWriter(Path(tmp) / "b.db", peer="bench", flush_interval=0.05) as tracer:
            real_work = min(emit_loop(tracer, n // 10, work=2000) for _ in range(3))
        with TraceWriter(Path(tmp) / "c.db", peer="bench", flush_interval=3600) as tracer:
            emit_loop(tracer, n)
            start = time.perf_counter()
            tracer.flush()
            write_s = time.perf_counter() - start
    print(f"emit: {real / n * 1e6:.2f} us/event (NullTracer {null / n * 1e6:.2f})")
    print(f"queue drained {drain:.3f} s after the last emit")
    print(f"writer throughput: {n / write_s:,.0f} events/s committed")
    print(f"store emit cost ratio (TraceWriter/NullTracer): {real / null:.2f}")
    print(f"store hot-loop slowdown ratio (with writer/without): {real_work / null_work:.2f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100_000)
