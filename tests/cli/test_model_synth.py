"""tessera model synth: published shapes read as the real models' configs are (their parameter counts
are the published ones), trimmed for benches, written one file per layer when large, and a folder
every command accepts; bad flags are one error line."""

from __future__ import annotations

import json

import pytest
import torch

from tessera.stages.errors import UnsupportedModel
from tessera.stages.families.shapes import SHAPES, shape_spec

from .test_engine_cli import tessera

# total parameters as published (embedding and head included; DeepSeek-V3 without its MTP module)
PUBLISHED_PARAMS = {
    "llama-3-8b": 8.03e9, "qwen3-8b": 8.19e9, "qwen3-30b-a3b": 30.5e9, "mixtral-8x7b": 46.7e9,
    "gpt-oss-20b": 20.91e9, "gpt-oss-120b": 116.83e9, "deepseek-v3": 671e9, "glm-4.5": 355e9,
    "glm-5": 744e9, "minimax-m2": 230e9, "qwen3-next-80b-a3b": 80e9, "mimo-v2-flash": 309e9,
    "kimi-linear-48b-a3b": 49.1e9, "nemotron-h-8b": 8.1e9,  # as their checkpoints hold them ("48B" and "8B" by name)
    # Gemma 4: the text model (the published 5.1B and 8B of the E-models count their ~0.45B and ~0.5B vision and
    # audio towers too, which are not run)
    "gemma-4-e2b": 5.1e9 - 0.45e9, "gemma-4-e4b": 8.0e9 - 0.5e9, "gemma-4-26b-a4b": 25.2e9, "gemma-4-31b": 30.7e9,
}
# (layers, sparse layers, experts, top-k) as published
LAYERS = {
    "llama-3-8b": (32, 0, 0, 0), "qwen3-8b": (36, 0, 0, 0), "qwen3-30b-a3b": (48, 48, 128, 8),
    "mixtral-8x7b": (32, 32, 8, 2), "gpt-oss-20b": (24, 24, 32, 4), "gpt-oss-120b": (36, 36, 128, 4),
    "deepseek-v3": (61, 58, 256, 8), "glm-4.5": (92, 89, 160, 8),
    "glm-5": (78, 75, 256, 8), "minimax-m2": (62, 62, 256, 8), "qwen3-next-80b-a3b": (48, 48, 512, 10),
    "kimi-linear-48b-a3b": (27, 26, 256, 8), "nemotron-h-8b": (52, 0, 0, 0),
    "mimo-v2-flash": (48, 47, 256, 8), "gemma-4-e2b": (35, 0, 0, 0), "gemma-4-e4b": (42, 0, 0, 0),
    "gemma-4-26b-a4b": (30, 30, 128, 8), "gemma-4-31b": (60, 0, 0, 0),
}


def total_params(spec) -> int:
    edges = spec.vocab_size * spec.hidden_size * (1 if spec.tie_embeddings else 2) + spec.hidden_size
    p = spec.per_layer_width * spec.num_layers  # Gemma 4's per-layer input table, projection and norm
    edges += spec.per_layer_vocab * p + p * spec.hidden_size + spec.per_layer_width
    total = sum(spec.layer_param_count(i) for i in range(spec.num_layers)) + edges
    assert spec.param_count == total  # what a folder's bytes are held to (stages/weights/folder.py)
    return total


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_a_shape_is_the_published_model(name):
    assert set(SHAPES) == set(PUBLISHED_PARAMS)
    try:
        spec = shape_spec(name)
    except UnsupportedModel as refused:  # a family not run yet (DeepSeek-V3, GLM-4.5 until they land)
        assert "unknown architecture" in str(refused)
        pytest.skip(str(refused))
    sparse = [layer.mlp for layer in spec.layers if layer.mlp is not None and layer.mlp.kind in ("moe", "dense_and_moe")]
    layers, n_sparse, experts, top_k = LAYERS[name]
    assert (spec.num_layers, len(sparse)) == (layers, n_sparse)
    assert {(m.num_experts, m.router.top_k) for m in sparse} <= {(experts, top_k)}
    assert abs(total_params(spec) / PUBLISHED_PARAMS[name] - 1) < 0.01


def test_a_shape_is_trimmed_for_a_bench():
    spec = shape_spec("qwen3-30b-a3b", layers=3, experts=4, vocab=300)
    assert spec.num_layers == 3 and spec.vocab_size == 300
    assert {(l.mlp.num_experts, l.mlp.router.top_k, l.mlp.width) for l in spec.layers} == {(4, 4, 768)}
    assert shape_spec("llama-3-8b", experts=2) == shape_spec("llama-3-8b")  # no sparse layer to trim


