"""The engine against an independent implementation: Hugging Face transformers."""

from __future__ import annotations

import pytest
import torch

from tessera.stages.assembly.stage import load_stage

from ..conftest import FRANCE

pytestmark = pytest.mark.slow
DECODE_STEPS = 32
TOLERANCE = 1e-4  # float32 logits, max abs, over prefill and every decode step


def hf_step(model, ids: list[int], cache=None):
    """One forward of the reference with its KV cache: (logits [T, V], cache)."""
    with torch.inference_mode():
        out = model(torch.tensor([ids]), cache=cache, use_cache=True)
    return out.logits[0], out.cache


def chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode_chat([{"role": "user", "content": text}])


def test_logits_match_transformers_over_prefill_and_decode(hf_smol, smol_stage, smol_tokenizer):
    ids = chat_ids(smol_tokenizer, FRANCE)
    assert len(ids) == 37  # the chat template adds SmolLM's default system prompt
    ref, cache = hf_step(hf_smol, ids)
    smol_stage.open("ref", capacity=len(ids) + DECODE_STEPS + 1)
    ours = smol_stage.logits(smol_stage.forward("ref", smol_stage.embed(ids), 0))
    worst = (ref - ours).abs().max().item()
    token, pos = int(ref[-1].argmax()), len(ids)
    for _ in range(DECODE_STEPS):
        ref, cache = hf_step(hf_smol, [token], cache)
        ours = smol_stage.logits(smol_stage.forward("ref", smol_stage.embed([token]), pos))
        worst = max(worst, (ref - ours).abs().max().item())
        token, pos = int(ref[-1].argmax()), pos + 1
    smol_stage.close("ref")
    print(f"max |logits - transformers| over prefill + {DECODE_STEPS} steps: {worst:.3g}")
    assert worst <= TOLERANCE


@pytest.mark.parametrize(
    "prompt,raw",
    [
        (FRANCE, False),
        ("Write a haiku about the sea.", False),
        ("List three prime numbers greater than 100.", False),
        ("The quick brown fox", True),
        ("def fibonacci(n):", True),
    ],
)
def test_greedy_tokens_match_transformers(hf_smol, local_engine, smol_tokenizer, prompt, raw):
    from tessera.stages.decoding.generate import prompt_ids

    ids = prompt_ids(smol_tokenizer, prompt, raw=raw)
    ours = local_engine.generate_ids(ids, max_new_tokens=24)
    with torch.inference_mode():
        ref = hf_smol.generate(
            torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=2, pad_token_id=2
        )[0, len(ids):].tolist()
    assert ours == ref


def test_france_answer(local_engine):
    result = local_engine.generate(FRANCE, max_new_tokens=32)
    assert result.text == "The capital of France is Paris."
    assert result.prompt_tokens == 37


def test_tokenizer_matches_transformers_gguf_tokenizer(smol_gguf, smol_tokenizer):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(smol_gguf.parent), gguf_file=smol_gguf.name)
    for text in ["Hello world, how are you?", "In 1492, 3 ships sailed.", "émigré ✓ 東京", "<|im_start|>user\nhi<|im_end|>"]:
        assert smol_tokenizer.encode(text) == ref.encode(text, add_special_tokens=False), text
        assert smol_tokenizer.decode(smol_tokenizer.encode(text), skip_special=False) == text


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "llama"])
def test_synthetic_architectures_match_transformers(tmp_path, arch):
    """Qwen2 (q/k/v bias) and Mistral shapes, random weights, against transformers' own classes."""
    transformers = pytest.importorskip("transformers")
    from tessera.peer.cli.model_files import synthesise

    folder = synthesise(
        tmp_path / arch, hidden=96, layers=3, heads=6, kv_heads=2, intermediate=160, vocab=320, seed=3,
        architecture=arch,
    )
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).requires_grad_(False)
    stage = load_stage(folder, embed=True, head=True)
    ids = list(range(5, 45))
    logits, cache = hf_step(ref, ids[:30])
    stage.open("s", capacity=64)
    worst = (logits - stage.logits(stage.forward("s", stage.embed(ids[:30]), 0))).abs().max().item()
    for pos in range(30, 40):
        logits, cache = hf_step(ref, [ids[pos]], cache)
        ours = stage.logits(stage.forward("s", stage.embed([ids[pos]]), pos))
        worst = max(worst, (logits - ours).abs().max().item())
    assert worst <= TOLERANCE, f"{arch}: {worst}"


def test_chunked_prefill_matches_whole_prefill_and_transformers(hf_smol, smol_stage, smol_tokenizer):
    """A ~300-token prompt prefilled in 64-token chunks at their positions (as peer/request/prefill.py
    sends it) gives the logits of one whole prefill and of transformers, every position."""
    from tessera.peer.request.prefill import chunks

    ids = smol_tokenizer.encode(" ".join(f"{FRANCE} ({i})" for i in range(30)))[:300]
    assert len(ids) == 300
    ref, _ = hf_step(hf_smol, ids)
    smol_stage.open("whole", capacity=len(ids))
    smol_stage.open("chunked", capacity=len(ids))
    try:
        whole = smol_stage.logits(smol_stage.forward("whole", smol_stage.embed(ids), 0))
        hidden = smol_stage.embed(ids)
        pieces = [smol_stage.forward("chunked", hidden[a:b], a) for a, b in chunks(len(ids), 64)]
        chunked = smol_stage.logits(torch.cat(pieces))
    finally:
        smol_stage.close("whole")
        smol_stage.close("chunked")
    assert len(pieces) == 5
    assert (chunked - ref).abs().max().item() <= TOLERANCE
    assert (chunked - whole).abs().max().item() <= TOLERANCE
    assert chunked.argmax(-1).tolist() == whole.argmax(-1).tolist()
