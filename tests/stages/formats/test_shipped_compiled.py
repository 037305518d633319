"""Compiled decode steps over weights as they ship: the fused forms (stages/engine/compiled/forms.py).

Each format's `fused_weight` (the weight as elementwise operations over the stored codes, which
inductor fuses into the product) is its `dequantized()` value for value, over every code and
the scales' whole range (hypothesis); its `fused_rows` is the product with that weight. A
compiled span of each fused format decodes its checkpoint's tokens with logits within the
compiled-vs-eager bound of the eager span's, solo (one-row reductions) and five sessions stacked
(the eight-row bucket: matmuls over the fused weight a chunk at a time); a GGUF mixing every
block type llama.cpp's low-bit files use compiles whole.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tessera.stages.engine.compiled.build import compile_decode
from tessera.stages.engine.compiled.forms import FusedRows, decode_form, unfused
from tessera.stages.engine.compiled.inductor import HEAD
from tessera.stages.engine.stage import Stage
from tessera.stages.assembly.stage import load_stage
from tessera.stages.families.shipped import GGML_TYPES
from tessera.stages.kernels.fp8 import Fp8BlockLinear
from tessera.stages.kernels.ggml.blocks import SCALED_TYPES
from tessera.stages.kernels.ggml.linear import TILE_PRODUCTS, GgmlLinear
from tessera.stages.kernels.ggml.scaled import float16_value
from tessera.stages.kernels.linear import ShippedLinear
from tessera.stages.kernels.mxfp4 import FUSED_SCALES, Mxfp4Linear

from ..families.conformance import PROMPT
from . import checkpoints as ck
from ..test_compiled import CLOSE, gap, solo_tokens, stacked_tokens

FUSED_FOLDERS = ["fp8-llama-ragged-blocks", "fp8-moe", "mxfp4-llama-every-matrix", "gguf-llama-Q8_0", "gguf-llama-q4",
                 "gguf-llama-every-type", "nvfp4-llama", "int4-moe-asym"]
STEPS = 6
STACKED = [PROMPT, PROMPT[:3], PROMPT[:5], PROMPT[:7], PROMPT[:9]]  # five rows: the eight-row bucket


def shipped_matrices(stage: Stage) -> list[ShippedLinear]:
    return [m for block in stage.blocks for m in block.modules() if isinstance(m, ShippedLinear)]


def check_fused(matrix: ShippedLinear) -> None:
    stored = matrix.fused_inputs()
    assert stored is not None
    want = matrix.dequantized()
    got = matrix.fused_weight(*stored)
    assert got.dtype == torch.float32 and torch.equal(got, want), f"{matrix.stored_as}: max {(got - want).abs().max()}"
    largest = float(want.abs().max())
    if largest > 2.0**-100:  # the product, with inputs scaled so that no sum leaves float32's range
        x = torch.randn(3, matrix.in_features, generator=torch.Generator().manual_seed(7))
        x *= 2.0 ** -math.ceil(math.log2(largest))
        rows, product = matrix.fused_rows(x, *stored), x @ want.T
        assert float((rows - product).abs().max() / product.abs().max()) <= 1e-5


@pytest.mark.parametrize("name", FUSED_FOLDERS + ["fp8-deepseek_v3", "mxfp4-moe-fused", "gguf-moe-every-type",
                                                  "gguf-moe-low-bit", "nvfp4-moe-modelopt", "int4-llama",
                                                  "fp8-deepseek_v3-fp4-experts"])
def test_every_fused_form_is_its_dequantized_weight(shipped, name):
    folder, _ = shipped[name]
    matrices = [m for m in shipped_matrices(load_stage(folder)) if m.fused_inputs() is not None]
    assert matrices
    for matrix in matrices:
        check_fused(matrix)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 255), min_size=8, max_size=8), st.integers(1, 3))
def test_fp8_fused_form_over_every_code(scale_bytes, bands):
    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # e4m3's NaN: refused at load
    codes = codes.view(16, 16).repeat(bands, 1).view(torch.float8_e4m3fn)  # [16 bands, 16]
    exponents = torch.tensor(scale_bytes, dtype=torch.int32).view(-1)[: 2 * bands].view(bands, 2)
    scale_inv = torch.ldexp(torch.ones(bands, 2), exponents - 160)  # 2^-160 .. 2^95: subnormal to large
    check_fused(Fp8BlockLinear(codes, scale_inv, (16, 8), None))


def test_fp8_compiled_form_reads_every_code_as_its_value():
    """Compiled (where the bit cast runs in inductor's vector code), every finite e4m3 code is its own
    value — the subnormals too, which a CPU flushing subnormal inputs to zero would lose — and the
    one-row product over them is the dequantized weight's."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # e4m3's NaN: refused at load
    matrix = Fp8BlockLinear(codes.view(16, 16).view(torch.float8_e4m3fn), torch.tensor([[0.5, 2.0]]), (16, 8), None)
    stored, want = matrix.fused_inputs(), matrix.dequantized()
    got = torch.compile(matrix.fused_weight, dynamic=False)(*stored)
    assert torch.equal(got, want), f"max {(got - want).abs().max()}"
    x = torch.randn(1, 16, generator=torch.Generator().manual_seed(3))
    rows, product = torch.compile(matrix.fused_rows, dynamic=False)(x, *stored), x @ want.T
    assert float((rows - product).abs().max() / product.abs().max()) <= 1e-5


def test_a_float16_scale_read_by_its_bits_is_its_value_for_every_pattern():
    """The GGUF blocks' float16 scales where no float16 view can load them (row tiles): every one of
    the 65,536 patterns, eager and compiled, is the float16's own value — subnormals, signed zeros,
    infinities and NaNs included."""
    bits = torch.arange(1 << 16, dtype=torch.int32)
    want = bits.to(torch.int16).view(torch.float16).float()
    for read in (float16_value, torch.compile(float16_value, dynamic=False)):
        got = read(bits)
        assert torch.equal(got.isnan(), want.isnan())
        finite = ~want.isnan()
        assert torch.equal(got[finite], want[finite]) and torch.equal(got[finite].signbit(), want[finite].signbit())


EVERY_BYTE = torch.arange(256, dtype=torch.uint8).view(1, 16, 16).repeat(2, 1, 1)  # [2 rows, 16 groups, 16]; a matrix takes its tensors over (row tiles, in place): each gets a copy


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(*FUSED_SCALES), min_size=16, max_size=16))
def test_mxfp4_fused_form_over_every_code_and_scale(scales):
    check_fused(Mxfp4Linear(EVERY_BYTE.clone(), torch.tensor(scales, dtype=torch.uint8).view(2, 8).repeat(1, 2), None))


