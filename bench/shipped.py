"""Weights in the form they ship (fp8 blocks, MXFP4, GGUF blocks, NVFP4, INT4): capacity, decode speed, resident bytes.

Used by bench/capacity.py (whose last lines print these figures); runnable alone:

    .venv/bin/python bench/shipped.py [--threads 1] [--tokens 32] [--rounds 3] [--budget-gb 2] [--no-1b] [--forms A,B]

1. Layers in a fixed budget (the peer's rule, `layer_bytes` of the form as shipped; norms in
   bf16) against bf16: SmolLM2, the synthetic 1B shape and a Qwen3-30B-A3B-shaped MoE. FP8 stores
   every linear (goal >= 1.9x bf16); MXFP4 every linear of a dense model, and of the MoE only the
   experts (gpt-oss's `modules_to_not_convert`: attention and router stay bf16) (goal >= 3.5x);
   NVFP4 every linear but the head and routers (ModelOpt's and compressed-tensors' exports);
   INT4 (compressed-tensors pack-quantized, groups of 32) every linear of a dense model and of the
   MoE the routed experts only (Kimi K2's INT4); fp8+fp4 experts, DeepSeek-V4's form, for the MoE;
   GGUF types for context. Pure arithmetic.
2. Decode tok/s as a CPU peer runs each form (float32 activations), against float32, rounds
   alternating, twice: eagerly (the stored matrices widened a chunk at a time) and compiled as
   `--compile auto` runs a CPU peer (every span, float32's included, and the head through
   inductor; the shipped matrices in their fused forms), each against float32 run the same way.
   SmolLM2 (fp8, MXFP4, NVFP4 and INT4 written from its own weights, its GGUF's Q4_1 layers
   imported as they are, the GGUF types whose blocks its 576 takes as random blocks), and the
   GGUF types of 256-weight blocks on `synth-k`, a synthetic Llama of widths they take (hidden
   1024, 4 layers, vocabulary 8192); decode time does not depend on the values (goal >= 0.9x).
   For the 1B shape, the per-layer speed a peer advertises, each form against float32.
   Printed with them (bench/rounds.py): the machine, each configuration's rounds as min / median /
   max, and the cores other processes kept busy meanwhile; a form whose rounds or float32's spread
   over 15% is named `not printed` in its line, and the line is not printed at all while other
   processes held a fifth of a core or more.
3. Resident bytes / on-disk bytes of a span in a fresh process, as
   tests/stages/formats/test_shipped_memory.py measures it: SmolLM2's layers [0, 15) and synth-k's
   [0, 4) (goal <= 1.15).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from rounds import CoreWatch, figure_line, machine_lines, refusal, spread_line, watch_line

from tessera.peer.node.config import KV_RESERVE_FRACTION
from tessera.stages.engine.compiled.build import compile_decode
from tessera.stages.engine.speed import measure_layer_throughput
from tessera.stages.engine.stage import Stage
from tessera.stages.assembly.stage import load_stage
from tessera.stages.families.catalog import spec_from_config, spec_from_file, to_config
from tessera.stages.families.shipped import GGML_TYPES, ShippedFormat
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.text.tokenizer import Tokenizer
from tessera.stages.weights import registry
from tessera.stages.weights.convert import convert_gguf
from tessera.stages.kernels.quant import layer_bytes
from tessera.stages.weights.synth import gguf_form, shipped_state, synth_spec, write_synth

ROOT = Path(__file__).resolve().parent.parent
SYNTH_1B = dict(hidden=2048, layers=24, heads=16, kv_heads=8, intermediate=5632)
SYNTH_K = dict(hidden=1024, layers=4, heads=16, kv_heads=4, intermediate=2816, vocab=8192)  # widths of 256-blocks
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
                 "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                 "num_experts_per_tok": 8, "norm_topk_prob": True, "rope_theta": 1e6}
GPT_OSS_SKIP = ("model.layers.*.self_attn", "model.layers.*.mlp.gate", "model.embed_tokens", "lm_head")
# the GGUF types measured: the k-quants, the low-bit files' IQ types, llama.cpp's FP4 types, Q8_0
GGUF_TYPES = ("Q4_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S",
              "IQ3_XXS", "IQ3_S", "IQ4_XS", "IQ4_NL", "MXFP4", "NVFP4")
HEAD_AND_ROUTERS = ("lm_head", r".*mlp\.gate$")  # what NVFP4 and INT4 exports leave in float
SPAN = (0, 15)
SYNTH_K_SPAN = (0, 4)


def forms(spec: ModelSpec, *, moe: bool, only: tuple[str, ...] = ()) -> dict[str, ShippedFormat]:
    """The shipped forms measured for `spec` (bf16 floats where a form leaves a matrix out); with `only`,
    those whose name holds one of its strings."""
    out = {"fp8": ShippedFormat("fp8"),
           "mxfp4": ShippedFormat("mxfp4", not_converted=GPT_OSS_SKIP if moe else ("lm_head",)),
           "nvfp4": ShippedFormat("nvfp4", layout="compressed-tensors", group=16, not_converted=HEAD_AND_ROUTERS),
           "int4": ShippedFormat("int4", layout="compressed-tensors", group=32, not_converted=HEAD_AND_ROUTERS,
                                 targets=(r".*\.experts\.",) if moe else ())}
    if moe:
        out["fp8+fp4 experts"] = ShippedFormat("fp8", scale_format="ue8m0", expert_form="fp4")
    inputs = {c for layer in spec.layers for _, c in layer.matrices(spec.hidden_size)}
    # a k-quant or IQ block is 256 inputs: SmolLM2's 576 takes none (llama.cpp falls back to Q8_0/Q5_0 there)
    out.update({f"gguf {kind}": gguf_form(spec, kind) for kind in GGUF_TYPES
                if all(c % GGML_TYPES[kind].block == 0 for c in inputs)})
    return {k: v for k, v in out.items() if not only or any(o in k for o in only)}


def capacity_lines(budget: int, smol: ModelSpec, only: tuple[str, ...] = ()) -> list[str]:
    shapes = {"smollm2": (smol, False), "synth-1b": (synth_spec(**SYNTH_1B), False),
              "qwen3-30b-a3b shape": (spec_from_config(QWEN3_30B_A3B), True)}
    last = []
    for name, (spec, moe) in shapes.items():
        usable = budget * (1 - KV_RESERVE_FRACTION)
        per_layer = {"bf16": max(layer_bytes(spec, 2, layer=i) for i in range(spec.num_layers))}
        for form, shipped in forms(spec, moe=moe, only=only).items():
            shaped = replace(spec, shipped=shipped)
            per_layer[form] = max(layer_bytes(shaped, 2, layer=i) for i in range(spec.num_layers))
        fits = {k: usable / v for k, v in per_layer.items()}
        print(f"{name}: MiB per layer " + ", ".join(f"{k} {v / 2**20:.1f}" for k, v in per_layer.items()))
        last.append(f"{name} layers in budget vs bf16: "
                    + ", ".join(f"{k} {fits[k] / fits['bf16']:.2f}x" for k in fits if k != "bf16"))
    return last


def write_form(folder: Path, out: Path, shipped: ShippedFormat) -> Path:
    """SmolLM2 (`folder`) with its layers' matrices in `shipped`'s form."""
    spec = replace(spec_from_file(folder / "config.json"), shipped=shipped)
    state = shipped_state(spec, load_file(str(folder / "model.safetensors")), seed=0)
    out.mkdir(parents=True)
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(to_config(spec)))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (folder / name).exists():
            shutil.copy(folder / name, out / name)
    return out


def decode_rate(stage: Stage, head: Stage, ids: list[int], n: int) -> float:
    stage.open("bench", capacity=len(ids) + n + 1)
    token = int(head.logits(stage.forward("bench", head.embed(ids), 0)[-1:]).argmax())
    pos = len(ids)
    started = time.perf_counter()
    for _ in range(n):
        token = int(head.logits(stage.forward("bench", head.embed([token]), pos)).argmax())
        pos += 1
    elapsed = time.perf_counter() - started
    stage.close("bench")
    return n / elapsed


def resident_ratio(folder: Path, span: tuple[int, int] = SPAN) -> float:
    """Held bytes of the folder's `span` in a fresh process over its on-disk bytes plus its KV cache."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from tests.resident import SPAN_RSS, span_on_disk  # the measurement tests/stages/formats/test_shipped_memory.py makes

    done = subprocess.run([sys.executable, "-c", SPAN_RSS, str(folder), *map(str, span)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-2000:])
    grown, _, kv = map(int, done.stdout.split())
    return grown / (span_on_disk(folder, *span) + kv)


