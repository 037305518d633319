"""One GGUF matrix's compiled one-row product, per block type, against float32's: the kernel alone.

    .venv/bin/python bench/matrix.py [--types Q4_0,IQ4_NL,MXFP4] [--rows 2816 --cols 1024] [--rounds 7]

A decode step multiplies one row of activations by each matrix; under torch.compile a GGUF matrix is
a fused product over its stored blocks (stages/kernels/ggml/linear.py `fused_rows`). This times that
product for random blocks of each type (stages/kernels/encode.py `random_ggml`; the time does not
depend on the values), compiled as a decode step compiles it, one torch thread, against float32's
compiled x @ W^T of the same shape, rounds alternating. It is the kernel alone: the matrix and its
inputs stay in the caches where they fit (a 2816 x 1024 float32 matrix is 11.5 MB), so float32 is
faster here than inside a span, and a kernel's figure here is not a span's (bench/shipped.py measures
spans; a product that wins alone can lose inside a layer's graph: ggml/k_lanes.py has such a case).
Each product is checked against the dequantized weight's before it is timed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from rounds import CoreWatch, figure_line, machine_lines, refusal, spread_line, watch_line

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tessera.stages.engine.compiled.inductor import REALIZE_READS, RECOMPILE_LIMIT  # noqa: E402
from tessera.stages.families.shipped import GGML_TYPES  # noqa: E402
from tessera.stages.kernels.encode import random_ggml  # noqa: E402
from tessera.stages.kernels.ggml.linear import GgmlLinear  # noqa: E402

TYPES = "Q8_0,Q4_0,Q4_1,Q4_K,Q5_K,Q6_K,Q2_K,Q3_K,IQ4_NL,IQ4_XS,MXFP4,NVFP4"
CALLS = 100  # products a round times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", default=TYPES)
    parser.add_argument("--rows", type=int, default=2816)
    parser.add_argument("--cols", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    # as a decode step compiles (stages/engine/compiled/inductor.py): one lambda's code holds a graph per
    # type (a recompile each), and a cheap result read by several loops is realised once
    with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT), \
            torch._inductor.config.patch(realize_reads_threshold=REALIZE_READS), torch.inference_mode():
        measure(args)


def measure(args: argparse.Namespace) -> None:
    for line in machine_lines(1):
        print(line)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, args.cols, generator=gen)
    products = {"float32": (torch.compile(lambda x, w: x @ w.T, dynamic=False), (torch.randn(args.rows, args.cols) * 0.02,))}
    for name in args.types.split(","):
        kind = GGML_TYPES[name]
        matrix = GgmlLinear(random_ggml(kind, args.rows, args.cols, std=0.02, gen=gen), kind, args.cols, None)
        stored = matrix.fused_inputs()
        product = torch.compile(lambda x, *s, m=matrix: m.fused_rows(x, *s), dynamic=False)
        want = x @ matrix.dequantized().T
        error = float((product(x, *stored) - want).abs().max() / want.abs().max())
        assert error <= 1e-5, f"{name}: the product is {error:.1e} off the dequantized weight's"
        products[f"gguf {name}"] = (product, stored)
    for product, inputs in products.values():  # compiled and warm before the first round
        for _ in range(5):
            product(x, *inputs)
    rounds: dict[str, list[float]] = {name: [] for name in products}
    with CoreWatch() as watch:
        for _ in range(args.rounds):
            for name, (product, inputs) in products.items():
                started = time.perf_counter()
                for _ in range(CALLS):
                    product(x, *inputs)
                rounds[name].append((time.perf_counter() - started) / CALLS * 1e3)
    for name, values in rounds.items():
        print(spread_line(name, values, "ms", digits=3))
    print(watch_line(watch))
    base = statistics.median(rounds["float32"])
    for name, values in rounds.items():
        if name != "float32":
            reason = refusal({"float32": rounds["float32"], name: values}, watch.others)
            print(figure_line(f"{args.rows} x {args.cols} one-row product vs float32, compiled, {name}",
                              f"{base / statistics.median(values):.2f}x (float32 {base:.3f} ms)", reason))


if __name__ == "__main__":
    main()
