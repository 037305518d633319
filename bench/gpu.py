"""The checks a CUDA GPU must pass, as one short script (skips with one line without a GPU).

1. Exactness: SmolLM2 on the GPU in float32 (TF32 off), bfloat16 and float16 against the
   CPU float32 oracle, over a prefill and 16 greedy steps. Tolerance: float32 1e-3
   relative (two float32 implementations differ in summation order only); bf16/fp16
   `tessera.protocol.fingerprint.tolerance(dtype, "float32", 30)` = 16 x roundoff x sqrt(layers),
   entrywise relative to |a| + |b| + the row's RMS (0.34 bf16, 0.043 fp16) — the bound spot
   checks hold an honest peer of that dtype to; greedy tokens must match in float32. The
   bf16/fp16 runs are fed the oracle's tokens (teacher forcing): once a low-precision run
   flips a near-tie, free-running logits would be over different contexts and say nothing.
2. Decode tok/s on the GPU (bf16) against transformers on the same GPU and dtype.
3. A 3-peer swarm on one GPU (`tessera peer --device cuda`): its tokens equal this process
   running the same GPU layers with a CPU float32 head, as a requester holds it.
4. Quantized spans on the GPU (int8, int4 g32; bf16 activations): logits within the bf16
   bound of their dequantized float32 model (fed its tokens), and allocated memory
   <= 1.15 x (weights + KV).
5. Batching: 1, 4 and 8 sessions stacked per step (bench/batching.py's lockstep) on the GPU,
   float32 and bf16: aggregate tok/s, ratios to one session, and each session's tokens
   against its solo run (required in float32, reported in bf16).
6. CUDA graphs (stages/engine/compiled/cuda_graphs.py) on SmolLM2: float32 (TF32 off) graphs
   against eager on the GPU and the CPU oracle (tokens equal, logits to 1e-3), bf16 graphs
   against the oracle (fed its tokens, the bf16 bound); decode tok/s eager vs graphs (one
   session, head included), and 1 vs 8 sessions stacked with graphs (each session's tokens
   against its solo run).
7. Realistic spans (bench/gpu_shapes.py): 8 layers of a Llama-3-8B and 4 of a Qwen3-30B-A3B
   shape, bf16, batch 1 and 8: tok/s eager, graphs and transformers on the same layers, each
   as a fraction of the HBM bound.

Sized to finish within 6 minutes on one H200, graph capture included.

    .venv/bin/python bench/gpu.py [--device cuda:0] [--only graphs shapes ...]
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import torch

from tessera.protocol.fingerprint import relative_difference, tolerance
from tessera.stages.weights import registry
from tessera.stages.decoding.generate import prompt_ids
from tessera.stages.assembly.blocks import dense_block
from tessera.stages.kernels.quant import Quant
from tessera.stages.engine.stage import Stage
from tessera.stages.assembly.stage import load_stage
from tessera.stages.text.tokenizer import Tokenizer

PROMPT = "What is the capital of France?"
STEPS = 16
FLOAT32_GPU_TOLERANCE = 1e-3


def run_greedy(layers: Stage, head: Stage, ids: list[int], n: int,
               forced: list[int] | None = None) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens and the float32 logits each was chosen from ([n, V], on the CPU).

    With `forced` (another run's tokens), each step is fed that run's token instead of its
    own choice (teacher forcing), so that both runs' logits are over the same context at
    every step: a low-precision run that flips a near-tie then still compares like for like.
    """
    layers.open("g", capacity=len(ids) + n)
    logits = [head.logits(layers.forward("g", head.embed(ids), 0)[-1:]).cpu()]
    out = [int(logits[-1][-1].argmax())]
    while len(out) < n:
        fed = forced[len(out) - 1] if forced is not None else out[-1]
        logits.append(head.logits(layers.forward("g", head.embed([fed]), len(ids) + len(out) - 1)).cpu())
        out.append(int(logits[-1][-1].argmax()))
    layers.close("g")
    return out, torch.cat(logits)


def agreement(tokens: list[int], want: list[int]) -> str:
    same = sum(a == b for a, b in zip(tokens, want))
    return "tokens equal" if same == len(want) else f"argmax equal at {same}/{len(want)} steps"


def worst_relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return relative_difference(a.float(), b.float(), b.float().pow(2).mean(-1).sqrt()).max().item()


