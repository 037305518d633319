"""Quantized spans against their own dequantized float32 model (stages/kernels/quant.py).

The reference for a span stored as int8/int4 is a float32 model whose matrices are the
dequantized values (q s, c s + m, or (q - 8) s + z) — the same model, computed without the
quantized forms.

Tolerances, derived:
- float32 activations (the CPU default): a float32 CPU span multiplies by rows dequantized
  with the reference's own function, a chunk at a time, so the two differ only in how the
  matmul blocks its sums (~1e-7 a product), as two float32 implementations do. Such noise
  is relative: ~1e-5 of the largest logit through 30 layers, and SmolLM2's logits reach
  ~30, so 3e-4 (measured: 4e-5 to 8e-5 on SmolLM2; 0 on the tiny model, whose matrices fit
  one chunk). The engine meets 1e-4 against transformers, whose kernels are the same as
  ours; a chunked matmul blocks its sums differently.
- bfloat16 activations (`--dtype bfloat16`: torch's fast CPU kernels; the CPU default is float32,
  because bfloat16 changes int4 SmolLM2's answer to the France prompt): the difference from
  the float32 reference is bfloat16 roundoff through 30 layers, and the project already
  bounds that: `tessera.protocol.fingerprint.tolerance("bfloat16", "float32", layers)` (16 x 2^-8 x
  sqrt(layers), entrywise relative to |a| + |b| + the row's RMS), the bound spot checks
  hold an honest bf16 peer to against a float32 one.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from tessera.peer.node.config import capacity_in_layers
from tessera.protocol.fingerprint import relative_difference, tolerance
from tessera.stages.decoding.generate import pick_dtype, prompt_ids
from tessera.stages.assembly.blocks import dense_block
from tessera.stages.assembly.stage import load_stage
from tessera.stages.engine.stage import Stage
from tessera.stages.families.catalog import spec_from_file
from tessera.stages.kernels import chunked
from tessera.stages.kernels.quant import (
    NO_QUANT, Int4BlockLinear, Int4Linear, Int8Linear, Quant, QuantError, base_model_id, dense_weight, layer_bytes,
    model_tag, quantize_linear,
)
from tessera.stages.layers.block import linear_paths

from ..conftest import FRANCE
from ..resident import ROOT

FLOAT32_TOLERANCE = 3e-4  # max |logits - reference|, float32 activations (see module docstring)
SCHEMES = ["int8", "int4g32", "int4g64"]


def reference_of(stage: Stage) -> Stage:
    """The float32 model whose weights are `stage`'s dequantized ones."""
    return Stage(stage.spec, stage.start, [dense_block(b, stage.spec) for b in stage.blocks],
                 embedding=stage.embedding.float(), norm=stage.norm.float(), head=stage.head.float())


