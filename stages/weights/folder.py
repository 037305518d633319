"""Reading weights from a Hugging Face-style folder: only the tensors a span needs.

A folder holds `config.json` and either `model.safetensors` or several shards
listed by `model.safetensors.index.json`. `WeightFolder` maps tensor names to
files and opens them memory-mapped, so asking for layers 10..19 of a 30-layer
model reads those layers' bytes and nothing else. Every tensor's shape is checked
against the `ModelSpec` before it is used, and — when the folder is given a `check` —
its bytes, as stored, are handed to it before they are cast or used (a peer hashes
its span against the model's manifest in that same read: peer/weights/verify.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open

from tessera.stages.errors import ModelFormatError
from tessera.stages.families.spec import ModelSpec

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def layer_tensor_names(spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
    """Hugging Face names of one layer's tensors, with the shape each must have."""
    h, i = spec.hidden_size, spec.intermediate_size
    p = f"model.layers.{layer}."
    names = {
        p + "input_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (spec.q_size, h),
        p + "self_attn.k_proj.weight": (spec.kv_size, h),
        p + "self_attn.v_proj.weight": (spec.kv_size, h),
        p + "self_attn.o_proj.weight": (h, spec.q_size),
        p + "post_attention_layernorm.weight": (h,),
        p + "mlp.gate_proj.weight": (i, h),
        p + "mlp.up_proj.weight": (i, h),
        p + "mlp.down_proj.weight": (h, i),
    }
    if spec.attention_bias:
        names[p + "self_attn.q_proj.bias"] = (spec.q_size,)
        names[p + "self_attn.k_proj.bias"] = (spec.kv_size,)
        names[p + "self_attn.v_proj.bias"] = (spec.kv_size,)
    return names


# Called with each tensor as it is read (its name, and the tensor in its stored dtype);
# raises to refuse it.
TensorCheck = Callable[[str, torch.Tensor], None]


class WeightFolder:
    """Tensors of one model folder, opened lazily and memory-mapped."""

    def __init__(self, folder: Path, *, check: TensorCheck | None = None) -> None:
        self.folder = Path(folder)
        self.spec = ModelSpec.from_file(self.folder / "config.json")
        self.check = check
        self._where = self._index()

    def _index(self) -> dict[str, Path]:
        index = self.folder / INDEX_FILE
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as bad:
                raise ModelFormatError(f"{str(index)!r} is not a safetensors index: {bad}") from None
            return {name: self.folder / file for name, file in weight_map.items()}
        single = self.folder / SINGLE_FILE
        if not single.exists():
            raise ModelFormatError(f"no {SINGLE_FILE} or {INDEX_FILE} in {str(self.folder)!r}")
        try:
            with safe_open(single, framework="pt") as f:
                return {name: single for name in f.keys()}
        except (SafetensorError, OSError) as bad:
            raise ModelFormatError(f"{str(single)!r} is not a readable safetensors file: {bad}") from None

    def files(self) -> list[Path]:
        """The files the folder's tensors live in (as the index names them), sorted."""
        return sorted(set(self._where.values()))

    def names(self) -> set[str]:
        """Every tensor name the folder lists."""
        return set(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def read(self, wanted: dict[str, tuple[int, ...]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Read the named tensors (each checked against its expected shape), cast to `dtype`."""
        out: dict[str, torch.Tensor] = {}
        by_file: dict[Path, list[str]] = {}
        for name in wanted:
            if name not in self._where:
                raise ModelFormatError(f"tensor {name!r} is missing from {str(self.folder)!r}")
            by_file.setdefault(self._where[name], []).append(name)
        for path, names in sorted(by_file.items()):
            try:
                with safe_open(path, framework="pt") as f:
                    for name in names:
                        tensor = f.get_tensor(name)
                        if tuple(tensor.shape) != wanted[name]:
                            raise ModelFormatError(
                                f"tensor {name!r} has shape {tuple(tensor.shape)!r}, expected {wanted[name]!r}"
                            )
                        if self.check is not None:
                            self.check(name, tensor)  # the bytes as stored, before any cast
                        out[name] = tensor.to(dtype)
            except (SafetensorError, OSError) as bad:
                raise ModelFormatError(f"cannot read {str(path)!r}: {bad}") from None
        return out

    def read_stacked(self, names: list[str], shapes: dict[str, tuple[int, ...]], dtype: torch.dtype) -> torch.Tensor:
        """Tensors concatenated along dim 0, read one at a time straight into one buffer
        (so that loading never holds a piece and the stacked copy of a whole layer at once)."""
        rows = sum(shapes[n][0] for n in names)
        out = torch.empty((rows, *shapes[names[0]][1:]), dtype=dtype)
        at = 0
        for name in names:
            piece = self.read({name: shapes[name]}, dtype)[name]
            out[at : at + piece.shape[0]] = piece
            at += piece.shape[0]
            del piece
        return out

    def block_state(self, layer: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """One layer's tensors under the engine's names (`tessera.stages.layers.model.Block`), q/k/v and gate/up stacked."""
        spec = self.spec
        p = f"model.layers.{layer}."
        shapes = layer_tensor_names(spec, layer)
        single = [p + "input_layernorm.weight", p + "self_attn.o_proj.weight",
                  p + "post_attention_layernorm.weight", p + "mlp.down_proj.weight"]
        t = self.read({n: shapes[n] for n in single}, dtype)
        state = {
            "attn_norm.weight": t[single[0]],
            "attn.wqkv.weight": self.read_stacked([p + f"self_attn.{x}_proj.weight" for x in "qkv"], shapes, dtype),
            "attn.wo.weight": t[single[1]],
            "mlp_norm.weight": t[single[2]],
            "mlp.w_gate_up.weight": self.read_stacked([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], shapes, dtype),
            "mlp.w_down.weight": t[single[3]],
        }
        if spec.attention_bias:
            state["attn.wqkv.bias"] = self.read_stacked([p + f"self_attn.{x}_proj.bias" for x in "qkv"], shapes, dtype)
        return state

    def embedding(self, dtype: torch.dtype) -> torch.Tensor:
        name = "model.embed_tokens.weight"
        return self.read({name: (self.spec.vocab_size, self.spec.hidden_size)}, dtype)[name]

    def head(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(final norm weight, lm_head weight); the embedding when the model ties them."""
        spec = self.spec
        # untied without lm_head.weight: `read` refuses it (transformers would draw a random head)
        head_name = "model.embed_tokens.weight" if spec.tie_embeddings else "lm_head.weight"
        t = self.read(
            {"model.norm.weight": (spec.hidden_size,), head_name: (spec.vocab_size, spec.hidden_size)},
            dtype,
        )
        return t["model.norm.weight"], t[head_name]

