"""Weights in the form they ship: FP8 blocks, MXFP4 and GGUF k-quants, each against its dequantized reference.

Every checkpoint here is written by the test from a float model transformers built
(checkpoints.py): a Llama block and a Qwen3-MoE (every layer sparse), FP8 with the published
128x128 blocks and (Llama) with blocks that do not divide the matrices, MXFP4 on the experts (gpt-oss's
`modules_to_not_convert`, experts one tensor each and fused) and on every matrix, a GGUF of each
k-quant type and Q8_0 for the Llama block, and one mixing every block type for the MoE. Its
reference is the float model the stored values mean, dequantized by the independent oracle
(transformers' arithmetic, the gguf package's dequantizers) and run by tessera's float engine
(itself held to transformers). The shipped span's float32 logits are within TOLERANCE of the
reference's over a prefill and a greedy decode, and its greedy tokens are the reference's.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.stages.assembly.stage import load_stage
from tessera.stages.errors import ModelFormatError, UnsupportedModel
from tessera.stages.families.catalog import spec_from_config, spec_from_file, to_config
from tessera.stages.families.shipped import GGML_TYPES
from tessera.stages.weights.folder_check import check_folder
from tessera.stages.assembly.blocks import dense_block
from tessera.stages.kernels.ggml.linear import SPLITS
from tessera.stages.kernels.quant import Quant, QuantError, span_bytes

from ..families.conformance import PROMPT, RTOL, logits_gap
from . import checkpoints as ck
from .conftest import NAMES

transformers = pytest.importorskip("transformers")

# Float32 logits against the dequantized reference (the bound): max abs beyond RTOL of the row's largest
# logit (conformance.py `logits_gap`). Measured on an Intel Xeon (2026-12-06): 0 where the eager rows are the
# reference's weights in the reference's order (MXFP4, NVFP4, INT4, Q8_0, the low-bit GGUF), up to 8.5e-5
# (gguf-llama-q4; Q4_K-Q6_K 5-8e-5, fp8 4-5e-5) where the eager product sums in another order (the split order's
# permuted inputs; fp8's float16-widened chunks) of logits ~12; on an AMD EPYC (2026-12-07) gguf-llama-Q4_K
# 1.24e-4 plain, within the bound with RTOL.
TOLERANCE = 1e-4
DECODE_STEPS = 8


def run(folder: Path, feed: list[int] | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the logits of every step (fed `feed`'s tokens when given, else its own)."""
    stage = load_stage(folder, embed=True, head=True)
    stage.open("s", capacity=len(PROMPT) + DECODE_STEPS + 1)
    step, pos, tokens, logits = PROMPT, 0, [], []
    for i in range(DECODE_STEPS):
        rows = stage.logits(stage.forward("s", stage.embed(step), pos))
        logits.append(rows)
        tokens.append(int(rows[-1].argmax()))
        pos += len(step)
        step = [feed[i] if feed is not None else tokens[-1]]
    return tokens, logits


@pytest.mark.parametrize("name", NAMES)
def test_a_shipped_checkpoint_computes_its_dequantized_reference(shipped, name):
    folder, reference = shipped[name]
    spec = check_folder(folder)  # what `tessera model import` checks accepts it as shipped
    assert spec.shipped is not None and spec.shipped.method == name.split("-")[0]
    want, ref_logits = run(reference)
    got, logits = run(folder, feed=want)
    worst = logits_gap(ref_logits, logits)
    assert worst <= TOLERANCE, f"{name}: max |logits diff| beyond {RTOL:g} of the row's largest: {worst:.3g}"
    assert got == want
    assert run(folder)[0] == want  # and decoding on its own, greedy, the same tokens


