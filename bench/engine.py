"""Decode speed of this engine, eager and compiled, against transformers and this machine's memory bound.

All three decode greedily from the same 37-token chat prompt; rounds alternate (eager,
compiled, transformers, eager, ...) so that machine noise hits them alike. A decode step
reads every weight once (the layers, the final norm and the head; a tied head and embedding
once), so this machine's bound is those bytes / the bandwidth of a matrix-vector product
measured here at the same threads: the best of torch's F.linear and of the compiled step's
reduction (engine/compiled/forms.py) over two 256 MB float32 matrices (8192 x 8192 and
16384 x 4096, far past the caches), in huge pages as a span's weights are
(engine/residency.py). The engine's fraction of it is tokens/s x bytes per token / bandwidth.

    .venv/bin/python bench/engine.py [--threads 1] [--tokens 48] [--rounds 5] [--compile auto]
                                     [--clock wall|thread] [--no-transformers]

`--clock thread` times with the thread's CPU clock instead of the wall clock (one thread
only: at one torch thread all compute runs on the calling thread): on a machine shared with
other busy processes it leaves out the time this one waited for a core, which the memory
bound's own measurement leaves out too. The last line reads
`memory-bound fraction: eager 0.39, compiled 0.74`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from tessera.stages.engine.compiled.build import compile_decode
from tessera.stages.engine.compiled.forms import rows_linear
from tessera.stages.engine.residency import settled
from tessera.stages.engine.stage import Stage
from tessera.stages.assembly.stage import load_stage
from tessera.stages.text.tokenizer import Tokenizer
from tessera.stages.weights import registry

BANDWIDTH_SHAPES = ((8192, 8192), (16384, 4096))  # 256 MB each in float32: far past any cache here
BANDWIDTH_REPEATS = 5


def ours_decode(stage: Stage, ids: list[int], n: int, clock: Callable[[], float]) -> float:
    stage.open("bench", capacity=len(ids) + n + 1)
    hidden = stage.forward("bench", stage.embed(ids), 0)
    token, pos = int(stage.logits(hidden[-1:]).argmax()), len(ids)
    started = clock()
    for _ in range(n):
        token = int(stage.logits(stage.forward("bench", stage.embed([token]), pos)).argmax())
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


def matvec_bandwidth(clock: Callable[[], float], compiled: bool) -> tuple[float, str]:
    """The best bytes/s of one row times a large float32 matrix (module docstring), and which kernel gave it."""
    gen = torch.Generator().manual_seed(0)
    reduction = torch.compile(lambda x, w: rows_linear(x, w, None))
    best, how = 0.0, ""
    for rows, cols in BANDWIDTH_SHAPES:
        weight, = settled([torch.randn(rows, cols, generator=gen)])
        x = torch.randn(1, cols, generator=gen)
        kernels = {"F.linear": F.linear}
        if compiled:
            kernels["compiled reduction"] = reduction
        for name, kernel in kernels.items():
            with torch.inference_mode():
                kernel(x, weight)  # warm-up (and the compile)
                for _ in range(BANDWIDTH_REPEATS):
                    started = clock()
                    kernel(x, weight)
                    rate = weight.nbytes / (clock() - started)
                    if rate > best:
                        best, how = rate, f"{name}, {rows} x {cols}"
        del weight
    return best, how


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
    plan = compile_decode(compiled, args.compile, say=lambda line: print(line, end="\r", flush=True))
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
    for run in runs.values():  # warm-up
        run()
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.rounds):
        for name, run in runs.items():
            rates[name].append(run())
        print(f"round {r}: " + ", ".join(f"{name} {v[-1]:.2f} tok/s" for name, v in rates.items()), flush=True)
    bandwidth, how = matvec_bandwidth(clock, plan.backend is not None)
    per_token = step_bytes(eager)
    bound = bandwidth / per_token
    median = {name: statistics.median(v) for name, v in rates.items()}
    print(f"threads: {args.threads}, dtype: float32, tokens per round: {args.tokens}, rounds: {args.rounds}, "
          f"clock: {args.clock}")
    print(f"weights read per token: {per_token / 1e6:.0f} MB; matrix-vector bandwidth: {bandwidth / 1e9:.1f} GB/s "
          f"({how}); memory bound: {bound:.1f} tok/s")
    for name, rate in median.items():
        print(f"{name} decode: {rate:.2f} tok/s ({rate / bound:.2f} of the memory bound)")
    if "transformers" in median:
        print(f"engine/transformers decode ratio: eager {median['eager'] / median['transformers']:.2f}, "
              f"compiled {median['compiled'] / median['transformers']:.2f}")
    print(f"memory-bound fraction: eager {median['eager'] / bound:.2f}, compiled {median['compiled'] / bound:.2f}")


if __name__ == "__main__":
    main()