def check_exactness(folder, device, ids, oracle_tokens, oracle_logits) -> list[str]:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    lines = []
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        stage = load_stage(folder, embed=True, head=True, device=device, dtype=dtype)
        # float32 runs free (its tokens must be the oracle's); bf16/fp16 are fed the oracle's
        # tokens, so their logits are compared over the same context at every step
        forced = None if dtype == torch.float32 else oracle_tokens
        tokens, logits = run_greedy(stage, stage, ids, STEPS, forced)
        worst = worst_relative(logits, oracle_logits)
        tol = FLOAT32_GPU_TOLERANCE if dtype == torch.float32 else tolerance(name, "float32", stage.spec.num_layers)
        ok = worst <= tol and (tokens == oracle_tokens or dtype != torch.float32)
        lines.append(f"exactness {name}{'' if forced is None else ' (fed the oracle tokens)'}: worst relative logit "
                     f"difference {worst:.3g} (tolerance {tol:.3g}), {agreement(tokens, oracle_tokens)}: "
                     f"{'PASS' if ok else 'FAIL'}")
        del stage
        torch.cuda.empty_cache()
    return lines


def check_speed(folder, device, ids) -> list[str]:
    import transformers

    transformers.logging.set_verbosity_error()
    stage = load_stage(folder, embed=True, head=True, device=device, dtype=torch.bfloat16)
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

    from tessera.stages.engine.compiled.build import compile_decode

    spans = [(0, 10), (10, 20), (20, 30)]
    layers = load_stage(folder, device=device, dtype=torch.bfloat16)
    compile_decode(layers, "auto")  # as the peers do theirs (--compile auto: CUDA graphs): the same kernels
    head = load_stage(folder, start=0, end=0, embed=True, head=True)
    want, _ = run_greedy(layers, head, ids, STEPS)
    swarm = LocalSwarm(3, extra_args=[["--layers", f"{a}:{b}", "--device", str(device)] for a, b in spans])
    got: list[int] = []
    offers: list[str] = []
    try:
        swarm.start(together=True)

        async def ask() -> None:
            async with Swarm.join(swarm.addrs[:1]) as requester:
                await requester.wait_for_route(60)
                for peer in requester.keeper.snapshot().peers:  # the VRAM-aware offer, as advertised
                    offers.append(f"peer {peer.name} [{peer.start}, {peer.end}) {peer.dtype} on {peer.device}: "
                                  f"offers {peer.free_memory / 2**30:.1f} GiB, device free {peer.device_free / 2**30:.1f} GiB")
                got.extend([t async for t in requester.generate_ids(ids, max_new_tokens=STEPS)])

        trio.run(ask)
    finally:
        swarm.stop(timeout=15)
    n = min(len(got), len(want))  # generation stops at the end-of-sequence token
    ok = got[:n] == want[:n] and n > 0
    return offers + [f"3-peer swarm on one GPU: tokens {'equal' if ok else 'DIFFER'} ({n}): {'PASS' if ok else 'FAIL'}"]


