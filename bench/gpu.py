"""The checks a CUDA GPU must pass, as one short script (skips with one line without a GPU).

1. Exactness: SmolLM2 on the GPU in float32 (TF32 off), bfloat16 and float16 against the
   CPU float32 oracle, over a prefill and 16 greedy steps. Tolerance: float32 1e-3
   relative (two float32 implementations differ in summation order only); bf16/fp16
   `tessera.protocol.fingerprint.tolerance(dtype, "float32", 30)` = 16 x roundoff x sqrt(layers),
   entrywise relative to |a| + |b| + the row's RMS (0.34 bf16, 0.043 fp16) — the bound spot
   checks hold an honest peer of that dtype to; greedy tokens must match in float32.
2. Decode tok/s on the GPU (bf16) against transformers on the same GPU and dtype.
3. A 3-peer swarm on one GPU (`tessera peer --device cuda`): its tokens equal this process
   running the same GPU layers with a CPU float32 head, as a requester holds it.
4. Quantized spans on the GPU (int8, int4 g32; bf16 activations): logits within the bf16
   bound of their dequantized float32 model, and allocated memory <= 1.15 x (weights + KV).
5. Batching ratios: bench/batching.py (the batched-serving work of issue 18).

    .venv/bin/python bench/gpu.py [--device cuda:0]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from tessera.protocol.fingerprint import relative_difference, tolerance
from tessera.stages import registry
from tessera.stages.generate import prompt_ids
from tessera.stages.quant import Quant, dense_block
from tessera.stages.stage import Stage
from tessera.stages.tokenizer import Tokenizer

PROMPT = "What is the capital of France?"
STEPS = 16
FLOAT32_GPU_TOLERANCE = 1e-3


def run_greedy(layers: Stage, head: Stage, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens and the float32 logits each was chosen from ([n, V], on the CPU)."""
    layers.open("g", capacity=len(ids) + n)
    logits = [head.logits(layers.forward("g", head.embed(ids), 0)[-1:]).cpu()]
    out = [int(logits[-1][-1].argmax())]
    while len(out) < n:
        logits.append(head.logits(layers.forward("g", head.embed(out[-1:]), len(ids) + len(out) - 1)).cpu())
        out.append(int(logits[-1][-1].argmax()))
    layers.close("g")
    return out, torch.cat(logits)


def worst_relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return relative_difference(a.float(), b.float(), b.float().pow(2).mean(-1).sqrt()).max().item()


def check_exactness(folder, device, ids, oracle_tokens, oracle_logits) -> list[str]:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    lines = []
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        stage = Stage.load(folder, embed=True, head=True, device=device, dtype=dtype)
        tokens, logits = run_greedy(stage, stage, ids, STEPS)
        worst = worst_relative(logits, oracle_logits)
        tol = FLOAT32_GPU_TOLERANCE if dtype == torch.float32 else tolerance(name, "float32", stage.spec.num_layers)
        ok = worst <= tol and (tokens == oracle_tokens or dtype != torch.float32)
        lines.append(f"exactness {name}: worst relative logit difference {worst:.3g} (tolerance {tol:.3g}), "
                     f"tokens {'equal' if tokens == oracle_tokens else 'differ'}: {'PASS' if ok else 'FAIL'}")
        del stage
        torch.cuda.empty_cache()
    return lines


def check_speed(folder, device, ids) -> list[str]:
    import transformers

    transformers.logging.set_verbosity_error()
    stage = Stage.load(folder, embed=True, head=True, device=device, dtype=torch.bfloat16)
    gguf = folder / "source.gguf"
    kwargs = {"gguf_file": gguf.name} if gguf.exists() else {}
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16, **kwargs).to(device)
    hf.requires_grad_(False)

    def ours() -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        run_greedy(stage, stage, ids, 64)
        torch.cuda.synchronize()
        return 64 / (time.perf_counter() - t)

    def theirs() -> float:
        with torch.inference_mode():
            torch.cuda.synchronize()
            t = time.perf_counter()
            hf.generate(torch.tensor([ids], device=device), max_new_tokens=64, min_new_tokens=64, do_sample=False)
            torch.cuda.synchronize()
            return 64 / (time.perf_counter() - t)

    ours(), theirs()  # warm-up
    a, b = max(ours() for _ in range(3)), max(theirs() for _ in range(3))
    return [f"decode on {device} (bf16): tessera {a:.1f} tok/s, transformers {b:.1f} tok/s, ratio {a / b:.2f}"]


