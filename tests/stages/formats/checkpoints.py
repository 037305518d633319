"""Tiny checkpoints in the forms large models ship in, written here from a float model, and their oracles.

Every writer starts from a float folder that `transformers` built (tests/stages/families/
conformance.py `build`) and quantizes its layers' matrices to the published layout, with a
`config.json` carrying the real `quantization_config`:

- `fp8_folder`: transformers' FineGrainedFP8 layout (float8_e4m3fn weight, float32
  `weight_scale_inv` per block), quantized as transformers' `Fp8Quantize` does;
- `mxfp4_folder`: gpt-oss's `_blocks`/`_scales`, the codes and exponents from the `gguf`
  package's MXFP4 quantizer (the same e2m1/e8m0 numbers; ggml packs a block's nibbles in
  halves, gpt-oss in pairs, and this repacks them);
- `gguf_file`: a llama.cpp GGUF written with the `gguf` package's writer: Q8_0/Q4_0/Q4_1/MXFP4 by its
  quantizers, Q4_K/Q5_K/Q6_K (which it only dequantizes) by the small quantizers here, the lower
  types (Q2_K, Q3_K, the IQ types, NVFP4) as random valid codes, q/k rows permuted as llama.cpp's
  converter permutes them, experts stacked.

The oracle of each is a float folder of the same model whose matrices are what the stored
values mean, computed by the independent dequantizer (`reference_folder`): transformers'
`Fp8Dequantize` arithmetic, its `convert_moe_packed_tensors`, the `gguf` package's
`dequantize`. Tessera's float engine reads that folder (it is held to transformers to 1e-4
by the family conformance tests), and transformers can load it too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors.torch import load_file, save_file

FP8_MAX = 448.0
QK_K = 256
MXFP4_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.gate", "model.embed_tokens", "lm_head"]


def copy_folder(source: Path, out: Path, state: dict[str, torch.Tensor], quantization: dict | None) -> Path:
    """`source`'s tokenizer files, `state` as its weights, its config with `quantization` set."""
    out.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.name not in ("model.safetensors", "config.json", "manifest.json"):
            shutil.copy(path, out / path.name)
    config = json.loads((source / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization is not None:
        config["quantization_config"] = quantization
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def layer_matrices(state: dict[str, torch.Tensor], skip: Callable[[str], bool]) -> list[str]:
    """The 2-D weights of the decoder layers (norms and routers excepted, and whatever `skip` says)."""
    return [n for n, t in state.items() if n.startswith("model.layers.") and t.dim() == 2
            and not n.endswith(("gate.weight",)) and not skip(n)]


# -- FP8 ----------------------------------------------------------------------------------------------

def fp8_quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Fp8Quantize on a [N, K] weight, blocks at the edges partial: (codes, scale_inv)."""
    (rows, cols), (bn, bk) = w.shape, block
    nb, kb = -(-rows // bn), -(-cols // bk)
    padded = torch.zeros(nb * bn, kb * bk)
    padded[:rows, :cols] = w
    tiles = padded.view(nb, bn, kb, bk)
    amax = tiles.abs().amax(dim=(1, 3))
    scales = torch.where(amax > 0, FP8_MAX / amax.clamp(min=1e-30), torch.ones_like(amax))
    codes = (tiles * scales[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(nb * bn, kb * bk)[:rows, :cols].contiguous(), (1.0 / scales).float()


def fp8_dequantize(codes: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """transformers' `_dequantize_fp8_weight` (its FP8Linear's arithmetic): codes times the scale of
    their block of the config's `weight_block_size`, blocks at the edges partial."""
    rows, cols = codes.shape
    s = scale_inv.repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return codes.float() * s


def fp8_folder(source: Path, out: Path, *, block: tuple[int, int] = (128, 128)) -> Path:
    state = load_file(str(source / "model.safetensors"))
    for name in layer_matrices(state, lambda n: False):
        state[name], state[name + "_scale_inv"] = fp8_quantize(state[name], block)
    quantization = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                    "weight_block_size": list(block), "modules_to_not_convert": ["lm_head"]}
    return copy_folder(source, out, state, quantization)


