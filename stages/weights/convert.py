"""GGUF -> a Hugging Face-style model folder, its blocks kept as they are or dequantised.

A GGUF file holds tensors under llama.cpp's names plus the tokenizer and chat template as
metadata. Each tensor is renamed, llama.cpp's RoPE row permutation of q/k is undone where
the file's family says llama.cpp made it (Llama, Mixtral: rows of blocks move as rows of
weights do), a sparse layer's experts, stacked on one tensor (`blk.N.ffn_gate_exps` [E, I, H] ...), are cut into one
tensor per expert as Hugging Face checkpoints publish them, and `config.json`,
`model.safetensors`, `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja`
are written. Two forms:

- kept (`tessera model import FILE.gguf`): every tensor's bytes as the file holds them, a
  block-quantised one as uint8 [rows, row bytes], its ggml type in the config's
  `quantization_config` (families/shipped.py "gguf"); a span computes them as stored
  (stages/kernels/ggml.py) and holds the file's bytes, not floats.
- dequantised (`--dequantize`; how the built-in SmolLM2 is fetched): every tensor to float32
  by the `gguf` package's own dequantizers.

A split GGUF (llama.cpp's `NAME-00001-of-00003.gguf` shards, how large models ship) is read
shard by shard, each shard's header checked, and written as one safetensors file per shard with
their index: the folder a peer loads one span of, as it would a sharded Hugging Face checkpoint.

Which family a file is, the config its metadata describes and its tensor names are the
family's to say (its `GgufForm`: stages/families/gguf.py); this module names none. A ggml type
outside families/shipped.py GGML_TYPES is refused when kept (the `gguf` package dequantises more).
Only byte-level BPE ("gpt2") tokenizers are converted; SentencePiece GGUFs are refused with a
clear error.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from safetensors.torch import save_file

from tessera.stages.errors import ModelFormatError, UnsupportedModel
from tessera.stages.families.catalog import FAMILIES, gguf_family, spec_from_config, to_config
from tessera.stages.families.gguf import GgufMetadata, hf_tensors
from tessera.stages.families.shipped import ShippedFormat, ggml_type_of
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.weights.folder import INDEX_FILE, SINGLE_FILE
from tessera.stages.weights.gguf_directory import read_gguf_directory

Progress = Callable[[int, int, str], None]

# GGUF token types (llama.cpp): 3 = control token, 4 = user-defined
SPECIAL_TOKEN_TYPES = (3, 4)


def unpermute_rope_rows(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (interleaved -> half-split RoPE layout)."""
    half = weight.shape[0] // n_heads // 2
    w = weight.reshape(n_heads, half, 2, *weight.shape[1:])
    return w.swapaxes(1, 2).reshape(weight.shape)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def spec_from_gguf(reader: Any) -> ModelSpec:
    return spec_from_config(gguf_config(reader))


def gguf_metadata(reader: Any) -> GgufMetadata:
    """A GGUF reader's metadata as the families read it (stages/families/gguf.py)."""
    return GgufMetadata(lambda key: _field(reader, key), frozenset(t.name for t in reader.tensors))


def gguf_config(reader: Any) -> dict[str, Any]:
    """The Hugging Face config.json a GGUF's metadata describes, as its family maps the keys
    (UnsupportedModel for an architecture no family reads, ModelFormatError for a key it lacks)."""
    meta = gguf_metadata(reader)
    family = gguf_family(meta)
    assert family.gguf is not None, "gguf_family returns a family with a GGUF form"
    try:
        return family.gguf.config(meta)
    except KeyError as missing:
        raise ModelFormatError(f"GGUF metadata lacks the key {missing.args[0]!r} a {family.name} file has") from None


