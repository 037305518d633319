"""Weights as a checkpoint ships them, when they are not plain floats: `quantization_config`, read as data.

Three forms load as they are (their arithmetic is stages/kernels/, their loading stages/weights/formats/load.py):

- "fp8", transformers' FineGrainedFP8Config (DeepSeek-V3, GLM, Qwen3 "-FP8" folders): every
  linear weight is float8_e4m3fn [N, K] (`x.weight`, or a fused expert tensor [E, N, K]) with
  `x.weight_scale_inv`, one float32 per `weight_block_size` block [ceil(N/bn), ceil(K/bk)]:
  w[r, c] = q[r, c] * s[r // bn, c // bk]. `modules_to_not_convert` (or MiniMax's alias
  `ignored_layers`) stay in float. Dynamic activation scaling only (a static scheme ships
  activation scales this engine does not apply), e4m3 only.
- "mxfp4", gpt-oss's: a weight [N, K] as `x_blocks` uint8 [N, K/32, 16], two e2m1 codes a byte
  (the low nibble the even input), and `x_scales` uint8 [N, K/32], an e8m0 exponent per 32
  inputs: w = FP4[code] * 2^(scale - 127). gpt-oss's own config keeps attention, router,
  embedding and head out through `modules_to_not_convert`; the format applies to any linear
  a checkpoint stores that way.
- "gguf", tessera's own: a llama.cpp GGUF imported as it is (`tessera model import FILE.gguf`),
  each tensor's blocks copied byte for byte into a uint8 safetensors tensor [N, K / block *
  block bytes]; `tensor_types` names each checkpoint tensor's ggml type (GGML_TYPES below).

Which stored tensors a checkpoint matrix is made of, and their bytes, is decided here from
names and shapes alone (no torch: placement prices spans from this), by `stored_tensors`
and `stored_bytes`. Whether a tensor is a matrix is read from the engine's tensor names
(families/tensors.py `matrix_paths`); a router or a norm is float in every form.
Any other `quant_method`, ggml type or setting is refused with one line naming it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tessera.stages.errors import ModelFormatError, UnsupportedModel

METHODS = ("fp8", "mxfp4", "gguf")
FP8_DTYPE = "F8_E4M3"
FP8_SCALE_DTYPES = ("F32", "BF16", "F8_E8M0")  # float (V3-style) or ue8m0 (a power of two a byte) scales
FLOAT_DTYPES = ("F32", "F16", "BF16")
MXFP4_GROUP = 32  # inputs per e8m0 scale
MXFP4_BLOCK_BYTES = MXFP4_GROUP // 2  # two e2m1 codes a byte
MAX_PATTERNS = 256  # modules_to_not_convert entries read (each a regular expression, as transformers reads them)
MAX_PATTERN_LENGTH = 256
# Float dtypes a config may declare for its unconverted tensors, and their bytes (the default: bf16, as shipped)
FLOAT_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class GgmlType:
    """One ggml block type: `block` weights a block, stored in `nbytes` bytes."""

    name: str
    ggml_id: int  # ggml_type, as a GGUF file's tensor info gives it
    block: int
    nbytes: int

    @property
    def is_float(self) -> bool:
        return self.block == 1


# The ggml types tessera computes as they are (k-quants, IQ types, FP4, Q8_0, Q4_0/Q4_1) or reads as floats.
GGML_TYPES = {t.name: t for t in (
    GgmlType("F32", 0, 1, 4), GgmlType("F16", 1, 1, 2), GgmlType("BF16", 30, 1, 2),
    GgmlType("Q4_0", 2, 32, 18), GgmlType("Q4_1", 3, 32, 20), GgmlType("Q8_0", 8, 32, 34),
    GgmlType("Q2_K", 10, 256, 84), GgmlType("Q3_K", 11, 256, 110),
    GgmlType("Q4_K", 12, 256, 144), GgmlType("Q5_K", 13, 256, 176), GgmlType("Q6_K", 14, 256, 210),
    GgmlType("IQ2_XXS", 16, 256, 66), GgmlType("IQ2_XS", 17, 256, 74), GgmlType("IQ3_XXS", 18, 256, 98),
    GgmlType("IQ1_S", 19, 256, 50), GgmlType("IQ4_NL", 20, 32, 18), GgmlType("IQ3_S", 21, 256, 110),
    GgmlType("IQ2_S", 22, 256, 82), GgmlType("IQ4_XS", 23, 256, 136), GgmlType("IQ1_M", 29, 256, 56),
    GgmlType("MXFP4", 39, 32, 17), GgmlType("NVFP4", 40, 64, 36),
)}
GGML_BY_ID = {t.ggml_id: t for t in GGML_TYPES.values()}
# ggml's names for the ids it has (a refusal names the type a file holds, not its number)
GGML_NAMES = {4: "Q4_2", 5: "Q4_3", 6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 15: "Q8_K", 24: "I8", 25: "I16", 26: "I32",
              27: "I64", 28: "F64", 34: "TQ1_0", 35: "TQ2_0", 41: "Q1_0"}


def ggml_type_of(ggml_id: int, where: str) -> GgmlType:
    """The GgmlType of a file's type id (UnsupportedModel naming the type for any other)."""
    if ggml_id not in GGML_BY_ID:
        name = GGML_NAMES.get(ggml_id, f"ggml type {ggml_id}")
        raise UnsupportedModel(f"{where} is {name}: tessera computes GGUF tensors in {sorted(GGML_TYPES)}")
    return GGML_BY_ID[ggml_id]