# -- MXFP4 --------------------------------------------------------------------------------------------

def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> gpt-oss's (blocks uint8 [N, K/32, 16], scales uint8 [N, K/32]), by gguf's MXFP4 quantizer."""
    from gguf.quants import MXFP4

    rows, cols = w.shape
    raw = MXFP4.quantize_blocks(w.numpy().astype(np.float32).reshape(-1, 32))  # [blocks, 1 + 16]
    scales, packed = raw[:, 0], raw[:, 1:]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)  # ggml: the low nibbles are values 0..15
    pairs = codes[:, 0::2] | (codes[:, 1::2] << 4)  # gpt-oss: byte j holds values 2j (low) and 2j+1
    return (torch.from_numpy(pairs.reshape(rows, cols // 32, 16).copy()),
            torch.from_numpy(scales.reshape(rows, cols // 32).copy()))


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """transformers' `convert_moe_packed_tensors`, back to [N, K]."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks[None], scales[None], dtype=torch.float32)[0].T.contiguous()


def mxfp4_folder(source: Path, out: Path, *, not_converted: list[str] = MXFP4_NOT_CONVERTED,
                 fused: bool = False) -> Path:
    """Experts (and any other matrix `not_converted` leaves) as MXFP4; with `fused`, a sparse layer's
    experts as gpt-oss stacks them (`mlp.experts.gate_up_proj_blocks` [E, 2I, H/32, 16] ...)."""
    from tessera.stages.families.shipped import ShippedFormat

    form = ShippedFormat("mxfp4", not_converted=tuple(not_converted))
    state = load_file(str(source / "model.safetensors"))
    for name in layer_matrices(state, lambda n: form.form_of(n) != "mxfp4"):
        blocks, scales = mxfp4_quantize(state.pop(name))
        state[name + "_blocks"], state[name + "_scales"] = blocks, scales
    if fused:
        state = fuse_experts(state)
    return copy_folder(source, out, state, {"quant_method": "mxfp4", "modules_to_not_convert": not_converted})


def fuse_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert MXFP4 tensors -> transformers 5's fused layout (gate rows before up rows), stacked on experts."""
    out, layers = {}, {}
    for name, tensor in state.items():
        parts = name.split(".")
        if ".mlp.experts." in name:
            layers.setdefault(parts[2], {})[(int(parts[5]), parts[6], parts[7])] = tensor
        else:
            out[name] = tensor
    for layer, tensors in layers.items():
        count = 1 + max(e for e, _, _ in tensors)
        for kind in ("weight_blocks", "weight_scales"):
            suffix = kind.removeprefix("weight")
            gate_up = [torch.cat((tensors[(e, "gate_proj", kind)], tensors[(e, "up_proj", kind)])) for e in range(count)]
            out[f"model.layers.{layer}.mlp.experts.gate_up_proj{suffix}"] = torch.stack(gate_up)
            out[f"model.layers.{layer}.mlp.experts.down_proj{suffix}"] = torch.stack(
                [tensors[(e, "down_proj", kind)] for e in range(count)])
    return out


# -- compressed-tensors (NVFP4, INT4) and ModelOpt's NVFP4 -------------------------------------------------

CT_IGNORE = ["lm_head", "re:.*mlp\\.gate$"]  # the head and the routers stay float, as published checkpoints keep them
MODELOPT_EXCLUDE = ["lm_head", "*.mlp.gate"]
MODELOPT_NAMES = {"weight_packed": "weight", "weight_global_scale": "weight_scale_2", "input_global_scale": "input_scale"}


