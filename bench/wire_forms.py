"""The error a compact activation form adds: what a requester trades for bytes with `--wire`.

SmolLM2, split into 2, 3 and 6 equal spans; at every cut the hidden state goes through the
wire form as a peer sends it (`protocol/tensors.py` `encode_wire`, then `decode_tensor`, as the
next peer reads it), the requester's own send into the first span included. Greedy decode of
the France prompt for `--tokens` tokens, fed the exact run's tokens: the largest |logit|
difference against the exact wire (""), the largest relative to the row's largest |logit|,
the first step whose greedy token differs (none: all the same), and the bytes of one decode
step's activations per hop. Deterministic: no timing involved.

    .venv/bin/python bench/wire_forms.py [--tokens 32] [--spans 2 3 6]
"""

from __future__ import annotations

import argparse

import torch

from tessera.protocol.tensors import WIRE_FORMS, decode_tensor, encode_wire
from tessera.stages.engine.stage import Stage
from tessera.stages.assembly.stage import load_stage
from tessera.stages.text.tokenizer import Tokenizer
from tessera.stages.weights import registry


def run(stages: list[Stage], head: Stage, ids: list[int], tokens: int, form: str,
        feed: list[int] | None) -> tuple[list[torch.Tensor], list[int], int]:
    """(logits of each step, greedy tokens, bytes of one decode step per hop) through `stages` with
    the hidden state in wire form `form` at every cut; fed `feed`'s tokens when given."""
    for stage in stages:
        stage.open("w", capacity=len(ids) + tokens + 1)
    step, pos, logits, chosen, hop_bytes = ids, 0, [], [], 0
    for i in range(tokens):
        hidden = head.embed(step)
        for stage in stages:
            data, _ = encode_wire(hidden, form)
            hop_bytes = len(data)
            hidden = stage.forward("w", decode_tensor(data), pos)
        rows = head.logits(hidden[-1:])
        logits.append(rows[0])
        chosen.append(int(rows.argmax()))
        pos += len(step)
        step = [feed[i] if feed is not None else chosen[-1]]
    for stage in stages:
        stage.close("w")
    return logits, chosen, hop_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--spans", type=int, nargs="+", default=[2, 3, 6])
    args = parser.parse_args()
    folder = registry.resolve(args.model)
    head = load_stage(folder, start=0, end=0, embed=True, head=True)
    ids = Tokenizer.from_folder(folder).encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    layers = head.spec.num_layers
    last = []
    for count in args.spans:
        cuts = [round(i * layers / count) for i in range(count + 1)]
        stages = [load_stage(folder, start=a, end=b) for a, b in zip(cuts, cuts[1:])]
        exact_logits, exact_tokens, exact_bytes = run(stages, head, ids, args.tokens, "", None)
        for form in WIRE_FORMS[1:]:
            logits, tokens, hop_bytes = run(stages, head, ids, args.tokens, form, exact_tokens)
            worst = max(float((a - b).abs().max()) for a, b in zip(logits, exact_logits))
            relative = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(logits, exact_logits))
            free = run(stages, head, ids, args.tokens, form, None)[1]
            first = next((i for i, (a, b) in enumerate(zip(free, exact_tokens)) if a != b), None)
            last.append(f"smollm2 {count} spans, wire {form}: max |logit diff| {worst:.3g} ({relative:.2%} of the "
                        f"row's largest), greedy {'identical' if first is None else f'differs from token {first}'} "
                        f"over {args.tokens}, {hop_bytes} bytes a decode hop vs {exact_bytes}")
    for line in last:
        print(line)


if __name__ == "__main__":
    main()
