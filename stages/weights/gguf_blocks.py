"""A span's int4 matrices read straight from the model's source GGUF, without a float copy.

A model fetched from a GGUF keeps the file beside its converted folder (`source.gguf`). When
the GGUF's matrices are Q4_1 — 32 weights a block, `w = d q + m` with q in [0, 15] and d, m
fp16 — a float32 CPU span quantized `int4` (group 32) takes the blocks as they are: the codes
are already in the layout `stages/kernels/quant.py` keeps (a block's low nibbles its first 16 codes,
the high nibbles its last 16), d and m widen exactly to float32, and q/k rows are un-permuted
as the converter does. Only integers are copied; no weight is ever dequantized to load it.

Served as-is only where it is the same model as `--quant int4` of the converted folder: every
block must hold codes 0 and 15 (llama.cpp's Q4_1 quantizer puts the block's minimum at 0 and
its maximum at 15) and `((15 d + m) - m) / 15` must give d back in float32. Then re-quantizing
the dequantized block (`quantize_linear`: s = (max - min) / 15, m = min, q = round((w - m) / s))
yields exactly these codes, d and m, so a peer loading the GGUF and a peer quantizing the
folder advertise the same `+int4g32` and hold the same integers and scales; and the reference,
the dequantized float32 model, is the converted folder itself (`w = d q + m` in float32 is
what the converter wrote). A matrix failing that check is quantized from the folder instead.

Not served as-is: Q4_0 (`w = d (q - 8)`, symmetric: a block's codes rarely reach both 0 and
15, so its integers are not `--quant int4`'s and would need a tag of their own) and Q8_0 (a
scale per block of 32, where `--quant int8` has one per row). SmolLM2-135M's GGUF is Q4_1 for
every span matrix (its Q8_0 tensor is the embedding, which a requester holds in float32).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tessera.stages.errors import ModelFormatError
from tessera.stages.families.catalog import FAMILIES
from tessera.stages.families.gguf import TENSOR_NAMES
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.kernels.chunked import dequantizes_in_chunks
from tessera.stages.kernels.quant import Quant
from tessera.stages.weights.convert import unpermute_rope_rows
from tessera.stages.weights.gguf_directory import read_gguf_directory

SOURCE_GGUF = "source.gguf"  # beside a fetched model's converted folder (peer/cli/model_files.py)
Q4_1_BLOCK = 32  # weights per Q4_1 block
Q4_1_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles
Q4_1_TYPE = 3  # ggml_type GGML_TYPE_Q4_1
# Hugging Face names -> llama.cpp's ({i} = layer)
GGUF_NAMES = {hf: gguf for gguf, hf in TENSOR_NAMES.items()}


def takes_gguf_blocks(quant: Quant, device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether a span stored as `quant` on `device` for `dtype` can take a GGUF's Q4_1 blocks as they
    are: int4 in groups of 32, in the float32 CPU block layout (stages/kernels/quant.py)."""
    return quant.kind == "int4" and quant.group_size == Q4_1_BLOCK and dequantizes_in_chunks(torch.device(device), dtype)


def q4_1_fields(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A Q4_1 tensor's bytes [rows, blocks * 20] -> (nibbles uint8 [rows, blocks, 16], d, m float32 [rows, blocks])."""
    blocks = raw.reshape(raw.shape[0], -1, Q4_1_BYTES)
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
    m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
    return np.ascontiguousarray(blocks[..., 4:]), d, m


def requantizes_to_itself(nibbles: np.ndarray, d: np.ndarray, m: np.ndarray) -> bool:
    """Whether `quantize_linear` on these blocks' dequantized weights gives back exactly (codes, d, m):
    every block holds codes 0 and 15, and its scale recomputed from its extremes, in float32 as
    quantize_linear computes it, is d. Works on the [rows, blocks] arrays only (no weight is formed)."""
    low, high = nibbles & 15, nibbles >> 4
    if not (np.minimum(low.min(-1), high.min(-1)) == 0).all() or not (np.maximum(low.max(-1), high.max(-1)) == 15).all():
        return False
    top = np.float32(15) * d + m  # what code 15 dequantizes to, in float32 (int4_block_rows' ops)
    return bool(np.array_equal((top - m) / np.float32(15), d))


class GgufQ4Source:
    """The Q4_1 blocks of a model's source GGUF, read per matrix from a memory map."""

    def __init__(self, path: Path, spec: ModelSpec) -> None:
        self.path = path
        self.tensors, _ = read_gguf_directory(path)
        form = FAMILIES[spec.family].gguf
        self.permute = form is not None and form.permuted_rope  # llama.cpp permuted q/k rows for its RoPE
        self.spec = spec

    @staticmethod
    def beside(folder: Path, spec: ModelSpec) -> "GgufQ4Source | None":
        path = Path(folder) / SOURCE_GGUF
        return GgufQ4Source(path, spec) if path.exists() else None

    def matrix(self, hf_names: list[str], shapes: dict[str, tuple[int, ...]]
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The stacked matrix of `hf_names` (rows in that order) as (nibbles uint8 [N, K/32, 16], d, m
        float32 [N, K/32]), or None unless every part is a Q4_1 tensor that `requantizes_to_itself`.
        Raises ModelFormatError if a tensor's shape is not the folder's (`shapes`: name -> [N, K])."""
        parts = []
        for name in hf_names:
            layer, pattern = split_layer(name)
            gguf_name = GGUF_NAMES.get(pattern)
            tensor = self.tensors.get(gguf_name.replace("{i}", layer)) if gguf_name else None
            if tensor is None or tensor.kind != Q4_1_TYPE:
                return None
            if tensor.dims[::-1] != tuple(shapes[name]):
                raise ModelFormatError(f"{str(self.path)!r}: {gguf_name.replace('{i}', layer)} is {list(tensor.dims[::-1])}, "
                                       f"the folder's {name} is {list(shapes[name])}: not this folder's source")
            rows, cols = shapes[name]
            if cols % Q4_1_BLOCK:
                return None
            raw = np.memmap(self.path, dtype=np.uint8, mode="r", offset=tensor.offset,
                            shape=(rows, cols // Q4_1_BLOCK * Q4_1_BYTES))
            fields = q4_1_fields(raw)  # copies: the map is dropped below
            del raw
            if self.permute and name.endswith(("q_proj.weight", "k_proj.weight")):
                layer_heads = self.spec.layers[int(layer)].attention
                heads = layer_heads.num_heads if name.endswith("q_proj.weight") else layer_heads.num_kv_heads
                fields = tuple(np.ascontiguousarray(unpermute_rope_rows(f, heads)) for f in fields)
            if not requantizes_to_itself(*fields):
                return None
            parts.append(tuple(torch.from_numpy(f) for f in fields))
        return tuple(torch.cat(column) for column in zip(*parts))  # type: ignore[return-value]


def split_layer(name: str) -> tuple[str, str]:
    """'model.layers.7.mlp.up_proj.weight' -> ('7', 'model.layers.{i}.mlp.up_proj.weight')."""
    parts = name.split(".")
    if len(parts) > 3 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return parts[2], ".".join(["model", "layers", "{i}", *parts[3:]])
    return "", name
