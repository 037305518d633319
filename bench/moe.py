"""What a mixture of experts costs a peer: decode time that follows the active parameters, and
memory that is the weights and the KV cache.

1. Decode: one decoder layer at Qwen3-30B-A3B's shape (hidden 2048, 32 query and 4 KV heads of
   128, an MoE MLP of 128 experts of width 768, top-8), one token a step after a context of
   `--context` positions, against the same layer with a dense SwiGLU of the same active
   parameters (width 8 x 768 = 6144: what Qwen3-30B-A3B's dense layers have). Each step's input
   is a fresh random row, so each step routes to other experts (as real decoding does: the
   weights it reads are not the last step's). The MLPs alone as well. One thread, rounds
   alternating, medians; every MoE step is checked exact against its reference sum
   (tests/stages/test_layer_kinds.py's definition) on the last round's first step.
2. Memory: a span of each family's published shape (stages/families/shapes.py, trimmed by
   layers and experts to fit a small machine: the per-layer matrices keep their real sizes), in a
   fresh process: resident bytes held after loading it, opening a session of `--capacity`
   positions and running a prefill and decode steps (anonymous pages plus weight-file pages, no
   huge pages: tests/resident.py), against the bytes its layers hold (`span_bytes`) plus the
   session's KV cache (`session_bytes`).

Prints the ratios last:

    moe/dense decode ratio (layer): 1.05
    moe/dense decode ratio (mlp): 1.08
    span memory / (weights + KV): llama 1.01, qwen3 1.01, qwen3_moe 1.02, mixtral 1.01, gpt_oss 1.02, glm_moe_dsa 1.04

Run:  .venv/bin/python bench/moe.py [--rounds 5] [--steps 32] [--context 256] [--no-memory]
(needs ~3 GiB of memory for the decode part and ~1.6 GiB per family for the memory part, and
~4 GiB of disk under --scratch for the synthetic spans).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from tessera.stages.families.shapes import shape_spec
from tessera.stages.families.spec.attention import AttentionSpec
from tessera.stages.families.spec.layer import LayerSpec
from tessera.stages.families.spec.mlp import MlpSpec, RouterSpec
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.families.spec.rope import RopeSpec
from tessera.stages.layers.attention import StepContext
from tessera.stages.layers.block import Block
from tessera.stages.layers.cache import SessionCache
from tessera.stages.layers.moe import MoE
from tessera.stages.layers.rope import RopeTables

ROOT = Path(__file__).resolve().parent.parent
HIDDEN, EXPERTS, TOP_K, WIDTH = 2048, 128, 8, 768  # Qwen3-30B-A3B
ATTENTION = AttentionSpec(32, 4, 128, RopeSpec("default", 1e6), qk_norm=True)
MOE_LAYER = LayerSpec(ATTENTION, MlpSpec(WIDTH, "moe", EXPERTS, RouterSpec("softmax_topk", TOP_K, True)))
DENSE_LAYER = LayerSpec(ATTENTION, MlpSpec(TOP_K * WIDTH))
# family -> (shape, layers, experts kept): real per-layer matrices, a span a small machine holds
SPANS = {
    "llama": ("llama-3-8b", 2, None),
    "qwen3": ("qwen3-8b", 2, None),
    "qwen3_moe": ("qwen3-30b-a3b", 2, 32),
    "mixtral": ("mixtral-8x7b", 1, 2),
    "gpt_oss": ("gpt-oss-20b", 2, 4),
    "glm_moe_dsa": ("glm-5", 1, None),  # its first layer (dense MLP): 1.5 GiB; DSA with its index-key cache
}


def random_block(spec: ModelSpec, layer: LayerSpec, seed: int) -> Block:
    torch.manual_seed(seed)
    block = Block(spec, layer)
    with torch.no_grad():
        for name, p in block.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.02 * torch.randn_like(p))
    return block.requires_grad_(False).eval()


def decode_seconds(block: Block, spec: ModelSpec, rows: torch.Tensor, context: int, mlp_only: bool) -> float:
    """Seconds per one-token step over `rows` [steps, H] (each its own step), after `context` positions."""
    cache = SessionCache([block.layer.cache], context + rows.shape[0] + 1)
    rope = RopeTables([block.layer])
    with torch.inference_mode():
        prefill = torch.randn(context, spec.hidden_size) * 0.5
        cache.reserve(0, context)
        ctx = StepContext(0, rope.tables(torch.arange(context), torch.float32), torch.device("cpu"))
        block.forward(prefill, ctx, cache.layers[0])
        started = time.perf_counter()
        for i in range(rows.shape[0]):
            x = rows[i : i + 1]
            if mlp_only:
                block.mlp.forward(x)
                continue
            pos = context + i
            cache.reserve(pos, 1)
            ctx = StepContext(pos, rope.tables(torch.tensor([pos]), torch.float32), torch.device("cpu"))
            block.forward(x, ctx, cache.layers[0])
        return (time.perf_counter() - started) / rows.shape[0]


def check_exact(moe: MoE, x: torch.Tensor) -> None:
    """The sparse MLP's row against the reference sum over its picked experts, in increasing expert order."""
    with torch.inference_mode():
        weights, picks = moe.router.forward(x)
        order = picks[0].argsort()
        want = torch.zeros_like(x)
        for j in order.tolist():
            want += moe.experts[int(picks[0, j])].forward(x) * weights[0, j]
        got = moe.forward(x)
    assert torch.equal(got, want), float((got - want).abs().max())