def ct_scheme(kind: str):
    """compressed-tensors' own presets: NVFP4 (W4A4), W4A16 (symmetric INT4, groups of 128 made 32 here:
    the tiny model's widths) and W4A16_ASYM (with zero points)."""
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4, W4A16, W4A16_ASYM

    if kind == "nvfp4":
        return QuantizationScheme(**NVFP4, targets=["Linear"], format="nvfp4-pack-quantized")
    preset = {"int4": W4A16, "int4-asym": W4A16_ASYM}[kind]
    # groups of 32 (the tiny model's widths); the asymmetric one with its scales in bf16, as real checkpoints
    weights = preset["weights"].model_copy(update={"group_size": 32, **({"scale_dtype": torch.bfloat16}
                                                                        if kind == "int4-asym" else {})})
    return QuantizationScheme(weights=weights, targets=["Linear"], format="pack-quantized")


def ct_compress(w: torch.Tensor, kind: str) -> dict[str, torch.Tensor]:
    """One [N, K] matrix compressed by compressed-tensors itself: its observers' min/max rule for the scales
    (`calculate_qparams`, `generate_gparam`) and its compressor's packing."""
    from compressed_tensors.compressors import NVFP4PackedCompressor, PackedQuantizationCompressor
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = ct_scheme(kind)
    args = scheme.weights
    rows, cols = w.shape
    groups = w.reshape(rows, cols // args.group_size, args.group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    state = {"weight": w}
    if kind == "nvfp4":
        state["weight_global_scale"] = generate_gparam(w.min(), w.max())
        state["weight_scale"], _ = calculate_qparams(low, high, args, global_scale=state["weight_global_scale"])
        out = NVFP4PackedCompressor.compress(state, scheme)
        out["input_global_scale"] = torch.tensor([3.5])  # a W4A4 checkpoint's: read, not applied
        return out
    state["weight_scale"], state["weight_zero_point"] = calculate_qparams(low, high, args)
    state["weight_scale"] = state["weight_scale"].to(args.scale_dtype or w.dtype)
    return PackedQuantizationCompressor.compress(state, scheme)


def ct_decompress(tensors: dict[str, torch.Tensor], kind: str) -> torch.Tensor:
    """The float32 weight compressed-tensors makes of one module's tensors: its unpackers and its
    `dequantize`, given float32 scales (its own decompress computes in the scale's dtype, then casts)."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    args = ct_scheme(kind).weights
    if kind == "nvfp4":
        packed = tensors["weight_packed"]
        values = unpack_fp4_from_uint8(packed, packed.shape[0], 2 * packed.shape[1], dtype=torch.float32)
        return dequantize(x_q=values, scale=tensors["weight_scale"].float(), args=args,
                          global_scale=tensors["weight_global_scale"], dtype=torch.float32)
    shape = tensors["weight_shape"]
    scale = tensors["weight_scale"].float()
    zero = tensors.get("weight_zero_point")
    if zero is not None:
        zero = unpack_from_int32(zero, 4, (int(shape[0]), scale.shape[-1]), packed_dim=0)
    values = unpack_from_int32(tensors["weight_packed"], 4, shape)
    return dequantize(x_q=values, scale=scale, zero_point=zero, args=args, dtype=torch.float32)


def ct_config(kind: str) -> dict:
    """The quantization_config compressed-tensors writes for `kind` (its own QuantizationConfig, dumped)."""
    from compressed_tensors.quantization import QuantizationConfig

    scheme = ct_scheme(kind)
    config = QuantizationConfig(config_groups={"group_0": scheme}, ignore=CT_IGNORE, format=scheme.format,
                                quantization_status="compressed")
    return {**json.loads(config.model_dump_json()), "quant_method": "compressed-tensors"}


def ct_folder(source: Path, out: Path, kind: str, *, modelopt: bool = False) -> Path:
    """Every layer matrix of `source` compressed by compressed-tensors as `kind` ("nvfp4", "int4",
    "int4-asym"); with `modelopt`, an NVFP4 folder in ModelOpt's layout instead: the compressed-tensors
    tensors renamed back as its ModelOpt converter maps them (weight_packed -> weight, the global scale
    g -> weight_scale_2 = 1 / g, input_global_scale x -> input_scale = 1 / x), ModelOpt's config."""
    state = load_file(str(source / "model.safetensors"))
    for name in layer_matrices(state, lambda n: False):
        module = name.removesuffix(".weight")
        for key, tensor in ct_compress(state.pop(name), kind).items():
            if modelopt and key in MODELOPT_NAMES:
                key, tensor = MODELOPT_NAMES[key], (tensor if key == "weight_packed" else 1 / tensor[0])
            state[f"{module}.{key}"] = tensor
    config = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": MODELOPT_EXCLUDE,
              "producer": {"name": "modelopt", "version": "0.29.0"}} if modelopt else ct_config(kind)
    return copy_folder(source, out, state, config)