@pytest.mark.parametrize("outside", [0, 1, 253, 254])
def test_an_mxfp4_scale_outside_the_fused_range_leaves_the_matrix_unfused(outside):
    """Such a product would leave float32's normal range in the bit arithmetic: the matrix keeps its
    eager form, and the decode form says which."""
    scales = torch.full((2, 16), 127, dtype=torch.uint8)
    scales[1, 3] = outside
    matrix = Mxfp4Linear(EVERY_BYTE.clone(), scales, None)
    assert matrix.fused_inputs() is None
    assert unfused(decode_form(torch.nn.Sequential(matrix))) == {"Mxfp4Linear"}


finite_halves = st.integers(0, 0xFFFF).filter(lambda bits: (bits >> 10) & 0x1F != 0x1F)  # no inf or NaN


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(["Q8_0", "Q4_0", "Q4_1"]), st.lists(finite_halves, min_size=16, max_size=16),
       st.integers(0, 2**32 - 1))
def test_gguf_fused_forms_over_random_blocks(kind, halves, seed):
    ggml = GGML_TYPES[kind]
    raw = torch.randint(0, 256, (4, 2 * ggml.nbytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    blocks = raw.view(4, 2, ggml.nbytes)
    bits = torch.tensor(halves, dtype=torch.int32)
    for at, half in ((0, bits[:8]), (2, bits[8:])) if kind == "Q4_1" else ((0, bits[:8]),):  # d (and m) per block
        blocks[..., at] = (half & 0xFF).view(4, 2).to(torch.uint8)
        blocks[..., at + 1] = (half >> 8).view(4, 2).to(torch.uint8)
    check_fused(GgmlLinear(raw, ggml, 2 * ggml.block, None))


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(sorted(SCALED_TYPES)), st.randoms(use_true_random=False))
def test_scaled_fused_forms_over_random_blocks(kind, rnd):
    """The k-quants', IQ types' and FP4 types' fused forms (ggml/scaled.py) over random blocks, scales
    finite: the fused weight is the dequantized one to the bit, the factored product its product."""
    ggml = GGML_TYPES[kind]
    raw = ck.finite_blocks(kind, np.frombuffer(rnd.randbytes(4 * 2 * ggml.nbytes), dtype=np.uint8), 8, rnd)
    check_fused(GgmlLinear(torch.from_numpy(raw).view(4, -1), ggml, 2 * ggml.block, None))


@pytest.mark.parametrize("kind", sorted(TILE_PRODUCTS))
def test_a_types_own_tile_product_compiled_is_its_dequantized_weights(kind):
    """The products of their own over row tiles (ggml/linear.py TILE_PRODUCTS: the k-quants' in
    ggml/k_lanes.py, the two-codes-a-byte types' in ggml/pair_lanes.py), compiled as a decode step compiles it:
    40 rows (two whole tiles and a tail of 8) of 4 random blocks each, scales finite: the fused weight is the
    dequantized one to the bit, and the compiled one-row product is its product."""
    ggml, rnd = GGML_TYPES[kind], random.Random(kind)
    raw = ck.finite_blocks(kind, np.frombuffer(rnd.randbytes(40 * 4 * ggml.nbytes), dtype=np.uint8), 40 * 4, rnd)
    matrix = GgmlLinear(torch.from_numpy(raw).view(40, -1), ggml, 4 * ggml.block, None)
    assert matrix.tiled and matrix.weight_tail is not None
    check_fused(matrix)
    want = matrix.dequantized()
    x = torch.randn(1, matrix.in_features, generator=torch.Generator().manual_seed(3))
    x *= 2.0 ** -math.ceil(math.log2(float(want.abs().max())))
    got, product = torch.compile(matrix.fused_rows, dynamic=False)(x, *matrix.fused_inputs()), x @ want.T
    assert float((got - product).abs().max() / product.abs().max()) <= 1e-5


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, 255).filter(lambda b: b & 0x7F != 0x7F), min_size=32, max_size=32),
       st.floats(2.0**-20, 2.0**20))