def decode_lines(label: str, folder: Path, folders: dict[str, Path], head: Stage, ids: list[int], *,
                 tokens: int, rounds: int) -> list[str]:
    """`label decode vs float32 (as shipped), eager|compiled: ...`: each form's folder against `folder`'s
    float32 model, rounds alternating, eagerly and then compiled."""
    stages = {"float32": load_stage(folder), **{form: load_stage(f) for form, f in folders.items()}}
    last = []
    for mode in ("eager", "compiled"):
        if mode == "compiled":
            for name, stage in [("head", head), *stages.items()]:
                plan = compile_decode(stage, "inductor")
                eager = stage.decode.eager if stage.decode is not None else {}
                print(f"compiled {label} {name}: {plan.reason}" + "".join(f"; {why}" for why in eager.values()))
        for stage in stages.values():
            decode_rate(stage, head, ids, 4)  # warm-up
        rates: dict[str, list[float]] = {k: [] for k in stages}
        with CoreWatch() as watch:
            for r in range(rounds):
                for k, stage in stages.items():
                    rates[k].append(decode_rate(stage, head, ids, tokens))
                print(f"{label} {mode} round {r}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in rates.items()) + " tok/s")
        for k, v in rates.items():
            print(spread_line(f"{label} {mode} {k}", v, "tok/s"))
        print(watch_line(watch))
        last.append(ratio_line(f"{label} decode vs float32 (as shipped), {mode}", rates, watch.others))
    return last


def ratio_line(label: str, rates: dict[str, list[float]], others: float | None) -> str:
    """`label: fp8 0.81x, ... (float32 40.4 tok/s)`, each form's median rate over float32's; a form whose
    rounds, or float32's, spread over bench/rounds.py's limit is named as not printed, and the whole
    line is not printed while other processes kept the cores busy."""
    busy = refusal({}, others)
    if busy is not None:
        return figure_line(label, "", busy)
    med = {k: statistics.median(v) for k, v in rates.items()}
    parts = []
    for k in med:
        if k == "float32":
            continue
        why = refusal({"float32": rates["float32"], k: rates[k]}, None)
        parts.append(f"{k} {med[k] / med['float32']:.2f}x" if why is None else f"{k}: not printed, {why}")
    return f"{label}: " + ", ".join(parts) + f" (float32 {med['float32']:.1f} tok/s)"


def shipped_figures(*, model: str = "smollm2-135m", tokens: int = 32, rounds: int = 3, budget_gb: float = 2.0,
                    one_b: bool = True, only: tuple[str, ...] = ()) -> list[str]:
    """Every figure above (`only`: the forms whose name holds one of its strings); returns the lines to print last."""
    folder = registry.resolve(model)
    smol = spec_from_file(folder / "config.json")
    last = capacity_lines(int(budget_gb * (1 << 30)), smol, only)
    with tempfile.TemporaryDirectory(prefix="tessera-shipped-") as tmp:
        root = Path(tmp)
        folders = {form: write_form(folder, root / form.replace(" ", "-"), shipped)
                   for form, shipped in forms(smol, moe=False, only=only).items()}
        if not only or any(o in "gguf Q4_1" for o in only):
            convert_gguf(folder / "source.gguf", root / "gguf-q4_1", keep_blocks=True)
            folders["gguf Q4_1 (SmolLM2's file)"] = root / "gguf-q4_1"
        ids = Tokenizer.from_folder(folder).encode_chat([{"role": "user", "content": "What is the capital of France?"}])
        head = load_stage(folder, start=0, end=0, embed=True, head=True)
        last += decode_lines("smollm2", folder, folders, head, ids, tokens=tokens, rounds=rounds)
        # the 256-weight-block GGUF types, on a synthetic model whose widths take them
        k_spec = synth_spec(**SYNTH_K)
        k_forms = {f: s for f, s in forms(k_spec, moe=False, only=only).items() if f.startswith("gguf") and f not in folders}
        synth_k = root / "synth-k"
        if k_forms:
            write_synth(k_spec, synth_k, seed=0)
            k_folders = {form: write_form(synth_k, root / f"k-{form.replace(' ', '-')}", shipped)
                         for form, shipped in k_forms.items()}
            k_head = load_stage(synth_k, start=0, end=0, embed=True, head=True)
            last += decode_lines("synth-k", synth_k, k_folders, k_head, list(range(40, 60)), tokens=tokens, rounds=rounds)
        ratios = {form: resident_ratio(f) for form, f in folders.items()}
        last.append(f"smollm2 layers [{SPAN[0]}, {SPAN[1]}) resident / on-disk: "
                    + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
        if k_forms:
            ratios = {form: resident_ratio(f, SYNTH_K_SPAN) for form, f in k_folders.items()}
            last.append(f"synth-k layers [{SYNTH_K_SPAN[0]}, {SYNTH_K_SPAN[1]}) resident / on-disk: "
                        + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    if one_b:
        spec = synth_spec(**SYNTH_1B)
        per_layer = {"float32": measure_layer_throughput(spec, seconds=1.0)}
        for form, shipped in forms(spec, moe=False, only=only).items():
            per_layer[form] = measure_layer_throughput(replace(spec, shipped=shipped), seconds=1.0)
        print("synth-1b one layer: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in per_layer.items()))
        last.append("synth-1b layer decode vs float32 (as shipped): "
                    + ", ".join(f"{k} {per_layer[k] / per_layer['float32']:.2f}x" for k in per_layer if k != "float32"))
    return last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget-gb", type=float, default=2.0)
    parser.add_argument("--no-1b", action="store_true", help="skip the synthetic 1B shape's per-layer speed")
    parser.add_argument("--forms", default="", help="only the forms whose name holds one of these (comma-separated: "
                        "e.g. 'nvfp4,int4,Q2_K,IQ4_XS')")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for line in machine_lines(args.threads):
        print(line)
    for line in shipped_figures(model=args.model, tokens=args.tokens, rounds=args.rounds, budget_gb=args.budget_gb,
                                one_b=not args.no_1b, only=tuple(f for f in args.forms.split(",") if f)):
        print(line)


if __name__ == "__main__":
    main()