@pytest.mark.parametrize("name", ["fp8-llama", "fp8-moe"])
def test_transformers_reads_the_fp8_checkpoint_as_the_reference_does(shipped, name):
    """The reference is what transformers itself makes of the FP8 folder (it dequantizes on a CPU, where
    the blocks divide the matrices: its CPU path refuses ragged edges, which its GPU kernels take)."""
    folder, reference = shipped[name]
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        theirs = model(torch.tensor([PROMPT])).logits[0]
    ours = run(reference)[1][0]
    assert float((theirs - ours).abs().max()) <= TOLERANCE


@pytest.mark.parametrize("name", ["fp8-llama-ragged-blocks", "mxfp4-moe-fused", "gguf-moe-every-type"])
def test_the_dense_reference_of_a_span_is_the_oracles(shipped, name):
    """`dense_block` (each module's `dequantized`) gives the very weights the oracle's dequantization does."""
    folder, reference = shipped[name]
    stage, ref = load_stage(folder), load_stage(reference)
    for ours, theirs in zip(stage.blocks, ref.blocks):
        dense = dense_block(ours, stage.spec).state_dict()
        for key, value in theirs.state_dict().items():
            assert torch.equal(dense[key], value), (name, key)


# matrices a span holds as float parameters whatever the checkpoint ships (MLA's wkv_b, DSA's indexers)
HELD_DENSE = ("kv_b_proj.weight", "indexer.wq_b.weight", "indexer.wk.weight", "indexer.weights_proj.weight")


@pytest.mark.parametrize("name", NAMES)
def test_placement_and_the_fetch_count_the_shipped_bytes(shipped, name, tmp_path):
    """A span holds its matrices as stored: its bytes are what placement counts (span_bytes) and what
    the manifest lists for its layers (what a peer fetching the span downloads and the model id hashes),
    but for what it holds dense: MLA's wkv_b and DSA's indexer matrices, parameters, widened to float32
    from their fp8 blocks."""
    from tessera.stages.weights import registry
    from tessera.stages.weights.tensor_table import groups_for_span

    folder = tmp_path / name
    shutil.copytree(shipped[name][0], folder)
    spec = spec_from_file(folder / "config.json")
    manifest = registry.write_manifest(folder)
    entries = manifest["tensors"]["entries"]
    for start, end in ((0, 1), (1, 3)):
        stage = load_stage(folder, start=start, end=end)
        layers = {f"layer.{i}" for i in range(start, end)}
        on_disk = sum(e["end"] - e["begin"] for e in entries.values() if e["group"] in layers)
        widened = sum(4 * math.prod(e["shape"]) - (e["end"] - e["begin"]) for n, e in entries.items()
                      if e["group"] in layers and n.endswith(HELD_DENSE)) + sum(
            -(e["end"] - e["begin"]) for n, e in entries.items()
            if e["group"] in layers and n.endswith(tuple(m + "_scale_inv" for m in HELD_DENSE)))
        assert stage.weight_bytes == span_bytes(spec, start, end, 4) == on_disk + widened  # float tensors here are F32
        assert layers <= groups_for_span(start, end, spec.num_layers, tied=spec.tie_embeddings)
    assert registry.verify(folder) == []


def test_the_model_id_covers_the_shipped_bytes(shipped, tmp_path):
    """One fp8 scale changed is another model: peers chain only on the identical checkpoint."""
    from safetensors.torch import load_file, save_file

    from tessera.stages.weights import registry

    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(shipped["fp8-llama"][0], a)
    shutil.copytree(shipped["fp8-llama"][0], b)
    state = load_file(str(b / "model.safetensors"))
    state["model.layers.1.mlp.down_proj.weight_scale_inv"] *= 2
    save_file(state, str(b / "model.safetensors"))
    assert registry.write_manifest(a)["model_id"] != registry.write_manifest(b)["model_id"]


def test_a_quantization_config_round_trips_through_the_spec(shipped):
    for name in ("fp8-llama-ragged-blocks", "mxfp4-moe", "gguf-moe-every-type", "nvfp4-moe-modelopt", "int4-moe-asym",
                 "fp8-deepseek_v3-fp4-experts"):
        spec = spec_from_file(shipped[name][0] / "config.json")
        assert spec_from_config(to_config(spec)) == spec