def test_nvfp4_fused_form_over_every_code_and_scale(scales, global_scale):
    from tessera.stages.kernels.nvfp4 import Nvfp4Linear

    codes = torch.arange(256, dtype=torch.uint8).view(2, 128)  # every byte: every pair of codes
    e4m3 = torch.tensor(scales, dtype=torch.uint8).view(2, 16).view(torch.float8_e4m3fn)
    check_fused(Nvfp4Linear(codes, e4m3, torch.tensor(global_scale, dtype=torch.float32), None))


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**32 - 1), st.booleans(), st.sampled_from([torch.bfloat16, torch.float16, torch.float32]))
def test_int4_fused_form_over_random_words(seed, symmetric, dtype):
    from tessera.stages.kernels.int4_packed import PackedInt4Linear

    gen = torch.Generator().manual_seed(seed)
    packed = torch.randint(-2**31, 2**31 - 1, (12, 16), dtype=torch.int32, generator=gen)  # 12 rows, 128 inputs
    scales = (torch.rand(12, 4, generator=gen) * 0.1).to(dtype)  # groups of 32
    zeros = None if symmetric else torch.randint(-2**31, 2**31 - 1, (2, 4), dtype=torch.int32, generator=gen)
    check_fused(PackedInt4Linear(packed, scales, zeros, None))


@pytest.fixture(scope="module")
def compiled(shipped):
    """Each folder's whole model compiled (buckets of one and eight rows), with what it said."""
    out = {}
    for name in FUSED_FOLDERS:
        stage, said = load_stage(shipped[name][0], embed=True, head=True), []
        compile_decode(stage, "inductor", say=said.append, buckets=(1, 8))
        out[name] = (stage, said)
    return out


@pytest.mark.parametrize("name", FUSED_FOLDERS)
def test_a_compiled_span_of_a_fused_format_decodes_as_the_eager_one(shipped, compiled, name):
    stage, said = compiled[name]
    runner = stage.decode
    assert not runner.eager, said  # every layer kind and the head compiled
    assert runner.compiled == set(stage.spec.layers) | {HEAD}
    assert any(isinstance(m, FusedRows) for form in runner.forms for m in form.modules())
    assert not any(unfused(form) for form in runner.forms)  # every shipped matrix in a fused form
    eager = load_stage(shipped[name][0], embed=True, head=True)
    want, want_logits = solo_tokens(eager, PROMPT, STEPS)
    before = runner.steps
    got, logits = solo_tokens(stage, PROMPT, STEPS)
    assert runner.steps - before == STEPS  # solo_tokens steps once more after its last token
    assert got == want
    assert max(gap(a, b) for a, b in zip(logits, want_logits)) <= CLOSE
    solo = [solo_tokens(eager, prompt, STEPS) for prompt in STACKED]
    tokens, stacked = stacked_tokens(stage, STACKED, STEPS)
    assert tokens == [t for t, _ in solo]
    assert max(gap(a, b) for i in range(len(STACKED)) for a, b in zip(stacked[i], solo[i][1])) <= CLOSE
    assert not runner.eager, [line for line in said if "eagerly" in line]  # no layer needed another compile


def test_the_decode_form_shares_the_stored_bytes():
    """A FusedRows holds views of its matrix's buffers: building the decode form copies no weight."""
    matrix = Mxfp4Linear(EVERY_BYTE.clone(), torch.full((2, 16), 127, dtype=torch.uint8), None)
    form = decode_form(torch.nn.Sequential(matrix))[0]
    assert isinstance(form, FusedRows)
    assert form.stored_0_0.data_ptr() == matrix.blocks.data_ptr() and form.stored_0_1.data_ptr() == matrix.scales.data_ptr()