def ct_reference_folder(shipped: Path, out: Path) -> Path:
    """The float32 model a compressed-tensors (or ModelOpt NVFP4) folder means: each module's tensors
    through compressed-tensors' decompression (a ModelOpt folder through its ModelOpt converter first)."""
    from compressed_tensors.entrypoints.convert.converters.modelopt_nvfp4 import ModelOptNvfp4Converter

    config = json.loads((shipped / "config.json").read_text())["quantization_config"]
    state = load_file(str(shipped / "model.safetensors"))
    if config["quant_method"] == "modelopt":
        modules = {n.rpartition(".")[0] for n in state if n.endswith(".weight_scale_2")}
        state = ModelOptNvfp4Converter(targets=sorted(modules)).process(state)
        kind = "nvfp4"
    else:
        kind = {"nvfp4-pack-quantized": "nvfp4"}.get(config["format"], "int4" if config["config_groups"]["group_0"][
            "weights"]["symmetric"] else "int4-asym")
    dense, parts = {}, {}
    for name, tensor in state.items():
        module, _, key = name.rpartition(".")
        if key.startswith(("weight_", "input_")):
            parts.setdefault(module, {})[key] = tensor
        else:
            dense[name] = tensor.float()
    for module, tensors in parts.items():
        dense[module + ".weight"] = ct_decompress(tensors, kind)
    return copy_folder(shipped, out, dense, None)


# -- DeepSeek-V4's FP8 (ue8m0 block scales) and FP4 experts -------------------------------------------------

def dsv4_folder(source: Path, out: Path, *, block: tuple[int, int] = (16, 16)) -> Path:
    """`source` (an MLA MoE family) as DeepSeek-V4 ships its weights: every layer matrix fp8 with power-of-two
    (ue8m0) block scales, stored F8_E8M0, except the routed experts' (`.experts.`): e2m1 pairs as int8
    [N, K/2] with an e8m0 scale per 32 inputs (the gguf package's MXFP4 quantizer's numbers)."""
    state = load_file(str(source / "model.safetensors"))
    for name in layer_matrices(state, lambda n: False):
        if ".experts." in name:
            blocks, scales = mxfp4_quantize(state[name])
            state[name] = blocks.reshape(blocks.shape[0], -1).view(torch.int8)
            state[name + "_scale_inv"] = scales.view(torch.float8_e8m0fnu)
            continue
        codes, scale_inv = fp8_quantize(state[name], block)
        scale_inv = torch.exp2(torch.ceil(torch.log2(scale_inv)))  # ue8m0: a power of two, rounded up
        s = scale_inv.repeat_interleave(block[0], 0)[: codes.shape[0]].repeat_interleave(block[1], 1)[:, : codes.shape[1]]
        state[name] = (state[name] / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        state[name + "_scale_inv"] = scale_inv.to(torch.float8_e8m0fnu)
    quantization = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(block),
                    "scale_fmt": "ue8m0", "expert_dtype": "fp4", "modules_to_not_convert": ["lm_head"]}
    return copy_folder(source, out, state, quantization)


