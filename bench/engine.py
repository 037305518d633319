"""Decode speed of this engine, eager and compiled, against transformers and this machine's memory bound.

All three decode greedily from the same 37-token chat prompt; rounds alternate (eager,
compiled, transformers, the bandwidth, eager, ...) so that machine noise hits them alike. A
decode step reads every weight once (the layers, the final norm and the head; a tied head and
embedding once), so this machine's bound is those bytes / the bandwidth of a matrix-vector
product measured here at the same threads: the best of torch's F.linear and of the compiled
step's reduction (engine/compiled/forms.py), each timed over one pass through a ring of 256 MB
float32 matrices (8192 x 8192 and 16384 x 4096) at least RING_OVER_CACHE times the last-level
cache and 1 GiB, so that no matrix is still cached when it is read again (a server core's L3
can hold hundreds of MB: one 256 MB matrix read five times in a row measured the cache, not the
memory), in huge pages as a span's weights are (engine/residency.py). The bandwidth is measured
in every round, beside the decodes, and the fraction is taken within each round: tokens/s x
bytes per token / that round's bandwidth; the median over rounds is printed.

The machine, the instruction sets, each configuration's rounds (min / median / max) and what
other processes did meanwhile (bench/rounds.py) are printed before the figures; the fractions
are not printed when a configuration's rounds spread over 15% or other processes kept the
cores busy (one line says why instead).

    .venv/bin/python bench/engine.py [--threads 1] [--tokens 48] [--rounds 5] [--compile auto]
                                     [--clock wall|thread] [--no-transformers]

`--clock thread` times with the thread's CPU clock instead of the wall clock (one thread
only: at one torch thread all compute runs on the calling thread): on a machine shared with
other busy processes it leaves out the time this one waited for a core, which the memory
bound's own measurement leaves out too. The last line reads
`memory-bound fraction: eager 0.39, compiled 0.74` (or `memory-bound fraction: not printed: ...`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from rounds import CoreWatch, figure_line, last_level_cache_bytes, machine_lines, refusal, spread_line, watch_line

from tessera.stages.engine.compiled.build import compile_decode
from tessera.stages.engine.compiled.forms import rows_linear
from tessera.stages.engine.residency import settled
from tessera.stages.engine.stage import Stage
from tessera.stages.assembly.stage import load_stage
from tessera.stages.text.tokenizer import Tokenizer
from tessera.stages.weights import registry

BANDWIDTH_SHAPES = ((8192, 8192), (16384, 4096))  # 256 MB each in float32, taken in turn around the ring
RING_OVER_CACHE = 2.5  # the ring's bytes over the last-level cache's (and at least RING_MIN_BYTES)
RING_MIN_BYTES = 1 << 30


def ours_decode(stage: Stage, ids: list[int], n: int, clock: Callable[[], float]) -> float:
    """Greedy decode of n tokens after the prompt, as the local engine runs it (Stage.next_token:
    embedding, layers, final norm, head and argmax; one compiled graph where compiled)."""
    stage.open("bench", capacity=len(ids) + n + 1)
    _, token = stage.next_token("bench", ids, 0)
    pos = len(ids)
    started = clock()
    for _ in range(n):
        _, token = stage.next_token("bench", [token], pos)
        pos += 1
    elapsed = clock() - started
    stage.close("bench")
    return n / elapsed


def hf_decode(model, ids: list[int], n: int, clock: Callable[[], float]) -> float:
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
        cache, token = out.cache, out.logits[0, -1].argmax()
        started = clock()
        for _ in range(n):
            out = model(token.view(1, 1), cache=cache, use_cache=True)
            cache, token = out.cache, out.logits[0, -1].argmax()
        return n / (clock() - started)


def step_bytes(stage: Stage) -> int:
    """Bytes of weights a decode step reads: every layer's, the final norm and the head (the
    embedding contributes one row; a tied head is the embedding, counted once)."""
    blocks = sum(p.nbytes for p in stage.blocks.parameters()) + sum(b.nbytes for b in stage.blocks.buffers())
    return blocks + sum(t.nbytes for t in (stage.norm, stage.head) if t is not None)


class Bandwidth:
    """The matrix-vector bandwidth of this machine (module docstring): a ring of matrices past the
    cache, and the kernels timed over it; `measure()` is one round's figure."""

    def __init__(self, clock: Callable[[], float], compiled: bool) -> None:
        self.clock = clock
        cache = last_level_cache_bytes() or 0
        ring_bytes = max(RING_MIN_BYTES, int(RING_OVER_CACHE * cache))
        gen = torch.Generator().manual_seed(0)
        shapes, total = [], 0
        while total < ring_bytes:
            rows, cols = BANDWIDTH_SHAPES[len(shapes) % len(BANDWIDTH_SHAPES)]
            shapes.append((rows, cols))
            total += rows * cols * 4
        self.ring = settled([torch.randn(rows, cols, generator=gen) for rows, cols in shapes])
        self.bytes = total
        self.inputs = {cols: torch.randn(1, cols, generator=gen) for _, cols in BANDWIDTH_SHAPES}
        self.kernels: dict[str, Callable] = {"F.linear": F.linear}
        if compiled:
            self.kernels["compiled reduction"] = torch.compile(lambda x, w: rows_linear(x, w, None))
        self.rates: dict[str, list[float]] = {name: [] for name in self.kernels}
        self.measure(record=False)  # warm-up (and the compile)

    def measure(self, record: bool = True) -> float:
        """One pass around the ring per kernel; the best kernel's bytes/s."""
        best = 0.0
        with torch.inference_mode():
            for name, kernel in self.kernels.items():
                started = self.clock()
                for weight in self.ring:
                    kernel(self.inputs[weight.shape[1]], weight)
                rate = self.bytes / (self.clock() - started)
                if record:
                    self.rates[name].append(rate)
                best = max(best, rate)
        return best

    def describe(self) -> str:
        best = max(self.rates, key=lambda name: statistics.median(self.rates[name]))
        return (f"{best}, a ring of {len(self.ring)} matrices, {self.bytes / 2**30:.2f} GiB; "
                + ", ".join(f"{name} {statistics.median(v) / 1e9:.1f}" for name, v in self.rates.items()) + " GB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compile", default="auto", choices=("auto", "inductor"),
                        help="the compiled engine's --compile (default auto)")
    parser.add_argument("--clock", default="wall", choices=("wall", "thread"))
    parser.add_argument("--no-transformers", action="store_true", help="leave transformers out of the rounds")
    args = parser.parse_args()
    if args.clock == "thread" and args.threads != 1:
        parser.error("--clock thread measures one thread's CPU time: use it with --threads 1")
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    folder = registry.resolve(args.model)
    ids = Tokenizer.from_folder(folder).encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    eager = load_stage(folder, embed=True, head=True)
    compiled = load_stage(folder, embed=True, head=True)
    started = time.perf_counter()
    # as the local engine compiles its stage (`LocalEngine`): the whole one-token step one graph where it can be
    plan = compile_decode(compiled, args.compile, say=lambda line: print(line, end="\r", flush=True), whole=True)
    print(f"\ncompiled decode: {plan.backend or 'none'} ({plan.reason}), {time.perf_counter() - started:.0f} s")
    runs: dict[str, Callable[[], float]] = {
        "eager": lambda: ours_decode(eager, ids, args.tokens, clock),
        "compiled": lambda: ours_decode(compiled, ids, args.tokens, clock),
    }
    if not args.no_transformers:
        os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF conversion bar
        import transformers

        transformers.logging.set_verbosity_error()
        gguf = folder / "source.gguf"
        kwargs = {"gguf_file": gguf.name} if gguf.exists() else {}
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **kwargs)
        hf.requires_grad_(False)
        runs["transformers"] = lambda: hf_decode(hf, ids, args.tokens, clock)
    bandwidth = Bandwidth(clock, plan.backend is not None)
    for run in runs.values():  # warm-up
        run()
    per_token = step_bytes(eager)
    rates: dict[str, list[float]] = {name: [] for name in runs}
    bounds: list[float] = []  # each round's memory bound, tok/s
    with CoreWatch() as watch:
        for r in range(args.rounds):
            for name, run in runs.items():
                rates[name].append(run())
            bounds.append(bandwidth.measure() / per_token)
            print(f"round {r}: " + ", ".join(f"{name} {v[-1]:.2f} tok/s" for name, v in rates.items())
                  + f", memory bound {bounds[-1]:.1f} tok/s", flush=True)
    fractions = {name: [rate / bound for rate, bound in zip(v, bounds)] for name, v in rates.items()}
    median = {name: statistics.median(v) for name, v in rates.items()}
    fraction = {name: statistics.median(v) for name, v in fractions.items()}
    for line in machine_lines(args.threads):
        print(line)
    print(f"threads: {args.threads}, dtype: float32, tokens per round: {args.tokens}, rounds: {args.rounds}, "
          f"clock: {args.clock}")
    for name, v in rates.items():
        print(spread_line(name, v, "tok/s"))
    print(spread_line("memory bound", bounds, "tok/s", 1))
    print(watch_line(watch))
    bound = statistics.median(bounds)
    print(f"weights read per token: {per_token / 1e6:.0f} MB; matrix-vector bandwidth: "
          f"{bound * per_token / 1e9:.1f} GB/s ({bandwidth.describe()}); memory bound: {bound:.1f} tok/s")
    for name, rate in median.items():
        print(f"{name} decode: {rate:.2f} tok/s ({fraction[name]:.2f} of the memory bound)")
    reason = refusal({**rates, "memory bound": bounds}, watch.others)
    if "transformers" in median:
        print(figure_line("engine/transformers decode ratio",
                          f"eager {median['eager'] / median['transformers']:.2f}, "
                          f"compiled {median['compiled'] / median['transformers']:.2f}", reason))
    print(figure_line("memory-bound fraction", f"eager {fraction['eager']:.2f}, compiled {fraction['compiled']:.2f}",
                      reason))


if __name__ == "__main__":
    main()
