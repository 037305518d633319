"""A shipped span stays compact: what it holds is what it ships (resident <= 1.15 x on-disk bytes).

SmolLM2's layers [0, 15) in each form, written here from the real model (fp8, MXFP4, NVFP4 in
ModelOpt's layout and compressed-tensors' INT4 with zero points encode its weights; llama.cpp's
IQ4_NL, MXFP4 and NVFP4 as random blocks of its shape; a GGUF as imported keeps SmolLM2's own Q4_1
file's blocks): a process loads the
span and runs a step, and the memory it then holds (anonymous and weight-file pages, no huge
pages: tests/resident.py) is at most 1.15 x the bytes the span's tensors take on disk plus its
KV cache — its dequantization scratch, norms in float32 and torch's own included. The float
weights are never all in memory: a matrix is copied from the file as stored.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tessera.stages.families.catalog import layer_matrices, spec_from_file, tensors_of_layer, to_config
from tessera.stages.families.shipped import ShippedFormat
from tessera.stages.kernels.encode import encode_matrix
from tessera.stages.weights.synth import gguf_form

from ...resident import ROOT, SPAN_RSS, span_on_disk

SPAN = (0, 15)

def write_span(smol: Path, out: Path, shipped: ShippedFormat) -> Path:
    """SmolLM2's layers in `shipped`'s form (every layer: a folder whose tensors name fewer layers than its
    config is refused when opened, stages/weights/folder.py `check_fits`; a span reads only its own)."""
    spec = replace(spec_from_file(smol / "config.json"), shipped=shipped)
    state, gen = {}, torch.Generator().manual_seed(0)
    with safe_open(smol / "model.safetensors", framework="pt") as f:
        for layer in range(spec.num_layers):
            matrices = {p + ".weight" for p in layer_matrices(spec, layer)}
            for ours, choices in tensors_of_layer(spec, layer).items():
                for name in choices[0].names:
                    if ours in matrices:
                        state.update(encode_matrix(shipped, name, f.get_tensor(name), std=0.02, gen=gen))
                    else:
                        state[name] = f.get_tensor(name)
    out.mkdir(parents=True)
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(to_config(spec)))
    return out


@pytest.fixture(scope="module")
def smol_spans(smol_dir, tmp_path_factory):
    from tessera.stages.weights.convert import convert_gguf

    root = tmp_path_factory.mktemp("smol-shipped")
    spec = spec_from_file(smol_dir / "config.json")
    forms = {"fp8": ShippedFormat("fp8", float_bytes=4), "mxfp4": ShippedFormat("mxfp4", float_bytes=4),
             "nvfp4": ShippedFormat("nvfp4", layout="modelopt", group=16, activation_scales=True, float_bytes=4),
             "int4": ShippedFormat("int4", layout="compressed-tensors", group=32, symmetric=False, float_bytes=4),
             # llama.cpp's types whose blocks SmolLM2's 576 inputs take (the 256-weight ones: bench/shipped.py)
             **{f"gguf-{kind}": replace(gguf_form(spec, kind), float_bytes=4) for kind in ("IQ4_NL", "MXFP4", "NVFP4")}}
    folders = {name: write_span(smol_dir, root / name, form) for name, form in forms.items()}
    convert_gguf(smol_dir / "source.gguf", root / "gguf-q4_1", keep_blocks=True)
    folders["gguf-q4_1"] = root / "gguf-q4_1"
    return folders


@pytest.mark.parametrize("form", ["fp8", "mxfp4", "nvfp4", "int4", "gguf-IQ4_NL", "gguf-MXFP4", "gguf-NVFP4", "gguf-q4_1"])
def test_a_shipped_span_holds_what_it_ships(smol_spans, form):
    folder = smol_spans[form]
    done = subprocess.run([sys.executable, "-c", SPAN_RSS, str(folder), *map(str, SPAN)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    grown, weights, kv = map(int, done.stdout.split())
    on_disk = span_on_disk(folder, *SPAN)
    print(f"{form}: +{grown / 2**20:.1f} MiB held for {on_disk / 2**20:.1f} MiB on disk ({weights / 2**20:.1f} MiB of "
          f"weights held) and {kv / 2**20:.1f} MiB of KV cache: ratio {grown / (on_disk + kv):.3f}\n{done.stderr.strip()}")
    assert weights <= 1.01 * on_disk  # the matrices as stored; norms widened to float32 (a few KiB)
    assert grown <= 1.15 * (on_disk + kv)
