"""Seeded random-weight models of real shapes, for benchmarks at sizes we cannot download.

Compute cost does not depend on the weights, so a 1B-shaped model with random
weights measures what a real 1B model would. The folder has the same format as a
converted model (config.json, model.safetensors, a small byte-level tokenizer and
a ChatML template), so every command accepts it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from tessera.stages.families.catalog import model_tensors, to_config
from tessera.stages.families.llama import llama_spec
from tessera.stages.families.spec import ModelSpec

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
INIT_STD = 0.02  # the usual initializer range of Llama-family configs


def synth_spec(
    *,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    vocab: int = 32000,
    architecture: str = "llama",
    tie_embeddings: bool = False,
    max_position: int = 4096,
) -> ModelSpec:
    """A Llama-block shape (`architecture`: llama, mistral or qwen2)."""
    return llama_spec(
        family=architecture,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        rms_norm_eps=1e-5,
        max_position=max_position,
        tie_embeddings=tie_embeddings,
        eos_token_ids=(2,),
    )


def synth_state(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Random weights for every tensor of `spec` (any family, in its published layout), drawn in a
    fixed order from `seed`."""
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in model_tensors(spec).items():
        if name.endswith("norm.weight"):
            state[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            state[name] = INIT_STD * torch.randn(shape, generator=gen)
    return state


def byte_tokenizer_json(vocab: int) -> str:
    """A byte-level tokenizer: 256 byte tokens, the ChatML specials, fillers up to `vocab`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    names = list(SPECIAL_TOKENS) + alphabet
    names += [f"<unused{i}>" for i in range(vocab - len(names))]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(names[:vocab])}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok.to_str()


def write_synth(spec: ModelSpec, out: Path, *, seed: int) -> list[str]:
    """Write a complete model folder; return the files written."""
    if spec.vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab {spec.vocab_size!r} is too small for the byte tokenizer (need >= 259)")
    out.mkdir(parents=True, exist_ok=True)
    save_file(synth_state(spec, seed), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**to_config(spec), "tessera_synth_seed": seed}, indent=2))
    (out / "tokenizer.json").write_text(byte_tokenizer_json(spec.vocab_size))
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_bos_token": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "chat_template.jinja").write_text(CHATML)
    return ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