def dsv4_reference_folder(shipped: Path, out: Path) -> Path:
    """The float32 model a DeepSeek-V4-style folder means: transformers' own `Fp8Dequantize` (which takes
    fp8 blocks and FP4 pairs, float32 or ue8m0 scales) on every quantized tensor."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    state = load_file(str(shipped / "model.safetensors"))
    dequantize = Fp8Dequantize(None)
    dense = {}
    for name, tensor in state.items():
        if name.endswith("_scale_inv"):
            continue
        if name + "_scale_inv" in state:
            dense[name] = dequantize._dequantize_one(tensor, state[name + "_scale_inv"], output_dtype=torch.float32)
        else:
            dense[name] = tensor.float()
    return copy_folder(shipped, out, dense, None)


# -- GGUF ---------------------------------------------------------------------------------------------

def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(*x.shape, 2)


def _k_quant_scales(scale: np.ndarray, low: np.ndarray, levels: int):
    """Six-bit sub-block scales/mins under a float16 super-block scale (the K_SCALE packing's inputs)."""
    d = (scale.max(-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    dmin = (low.max(-1, keepdims=True) / 63).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(np.divide(scale, d, out=np.zeros_like(scale), where=d > 0)), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(np.divide(low, dmin, out=np.zeros_like(low), where=dmin > 0)), 0, 63).astype(np.uint8)
    return d, dmin, sc, mn


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """llama.cpp's 12-byte packing of 8 six-bit scales and mins (what get_scale_min_k4 unpacks)."""
    out = np.zeros((*sc.shape[:-1], 12), dtype=np.uint8)
    out[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    out[..., 4:8] = mn[..., :4] | ((mn[..., 4:] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4)
    return out


def _k_codes(x: np.ndarray, levels: int):
    """Per sub-block of 32: codes in [0, levels] for x ~ (d sc) q - dmin m, and the block's header."""
    lo = np.minimum(x.min(-1), 0)
    scale = (x.max(-1) - lo) / levels
    d, dmin, sc, mn = _k_quant_scales(scale, -lo, levels)
    step = d * sc
    q = np.round(np.divide(x + (dmin * mn)[..., None], step[..., None], out=np.zeros_like(x), where=step[..., None] > 0))
    return np.clip(q, 0, levels).astype(np.uint8), d, dmin, sc, mn


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    x = w.astype(np.float32).reshape(-1, 8, 32)
    q, d, dmin, sc, mn = _k_codes(x, 15)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # per 64 weights: sub-block 2i low, 2i+1 high
    return np.concatenate([_f16(d[:, 0]), _f16(dmin[:, 0]), _pack_k_scales(sc, mn), qs], axis=-1)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    x = w.astype(np.float32).reshape(-1, 8, 32)
    q, d, dmin, sc, mn = _k_codes(x, 31)
    low = q & 0x0F
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(-1, 128)
    qh = np.zeros((x.shape[0], 32), dtype=np.uint8)
    for j in range(8):  # bit j of byte l: the fifth bit of sub-block j's weight l
        qh |= ((q[:, j] >> 4) & 1) << j
    return np.concatenate([_f16(d[:, 0]), _f16(dmin[:, 0]), _pack_k_scales(sc, mn), qh, qs], axis=-1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    x = w.astype(np.float32).reshape(-1, 16, 16)
    scale = np.abs(x).max(-1) / 31
    d = (scale.max(-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(np.divide(scale, d, out=np.zeros_like(scale), where=d > 0)), -128, 127).astype(np.int8)
    step = (d * sc)[..., None]
    q = np.clip(np.round(np.divide(x, step, out=np.zeros_like(x), where=step != 0)), -32, 31).astype(np.int16) + 32
    q = q.reshape(-1, 2, 4, 32).astype(np.uint8)  # value h*128 + s*32 + l
    ql = np.zeros((x.shape[0], 2, 64), dtype=np.uint8)
    ql[..., :32] = (q[:, :, 0] & 0x0F) | ((q[:, :, 2] & 0x0F) << 4)
    ql[..., 32:] = (q[:, :, 1] & 0x0F) | ((q[:, :, 3] & 0x0F) << 4)
    qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), _f16(d[:, 0])], axis=-1)


K_QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}
# The lower types without a quantizer in the gguf package (it dequantizes them all): random valid codes
# (every grid index, sign index and nibble is valid) under a block scale that gives the matrix's std
RANDOM_CODES = ("Q2_K", "Q3_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS",
                "IQ4_NL", "NVFP4")
LOW_BIT = (*RANDOM_CODES, "MXFP4")  # MXFP4 by the gguf package's own quantizer


def random_codes(w: np.ndarray, kind: str) -> np.ndarray:
    """Random blocks of `kind` for a [rows, K] matrix, weights of about w's std (seeded by the shape)."""
    from tessera.stages.families.shipped import GGML_TYPES
    from tessera.stages.kernels.encode import random_ggml

    gen = torch.Generator().manual_seed(w.shape[0] * 7919 + w.shape[1])
    return random_ggml(GGML_TYPES[kind], *w.shape, std=float(w.std()), gen=gen).numpy()


def ggml_quantize(w: np.ndarray, kind: str) -> np.ndarray:
    """A [rows, K] float matrix as ggml blocks of `kind`, uint8 [rows, row bytes] (F32/F16 as they are)."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    if kind == "F32":
        return w.astype(np.float32)
    if kind == "F16":
        return w.astype(np.float16)
    if kind in K_QUANTIZERS:
        rows = w.shape[0]
        return K_QUANTIZERS[kind](w.reshape(-1, QK_K)).reshape(rows, -1)
    if kind in RANDOM_CODES:
        return random_codes(w, kind)
    return quantize(w.astype(np.float32), GGMLQuantizationType[kind])


# where each block type keeps its float16 scales (the bytes left random may hold any code)
HALVES = {"Q6_K": (208,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,),
          "IQ1_M": (), "MXFP4": (), "NVFP4": ()}


def finite_blocks(kind: str, data: np.ndarray, count: int, rnd) -> np.ndarray:
    """`count` blocks of `kind` from random bytes, their scales made finite: float16 scales drawn in
    [-4, 4], IQ1_M's float16 (spread over four nibbles) kept below infinity, MXFP4's exponent below 250
    (2^122 times a code stays finite; gguf's numpy makes inf * 0 a NaN)."""
    from tessera.stages.families.shipped import GGML_TYPES

    raw = data.reshape(count, GGML_TYPES[kind].nbytes).copy()
    for at in HALVES.get(kind, (0,)):
        raw[:, at : at + 2] = np.array([rnd.uniform(-4, 4) for _ in range(count)], np.float16).view(np.uint8).reshape(-1, 2)
    if kind == "IQ1_M":
        raw[:, 55] &= 0xBF  # d's exponent's top bit
    if kind == "MXFP4":
        raw[:, 0] %= 250
    return raw


def permute_rope_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `LlamaModel.permute` (half-split RoPE rows -> interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_LAYER_NAMES = {  # Hugging Face suffix -> llama.cpp name, under blk.N.
    "input_layernorm.weight": "attn_norm", "post_attention_layernorm.weight": "ffn_norm",
    "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k", "self_attn.v_proj.weight": "attn_v",
    "self_attn.o_proj.weight": "attn_output", "self_attn.q_norm.weight": "attn_q_norm",
    "self_attn.k_norm.weight": "attn_k_norm", "mlp.gate_proj.weight": "ffn_gate", "mlp.up_proj.weight": "ffn_up",
    "mlp.down_proj.weight": "ffn_down", "mlp.gate.weight": "ffn_gate_inp",
}
EXPERT_NAMES = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def gguf_file(source: Path, out: Path, types: Callable[[str], str], *, edge_type: str = "Q8_0",
              quantize: Callable[[np.ndarray, str], np.ndarray] = ggml_quantize, split_max_tensors: int = 0) -> Path:
    """`source` (a transformers llama or qwen3_moe folder) as a llama.cpp GGUF: each layer matrix in
    `types(its Hugging Face name)`, the embedding and head in `edge_type`, norms F32; `quantize`
    makes the blocks. With `split_max_tensors`, split as llama.cpp splits large models (the gguf
    package's writer: `out`'s stem -00001-of-0000N.gguf ...); the first shard's path is returned."""
    import gguf

    config = json.loads((source / "config.json").read_text())
    state = {n: t.numpy() for n, t in load_file(str(source / "model.safetensors")).items()}
    moe = config["model_type"] == "qwen3_moe"
    arch = "qwen3moe" if moe else "llama"
    writer = gguf.GGUFWriter(str(out), arch, split_max_tensors=split_max_tensors)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(float(config.get("rope_parameters", {}).get("rope_theta", config.get("rope_theta", 1e4))))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if moe:
        writer.add_expert_count(config.get("num_experts", config.get("num_local_experts")))
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    vocab = json.loads((source / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    tokens += [f"<pad{i}>" for i in range(config["vocab_size"] - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
    writer.add_token_merges([])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_chat_template((source / "chat_template.jinja").read_text())

    def put(name: str, w: np.ndarray, kind: str) -> None:
        from gguf.constants import GGMLQuantizationType

        data = quantize(w.reshape(-1, w.shape[-1]), kind).reshape(*w.shape[:-1], -1) if w.ndim > 1 else w
        raw = None if kind in ("F32", "F16") else GGMLQuantizationType[kind]
        writer.add_tensor(name, data, raw_dtype=raw)

    put("token_embd.weight", state.pop("model.embed_tokens.weight"), edge_type)
    put("output_norm.weight", state.pop("model.norm.weight"), "F32")
    if "lm_head.weight" in state:
        put("output.weight", state.pop("lm_head.weight"), edge_type)
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        experts: dict[str, list[np.ndarray]] = {}
        for name in sorted(n for n in state if n.startswith(prefix)):
            suffix, w = name[len(prefix):], state[name]
            if ".experts." in suffix:
                experts.setdefault(suffix.split(".")[3], []).append((int(suffix.split(".")[2]), name))
                continue
            if not moe and suffix in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
                heads = config["num_attention_heads"] if "q_proj" in suffix else config["num_key_value_heads"]
                w = permute_rope_rows(w, heads)
            kind = "F32" if w.ndim == 1 or suffix == "mlp.gate.weight" else types(name)
            put(f"blk.{i}.{GGUF_LAYER_NAMES[suffix]}.weight", w, kind)
        for part, members in experts.items():
            stacked = np.stack([state[n] for _, n in sorted(members)])  # [E, rows, cols]
            put(f"blk.{i}.{EXPERT_NAMES[part]}.weight", stacked, types(sorted(members)[0][1]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    shards = sorted(out.parent.glob(f"{out.stem}-*-of-*.gguf"))
    return shards[0] if split_max_tensors and shards else out


# -- the oracles --------------------------------------------------------------------------------------

def reference_folder(shipped: Path, out: Path) -> Path:
    """The float32 model a shipped fp8/mxfp4 folder means, dequantized by transformers' arithmetic."""
    state = load_file(str(shipped / "model.safetensors"))
    block = json.loads((shipped / "config.json").read_text())["quantization_config"].get("weight_block_size")
    dense: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith("_scale_inv") or name.endswith("_scales"):
            continue
        if name + "_scale_inv" in state:
            dense[name] = fp8_dequantize(tensor, state[name + "_scale_inv"], tuple(block))
        elif name.endswith("_blocks"):
            base = name.removesuffix("_blocks")
            scales = state[base + "_scales"]
            if tensor.dim() == 3:
                dense[base] = mxfp4_dequantize(tensor, scales)
            else:  # fused [E, N, G, 16]: each expert
                dense[base] = torch.stack([mxfp4_dequantize(b, s) for b, s in zip(tensor, scales)])
        else:
            dense[name] = tensor.float()
    return copy_folder(shipped, out, dense, None)


def gguf_reference_folder(path: Path, out: Path) -> Path:
    """The float32 model a GGUF means: every tensor through the gguf package's `dequantize` (tessera's
    dequantising import, the path the built-in SmolLM2 takes)."""
    from tessera.stages.weights.convert import convert_gguf

    convert_gguf(path, out, keep_blocks=False)
    return out
