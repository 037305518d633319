"""Reading weights from a Hugging Face-style folder: only the tensors a span needs.

A folder holds `config.json` and either `model.safetensors` or several shards
listed by `model.safetensors.index.json`. `WeightFolder` maps tensor names to
files and opens them memory-mapped, so asking for layers 10..19 of a 30-layer
model reads those layers' bytes and nothing else. Every tensor's shape is checked
against the `ModelSpec` before it is used, and — when the folder is given a `check` —
its bytes, as stored, are handed to it before they are cast or used (a peer hashes
its span against the model's manifest in that same read: peer/weights/verify.py).
Which checkpoint tensors make each of the engine's is the family's mapping
(stages/families/tensors.py); this module only reads.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors import SafetensorError, safe_open

from tessera.stages.errors import ModelFormatError
from tessera.stages.families.catalog import edge_names, spec_from_file, tensors_of_layer
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.families.tensors import Choices, Stacked, embedding_name, final_norm_name
from tessera.stages.weights.registry import MANIFEST
from tessera.stages.weights.tensor_table import group_of

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Fewer bytes than a parameter takes in any form a folder may store it in (GGUF's lowest-bit blocks,
# IQ1_S, take 1.56 bits a weight; MXFP4 4.25; Q4_0 4.5): a config describing more parameters than its
# folder's weight files could hold at one bit each describes another model.
MIN_BYTES_PER_PARAM = 1 / 8


# Called with each tensor as it is read: its name, and the whole tensor in its stored dtype —
# or None when only part of it is read (a fused tensor's row, a rank's slices), for the check
# to read the rest itself; raises to refuse it.
TensorCheck = Callable[[str, torch.Tensor | None], None]


def check_fits(spec: ModelSpec, names: Iterable[str], stored_bytes: int | None) -> None:
    """Raise ModelFormatError when config.json describes more than the folder holds: more decoder
    layers than its tensors name, or more parameters than `stored_bytes` of weight files could store
    at one bit each (`MIN_BYTES_PER_PARAM`). A crafted config (`num_hidden_layers`, `num_experts`, a
    width far past the tensors) is so refused before anything is built per layer or per expert."""
    layers = [int(group[len("layer."):]) for group in map(group_of, names) if group.startswith("layer.")]
    held = max(layers) + 1 if layers else 0
    if spec.num_layers > held:
        raise ModelFormatError(f"config.json describes {spec.num_layers} decoder layers, but the folder's tensors "
                               f"name {held}")
    if stored_bytes is not None and spec.param_count * MIN_BYTES_PER_PARAM > stored_bytes:
        raise ModelFormatError(f"config.json describes {spec.param_count} parameters, more than the folder's "
                               f"{stored_bytes} bytes of weights can hold")


def partial_table(folder: Path) -> dict[str, int] | None:
    """{tensor: its bytes} of the whole model, from the manifest of a folder a fetch fills in part
    (stages/weights/registry.py), or None for any other folder."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        if not manifest.get("partial"):
            return None
        return {name: int(e["end"]) - int(e["begin"]) for name, e in manifest["tensors"]["entries"].items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


class WeightFolder:
    """Tensors of one model folder, opened lazily and memory-mapped."""

    def __init__(self, folder: Path, *, check: TensorCheck | None = None) -> None:
        self.folder = Path(folder)
        self.spec = spec_from_file(self.folder / "config.json")
        self.check = check
        self._where = self._index()
        self._check_fits()

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

    def _check_fits(self) -> None:
        """`check_fits` against the tensors the folder names and the bytes of its files; where those
        fall short, a folder a fetch fills in part (its manifest says "partial") is held to the whole
        model's table in its manifest instead (its files hold only the fetched spans)."""
        try:
            stored: int | None = sum(path.stat().st_size for path in self.files())
        except OSError:  # a file the index names is not there: the checks that read it say so
            stored = None
        try:
            check_fits(self.spec, self._where, stored)
        except ModelFormatError:
            table = partial_table(self.folder)
            if table is None:
                raise
            check_fits(self.spec, table, sum(table.values()))

    def reading_as(self, spec: ModelSpec) -> "WeightFolder":
        """This folder read by `spec` rather than by its config's: a checkpoint's multi-token-prediction
        blocks, named and shaped as decoder layers of a spec that lists them (families/mtp.py)."""
        other = copy.copy(self)
        other.spec = spec
        return other

    def files(self) -> list[Path]:
        """The files the folder's tensors live in (as the index names them), sorted."""
        return sorted(set(self._where.values()))

    def names(self) -> set[str]:
        """Every tensor name the folder lists."""
        return set(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def stored_name(self, name: str) -> str:
        """The name the folder holds tensor `name` under: it, or the first alias of it its family gives
        (`Family.edge_aliases`: DeepSeek-V4's published `head.weight` for `lm_head.weight`) it holds."""
        return next((n for n in edge_names(self.spec, name) if n in self._where), name)

    def read(self, wanted: dict[str, tuple[int, ...]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Read the named tensors (each checked against its expected shape), cast to `dtype` (a tensor of
        integers, a hash layer's expert table, keeps its dtype). A name may be held under an alias."""
        out: dict[str, torch.Tensor] = {}
        by_file: dict[Path, list[tuple[str, str]]] = {}
        for name in wanted:
            stored = self.stored_name(name)
            if stored not in self._where:
                raise ModelFormatError(f"tensor {name!r} is missing from {str(self.folder)!r}")
            by_file.setdefault(self._where[stored], []).append((name, stored))
        for path, names in sorted(by_file.items()):
            try:
                with safe_open(path, framework="pt") as f:
                    for name, stored in names:
                        tensor = f.get_tensor(stored)
                        if tuple(tensor.shape) != wanted[name]:
                            raise ModelFormatError(
                                f"tensor {stored!r} has shape {tuple(tensor.shape)!r}, expected {wanted[name]!r}"
                            )
                        if self.check is not None:
                            self.check(stored, tensor)  # the bytes as stored, before any cast
                        out[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
            except (SafetensorError, OSError) as bad:
                raise ModelFormatError(f"cannot read {str(path)!r}: {bad}") from None
        return out

    def choose(self, choices: Choices) -> Stacked:
        """The first layout of an engine tensor that the folder holds completely (ModelFormatError
        naming a missing tensor of the first layout when it holds none)."""
        for source in choices:
            if all(name in self._where for name in source.names):
                return source
        missing = next(n for n in choices[0].names if n not in self._where)
        raise ModelFormatError(f"tensor {missing!r} is missing from {str(self.folder)!r}")

    def read_stacked(self, source: Stacked, dtype: torch.dtype) -> torch.Tensor:
        """The parts of `source` concatenated along dim 0, read one at a time straight into one
        buffer (so that loading never holds a piece and the stacked copy of a whole layer at once);
        of a fused tensor only row `source.index` is read, transposed and its interleaved rows
        regrouped as `source` says. A tensor taken whole is as `read` gives it."""
        if len(source.names) == 1 and source.index is None and not (source.transposed or source.interleaved):
            return self.read({source.names[0]: source.shapes[0]}, dtype)[source.names[0]]
        out = torch.empty(source.shape, dtype=dtype)
        at = 0
        for i, name in enumerate(source.names):
            piece = self.read_part(name, source.shapes[i], source.index, dtype)
            if source.transposed:
                piece = piece.transpose(-1, -2)
            if source.interleaved:  # rows gate0, up0, gate1, up1, ... -> all gates, then all ups
                piece = torch.cat((piece[0::2], piece[1::2]))
            out[at : at + piece.shape[0]] = piece
            at += piece.shape[0]
            del piece
        return out

    def read_part(self, name: str, shape: tuple[int, ...], index: int | None, dtype: torch.dtype,
                  *, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor `name` (checked to have `shape`) — its row `index` when given — cast to `dtype`;
        of that, only `rows` and `cols` ([lo, hi)) when given (a tensor-shard rank's slices)."""
        if name not in self._where:
            raise ModelFormatError(f"tensor {name!r} is missing from {str(self.folder)!r}")
        path = self._where[name]
        try:
            with safe_open(path, framework="pt") as f:
                sl = f.get_slice(name)
                if tuple(sl.get_shape()) != shape:
                    raise ModelFormatError(f"tensor {name!r} has shape {tuple(sl.get_shape())!r}, expected {shape!r}")
                inner = shape[1:] if index is not None else shape
                r0, r1 = rows if rows is not None else (0, inner[0])
                window = [slice(r0, r1)] if len(inner) == 1 else [slice(r0, r1), slice(*(cols or (0, inner[1])))]
                tensor = sl[tuple([index, *window] if index is not None else window)]
        except (SafetensorError, OSError) as bad:
            raise ModelFormatError(f"cannot read {str(path)!r}: {bad}") from None
        if self.check is not None:
            whole = index is None and rows is None and cols is None
            self.check(name, tensor if whole else None)  # the bytes as stored; a part: the check reads the rest
        return (tensor.to(dtype) if tensor.is_floating_point() else tensor).contiguous()

    def read_stored(self, name: str, shape: tuple[int, ...], dtypes: tuple[str, ...], *,
                    index: int | None = None) -> torch.Tensor:
        """Tensor `name` exactly as stored (a shipped format's codes, blocks or scales: no cast),
        checked to have `shape` and one of the safetensors `dtypes`; of it only row `index` when
        given (one expert of a fused tensor). Whole, it is a view of the memory-mapped file."""
        if name not in self._where:
            raise ModelFormatError(f"tensor {name!r} is missing from {str(self.folder)!r}")
        path = self._where[name]
        try:
            with safe_open(path, framework="pt") as f:
                sl = f.get_slice(name)
                if tuple(sl.get_shape()) != shape:
                    raise ModelFormatError(f"tensor {name!r} has shape {tuple(sl.get_shape())!r}, expected {shape!r}")
                if sl.get_dtype() not in dtypes:
                    raise ModelFormatError(f"tensor {name!r} is {sl.get_dtype()}, expected {' or '.join(dtypes)}")
                tensor = f.get_tensor(name) if index is None else sl[index]
        except (SafetensorError, OSError, TypeError) as bad:  # TypeError: a dtype this torch cannot hold
            raise ModelFormatError(f"cannot read {name!r} from {str(path)!r}: {bad}") from None
        if self.check is not None:
            self.check(name, tensor if index is None else None)  # as stored; one expert's row: the check reads the rest
        return tensor

    def layer_state(self, layer: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Every tensor of layer `layer` under the engine's names (`tessera.stages.layers.block.Block`),
        q/k/v and gate/up stacked."""
        return {name: self.read_stacked(self.choose(choices), dtype)
                for name, choices in tensors_of_layer(self.spec, layer).items()}

    def embedding(self, dtype: torch.dtype) -> torch.Tensor:
        name = embedding_name(self.spec)
        return self.read({name: (self.spec.vocab_size, self.spec.hidden_size)}, dtype)[name]

    def head(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(final norm weight as stored, lm_head weight); the embedding when the model ties them."""
        spec = self.spec
        # untied without lm_head.weight: `read` refuses it (transformers would draw a random head)
        head_name = embedding_name(spec) if spec.tie_embeddings else "lm_head.weight"
        norm = final_norm_name(spec)
        t = self.read({norm: (spec.hidden_size,), head_name: (spec.vocab_size, spec.hidden_size)}, dtype)
        return t[norm], t[head_name]

