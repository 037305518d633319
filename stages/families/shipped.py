"""Weights as a checkpoint ships them, when they are not plain floats: `quantization_config`, read as data.

These forms load as they are (their arithmetic is stages/kernels/, their loading stages/weights/formats/load.py):

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

- "nvfp4" (quant_method "modelopt", or "compressed-tensors" with format nvfp4-pack-quantized:
  families/quant_configs.py reads both): a weight [N, K] as e2m1 codes, two a byte (the low nibble
  the even input), uint8 [N, K/2] (`x.weight` in ModelOpt's layout, `x.weight_packed` in
  compressed-tensors'), an e4m3 scale per 16 inputs `x.weight_scale` [N, K/16], and a float32
  global scale: ModelOpt's `x.weight_scale_2` [] multiplies (read as compressed-tensors' converter
  reads it: global = 1 / weight_scale_2), compressed-tensors' `x.weight_global_scale` [1] divides:
  w = FP4[code] * (scale / global). W4A4 checkpoints also ship an input scale per matrix
  (`x.input_scale`, `x.input_global_scale`): read, not applied (activations stay float).
- "int4" (compressed-tensors' pack-quantized, the W4A16 checkpoints of Kimi K2 and llm-compressor):
  `x.weight_packed` int32 [N, K/8] (eight 4-bit codes a word, the lowest first, each code + 8),
  `x.weight_scale` [N, K/G] (bf16, f16 or f32; G = 1 column group per row for strategy channel),
  `x.weight_shape` [2], and, asymmetric, `x.weight_zero_point` int32 [ceil(N/8), K/G] (codes + 8
  packed along the rows): w = (q - z) * s.
- DeepSeek-V4's fp8: "fp8" with `scale_fmt` ue8m0 (power-of-two block scales, F8_E8M0) and
  `expert_dtype` "fp4": each routed expert's matrices (`.experts.` in the name) as e2m1 codes, two a
  byte (the low nibble the even input), int8 `x.weight` [N, K/2], and an e8m0 scale per 32 inputs
  `x.weight_scale_inv` [N, K/32] (transformers' FP8Experts layout): MXFP4's numbers.

Which stored tensors a checkpoint matrix is made of, and their bytes, is decided here from
names and shapes alone (no torch: placement prices spans from this), by `stored_tensors`
and `stored_bytes`. Whether a tensor is a matrix is read from the engine's tensor names
(families/tensors.py `matrix_paths`); a router or a norm is float in every form.
Any other `quant_method`, ggml type or setting is refused with one line naming it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tessera.stages.errors import ModelFormatError, UnsupportedModel
from tessera.stages.families.quant_configs import (
    Fields, compressed_tensors_config, modelopt_config, read_compressed_tensors, read_modelopt,
)

METHODS = ("fp8", "mxfp4", "gguf", "modelopt", "compressed-tensors")  # quant_method values read here
FP8_DTYPE = "F8_E4M3"
FP8_SCALE_DTYPES = ("F32", "BF16", "F8_E8M0")  # float (V3-style) or ue8m0 (a power of two a byte) scales
UE8M0_SCALE_DTYPES = ("F8_E8M0", "F32", "BF16")  # scale_fmt ue8m0: DeepSeek-V4's bytes first
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

    method:        "fp8", "mxfp4", "gguf", "nvfp4" or "int4".
    block:         fp8's `weight_block_size` (rows, columns of one scale).
    not_converted: fp8/mxfp4 `modules_to_not_convert`, nvfp4/int4 ignore lists: module patterns
                   (regular expressions, transformers' form) left in float.
    tensor_types:  gguf: (checkpoint tensor name, ggml type name) for every matrix.
    float_bytes:   bytes per value of the float tensors as shipped (the config's dtype).
    scale_format:  fp8's `scale_fmt`: "float" or "ue8m0" (power-of-two scales); the arithmetic is
                   the same, w = q * s in float32.
    expert_form:   fp8: "fp4" when the routed experts ship as e2m1 with e8m0 scales (DeepSeek-V4).
    layout:        nvfp4: "modelopt" or "compressed-tensors" (the tensors' names and global scale).
    group:         nvfp4: 16; int4: inputs per scale (0: one scale per row).
    symmetric:     int4: no zero point.
    activation_scales: nvfp4: each matrix ships an input scale (W4A4), read and not applied.
    targets:       nvfp4/int4 (compressed-tensors): module patterns quantized; () for every linear.
    scale_dtype:   int4: the scales' safetensors dtype when the config names it ("" : the model's dtype).
    """

    method: str
    block: tuple[int, int] = (128, 128)
    not_converted: tuple[str, ...] = ()
    tensor_types: tuple[tuple[str, str], ...] = ()
    float_bytes: int = 2
    scale_format: str = "float"
    expert_form: str = ""
    layout: str = ""
    group: int = 0
    symmetric: bool = True
    activation_scales: bool = False
    targets: tuple[str, ...] = ()
    scale_dtype: str = ""

    @property
    def tag(self) -> str:
        """What a peer shows of it ("fp8", "mxfp4", "gguf", "nvfp4", "int4")."""
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
        if any(_matches(p, module) for p in self.not_converted):
            return "float"
        if self.method in LINEAR_ONLY and EMBEDDING in f".{name}":  # an embedding is no linear module
            return "float"
        if self.targets and not any(_matches(p, module) for p in self.targets):
            return "float"
        if self.expert_form and EXPERTS in f".{name}":
            return self.expert_form
        return self.method

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
            # ue8m0 scales counted as the byte DeepSeek-V4 stores each in (V3.1 ships them as F32: 3 bytes
            # a block of 16384 weights more than counted)
            scales = UE8M0_SCALE_DTYPES if self.scale_format == "ue8m0" else FP8_SCALE_DTYPES
            return {name: (shape, (FP8_DTYPE,)), name + "_scale_inv": ((*lead, -(-rows // bn), -(-cols // bk)), scales)}
        if form == "mxfp4":
            _whole(name, cols, MXFP4_GROUP, "mxfp4")
            groups = cols // MXFP4_GROUP
            return {name + "_blocks": ((*lead, rows, groups, MXFP4_BLOCK_BYTES), ("U8",)),
                    name + "_scales": ((*lead, rows, groups), ("U8",))}
        if form == "fp4":  # DeepSeek-V4's experts
            _whole(name, cols, MXFP4_GROUP, "fp4")
            return {name: ((*lead, rows, cols // 2), ("I8", "U8")),
                    name + "_scale_inv": ((*lead, rows, cols // MXFP4_GROUP), ("F8_E8M0", "U8"))}
        if form in ("nvfp4", "int4"):
            return self._four_bit_tensors(form, name, tuple(lead), rows, cols)
        kind = GGML_TYPES[form]
        _whole(name, cols, kind.block, form)
        return {name: ((*lead, rows, cols // kind.block * kind.nbytes), ("U8",))}

    def _four_bit_tensors(self, form: str, name: str, lead: tuple[int, ...], rows: int, cols: int
                          ) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
        """nvfp4's and int4's stored tensors (module docstring) of matrix `name`."""
        base = name.removesuffix(".weight") + "." if name.endswith(".weight") else name + "_"
        if form == "nvfp4":
            _whole(name, cols, self.group, "nvfp4")
            modelopt = self.layout == "modelopt"
            out = {(name if modelopt else base + "weight_packed"): ((*lead, rows, cols // 2), ("U8",)),
                   base + "weight_scale": ((*lead, rows, cols // self.group), ("F8_E4M3",))}
            scalar = lead if modelopt else (*lead, 1)
            out[base + ("weight_scale_2" if modelopt else "weight_global_scale")] = (scalar, ("F32",))
            if self.activation_scales:
                out[base + ("input_scale" if modelopt else "input_global_scale")] = (scalar, ("F32",))
            return out
        group = self.group or cols
        _whole(name, cols, group, "int4")
        if cols % INT4_PER_WORD:
            raise ModelFormatError(f"tensor {name!r} has {cols} inputs, not a whole number of int32 words of 4-bit codes")
        out = {base + "weight_packed": ((*lead, rows, cols // INT4_PER_WORD), ("I32",)),
               base + "weight_scale": ((*lead, rows, cols // group), (self.scale_dtype,) if self.scale_dtype else FLOAT_DTYPES),
               base + "weight_shape": ((*lead, 2), ("I64", "I32"))}
        if not self.symmetric:
            out[base + "weight_zero_point"] = ((*lead, -(-rows // INT4_PER_WORD), cols // group), ("I32",))
        return out

    def stored_bytes(self, name: str, shape: tuple[int, ...]) -> int:
        """Bytes the checkpoint MATRIX `name` of `shape` occupies as shipped (and, kept compact,
        in memory): what placement and the weights fetch count."""
        total = 0
        for stored, (dims, dtypes) in self.stored_tensors(name, shape).items():
            numel = 1
            for d in dims:
                numel *= d
            # a float matrix as the config's dtype (an int4 scale too); fp8 scales as float32 (what DeepSeek
            # and Qwen ship)
            total += numel * (self.float_bytes if dtypes == FLOAT_DTYPES else DTYPE_BYTES[dtypes[0]])
        return total

    def to_config(self) -> dict[str, Any]:
        """The `quantization_config` that reads back into this (what synth and the GGUF import write)."""
        if self.method == "gguf":
            return {"quant_method": "gguf", "tensor_types": dict(self.tensor_types)}
        if self.method == "nvfp4" and self.layout == "modelopt":
            return {**modelopt_config(self.not_converted), **({} if self.activation_scales else {
                "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16}}}})}
        if self.method in ("nvfp4", "int4"):
            return compressed_tensors_config(self.method, self.group, self.symmetric, self.activation_scales,
                                             self.scale_dtype, self.not_converted, self.targets)
        config: dict[str, Any] = {"quant_method": self.method, "modules_to_not_convert": list(self.not_converted)}
        if self.method == "fp8":
            config.update({"activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(self.block),
                           "scale_fmt": self.scale_format})
            if self.expert_form:
                config["expert_dtype"] = self.expert_form
        return config


DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "U8": 1, "I8": 1, "I32": 4, "I64": 8, FP8_DTYPE: 1, "F8_E8M0": 1}
EXPERTS = ".experts."  # in a routed expert's tensor names (a shared expert's are `shared_experts.`)
EMBEDDING = ".embed_tokens."  # the embedding's module
LINEAR_ONLY = ("nvfp4", "int4")  # methods whose tools quantize linear modules only (never the embedding)
INT4_PER_WORD = 8  # 4-bit codes an int32 holds


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
    dtype = config.get("torch_dtype", config.get("dtype", "bfloat16"))
    float_bytes = FLOAT_ITEMSIZE.get(dtype, 2) if isinstance(dtype, str) else 2
    if method == "modelopt":
        return ShippedFormat(**read_modelopt(raw), float_bytes=float_bytes)
    if method == "compressed-tensors":
        return ShippedFormat(**read_compressed_tensors(raw), float_bytes=float_bytes)
    fields = Fields(raw, method)
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
    expert_dtype = fields.expect("expert_dtype", ("fp8", "fp4"), "fp8")
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
                         scale_format=scale_format, expert_form="" if expert_dtype == "fp8" else expert_dtype)