# -- the arithmetic, against the oracles' ----------------------------------------------------------

def test_fp8_codes_widen_exactly():
    """Every finite e4m3 code through the float16 trick is torch's own conversion (times 2^-8)."""
    from tessera.stages.kernels.fp8 import widen_codes

    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    codes = codes[(torch.arange(256) & 0x7F) != 0x7F].reshape(2, -1)
    assert torch.equal(widen_codes(codes, torch.empty(codes.shape)) * 256, codes.float())


@settings(max_examples=25, deadline=None)
@given(st.binary(min_size=16 * 17, max_size=16 * 17))
def test_mxfp4_matches_transformers(data):
    from tessera.stages.kernels.mxfp4 import mxfp4_dense, widen_groups

    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    blocks, scales = raw[: 16 * 16].view(4, 4, 16), (raw[16 * 16:].view(4, 4) % 64 + 100).to(torch.uint8)
    want = ck.mxfp4_dequantize(blocks, scales)
    assert torch.equal(mxfp4_dense(blocks, scales), want)
    assert torch.equal(widen_groups(blocks, scales, torch.empty(4, 128)), want)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(k for k, t in GGML_TYPES.items() if not t.is_float)), st.integers(1, 3),
       st.randoms(use_true_random=False))
def test_ggml_blocks_match_the_gguf_package(kind, rows, rnd):
    """Any bytes (scales made finite) dequantize as the gguf package's numpy dequantizers do, to the bit,
    in the reference's arithmetic and the fast one's."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    from tessera.stages.kernels.ggml.blocks import ggml_rows
    from tessera.stages.kernels.ggml.linear import split_weight

    t = GGML_TYPES[kind]
    raw = ck.finite_blocks(kind, np.frombuffer(rnd.randbytes(rows * 2 * t.nbytes), dtype=np.uint8), rows * 2, rnd)
    raw = raw.reshape(rows, 2 * t.nbytes)
    want = dequantize(raw, GGMLQuantizationType[kind]).reshape(rows, -1)
    assert np.array_equal(ggml_rows(torch.from_numpy(raw), t).numpy(), want)
    if kind in SPLITS:  # the eager fast path of the types that have one
        assert np.array_equal(split_weight(torch.from_numpy(raw), t).numpy(), want)


@pytest.mark.parametrize("kind", sorted(k for k, t in GGML_TYPES.items() if not t.is_float))
def test_a_matrix_whose_rows_start_at_an_odd_byte_computes_its_reference(kind):
    """A span's matrix is a view of the file's mapping, and its rows may start at an odd byte (a tensor
    before it of an odd size: MXFP4's blocks are 17 bytes; bench/shipped.py's synth-k Q6_K span raised
    so before kernels/ggml's product copied such rows): its dequantized weight is the gguf package's,
    and its eager product and its fused form's are the products with it. 17 rows: a whole row tile and a
    tail of one row, which the tiled types hand over as a view of the bytes, not a copy."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    from tessera.stages.kernels.ggml.linear import GgmlLinear

    t, rows, rnd = GGML_TYPES[kind], 17, random.Random(kind)
    raw = ck.finite_blocks(kind, np.frombuffer(rnd.randbytes(rows * 2 * t.nbytes), dtype=np.uint8), rows * 2, rnd)
    want = torch.from_numpy(dequantize(raw.reshape(rows, -1), GGMLQuantizationType[kind]).reshape(rows, -1))
    mapping = torch.zeros(1 + raw.size, dtype=torch.uint8)  # the rows at byte 1 of it
    odd = mapping[1:].view(rows, -1)
    odd.copy_(torch.from_numpy(raw).view(rows, -1))
    assert odd.storage_offset() % 2 == 1
    matrix = GgmlLinear(odd, t, 2 * t.block, None)
    assert torch.equal(matrix.dequantized(), want)
    x = torch.randn(3, 2 * t.block, generator=torch.Generator().manual_seed(5))
    x *= 2.0 ** -math.ceil(math.log2(float(want.abs().max())))  # no sum leaves float32's range
    product = x @ want.T
    stored = matrix.fused_inputs()
    for got in (matrix.matmul(x), *(() if stored is None else (matrix.fused_rows(x, *stored),))):
        assert float((got - product).abs().max() / product.abs().max()) <= 1e-5




# -- what is refused, with one line ------------------------------------------------------------------

@pytest.mark.parametrize("quantization, words", [
    ({"quant_method": "gptq", "bits": 4}, "quant_method 'gptq'"),
    ({"quant_method": "awq"}, "quant_method 'awq'"),
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
    ({"quant_method": "compressed-tensors"}, "format None"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "quant_algo 'FP8'"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8"}, "kv_cache_quant_algo 'FP8'"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}, "group_size 32"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "activation_scheme 'static'"),
    ({"quant_method": "fp8", "weight_block_size": None}, "weight_block_size null"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "expert_dtype": "int4"}, "expert_dtype 'int4'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}, "fmt 'e5m2'"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "kv_cache_scheme": "fp8"}, "kv_cache_scheme"),
    ({"quant_method": "mxfp4", "dequantize": True}, "dequantize True"),
    ({"quant_method": "gguf", "tensor_types": {"model.layers.0.mlp.up_proj.weight": "Q5_0"}}, "'Q5_0'"),
])
def test_another_quantization_is_refused_by_name(sources, quantization, words):
    config = json.loads((sources["llama"] / "config.json").read_text())
    with pytest.raises(UnsupportedModel, match=words) as refused:
        spec_from_config({**config, "quantization_config": quantization})
    assert "\n" not in str(refused.value)


def _ct(kind: str, change) -> dict:
    config = ck.ct_config(kind)
    change(config, config["config_groups"]["group_0"])
    return config


@pytest.mark.parametrize("config, words", [
    (_ct("int4", lambda c, g: g["weights"].update(actorder="group")), "actorder 'group'"),
    (_ct("int4", lambda c, g: g["weights"].update(num_bits=8)), "num_bits 8"),
    (_ct("int4", lambda c, g: g["weights"].update(strategy="block", block_structure=[128, 128])), "strategy 'block'"),
    (_ct("int4", lambda c, g: g["weights"].update(group_size=48)), "group_size 48"),
    (_ct("int4", lambda c, g: g.update(input_activations={"num_bits": 8, "type": "int", "dynamic": True})),
     "input_activations is not supported for pack-quantized"),
    (_ct("int4", lambda c, g: c.update(quantization_status="frozen")), "quantization_status 'frozen'"),
    (_ct("int4", lambda c, g: c.update(kv_cache_scheme={"num_bits": 8, "type": "float"})), "kv_cache_scheme"),
    (_ct("int4", lambda c, g: c["config_groups"].update(group_1={**g, "weights": {**g["weights"], "group_size": 64}})),
     "mix 2 schemes"),
    (_ct("nvfp4", lambda c, g: g["input_activations"].update(num_bits=8, type="int")), "num_bits 8"),
    (_ct("nvfp4", lambda c, g: g["weights"].update(group_size=32)), "group_size 32"),
    (_ct("nvfp4", lambda c, g: g.update(output_activations=g["weights"])), "output_activations"),
    (_ct("nvfp4", lambda c, g: c.update(sparsity_config={"format": "sparse-24-bitmask"})), "sparsity_config"),
])
def test_a_compressed_tensors_setting_we_do_not_compute_is_refused(sources, config, words):
    """compressed-tensors' own configs (its QuantizationConfig, dumped), each changed in one setting that
    changes what the stored numbers mean."""
    base = json.loads((sources["llama"] / "config.json").read_text())
    with pytest.raises(UnsupportedModel, match=words) as refused:
        spec_from_config({**base, "quantization_config": config})
    assert "\n" not in str(refused.value)


def test_the_configs_compressed_tensors_writes_are_read_and_round_trip(sources):
    base = json.loads((sources["llama"] / "config.json").read_text())
    for kind in ("nvfp4", "int4", "int4-asym"):
        spec = spec_from_config({**base, "quantization_config": ck.ct_config(kind)})
        assert spec.shipped.method == kind.split("-")[0] and spec.shipped.symmetric == (kind != "int4-asym")
        assert spec_from_config(to_config(spec)) == spec


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "TQ2_0"])
def test_a_gguf_of_another_type_is_refused_naming_it(sources, tmp_path, kind):
    """A tensor of a ggml type tessera does not compute as stored: the import names it (and
    --dequantize still converts what the gguf package dequantizes)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    from tessera.stages.weights.convert import convert_gguf

    def types(name: str) -> str:
        return kind if name.endswith("mlp.down_proj.weight") else "Q8_0"

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]

    def quantize(w: np.ndarray, k: str) -> np.ndarray:  # the gguf package quantizes Q5_0/Q5_1; TQ2_0: random blocks
        if k != kind or kind in ("Q5_0", "Q5_1"):
            return ck.ggml_quantize(w, k)
        return np.random.default_rng(0).integers(0, 256, (w.shape[0], w.shape[1] // block * size), dtype=np.uint8)

    path = ck.gguf_file(sources["llama"], tmp_path / "other.gguf", types, quantize=quantize)
    with pytest.raises(UnsupportedModel, match=f"blk.0.ffn_down.weight' is {kind}") as refused:
        convert_gguf(path, tmp_path / "kept", keep_blocks=True)
    assert "\n" not in str(refused.value)


def test_a_shipped_model_is_not_quantized_again(shipped):
    with pytest.raises(QuantError, match="ships as fp8: --quant int8 applies to float weights"):
        load_stage(shipped["fp8-llama"][0], quant=Quant("int8"))


def test_a_broken_shipped_tensor_is_refused_naming_it(shipped, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "nan"
    shutil.copytree(shipped["fp8-llama"][0], folder)
    state = load_file(str(folder / "model.safetensors"))
    name = "model.layers.2.self_attn.o_proj.weight"
    codes = state[name].view(torch.uint8).clone()
    codes[3, 5] = 0x7F  # e4m3's NaN
    state[name] = codes.view(torch.float8_e4m3fn)
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ModelFormatError, match=f"{name}' holds float8 NaN codes"):
        load_stage(folder, start=2, end=3)
    del state[name + "_scale_inv"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ModelFormatError, match=f"{name}_scale_inv' \\(fp8\\) is missing"):
        load_stage(folder, start=2, end=3)
    with pytest.raises(ModelFormatError, match=f"{name}_scale_inv' is missing"):
        check_folder(folder)


# -- a device's own kernel ---------------------------------------------------------------------------

@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="torch's blockwise fp8 scaled_mm needs a CUDA device of capability 9.0 (H100/H200)")
def test_fp8_takes_torchs_scaled_mm_on_sm90():  # not run on this project's CI (no GPU)
    from tessera.stages.kernels.encode import fp8_encode
    from tessera.stages.kernels.fp8 import Fp8BlockLinear

    w = torch.randn(512, 1024) * 0.02
    codes, scale_inv = fp8_encode(w, (128, 128))
    layer = Fp8BlockLinear(codes.cuda(), scale_inv.cuda(), (128, 128), None)
    x = torch.randn(5, 1024, device="cuda", dtype=torch.bfloat16)
    got = layer(x).float()
    assert layer._kernel_ok, "scaled_mm ran and agreed with the dequantized weight"
    want = x.float() @ layer.dequantized().cuda().T
    assert float((got - want).abs().max()) <= 0.05 * float(want.abs().max())