def decode_figures(args: argparse.Namespace) -> list[str]:
    spec = ModelSpec("qwen3_moe", 1000, HIDDEN, (MOE_LAYER, DENSE_LAYER))
    blocks = {"moe": random_block(spec, MOE_LAYER, 1), "dense": random_block(spec, DENSE_LAYER, 2)}
    moe_params = sum(p.numel() for p in blocks["moe"].mlp.parameters())
    active = TOP_K * 3 * HIDDEN * WIDTH
    print(f"MoE MLP: {moe_params / 1e6:.0f}M parameters, {active / 1e6:.1f}M active a token "
          f"(+{EXPERTS * HIDDEN / 1e6:.2f}M router); dense MLP: "
          f"{sum(p.numel() for p in blocks['dense'].mlp.parameters()) / 1e6:.1f}M")
    gen = torch.Generator().manual_seed(3)
    times: dict[tuple[str, bool], list[float]] = {(k, m): [] for k in blocks for m in (False, True)}
    for r in range(args.rounds + 1):  # round 0 warms up
        rows = torch.randn(args.steps, HIDDEN, generator=gen)
        for mlp_only in (False, True):
            for kind, block in blocks.items():
                seconds = decode_seconds(block, spec, rows, args.context, mlp_only)
                if r:
                    times[(kind, mlp_only)].append(seconds)
        if r:
            print(f"round {r}: " + ", ".join(f"{k}{' mlp' if m else ''} {v[-1] * 1e3:.2f} ms" for (k, m), v in times.items()))
    check_exact(blocks["moe"].mlp, rows[:1])
    med = {key: statistics.median(v) for key, v in times.items()}
    return [f"moe/dense decode ratio ({'mlp' if mlp_only else 'layer'}): "
            f"{med[('moe', mlp_only)] / med[('dense', mlp_only)]:.2f}" for mlp_only in (False, True)]


SPAN_RSS = """
import gc, json, sys, torch
from pathlib import Path
from tessera.stages.assembly.stage import load_stage
from tessera.stages.kernels.quant import span_bytes
from tests.resident import held_bytes, no_huge_pages
no_huge_pages()
torch.set_num_threads(1)
folder, capacity = Path(sys.argv[1]), int(sys.argv[2])
warm = load_stage(folder, start=0, end=1)
warm.open("w", capacity=4)
warm.forward("w", torch.zeros(3, warm.spec.hidden_size), 0)  # torch's lazy set-up, not the span
warm.forward("w", torch.zeros(1, warm.spec.hidden_size), 3)
del warm
gc.collect()
before = held_bytes()
stage = load_stage(folder)
stage.open("s", capacity=capacity)
gen = torch.Generator().manual_seed(0)
stage.forward("s", torch.randn(capacity // 2, stage.spec.hidden_size, generator=gen), 0)
for pos in range(capacity // 2, capacity // 2 + 8):
    stage.forward("s", torch.randn(1, stage.spec.hidden_size, generator=gen), pos)
gc.collect()
held = held_bytes() - before
print(json.dumps({"held": held, "weights": span_bytes(stage.spec, 0, stage.spec.num_layers, 4),
                  "kv": stage.session_bytes(capacity), "stage_weights": stage.weight_bytes}))
"""


def memory_figures(args: argparse.Namespace) -> list[str]:
    from tessera.stages.weights.synth import synth_ids, write_synth

    ratios = {}
    with tempfile.TemporaryDirectory(dir=args.scratch) as tmp:
        for family, (shape, layers, experts) in SPANS.items():
            spec = synth_ids(shape_spec(shape, layers=layers, experts=experts, vocab=1000))
            folder = Path(tmp) / family
            write_synth(spec, folder, seed=1)
            done = subprocess.run([sys.executable, "-c", SPAN_RSS, str(folder), str(args.capacity)],
                                  capture_output=True, text=True, cwd=ROOT, timeout=1800)
            if done.returncode:
                raise SystemExit(f"{family}: the span's process failed:\n{done.stderr}")
            got = json.loads(done.stdout.strip().splitlines()[-1])
            assert got["stage_weights"] == got["weights"], got  # what placement counts is what the span holds
            ratios[family] = got["held"] / (got["weights"] + got["kv"])
            print(f"{family} ({shape}, {layers} layers{f', {experts} experts' if experts else ''}): "
                  f"held {got['held'] / 2**20:.0f} MiB, weights {got['weights'] / 2**20:.0f} MiB, "
                  f"KV {got['kv'] / 2**20:.1f} MiB ({args.capacity} positions)")
            for path in folder.iterdir():
                path.unlink()
    return ["span memory / (weights + KV): " + ", ".join(f"{f} {r:.2f}" for f, r in ratios.items())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds, alternating MoE and dense (default 5)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps a round (default 32)")
    parser.add_argument("--context", type=int, default=256, help="positions in the cache before decoding (256)")
    parser.add_argument("--capacity", type=int, default=512, help="positions of the memory part's session (512)")
    parser.add_argument("--scratch", default=None, help="where the memory part writes its synthetic spans")
    parser.add_argument("--no-memory", action="store_true", help="only the decode part")
    parser.add_argument("--no-decode", action="store_true", help="only the memory part")
    args = parser.parse_args()
    torch.set_num_threads(1)
    last = [] if args.no_decode else decode_figures(args)
    if not args.no_memory:
        last += memory_figures(args)
    print(f"threads: 1, rounds: {args.rounds}, steps a round: {args.steps}, context: {args.context}")
    for line in last:
        print(line)


if __name__ == "__main__":
    main()