def test_a_large_model_is_written_one_file_per_layer(tmp_path, monkeypatch):
    """Past SINGLE_FILE_BYTES: embedding, each layer, and norm with head each in their own file, with
    transformers' index, holding the very tensors the single file holds; the folder checks and runs."""
    from safetensors.torch import load_file

    from tessera.stages.decoding.generate import LocalEngine
    from tessera.stages.weights import synth
    from tessera.stages.weights.folder_check import check_folder

    spec = shape_small(synth.synth_ids(shape_spec("gpt-oss-20b", layers=2, experts=3, vocab=300)))
    whole = synth.write_synth(spec, tmp_path / "whole", seed=3)
    assert "model.safetensors" in whole
    monkeypatch.setattr(synth, "SINGLE_FILE_BYTES", 1)
    files = synth.write_synth(spec, tmp_path / "split", seed=3)
    parts = [f"model-0000{i}-of-00005.safetensors" for i in range(1, 6)]
    assert files[1:7] == ["model.safetensors.index.json", *parts]
    index = json.loads((tmp_path / "split" / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["model.embed_tokens.weight"] == parts[0]
    assert index["model.layers.1.mlp.experts.gate_up_proj"] == index["model.layers.1.self_attn.sinks"] == parts[2]
    assert (index["model.norm.weight"], index["lm_head.weight"]) == (parts[3], parts[4])
    split = {}
    for name in sorted(set(index.values())):
        split.update(load_file(tmp_path / "split" / name))
    single = load_file(tmp_path / "whole" / "model.safetensors")
    assert split.keys() == single.keys() and all(torch.equal(split[k], single[k]) for k in single)
    assert check_folder(tmp_path / "split").num_layers == 2
    engine = LocalEngine(tmp_path / "split", device="cpu", dtype="float32")
    assert len(engine.generate_ids([5, 6, 7], max_new_tokens=4)) == 4


def shape_small(spec):
    """`spec` narrowed to a hidden size of 64, 4 heads of 16 and MLPs of width 32 (a few MB)."""
    from dataclasses import replace

    return replace(spec, hidden_size=64, layers=tuple(replace(
        layer, attention=replace(layer.attention, num_heads=4, num_kv_heads=2, head_dim=16),
        mlp=replace(layer.mlp, width=32)) for layer in spec.layers))


def test_a_large_tensor_is_drawn_row_by_row_in_its_dtype(monkeypatch):
    from tessera.stages.weights import synth

    spec = shape_small(shape_spec("qwen3-30b-a3b", layers=1, experts=2, vocab=300))
    monkeypatch.setattr(synth, "DRAW_ROWS_BYTES", 1024)
    drawn = dict(synth.synth_tensors(spec, 5, torch.bfloat16))
    embedding = drawn["model.embed_tokens.weight"]  # 300 x 64 floats: past 1 KiB, drawn row by row
    assert embedding.dtype == torch.bfloat16 and embedding.shape == (300, 64)
    assert 0.015 < float(embedding.float().std()) < 0.025 and len(set(embedding[:, 0].tolist())) > 250
    norm = drawn["model.norm.weight"]
    assert abs(float(norm.float().mean()) - 1) < 0.05


def test_the_command_writes_a_shape_every_command_accepts(tmp_path):
    from tessera.stages.weights.folder_check import check_folder

    out = tmp_path / "qwen3-moe"
    done = tessera("model", "synth", "--shape", "qwen3-30b-a3b", "--layers", "1", "--experts", "2", "--vocab", "300",
                   "--dtype", "bfloat16", "--seed", "4", "--out", str(out))
    assert done.returncode == 0, done.stderr
    config = json.loads((out / "config.json").read_text())
    assert (config["hidden_size"], config["num_experts"], config["moe_intermediate_size"]) == (2048, 2, 768)
    assert config["num_hidden_layers"] == 1 and config["eos_token_id"] == 2
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"] == {"synth_seed": 4, "synth_shape": "qwen3-30b-a3b"}
    entry = manifest["tensors"]["entries"]["model.layers.0.mlp.experts.1.down_proj.weight"]
    assert entry["dtype"] == "BF16" and entry["shape"] == [2048, 768]
    assert check_folder(out).layers[0].mlp.num_experts == 2  # what `tessera model import` checks


@pytest.mark.parametrize("args, needle", [
    (["--shape", "gpt-oss-20b", "--layers", "99"], "error: gpt-oss-20b has 24 layers: cannot keep 99"),
    (["--shape", "gpt-oss-20b", "--hidden", "64"], "error: --hidden is for a Llama-block shape"),
    (["--layers", "2"], "error: give --shape, or --hidden"),
    (["--shape", "llama-3-8b", "--layers", "1", "--vocab", "100"], "error: vocab 100 is too small for the byte tokenizer"),
])
def test_bad_flags_are_one_error_line(tmp_path, capsys, args, needle):
    """Run in this process (the command's own code; no interpreter start-up per case)."""
    from tessera.peer.cli.main import main

    code = main(["model", "synth", *args, "--seed", "0", "--out", str(tmp_path / "m")])
    said = capsys.readouterr().err
    assert code == 1 and said.startswith(needle) and said.count("\n") == 1, said
    assert not (tmp_path / "m").exists()


def test_the_dtypes_named_for_a_light_help_are_synths():
    from tessera.peer.cli import model as cli_model
    from tessera.stages.weights import synth

    assert cli_model.SYNTH_DTYPES == tuple(synth.SYNTH_DTYPES)