@dataclass(frozen=True)
class ShippedFormat:
    """How a checkpoint stores its matrices (module docstring).

    method:        "fp8", "mxfp4" or "gguf".
    block:         fp8's `weight_block_size` (rows, columns of one scale).
    not_converted: fp8/mxfp4 `modules_to_not_convert`: module names or patterns left in float.
    tensor_types:  gguf: (checkpoint tensor name, ggml type name) for every matrix.
    float_bytes:   bytes per value of the float tensors as shipped (the config's dtype).
    scale_format:  fp8's `scale_fmt`: "float" or "ue8m0" (power-of-two scales); the arithmetic is
                   the same, w = q * s in float32.
    """

    method: str
    block: tuple[int, int] = (128, 128)
    not_converted: tuple[str, ...] = ()
    tensor_types: tuple[tuple[str, str], ...] = ()
    float_bytes: int = 2
    scale_format: str = "float"

    @property
    def tag(self) -> str:
        """What a peer shows of it ("fp8", "mxfp4", "gguf")."""
        return self.method

    @property
    def float_dtype(self) -> str:
        """The config's dtype for `float_bytes`."""
        return next(name for name, size in FLOAT_ITEMSIZE.items() if size == self.float_bytes and name != "float16")

    def form_of(self, name: str) -> str:
        """How the checkpoint MATRIX `name` (`x.weight`, or a fused expert tensor) is stored:
        "fp8", "mxfp4", a ggml type name ("Q4_K" ...; "F32"/"F16"/"BF16" for a float one in a
        GGUF), or "float"."""
        if self.method == "gguf":
            return dict(self.tensor_types).get(name, "float")
        module = name.removesuffix(".weight") if name.endswith(".weight") else name.rpartition(".")[0]
        return "float" if any(_matches(p, module) for p in self.not_converted) else self.method

    def stored_tensors(self, name: str, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
        """The tensors the checkpoint MATRIX `name` of logical `shape` ([..., N, K]) is stored as:
        {stored name: (shape, safetensors dtypes it may have)}. Raises ModelFormatError when the
        shape cannot be stored so (K not a whole number of blocks)."""
        form = self.form_of(name)
        if form == "float" or (form in GGML_TYPES and GGML_TYPES[form].is_float):
            return {name: (shape, FLOAT_DTYPES if form == "float" else (form,))}
        *lead, rows, cols = shape
        if form == "fp8":
            bn, bk = self.block
            return {name: (shape, (FP8_DTYPE,)), name + "_scale_inv": ((*lead, -(-rows // bn), -(-cols // bk)), FP8_SCALE_DTYPES)}
        if form == "mxfp4":
            _whole(name, cols, MXFP4_GROUP, "mxfp4")
            groups = cols // MXFP4_GROUP
            return {name + "_blocks": ((*lead, rows, groups, MXFP4_BLOCK_BYTES), ("U8",)),
                    name + "_scales": ((*lead, rows, groups), ("U8",))}
        kind = GGML_TYPES[form]
        _whole(name, cols, kind.block, form)
        return {name: ((*lead, rows, cols // kind.block * kind.nbytes), ("U8",))}

    def stored_bytes(self, name: str, shape: tuple[int, ...]) -> int:
        """Bytes the checkpoint MATRIX `name` of `shape` occupies as shipped (and, kept compact,
        in memory): what placement and the weights fetch count."""
        total = 0
        for stored, (dims, dtypes) in self.stored_tensors(name, shape).items():
            numel = 1
            for d in dims:
                numel *= d
            # a float matrix as the config's dtype; fp8 scales as float32 (what DeepSeek and Qwen ship)
            total += numel * (self.float_bytes if dtypes == FLOAT_DTYPES else DTYPE_BYTES[dtypes[0]])
        return total

    def to_config(self) -> dict[str, Any]:
        """The `quantization_config` that reads back into this (what synth and the GGUF import write)."""
        if self.method == "gguf":
            return {"quant_method": "gguf", "tensor_types": dict(self.tensor_types)}
        config: dict[str, Any] = {"quant_method": self.method, "modules_to_not_convert": list(self.not_converted)}
        if self.method == "fp8":
            config.update({"activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(self.block),
                           "scale_fmt": self.scale_format})
        return config


DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "U8": 1, FP8_DTYPE: 1, "F8_E8M0": 1}


def _whole(name: str, cols: int, block: int, form: str) -> None:
    if cols % block:
        raise ModelFormatError(f"tensor {name!r} has {cols} inputs, not a whole number of {form} blocks of {block}")


def _matches(pattern: str, module: str) -> bool:
    """transformers' `should_convert_module` test, negated: `pattern` names `module` from the start
    up to a module boundary, as a regular expression with that boundary, or as a suffix."""
    try:
        return re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", module) is not None or module.endswith(pattern)
    except re.error:
        return module.endswith(pattern)


def read_shipped(config: dict[str, Any]) -> ShippedFormat | None:
    """The config's `quantization_config` as a ShippedFormat (None when absent: float weights).

    Raises UnsupportedModel naming the method, key or value tessera does not load as shipped,
    ModelFormatError for a malformed one."""
    raw = config.get("quantization_config")
    if not raw:
        return None
    if not isinstance(raw, dict):
        raise ModelFormatError(f"config quantization_config {raw!r} is not a JSON object")
    method = raw.get("quant_method")
    if method not in METHODS:
        raise UnsupportedModel(f"config quantization_config.quant_method {method!r} is not supported "
                               f"(tessera loads {list(METHODS)} as they ship)")
    fields = _Fields(raw, method)
    dtype = config.get("torch_dtype", config.get("dtype", "bfloat16"))
    float_bytes = FLOAT_ITEMSIZE.get(dtype, 2) if isinstance(dtype, str) else 2
    if method == "gguf":
        types = fields.take("tensor_types", {})
        if not isinstance(types, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in types.items()):
            raise ModelFormatError(f"config quantization_config.tensor_types {types!r} is not a map of names to types")
        for name, kind in sorted(types.items()):
            if kind not in GGML_TYPES:
                raise UnsupportedModel(f"config quantization_config.tensor_types: {name!r} is {kind!r}; "
                                       f"tessera computes GGUF tensors in {sorted(GGML_TYPES)}")
        fields.finish()
        return ShippedFormat("gguf", tensor_types=tuple(sorted(types.items())), float_bytes=float_bytes)
    fields.expect("dequantize", (False,), False)
    skip = fields.take("modules_to_not_convert", None)
    alias = fields.take("ignored_layers", None)
    skip = skip if skip is not None else (alias or [])
    if not isinstance(skip, list) or len(skip) > MAX_PATTERNS or not all(
            isinstance(p, str) and 0 < len(p) <= MAX_PATTERN_LENGTH for p in skip):
        raise ModelFormatError(f"config quantization_config.modules_to_not_convert {skip!r} is not a list of module names")
    if method == "mxfp4":
        fields.finish()
        return ShippedFormat("mxfp4", not_converted=tuple(skip), float_bytes=float_bytes)
    fields.expect("activation_scheme", ("dynamic",), "dynamic")
    fields.expect("fmt", ("e4m3",), "e4m3")
    fields.expect("expert_dtype", ("fp8",), "fp8")
    scale_format = fields.expect("scale_fmt", ("float", "ue8m0"), "float")
    if fields.take("modules_to_convert", None):
        raise UnsupportedModel(f"config quantization_config.modules_to_convert {raw['modules_to_convert']!r} is not "
                               "supported (fp8 embeddings)")
    block = fields.take("weight_block_size", None)
    if block is None:
        raise UnsupportedModel("config quantization_config.weight_block_size null (one fp8 scale per tensor) is not "
                               "supported: tessera loads block-scaled fp8")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and not isinstance(b, bool)
                                                                and 0 < b <= 1 << 16 for b in block)):
        raise ModelFormatError(f"config quantization_config.weight_block_size {block!r} is not two positive integers")
    fields.finish()
    return ShippedFormat("fp8", block=(block[0], block[1]), not_converted=tuple(skip), float_bytes=float_bytes,
                         scale_format=scale_format)


class _Fields:
    """The keys of one quantization_config, read one at a time; `finish` refuses any left over."""

    def __init__(self, raw: dict[str, Any], method: str) -> None:
        self.raw, self.method, self.read = raw, method, {"quant_method"}

    def take(self, key: str, default: Any) -> Any:
        self.read.add(key)
        value = self.raw.get(key)
        return default if value is None else value

    def expect(self, key: str, allowed: tuple[Any, ...], default: Any) -> Any:
        value = self.take(key, default)
        if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
            raise UnsupportedModel(f"config quantization_config.{key} {value!r} is not supported for "
                                   f"{self.method} (tessera computes {list(allowed)!r})")
        return value

    def finish(self) -> None:
        for key in sorted(set(self.raw) - self.read):
            raise UnsupportedModel(f"config quantization_config.{key} (value {json.dumps(self.raw[key])[:80]}) is not "
                                   f"one tessera knows for {self.method}: it may change what the weights mean")