def check_swarm(folder, device, ids) -> list[str]:
    import trio

    from tessera.peer.request.client import Swarm
    from tessera.peer.cli.demo import LocalSwarm

    spans = [(0, 10), (10, 20), (20, 30)]
    layers = Stage.load(folder, device=device, dtype=torch.bfloat16)
    head = Stage.load(folder, start=0, end=0, embed=True, head=True)
    want, _ = run_greedy(layers, head, ids, STEPS)
    swarm = LocalSwarm(3, extra_args=[["--layers", f"{a}:{b}", "--device", str(device)] for a, b in spans])
    got: list[int] = []
    try:
        swarm.start(together=True)

        async def ask() -> None:
            async with Swarm.join(swarm.addrs[:1]) as requester:
                await requester.wait_for_route(60)
                got.extend([t async for t in requester.generate_ids(ids, max_new_tokens=STEPS)])

        trio.run(ask)
    finally:
        swarm.stop(timeout=15)
    n = min(len(got), len(want))  # generation stops at the end-of-sequence token
    ok = got[:n] == want[:n] and n > 0
    return [f"3-peer swarm on one GPU: tokens {'equal' if ok else 'DIFFER'} ({n}): {'PASS' if ok else 'FAIL'}"]


def check_quantized(folder, device, ids) -> list[str]:
    lines = []
    for scheme in ("int8", "int4"):
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
        stage = Stage.load(folder, device=device, dtype=torch.bfloat16, quant=Quant.parse(scheme))
        stage.open("m", capacity=256)
        stage.forward("m", torch.zeros(1, stage.spec.hidden_size), 0)
        used = torch.cuda.memory_allocated(device) - before
        budget = stage.weight_bytes + stage.session_bytes(256)
        stage.close("m")
        head = Stage.load(folder, start=0, end=0, embed=True, head=True)
        ref = Stage(stage.spec, 0, [dense_block(b, stage.spec) for b in stage.blocks])
        tokens, logits = run_greedy(stage, head, ids, STEPS)
        want, ref_logits = run_greedy(ref, head, ids, STEPS)
        worst = worst_relative(logits, ref_logits)
        tol = tolerance("bfloat16", "float32", stage.spec.num_layers)
        ok = worst <= tol and used <= 1.15 * budget
        lines.append(f"quantized {scheme} on {device}: worst relative logit difference vs dequantized float32 "
                     f"{worst:.3g} (tolerance {tol:.3g}), tokens {'equal' if tokens == want else 'differ'}; "
                     f"allocated {used / 2**20:.1f} MiB for {budget / 2**20:.1f} MiB weights+KV: "
                     f"{'PASS' if ok else 'FAIL'}")
        del stage, ref
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(f"bench/gpu.py: skipped, no CUDA GPU here (torch {torch.__version__}, CUDA build: {torch.version.cuda})")
        return 0
    device = torch.device(args.device)
    folder = registry.resolve(args.model)
    ids = prompt_ids(Tokenizer.from_folder(folder), PROMPT, raw=False)
    oracle = Stage.load(folder, embed=True, head=True)
    oracle_tokens, oracle_logits = run_greedy(oracle, oracle, ids, STEPS)
    del oracle
    print(f"GPU: {torch.cuda.get_device_name(device)}")
    lines = check_exactness(folder, device, ids, oracle_tokens, oracle_logits)
    lines += check_speed(folder, device, ids)
    lines += check_swarm(folder, device, ids)
    lines += check_quantized(folder, device, ids)
    lines.append("batching ratios: bench/batching.py")
    for line in lines:
        print(line)
    return 0 if not any(line.endswith("FAIL") for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