def gguf_tokenizer_files(reader: Any) -> dict[str, str]:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja from GGUF metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise UnsupportedModel(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges") or []]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)]
    if _field(reader, "tokenizer.ggml.pre") == "smollm":
        # SmolLM's own tokenizer splits every digit apart before the byte-level regex
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    special = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t in SPECIAL_TOKEN_TYPES]
    tok.add_special_tokens(special)

    def token(key: str) -> str | None:
        idx = _field(reader, key)
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    template = _field(reader, "tokenizer.chat_template")
    config = {
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "pad_token": token("tokenizer.ggml.padding_token_id"),
        "unk_token": token("tokenizer.ggml.unknown_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
    }
    files = {"tokenizer.json": tok.to_str(), "tokenizer_config.json": json.dumps(config, indent=2)}
    if template:
        files["chat_template.jinja"] = template
    return files


# llama.cpp's split files (gguf-split, convert_hf_to_gguf --split-max-*): NAME-00001-of-00003.gguf ...
SPLIT_NAME = re.compile(r"(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf")
MAX_SHARDS = 9999  # what the name's five digits allow


def gguf_shards(path: Path) -> list[Path]:
    """The files of the GGUF `path` is: itself, or every shard of a split one in order (any shard named).
    Raises ModelFormatError for a shard that is missing."""
    match = SPLIT_NAME.fullmatch(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    if not 1 <= int(match["no"]) <= count <= MAX_SHARDS:
        raise ModelFormatError(f"{str(path)!r}: shard {int(match['no'])} of {count} is not a split GGUF's name")
    shards = [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [str(s.name) for s in shards if not s.exists()]
    if missing:
        raise ModelFormatError(f"{str(path)!r} is shard {int(match['no'])} of {count}: {missing[0]!r} is missing "
                               f"({len(missing)} missing in all) beside it")
    return shards


def split_name(path: Path) -> str:
    """A GGUF's model name: its file name without `.gguf` and without a split file's `-00001-of-00003`."""
    match = SPLIT_NAME.fullmatch(path.name)
    return match["stem"] if match is not None else path.stem


def convert_gguf(path: Path, out: Path, *, keep_blocks: bool = False, progress: Progress | None = None) -> list[str]:
    """Write a model folder for the GGUF at `path` into `out`; return the files written. With
    `keep_blocks`, every tensor keeps the file's bytes (module docstring); otherwise each is
    dequantised to float32. A split GGUF (any of its shards named) is read shard by shard, each
    written as one safetensors file of the folder (with the index transformers writes), so that
    converting never holds more than a shard's tensors.

    Raises ModelFormatError (unreadable file, a missing or foreign shard, an unknown tensor) or
    UnsupportedModel.
    """
    from gguf import GGUFReader

    shards = gguf_shards(path)
    for shard in shards:
        read_gguf_directory(shard)  # the header checked first: the gguf package's reader trusts its counts
    try:
        readers = [GGUFReader(str(shard)) for shard in shards]
        config = gguf_config(readers[0])
        tokenizer_files = gguf_tokenizer_files(readers[0])
        check_split(shards, readers)
    except (OSError, ValueError, KeyError, IndexError, TypeError, OverflowError, UnicodeDecodeError) as bad:
        raise ModelFormatError(f"{str(path)!r} is not a readable GGUF file: {type(bad).__name__}: "
                               f"{str(bad).splitlines()[0] if str(bad) else ''}") from None
    spec = spec_from_config(config)
    family = FAMILIES[spec.family]
    permute = family.gguf is not None and family.gguf.permuted_rope
    out.mkdir(parents=True, exist_ok=True)
    types: dict[str, str] = {}
    total, done = sum(len(r.tensors) for r in readers), 0
    files = [SINGLE_FILE] if len(readers) == 1 else \
        [f"model-{i + 1:05d}-of-{len(readers):05d}.safetensors" for i in range(len(readers))]
    weight_map: dict[str, str] = {}
    for reader, file in zip(readers, files):
        state: dict[str, torch.Tensor] = {}
        for t in reader.tensors:
            state.update(_converted(t, spec, permute, keep_blocks, types))
            done += 1
            if progress:
                progress(done, total, "copying blocks" if keep_blocks else "dequantising")
        save_file(state, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(state, file))
        del state
    if keep_blocks:
        spec = replace(spec, shipped=ShippedFormat("gguf", tensor_types=tuple(sorted(types.items()))))
    (out / "config.json").write_text(json.dumps(to_config(spec), indent=2))
    written = ["config.json", *files]
    if len(files) > 1:
        sizes = sum((out / f).stat().st_size for f in files)
        (out / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": sizes}, "weight_map": weight_map}, indent=2))
        written.append(INDEX_FILE)
    for fname, text in tokenizer_files.items():
        (out / fname).write_text(text)
        written.append(fname)
    return written


def check_split(shards: list[Path], readers: list[Any]) -> None:
    """Each shard of a split GGUF says it is that shard of that many, and they hold the tensors the first
    counts; a lone file must not be one shard of several. Raises ModelFormatError."""
    for i, (shard, reader) in enumerate(zip(shards, readers)):
        no, count = _field(reader, "split.no", 0), _field(reader, "split.count", 1)
        if (int(no), int(count)) != (i, len(shards)):
            raise ModelFormatError(f"{str(shard)!r} says it is shard {int(no) + 1} of {int(count)}, where its name "
                                   f"and its neighbours make it {i + 1} of {len(shards)}")
    if len(shards) > 1:
        counted = int(_field(readers[0], "split.tensors.count", -1))
        held = sum(len(r.tensors) for r in readers)
        if counted != held:
            raise ModelFormatError(f"{str(shards[0])!r}: the split counts {counted} tensors, its shards hold {held}")


def _converted(t: Any, spec: ModelSpec, permute: bool, keep_blocks: bool, types: dict[str, str]) -> dict[str, torch.Tensor]:
    """The checkpoint tensors GGUF tensor `t` becomes (its blocks kept, or dequantised); `types` gets their
    ggml types. Raises ModelFormatError (no counterpart) or UnsupportedModel (a type not kept as it is)."""
    from gguf.quants import dequantize

    experts = FAMILIES[spec.family].experts
    num_experts = max((layer.mlp.num_experts for layer in spec.layers), default=0)
    targets = hf_tensors(t.name, experts, num_experts)
    if not targets:
        if t.name.startswith("rope_freqs"):
            return {}  # llama.cpp's precomputed RoPE factors; we compute them from the config
        raise ModelFormatError(f"GGUF tensor {t.name!r} has no Hugging Face counterpart")
    dims = [int(d) for d in reversed(t.shape)]  # GGUF lists the innermost first
    if keep_blocks:
        kind = ggml_type_of(int(t.tensor_type), f"GGUF tensor {t.name!r}")
        values = np.asarray(t.data)  # a block type: uint8 [..., rows, row bytes]; a float one: its values
        values = values.reshape([*dims[:-1], values.shape[-1]] if not kind.is_float else dims)
        if kind.name == "BF16":  # numpy has no bfloat16: the reader gives its bits
            values = values.view(np.int16)
    else:
        values = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(dims)
    out = {}
    for name, expert in targets:
        tensor = values if expert is None else values[expert]
        layer = spec.layers[int(name.split(".")[2])] if name.startswith("model.layers.") else None
        if permute and layer is not None and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = layer.attention.num_heads if name.endswith("q_proj.weight") else layer.attention.num_kv_heads
            tensor = unpermute_rope_rows(tensor, heads)
        out[name] = torch.from_numpy(np.require(tensor, requirements=["C", "W"]))
        if keep_blocks:
            if kind.name == "BF16":
                out[name] = out[name].view(torch.bfloat16)
            types[name] = kind.name
    return out
