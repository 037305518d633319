"""Seeded random-weight models of real shapes, for benchmarks at sizes we cannot download.

Compute cost does not depend on the weights, so a 1B-shaped model with random
weights measures what a real 1B model would. The folder has the same format as a
converted model (config.json, model.safetensors — or, past SINGLE_FILE_BYTES, one file
per layer and their index — a small byte-level tokenizer and a ChatML template), so
every command accepts it. Any family's spec can be written (`write_synth`); published
shapes by name are in stages/families/shapes.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import torch
from safetensors.torch import save_file

from tessera.stages.errors import UnsupportedModel
from tessera.stages.families.catalog import (
    FAMILIES, families_from_sizes, layer_matrices, model_tensors, tensors_of_layer, to_config,
)
from tessera.stages.families.shipped import ShippedFormat
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.weights.folder import INDEX_FILE, SINGLE_FILE
from tessera.stages.kernels.encode import encode_matrix
from tessera.stages.weights.tensor_table import group_of

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
INIT_STD = 0.02  # the usual initializer range of Llama-family configs
SINGLE_FILE_BYTES = 2 << 30  # larger models are written one file per layer (write_weights)
DRAW_ROWS_BYTES = 256 << 20  # larger tensors are drawn one row at a time (synth_tensors)
SYNTH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    """A shape of family `architecture` from plain sizes (a family whose `from_sizes` builds one:
    families/catalog.py `families_from_sizes`; UnsupportedModel for any other)."""
    family = FAMILIES.get(architecture)
    if family is None or family.from_sizes is None:
        raise UnsupportedModel(f"{architecture!r} is not built from plain sizes (tessera builds {list(families_from_sizes())})")
    return family.from_sizes(
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


def synth_ids(spec: ModelSpec) -> ModelSpec:
    """`spec` with the byte tokenizer's special ids (no BOS; EOS `<|im_end|>`), which a synthetic
    model's folder holds whatever the published model's ids were."""
    return replace(spec, bos_token_id=None, eos_token_ids=(SPECIAL_TOKENS.index("<|im_end|>"),))


def synth_tensors(spec: ModelSpec, seed: int, dtype: torch.dtype = torch.float32
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """Random weights for every tensor of `spec` (any family, in its published layout), drawn in a
    fixed order from `seed`, one tensor at a time. A tensor over `DRAW_ROWS_BYTES` (a fused expert
    tensor at a real shape) is drawn row by row into its `dtype`, never whole in float32."""
    gen = torch.Generator().manual_seed(seed)
    for name, shape in model_tensors(spec).items():
        mean, std = (1.0, 0.1) if name.endswith("norm.weight") else (0.0, INIT_STD)
        if math.prod(shape) * 4 <= DRAW_ROWS_BYTES:
            yield name, (mean + std * torch.randn(shape, generator=gen)).to(dtype)
            continue
        tensor = torch.empty(shape, dtype=dtype)
        for row in range(shape[0]):
            tensor[row] = mean + std * torch.randn(shape[1:], generator=gen)
        yield name, tensor


def synth_state(spec: ModelSpec, seed: int) -> dict[str, torch.Tensor]:
    """Every tensor of `synth_tensors` at once (float32)."""
    return dict(synth_tensors(spec, seed))


def shipped_state(spec: ModelSpec, state: dict[str, torch.Tensor], *, seed: int) -> dict[str, torch.Tensor]:
    """`state` (float, every tensor in its published layout) with each layer matrix in the form
    `spec.shipped` stores it (stages/kernels/encode.py: fp8 and MXFP4 encode the values,
    GGUF block types are random blocks of the same size)."""
    assert spec.shipped is not None, "a spec that ships quantized"
    gen = torch.Generator().manual_seed(seed)
    out = dict(state)
    for layer in range(spec.num_layers):
        matrices = {path + ".weight" for path in layer_matrices(spec, layer)}
        for ours, choices in tensors_of_layer(spec, layer).items():
            if ours in matrices:
                for name in choices[0].names:
                    out.update(encode_matrix(spec.shipped, name, out.pop(name), std=INIT_STD, gen=gen))
    return out


def gguf_form(spec: ModelSpec, kind: str) -> ShippedFormat:
    """Every layer matrix of `spec` as GGUF blocks of `kind` (the embedding and head stay float)."""
    names = [name for layer in range(spec.num_layers)
             for ours, choices in tensors_of_layer(spec, layer).items()
             if ours.rpartition(".")[0] in layer_matrices(spec, layer) for name in choices[0].names]
    return ShippedFormat("gguf", tensor_types=tuple(sorted((name, kind) for name in names)))


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


def write_weights(spec: ModelSpec, out: Path, *, seed: int, dtype: torch.dtype = torch.float32) -> list[str]:
    """`synth_tensors` as safetensors: one `model.safetensors` up to `SINGLE_FILE_BYTES`, else one
    file per part of the model (embedding, each layer, norm and head: `tensor_table.group_of`) with
    the index transformers writes, each written as soon as it is drawn, so that a model at a real
    shape never lies whole in memory. Returns the files written."""
    shapes = model_tensors(spec)
    itemsize = torch.empty((), dtype=dtype).element_size()
    total = sum(math.prod(shape) for shape in shapes.values()) * itemsize
    if total <= SINGLE_FILE_BYTES:
        save_file(dict(synth_tensors(spec, seed, dtype)), str(out / SINGLE_FILE), metadata={"format": "pt"})
        return [SINGLE_FILE]
    groups = list(dict.fromkeys(group_of(name) for name in shapes))  # in drawing order
    files = {g: f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i, g in enumerate(groups)}
    part: dict[str, torch.Tensor] = {}
    for name, tensor in synth_tensors(spec, seed, dtype):
        if part and group_of(next(iter(part))) != group_of(name):
            save_file(part, str(out / files[group_of(next(iter(part)))]), metadata={"format": "pt"})
            part = {}
        part[name] = tensor
    save_file(part, str(out / files[group_of(next(iter(part)))]), metadata={"format": "pt"})
    index = {"metadata": {"total_size": total}, "weight_map": {name: files[group_of(name)] for name in shapes}}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    return [INDEX_FILE, *files.values()]


def write_synth(spec: ModelSpec, out: Path, *, seed: int, dtype: torch.dtype = torch.float32) -> list[str]:
    """Write a complete model folder (weights stored as `dtype`); return the files written."""
    if spec.vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab {spec.vocab_size!r} is too small for the byte tokenizer (need >= 259)")
    out.mkdir(parents=True, exist_ok=True)
    if spec.shipped is not None:  # drawn in float32 and encoded whole: a test's or a bench's model
        save_file(shipped_state(spec, synth_state(spec, seed), seed=seed), str(out / SINGLE_FILE),
                  metadata={"format": "pt"})
        weights = [SINGLE_FILE]
    else:
        weights = write_weights(spec, out, seed=seed, dtype=dtype)
    (out / "config.json").write_text(json.dumps({**to_config(spec), "tessera_synth_seed": seed}, indent=2))
    (out / "tokenizer.json").write_text(byte_tokenizer_json(spec.vocab_size))
    config = {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "add_bos_token": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out / "chat_template.jinja").write_text(CHATML)
    return ["config.json", *weights, "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