def layer_decode_rate(stage: Stage, steps: int = 64) -> float:
    """Tokens/s of one-row decode steps through every layer of `stage` (no head): what a peer
    serving that span computes per token. Best of three timed runs after a warm-up."""
    row = torch.randn(1, stage.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    best = 0.0
    for attempt in range(4):
        stage.open("r", capacity=steps + 1)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for pos in range(steps):
            stage.forward("r", row, pos)
        torch.cuda.synchronize()
        if attempt:
            best = max(best, steps / (time.perf_counter() - started))
        stage.close("r")
    return best


def check_quantized(folder, device, ids) -> list[str]:
    dense = load_stage(folder, device=device, dtype=torch.bfloat16)
    rates = {"bf16": layer_decode_rate(dense)}
    del dense
    lines = []
    for scheme in ("int8", "int4"):
        torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated(device)
        stage = load_stage(folder, device=device, dtype=torch.bfloat16, quant=Quant.parse(scheme))
        stage.open("m", capacity=256)
        stage.forward("m", torch.zeros(1, stage.spec.hidden_size), 0)
        used = torch.cuda.memory_allocated(device) - before
        budget = stage.weight_bytes + stage.session_bytes(256)
        stage.close("m")
        head = load_stage(folder, start=0, end=0, embed=True, head=True)
        ref = Stage(stage.spec, 0, [dense_block(b, stage.spec) for b in stage.blocks])
        want, ref_logits = run_greedy(ref, head, ids, STEPS)
        tokens, logits = run_greedy(stage, head, ids, STEPS, forced=want)
        worst = worst_relative(logits, ref_logits)
        tol = tolerance("bfloat16", "float32", stage.spec.num_layers)
        ok = worst <= tol and used <= 1.15 * budget
        lines.append(f"quantized {scheme} on {device}: worst relative logit difference vs dequantized float32 "
                     f"{worst:.3g} (tolerance {tol:.3g}), fed its tokens: {agreement(tokens, want)}; "
                     f"allocated {used / 2**20:.1f} MiB for {budget / 2**20:.1f} MiB weights+KV: "
                     f"{'PASS' if ok else 'FAIL'}")
        rates[scheme] = layer_decode_rate(stage)
        del stage, ref
    lines.append(f"layer decode on {device} (30 layers, one row): " + ", ".join(
        f"{k} {v:.0f} tok/s ({v / rates['bf16']:.2f}x bf16)" for k, v in rates.items()))
    return lines


QUESTIONS = (  # eight prompts of different lengths for the batching check
    "What is the capital of France?",
    "Name three primary colours.",
    "Write one sentence about the sea.",
    "Why is the sky blue? Answer briefly.",
    "List the first five prime numbers, separated by commas.",
    "Translate 'good morning' into Spanish, French and German.",
    "Explain in two sentences what a hash function is and why it is useful.",
    "A train leaves at nine and travels for three hours at sixty miles an hour. How far does it go?",
)


def check_batching(folder, device, tokenizer) -> list[str]:
    """1, 4 and 8 sessions stacked per step (bench/batching.py's lockstep), each greedy from its
    own prompt: aggregate decode tok/s and ratios to one session, and whether every stacked
    session's tokens equal its solo run's. float32 (TF32 off) must be exact; bf16 is reported:
    a stack of more rows may take another GEMM and round differently, and a near-tie then flips."""
    from batching import COUNTS, lockstep  # bench/batching.py, beside this script

    torch.backends.cuda.matmul.allow_tf32 = False
    batch = [prompt_ids(tokenizer, q, raw=False) for q in QUESTIONS]
    tokens = 32
    lines, failed = [], False
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        stage = load_stage(folder, embed=True, head=True, device=device, dtype=dtype)
        solo = [lockstep(stage, [p], tokens)[0][0] for p in batch]
        lockstep(stage, batch, tokens)  # warm-up
        rates, equal = {}, {}
        for c in COUNTS:
            best = 0.0
            for _ in range(3):
                torch.cuda.synchronize()
                got, spent = lockstep(stage, batch[:c], tokens)
                best = max(best, c * (tokens - 1) / spent)
            rates[c] = best
            equal[c] = sum(g == s for g, s in zip(got, solo[:c]))
        exact = all(equal[c] == c for c in COUNTS)
        failed |= dtype == torch.float32 and not exact
        verdict = ("PASS" if exact else "FAIL") if dtype == torch.float32 else ("all equal" if exact else "reported")
        lines += [f"batched decode on {device} ({name}, stage): "
                  + ", ".join(f"{c} sessions {rates[c]:.0f} tok/s ({rates[c] / rates[1]:.2f}x)" for c in COUNTS),
                  f"batched {name}: sessions equal to their solo run: "
                  + ", ".join(f"{equal[c]}/{c}" for c in COUNTS) + f": {verdict}"]
        del stage
    return lines


def timed_greedy(layers: Stage, head: Stage, ids: list[int], n: int) -> float:
    """Decode tok/s of one greedy session (head and argmax included), the device synchronised."""
    torch.cuda.synchronize()
    started = time.perf_counter()
    run_greedy(layers, head, ids, n)
    torch.cuda.synchronize()
    return (n - 1) / (time.perf_counter() - started)


def check_graphs(folder, device, ids, oracle_tokens, oracle_logits, tokenizer) -> list[str]:
    """CUDA graphs on SmolLM2 (module docstring, check 6)."""
    from batching import lockstep  # bench/batching.py, beside this script

    from tessera.stages.engine.compiled.build import compile_decode

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    lines = []
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        stage = load_stage(folder, embed=True, head=True, device=device, dtype=dtype)
        began = time.perf_counter()
        plan = compile_decode(stage, "cuda-graphs")
        runner = stage.decode
        lines.append(f"graphs {name}: {plan.backend} ({plan.reason}), {len(runner.compiled) if runner else 0} "
                     f"buckets captured in {time.perf_counter() - began:.1f} s"
                     + (f"; eager: {runner.eager}" if runner is not None and runner.eager else ""))
        forced = None if dtype == torch.float32 else oracle_tokens
        tokens, logits = run_greedy(stage, stage, ids, STEPS, forced)
        stage.decode = None
        eager_tokens, eager_logits = run_greedy(stage, stage, ids, STEPS, forced)
        stage.decode = runner
        vs_oracle, vs_eager = worst_relative(logits, oracle_logits), worst_relative(logits, eager_logits)
        if dtype == torch.float32:
            ok = vs_oracle <= FLOAT32_GPU_TOLERANCE and vs_eager <= FLOAT32_GPU_TOLERANCE and \
                tokens == oracle_tokens == eager_tokens
        else:
            ok = vs_oracle <= tolerance(name, "float32", stage.spec.num_layers)
        lines.append(f"graphs {name}{'' if forced is None else ' (fed the oracle tokens)'}: worst relative logit "
                     f"difference {vs_oracle:.3g} vs the CPU oracle, {vs_eager:.3g} vs eager on {device}, "
                     f"{agreement(tokens, oracle_tokens)}: {'PASS' if ok else 'FAIL'}")
        if dtype == torch.bfloat16:
            stage.decode = None
            timed_greedy(stage, stage, ids, 16)  # warm-up
            eager = max(timed_greedy(stage, stage, ids, 64) for _ in range(3))
            stage.decode = runner
            timed_greedy(stage, stage, ids, 16)
            graphs = max(timed_greedy(stage, stage, ids, 64) for _ in range(3))
            lines.append(f"decode on {device} (bf16, one session, head included): eager {eager:.0f} tok/s, "
                         f"graphs {graphs:.0f} tok/s, graphs/eager {graphs / eager:.2f}x")
            batch = [prompt_ids(tokenizer, q, raw=False) for q in QUESTIONS]
            rates, equal = {}, {}
            solo = [lockstep(stage, [p], 32)[0][0] for p in batch]
            for c in (1, 8):
                lockstep(stage, batch[:c], 8)  # warm-up
                best = 0.0
                for _ in range(3):
                    torch.cuda.synchronize()
                    started = time.perf_counter()
                    got, _ = lockstep(stage, batch[:c], 32)
                    torch.cuda.synchronize()
                    best = max(best, c * 31 / (time.perf_counter() - started))
                rates[c] = best
                equal[c] = sum(g == s for g, s in zip(got, solo[:c]))
            lines.append(f"graphs, sessions stacked (bf16, heads included): 1 session {rates[1]:.0f} tok/s, "
                         f"8 sessions {rates[8]:.0f} tok/s ({rates[8] / rates[1]:.2f}x); equal to their solo run: "
                         f"{equal[1]}/1, {equal[8]}/8 (bf16: reported)")
        del stage, runner
        torch.cuda.empty_cache()
    return lines


def check_shapes(device) -> list[str]:
    from gpu_shapes import check_shapes as shapes  # bench/gpu_shapes.py, beside this script

    return shapes(device)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--only", nargs="*", default=(),
                        help="run only these checks (exactness speed swarm quantized batching graphs shapes)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(f"bench/gpu.py: skipped, no CUDA GPU here (torch {torch.__version__}, CUDA build: {torch.version.cuda})")
        return 0
    device = torch.device(args.device)
    folder = registry.resolve(args.model)
    tokenizer = Tokenizer.from_folder(folder)
    ids = prompt_ids(tokenizer, PROMPT, raw=False)
    oracle = load_stage(folder, embed=True, head=True)
    oracle_tokens, oracle_logits = run_greedy(oracle, oracle, ids, STEPS)
    del oracle
    print(f"GPU: {torch.cuda.get_device_name(device)} (torch {torch.__version__}, CUDA {torch.version.cuda})", flush=True)
    checks = {
        "exactness": lambda: check_exactness(folder, device, ids, oracle_tokens, oracle_logits),
        "speed": lambda: check_speed(folder, device, ids),
        "swarm": lambda: check_swarm(folder, device, ids),
        "quantized": lambda: check_quantized(folder, device, ids),
        "batching": lambda: check_batching(folder, device, tokenizer),
        "graphs": lambda: check_graphs(folder, device, ids, oracle_tokens, oracle_logits, tokenizer),
        "shapes": lambda: check_shapes(device),
    }
    failed = False
    for name, check in checks.items():  # one broken check does not hide the others' figures
        if args.only and name not in args.only:
            continue
        try:
            lines = check()
        except Exception:  # noqa: BLE001 - reported, and the run fails
            traceback.print_exc()
            lines = [f"{name}: raised (traceback above): FAIL"]
        for line in lines:
            print(line, flush=True)
        failed |= any(line.endswith("FAIL") for line in lines)
        torch.cuda.empty_cache()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