def greedy(stage: Stage, ids: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    """n greedy tokens and the logits of every step."""
    stage.open("g", capacity=len(ids) + n)
    logits = [stage.logits(stage.forward("g", stage.embed(ids), 0))]
    out: list[int] = []
    while len(out) < n:
        out.append(int(logits[-1][-1].argmax()))
        logits.append(stage.logits(stage.forward("g", stage.embed(out[-1:]), len(ids) + len(out) - 1)))
    stage.close("g")
    return out, logits


# -- the scheme itself ----------------------------------------------------------------------


def test_names_and_bad_values():
    assert Quant.parse("int8").tag == "int8" and Quant.parse("int4").tag == "int4g32"
    assert Quant.parse("int4", 64) == Quant("int4", 64) == Quant.parse("int4g64")
    assert model_tag("abc", NO_QUANT) == "abc" and model_tag("abc", Quant("int4", 64)) == "abc+int4g64"
    assert base_model_id("abc+int8") == "abc"
    with pytest.raises(QuantError, match="'int3'"):
        Quant("int3")
    with pytest.raises(QuantError, match="48"):
        Quant("int4", 48)
    with pytest.raises(QuantError, match="128 does not divide a weight's 576"):
        quantize_linear(torch.zeros(64, 576), None, Quant("int4", 128), dtype=torch.float32, device="cpu")
    with pytest.raises(QuantError, match="multiples of 16, a weight has 40"):  # torch's bf16 CPU kernel's rule
        quantize_linear(torch.zeros(40, 64), None, Quant("int4"), dtype=torch.bfloat16, device="cpu")


@pytest.mark.parametrize("scheme", SCHEMES)
def test_kernel_multiplies_by_the_dequantized_weight(scheme):
    """The reference's weight is what the kernel uses: x W_ref^T equals the kernel to float32 roundoff
    (bfloat16 roundoff for torch's bf16 kernels), and W_ref is within one quantization step of the float weight."""
    gen = torch.Generator().manual_seed(1)
    w, bias, x = torch.randn(96, 128, generator=gen) * 0.02, torch.randn(96, generator=gen), torch.randn(5, 128, generator=gen)
    quant = Quant.parse(scheme)
    fast = quantize_linear(w, bias, quant, dtype=torch.bfloat16, device="cpu")
    assert isinstance(fast, Int8Linear if quant.kind == "int8" else Int4Linear)
    want = x.bfloat16().float() @ dense_weight(fast).T + bias.bfloat16().float()
    assert (fast(x.bfloat16()).float() - want).abs().max() < 2 ** -7 * want.abs().max()  # bf16 output roundoff
    layer = quantize_linear(w, bias, quant, dtype=torch.float32, device="cpu")
    assert isinstance(layer, Int8Linear if quant.kind == "int8" else Int4BlockLinear)
    dense = dense_weight(layer)
    assert (layer(x) - (x @ dense.T + bias)).abs().max() < 1e-5
    if quant.kind == "int8":
        step = w.abs().amax(1, keepdim=True) / 127  # one step per row
    else:
        g = w.reshape(96, -1, quant.group_size)
        step = ((g.amax(-1) - g.amin(-1)) / 15).repeat_interleave(quant.group_size, 1)
    assert ((dense - w).abs() <= step / 2 + 1e-7).all()  # rounding to the nearest level
    assert layer.weight.dtype == (torch.int8 if quant.kind == "int8" else torch.uint8)


def test_placement_counts_quantized_bytes(smol_dir):
    spec = spec_from_file(smol_dir / "config.json")
    f32 = layer_bytes(spec, 4)
    assert f32 == spec.layer_bytes(4)
    int8, int4 = layer_bytes(spec, 2, Quant("int8")), layer_bytes(spec, 2, Quant("int4"))
    # int8: 1 byte per weight + a bf16 scale per row; int4: half a byte + a bf16 (scale, zero) per 32
    assert 3.9 < f32 / int8 < 4.0 and 6.3 < f32 / int4 < 6.5  # 4 / (0.5 + 4 / 32) = 6.4
    budget = 1 << 30
    assert capacity_in_layers(spec, budget // 8, 4) < capacity_in_layers(spec, budget // 8, 2, Quant("int4"))
    assert capacity_in_layers(spec, 5 * f32, 2, Quant("int8")) == min(30, int(5 * f32 * 0.75 // int8))


def test_quantized_spans_compute_in_float32_on_cpu_unless_asked():
    cpu = torch.device("cpu")
    assert pick_dtype("auto", cpu) == torch.float32
    assert pick_dtype("auto", cpu, Quant("int8")) == pick_dtype("auto", cpu, Quant("int4")) == torch.float32
    assert pick_dtype("bfloat16", cpu, Quant("int4")) == torch.bfloat16
    assert pick_dtype("float32", cpu, Quant("int4")) == torch.float32


@pytest.mark.parametrize("scheme", SCHEMES)
def test_float32_cpu_form_dequantizes_in_bounded_chunks(scheme, monkeypatch):
    """A float32 CPU span multiplies by dequantized rows, a few at a time: the result is the
    reference's to float32 roundoff however the rows are cut, and its int4 integers are GGUF's Q4
    layout (w = c s + m, low nibbles first)."""
    gen = torch.Generator().manual_seed(2)
    w, x = torch.randn(80, 256, generator=gen) * 0.02, torch.randn(3, 256, generator=gen)
    quant = Quant.parse(scheme)
    layer = quantize_linear(w, None, quant, dtype=torch.float32, device="cpu")  # 80 rows: no multiple of 16 needed
    whole = layer(x)
    monkeypatch.setattr(chunked, "DEQUANT_CHUNK_BYTES", 7 * 256 * 4)  # 7 rows a chunk: 12 chunks
    assert (layer(x) - whole).abs().max() < 1e-6
    assert (whole - x @ dense_weight(layer).T).abs().max() < 1e-6
    if quant.kind == "int4":
        assert isinstance(layer, Int4BlockLinear) and layer.weight.shape == (80, 256 // quant.group_size, quant.group_size // 2)
        half = quant.group_size // 2
        codes = torch.cat((layer.weight & 15, layer.weight >> 4), -1).float()  # [N, K/G, G]
        assert torch.equal(dense_weight(layer), (codes * layer.scales[..., None] + layer.mins[..., None]).reshape(80, 256))
        assert int(codes[0, 0, half]) == int(layer.weight[0, 0, 0] >> 4)


def test_a_forward_outside_inference_mode_after_one_inside_it():
    """The dequantization scratch is per thread and reused: a peer's worker runs forwards under
    inference_mode, a test or a tool the same layer without it. A buffer first made inside
    inference_mode could not be written outside it (this failed CI in a run-order-dependent way)."""
    gen = torch.Generator().manual_seed(3)
    w, x = torch.randn(48, 128, generator=gen) * 0.02, torch.randn(2, 128, generator=gen)
    for scheme in SCHEMES:
        chunked.SCRATCH.__dict__.clear()  # this thread's buffers: made anew below, inside inference_mode
        layer = quantize_linear(w, None, Quant.parse(scheme), dtype=torch.float32, device="cpu")
        with torch.inference_mode():
            inside = layer(x)
        assert torch.equal(layer(x), inside), scheme


# -- a tiny synthetic model, float32 activations --------------------------------------------


@pytest.mark.parametrize("scheme", SCHEMES)
def test_tiny_model_equals_its_dequantized_float32_model(tiny_llama, scheme):
    stage = load_stage(tiny_llama, embed=True, head=True, quant=Quant.parse(scheme))
    ref = reference_of(stage)
    ids = [3, 17, 99, 250, 42, 7, 7, 8]
    got, got_logits = greedy(stage, ids, 12)
    want, want_logits = greedy(ref, ids, 12)
    worst = max((a - b).abs().max().item() for a, b in zip(got_logits, want_logits))
    print(f"{scheme}: max |logits - dequantized float32| = {worst:.2g}")
    assert got == want
    assert worst <= FLOAT32_TOLERANCE
    dense = load_stage(tiny_llama, embed=True, head=True)
    assert stage.weight_bytes < dense.weight_bytes  # not a float copy in disguise
    assert not any(t.is_meta for t in [*stage.blocks.parameters(), *stage.blocks.buffers()])


# -- SmolLM2 -------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["int8", "int4g32"])
def smol_quantized(request, smol_dir):
    """(scheme, the quantized model as a CPU peer serves it by default, its dequantized float32 model)."""
    quant = Quant.parse(request.param)
    stage = load_stage(smol_dir, embed=True, head=True, quant=quant, dtype=pick_dtype("auto", torch.device("cpu"), quant))
    return request.param, stage, reference_of(stage)


@pytest.fixture(scope="module", params=["int8", "int4g32"])
def smol_quantized_bf16(request, smol_dir):
    """(scheme, the quantized model with --dtype bfloat16: torch's fast CPU kernels, its dequantized float32 model)."""
    stage = load_stage(smol_dir, embed=True, head=True, quant=Quant.parse(request.param), dtype=torch.bfloat16)
    return request.param, stage, reference_of(stage)


@pytest.mark.slow
@pytest.mark.parametrize("prompt,raw", [(FRANCE, False), ("The quick brown fox", True)])
def test_smollm2_default_dtype_equals_the_dequantized_model(smol_quantized, smol_tokenizer, prompt, raw):
    """The default on a CPU (float32 activations): greedy tokens identical to the dequantized float32
    model, logits within FLOAT32_TOLERANCE at every step (int4 in bfloat16 answered France wrongly)."""
    scheme, stage, ref = smol_quantized
    assert stage.blocks[0].attn_norm.weight.dtype == torch.float32
    ids = prompt_ids(smol_tokenizer, prompt, raw=raw)
    got, got_logits = greedy(stage, ids, 12)
    want, want_logits = greedy(ref, ids, 12)
    worst = max((a - b).abs().max().item() for a, b in zip(got_logits, want_logits))
    print(f"{scheme} {prompt!r}: {smol_tokenizer.decode(got)!r}; max |logits - dequantized float32| = {worst:.2g}")
    assert got == want
    assert worst <= FLOAT32_TOLERANCE
    if prompt == FRANCE:
        assert smol_tokenizer.decode(got).startswith("The capital of France is Paris.")


@pytest.mark.slow
@pytest.mark.parametrize("prompt,raw", [(FRANCE, False), ("The quick brown fox", True)])
def test_smollm2_bfloat16_tokens_and_logits_against_the_dequantized_model(smol_quantized_bf16, smol_tokenizer,
                                                                          prompt, raw):
    """Logits within the bf16 bound at every step; greedy tokens identical, except that a step whose
    reference top-2 margin lies inside that bound may flip (bf16 roundoff alone flips such near ties:
    the unquantized bf16 model does on "List three prime numbers greater than 100.")."""
    scheme, stage, ref = smol_quantized_bf16
    ids = prompt_ids(smol_tokenizer, prompt, raw=raw)
    got, got_logits = greedy(stage, ids, 12)
    tol = tolerance("bfloat16", "float32", stage.spec.num_layers)
    ref.open("r", capacity=len(ids) + len(got))
    want_logits = [ref.logits(ref.forward("r", ref.embed(ids + got[:-1]), 0))]  # teacher-forced on our tokens
    ref.close("r")
    ours = torch.cat([got_logits[0][-1:], *got_logits[1:-1]])  # [n, V]: the logits each token was chosen from
    theirs = want_logits[0][len(ids) - 1:]
    rms = theirs.pow(2).mean(-1).sqrt()
    worst = relative_difference(ours, theirs, rms).max().item()
    print(f"{scheme} {prompt!r}: {smol_tokenizer.decode(got)!r}; worst relative logit difference {worst:.3g} "
          f"(tolerance {tol:.3g})")
    assert worst <= tol
    for step, token in enumerate(got):
        best = int(theirs[step].argmax())
        if token != best:  # a near tie: allowed only inside the bound, the reference's margin included
            a, b = theirs[step], ours[step]
            slack = tol * (a[best].abs() + b[best].abs() + a[token].abs() + b[token].abs() + 2 * rms[step])
            assert a[best] - a[token] <= slack, (scheme, step, token, best)


# -- memory ---------------------------------------------------------------------------------

QUANT_SPAN_RSS = """
import gc, sys, torch
from pathlib import Path
from tessera.stages.engine.stage import Stage
from tessera.stages.assembly.stage import load_stage
from tessera.stages.kernels.quant import Quant
from tests.resident import held_bytes, mib, no_huge_pages, resident_parts
no_huge_pages()
torch.set_num_threads(1)
warm = load_stage(Path(sys.argv[1]), start=0, end=1, quant=Quant.parse(sys.argv[2]))
warm.open("w", capacity=4)
warm.forward("w", torch.zeros(1, warm.spec.hidden_size), 0)  # torch's lazy kernel set-up, not the span
del warm
import tessera.stages.kernels.chunked as chunked
chunked.SCRATCH.__dict__.clear()  # the dequantization buffers count: this thread's made anew for the span
gc.collect()
def rss():
    return next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
                if line.startswith("VmRSS:"))
before, held_before = rss(), held_bytes()
print('before the span:', mib(resident_parts()), file=sys.stderr)
Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the current RSS
stage = load_stage(Path(sys.argv[1]), start=0, end=15, quant=Quant.parse(sys.argv[2]))  # float32: the CPU default
peak = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
            if line.startswith("VmHWM:"))
# The kernel keeps only a peak of the whole RSS: take out the library pages mapped by the load
# (counted after it, so the peak held is, if anything, under-stated by those mapped after the peak).
libraries = (rss() - before) - (held_bytes() - held_before)
stage.open("s", capacity=64)
stage.forward("s", torch.zeros(1, stage.spec.hidden_size), 0)  # every weight touched, so resident
gc.collect()
print('after the span:', mib(resident_parts()), file=sys.stderr)
print(held_bytes() - held_before, stage.weight_bytes, stage.session_bytes(64), peak - before - libraries)
"""


FLOAT_TEMPORARIES = 48 << 20  # the largest float32 matrix (gate/up: 7 MiB) and its int4 temporaries (~5 copies)


GGUF_LOAD_TEMPORARIES = 8 << 20  # the GGUF header's pages while parsed and one matrix's integer copies (measured +0.8 MiB)


@pytest.fixture(scope="module")
def smol_without_gguf(smol_dir, tmp_path_factory):
    """SmolLM2's converted folder without its source GGUF (links): int4 is quantized from the float weights."""
    folder = tmp_path_factory.mktemp("smol-no-gguf")
    for path in smol_dir.iterdir():
        if path.name != "source.gguf":
            (folder / path.name).symlink_to(path)
    return folder


@pytest.mark.parametrize("scheme,source", [("int8", "folder"), ("int4", "folder"), ("int4", "gguf")])
def test_quantized_span_resident_memory(smol_dir, smol_without_gguf, scheme, source):  # layers [0, 15) of SmolLM2
    """Memory held after loading (and running) a quantized span (anonymous and weight-file pages,
    no huge pages: tests/resident.py) <= 1.15 x (its quantized weights + KV cache),
    its dequantization scratch included, and the float weights were never all in memory at once:
    quantized from the folder, the peak is the quantized span plus a few float matrices (layers
    [0, 15): measured peaks +68 MiB for 51 MiB int8, +54 MiB for 38 MiB int4, against a 203 MiB
    float32 span); from the GGUF's blocks there is no float matrix at all (measured: peak +38.8 MiB
    for 38 MiB of int4)."""
    folder = smol_dir if source == "gguf" else smol_without_gguf
    done = subprocess.run([sys.executable, "-c", QUANT_SPAN_RSS, str(folder), scheme],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    grown, weights, kv, peak = map(int, done.stdout.split())
    float_span = 15 * spec_from_file(smol_dir / "config.json").layer_bytes(4)
    print(f"{scheme} from the {source}: +{grown / 2**20:.1f} MiB held for {weights / 2**20:.1f} MiB of weights and "
          f"{kv / 2**20:.1f} MiB of KV cache (ratio {grown / (weights + kv):.3f}); peak +{peak / 2**20:.1f} MiB "
          f"(float32 span {float_span / 2**20:.0f} MiB)\n{done.stderr.strip()}")
    assert grown <= 1.15 * (weights + kv)
    assert peak <= weights + kv + (GGUF_LOAD_TEMPORARIES if source == "gguf" else FLOAT_TEMPORARIES)


# -- a GGUF's Q4_1 blocks, as they are -----------------------------------------------------


def test_int4_span_takes_the_gguf_blocks_without_reading_a_float_matrix(smol_dir, smol_without_gguf, monkeypatch):
    """SmolLM2's GGUF is Q4_1: an int4 float32 CPU span takes its blocks as they are (no float matrix
    is read: the folder's reader refuses here), and they are exactly what quantizing the converted
    folder gives (same integers and scales, so the same `+int4g32` model), and their dequantized
    weights ARE the folder's float32 weights: the reference model is the unquantized one."""
    from tessera.stages.weights.folder import WeightFolder

    quantized = load_stage(smol_without_gguf, start=0, end=3, quant=Quant("int4"))
    dense = load_stage(smol_dir, start=0, end=3)

    def no_float_matrices(self, source, dtype):
        raise AssertionError(f"a float matrix was read: {source.names}")

    monkeypatch.setattr(WeightFolder, "read_stacked", no_float_matrices)
    as_is = load_stage(smol_dir, start=0, end=3, quant=Quant("int4"))
    monkeypatch.undo()
    for ours, theirs, floats in zip(as_is.blocks, quantized.blocks, dense.blocks):
        for path in linear_paths(floats):
            layer = ours.get_submodule(path)
            assert isinstance(layer, Int4BlockLinear)
            for buffer in ("weight", "scales", "mins"):
                assert torch.equal(getattr(layer, buffer), getattr(theirs.get_submodule(path), buffer)), path
            assert torch.equal(dense_weight(layer), floats.get_submodule(path).weight), path
    # bf16 activations use torch's kernels, whose packing is not GGUF's: quantized from the folder
    with pytest.raises(AssertionError, match="a float matrix was read"):
        monkeypatch.setattr(WeightFolder, "read_stacked", no_float_matrices)
        load_stage(smol_dir, start=0, end=1, quant=Quant("int4"), dtype=torch.bfloat16)


def test_gguf_blocks_served_as_is_only_when_they_requantize_to_themselves(tmp_path, smol_dir):
    from tessera.stages.errors import ModelFormatError
    from tessera.stages.weights.gguf_blocks import GgufQ4Source, requantizes_to_itself
    from tessera.stages.weights.gguf_directory import read_gguf_directory

    source = GgufQ4Source.beside(smol_dir, spec_from_file(smol_dir / "config.json"))
    v = "model.layers.0.self_attn.v_proj.weight"
    nibbles, d, m = source.matrix([v], {v: (192, 576)})
    assert nibbles.shape == (192, 18, 16) and d.shape == m.shape == (192, 18) and d.dtype == torch.float32
    with pytest.raises(ModelFormatError, match="not this folder's source"):
        source.matrix([v], {v: (64, 576)})

    gen = np.random.default_rng(0)
    nibbles = gen.integers(0, 256, (4, 3, 16), dtype=np.uint8)
    nibbles[..., 0] = 0x0F  # code 15 first, code 0 in the second half: every block spans [0, 15]
    d = np.full((4, 3), 0.01, dtype=np.float32)
    m = np.full((4, 3), -0.07, dtype=np.float32)
    assert requantizes_to_itself(nibbles, d, m)
    short = nibbles & 0xEE  # no block reaches code 15 now: --quant int4 would choose another scale
    assert not requantizes_to_itself(short, d, m)
    (tmp_path / "bad.gguf").write_bytes(b"GGML" + bytes(64))
    with pytest.raises(ModelFormatError, match="not a GGUF file"):
        read_gguf_directory(tmp_path / "bad.gguf")
    (tmp_path / "short.gguf").write_bytes(b"GGUF" + (3).to_bytes(4, "little") + (5).to_bytes(8, "little"))
    with pytest.raises(ModelFormatError, match="truncated"):
        read_gguf_directory(tmp_path / "short.gguf")


def test_command_line_quant_options():
    from tessera.peer.cli.main import build_parser
    from tessera.peer.cli.peer import config_from
    from tessera.peer.base.errors import ConfigError

    parser = build_parser()
    args = parser.parse_args(["peer", "--quant", "int4", "--quant-group", "64"])
    assert config_from(args).quant == Quant("int4", 64)
    assert config_from(parser.parse_args(["peer"])).quant == NO_QUANT
    sharded = parser.parse_args(["peer", "--quant", "int8", "--layers", "0:10", "--shard", "0/3", "--group", "g"])
    with pytest.raises(ConfigError, match="--quant int8"):
        config_from(sharded)
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "x", "--local", "--quant", "int3"])
    assert parser.parse_args(["generate", "x", "--join", "a", "--accept-mixed"]).accept_mixed
    # the HTTP gateway chooses the peers it chains the same way
    from tessera.peer.cli.options import quant_from
    from tessera.peer.cli.serve import peers_note

    serve = parser.parse_args(["serve", "--join", "a", "--quant", "int4", "--quant-group", "64"])
    assert quant_from(serve) == Quant("int4", 64) and not serve.accept_mixed
    assert peers_note(serve) == "; chaining int4g64 peers"
    assert peers_note(parser.parse_args(["serve", "--join", "a"])) == ""
    assert "any quantization" in peers_note(parser.parse_args(["serve", "--join", "a", "--accept-mixed"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--join", "a", "--quant-group", "48"])
