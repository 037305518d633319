"""Decode speed of this engine vs transformers on the same model, dtype and threads.

Both decode greedily from the same 37-token chat prompt; rounds alternate
(ours, theirs, ours, ...) so that machine noise hits both alike. Prints the
median tokens/s of each and their ratio last.

    .venv/bin/python bench/engine.py [--threads N] [--tokens 48] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tessera.stages.weights import registry
from tessera.stages.engine.stage import Stage
from tessera.stages.text.tokenizer import Tokenizer


def ours_decode(stage: Stage, ids: list[int], n: int) -> float:
    stage.open("bench", capacity=len(ids) + n + 1)
    hidden = stage.forward("bench", stage.embed(ids), 0)
    token, pos = int(stage.logits(hidden[-1:]).argmax()), len(ids)
    started = time.perf_counter()
    for _ in range(n):
        token = int(stage.logits(stage.forward("bench", stage.embed([token]), pos)).argmax())
        pos += 1
    elapsed = time.perf_counter() - started
    stage.close("bench")
    return n / elapsed


def hf_decode(model, ids: list[int], n: int) -> float:
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
        cache, token = out.cache, out.logits[0, -1].argmax()
        started = time.perf_counter()
        for _ in range(n):
            out = model(token.view(1, 1), cache=cache, use_cache=True)
            cache, token = out.cache, out.logits[0, -1].argmax()
        return n / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    folder = registry.resolve(args.model)
    ids = Tokenizer.from_folder(folder).encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    stage = Stage.load(folder, embed=True, head=True)
    gguf = folder / "source.gguf"
    if gguf.exists():
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=gguf.name, dtype=torch.float32)
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    hf.requires_grad_(False)
    ours_decode(stage, ids, 8), hf_decode(hf, ids, 8)  # warm-up
    ours, theirs = [], []
    for r in range(args.rounds):
        ours.append(ours_decode(stage, ids, args.tokens))
        theirs.append(hf_decode(hf, ids, args.tokens))
        print(f"round {r}: tessera {ours[-1]:.2f} tok/s, transformers {theirs[-1]:.2f} tok/s")
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"threads: {args.threads}, dtype: float32, tokens per round: {args.tokens}, rounds: {args.rounds}")
    print(f"tessera decode: {a:.2f} tok/s")
    print(f"transformers decode: {b:.2f} tok/s")
    print(f"engine/transformers decode ratio: {a / b:.2f}")


if __name__ == "__main__":
    main()
