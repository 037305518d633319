"""A peer hashes the span it loads against the manifest (peer/weights/verify.py), in the loading pass.

- an altered tensor (same size: scaled in place) is refused at load, named, with its chunk;
- tensors outside the span are not read, so not hashed; a fresh check re-hashes everything;
- the cache: an untouched file (size, mtime, inode, device) is not hashed again; a rewrite is;
  a write that restores the mtime on the same inode is NOT seen (the documented limit that the
  spot checks cover: tests/request/test_weight_check_swarm.py);
- a manifest edited to match altered weights no longer hashes to its model id: refused;
- a fetched file is recorded as checked; a tensor-shard rank's span is hashed from the files;
- the real peer (`tessera peer`) on a copy of SmolLM2 with model.layers.5.mlp.down_proj.weight
  scaled by 1.5 exits at load with one line naming the tensor.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tessera.peer.cli.model_files import synthesise
from tessera.peer.weights.errors import WeightsMismatch
from tessera.peer.weights.verify import CACHE_FILE, VerifiedCache, WeightCheck, stamp_of
from tessera.stages.assembly.stage import load_stage
from tessera.stages.errors import ModelFormatError
from tessera.stages.weights.registry import MANIFEST
from tessera.stages.weights.tensor_table import read_header

ALTERED = "model.layers.2.mlp.down_proj.weight"


@pytest.fixture()
def model(tmp_path) -> Path:
    """A 4-layer random model whose tensors span several 4 KiB manifest chunks."""
    folder = synthesise(tmp_path / "m", hidden=64, layers=4, heads=4, kv_heads=2, intermediate=128, vocab=300, seed=3)
    from tessera.stages.weights.registry import write_manifest

    write_manifest(folder, chunk_bytes=4096)  # several chunks per matrix: a mismatch names one
    return folder


def scale_in_place(folder: Path, name: str, factor: float, *, keep_mtime: bool = False) -> None:
    """Multiply one float32 tensor of model.safetensors by `factor`, writing its bytes in place
    (same size, same inode); with `keep_mtime`, the file's mtime is set back afterwards."""
    path = folder / "model.safetensors"
    before = os.stat(path)
    data_at, header = read_header(path)
    begin, end = header[name]["data_offsets"]
    with open(path, "r+b") as f:
        f.seek(data_at + begin)
        values = torch.frombuffer(bytearray(f.read(end - begin)), dtype=torch.float32) * factor
        f.seek(data_at + begin)
        f.write(values.numpy().tobytes())
    if keep_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert os.stat(path).st_size == before.st_size and os.stat(path).st_ino == before.st_ino


def load(folder: Path, check: WeightCheck, start: int = 0, end: int = 4):
    span = check.begin()
    stage = load_stage(folder, start=start, end=end, check=span)
    span.commit()
    return stage, span


def test_an_altered_tensor_is_refused_at_load_naming_it(model, tmp_path):
    scale_in_place(model, ALTERED, 1.5)
    check = WeightCheck(model, VerifiedCache(tmp_path / CACHE_FILE))
    with pytest.raises(WeightsMismatch) as refused:
        load(model, check)
    assert ALTERED in str(refused.value) and "chunk 1 of" in str(refused.value)
    assert not (tmp_path / CACHE_FILE).exists()  # a refused load records nothing
    # the span before it does not read layer 2, so it loads
    stage, span = load(model, check, 0, 2)
    assert span.stats.hashed == 2 * 9 and span.stats.trusted == 0  # 9 tensors a layer


def test_an_untouched_file_is_not_hashed_again_but_a_rewrite_is(model, tmp_path):
    cache = VerifiedCache(tmp_path / CACHE_FILE)
    _, first = load(model, WeightCheck(model, cache))
    assert first.stats.hashed == 4 * 9 and first.stats.trusted == 0
    _, second = load(model, WeightCheck(model, cache))
    assert second.stats.hashed == 0 and second.stats.trusted == 4 * 9
    # a write through the file system moves the mtime: everything is hashed again, and caught
    scale_in_place(model, ALTERED, 1.5)
    with pytest.raises(WeightsMismatch, match=ALTERED):
        load(model, WeightCheck(model, cache))


def test_the_cache_does_not_see_a_write_that_restores_the_mtime(model, tmp_path):
    """The stated limit: same size, same inode, mtime set back — the cache vouches for the old
    bytes. Spot checks are what catch a peer serving such weights."""
    cache = VerifiedCache(tmp_path / CACHE_FILE)
    load(model, WeightCheck(model, cache))
    stamp = stamp_of(model / "model.safetensors")
    scale_in_place(model, ALTERED, 1.5, keep_mtime=True)
    assert stamp_of(model / "model.safetensors") == stamp
    _, span = load(model, WeightCheck(model, cache))
    assert span.stats.trusted == 4 * 9
    # without the cache (another data dir, or a fresh one) it is caught
    with pytest.raises(WeightsMismatch, match=ALTERED):
        load(model, WeightCheck(model, VerifiedCache(tmp_path / "other" / CACHE_FILE)))


def test_a_manifest_edited_to_match_altered_weights_no_longer_hashes_to_its_id(model, tmp_path):
    scale_in_place(model, ALTERED, 1.5)
    manifest = json.loads((model / MANIFEST).read_text())
    from tessera.stages.weights.tensor_table import table_digest, table_of_file

    entries = table_of_file(model / "model.safetensors", "model.safetensors", chunk_bytes=4096)
    tensors = manifest["tensors"]
    tensors["entries"][ALTERED] = entries[ALTERED]
    tensors["digest"] = table_digest(tensors["entries"], tensors["chunk_bytes"])  # the model id is left as it was
    (model / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(ModelFormatError, match="hashes to"):
        WeightCheck(model, VerifiedCache(tmp_path / CACHE_FILE))


def test_a_cache_for_another_manifest_or_in_garbage_is_ignored(model, tmp_path):
    path = tmp_path / CACHE_FILE
    load(model, WeightCheck(model, VerifiedCache(path)))
    data = json.loads(path.read_text())
    (entry,) = data["files"].values()
    entry["digest"] = "0" * 64
    path.write_text(json.dumps(data))
    _, span = load(model, WeightCheck(model, VerifiedCache(path)))
    assert span.stats.trusted == 0 and span.stats.hashed == 4 * 9
    path.write_text("{not json")
    _, span = load(model, WeightCheck(model, VerifiedCache(path)))
    assert span.stats.trusted == 0


def test_fetched_tensors_are_recorded_as_checked(model, tmp_path):
    """What the fetcher wrote (every chunk matched as it came) is trusted at the next load; the
    tensors the file held before count only if the cache vouched for them then."""
    cache = VerifiedCache(tmp_path / CACHE_FILE)
    check = WeightCheck(model, cache)
    layer1 = [n for n in check.manifest["tensors"]["entries"] if n.startswith("model.layers.1.")]
    check.record_fetched("model.safetensors", layer1, stamp_before=None)
    span = check.begin()
    load_stage(model, start=0, end=2, check=span)
    assert span.stats.trusted == 9 and span.stats.hashed == 9


def test_a_tensor_shard_rank_hashes_its_span_from_the_files(model, tmp_path):
    scale_in_place(model, ALTERED, 1.5)
    span = WeightCheck(model, VerifiedCache(tmp_path / CACHE_FILE)).begin()
    span.verify_files(n for n, e in span.entries.items() if e["group"] in {"layer.0", "layer.1"})
    assert span.stats.hashed == 18
    with pytest.raises(WeightsMismatch, match=ALTERED):
        span.verify_files(n for n, e in span.entries.items() if e["group"] == "layer.2")


@pytest.mark.slow
def test_the_peer_with_an_altered_tensor_refuses_to_serve(smol_dir, tmp_path):
    """`tessera peer` on a copy of SmolLM2 whose model.layers.5.mlp.down_proj.weight is scaled by
    1.5 (the file keeps its size): it exits at load, naming the tensor, and never serves."""
    copy = tmp_path / "smol"
    copy.mkdir()
    for item in smol_dir.iterdir():
        if item.name == "model.safetensors":
            shutil.copyfile(item, copy / item.name)
        elif item.is_file():
            os.link(item, copy / item.name)
    scale_in_place(copy, "model.layers.5.mlp.down_proj.weight", 1.5)
    done = subprocess.run(
        [sys.executable, "-m", "tessera.peer.cli.main", "peer", "--model", str(copy), "--layers", "0:10",
         "--data-dir", str(tmp_path / "data"), "--threads", "1", "--listen", "/ip4/127.0.0.1/tcp/0"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "model.layers.5.mlp.down_proj.weight" in done.stderr and "refusing to serve" in done.stderr
    assert "serving layers" not in done.stdout


def test_fused_experts_read_row_by_row_are_hashed_whole_once(tmp_path):
    """gpt-oss keeps its experts fused ([E, H, 2I], one tensor): the loader reads one expert's row
    at a time, which the check cannot hash, so it hashes the tensor from its file — once — and
    a change in any expert is refused like any other."""
    transformers = pytest.importorskip("transformers")
    from ..stages.families.conformance import SHAPE, build

    from tessera.stages.weights.registry import write_manifest

    config = transformers.GptOssConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                                       sliding_window=8)
    folder = build(tmp_path, "gpt-oss", config, seed=3, fused=True)
    write_manifest(folder)
    check = WeightCheck(folder, VerifiedCache(tmp_path / CACHE_FILE))
    layer0 = {n for n, e in check.manifest["tensors"]["entries"].items() if e["group"] == "layer.0"}
    fused = next(n for n in layer0 if "experts" in n and "gate_up" in n)
    span = check.begin()
    load_stage(folder, start=0, end=1, check=span)
    assert span.done == layer0 and span.stats.hashed == len(layer0)  # every tensor, each once
    scale_in_place(folder, fused, 1.5)
    with pytest.raises(WeightsMismatch, match=fused):
        load_stage(folder, start=0, end=1, check=WeightCheck(folder, VerifiedCache(None)).begin())


def flip_a_byte(folder: Path, name: str) -> None:
    """Change one stored byte of tensor `name` in model.safetensors (any dtype), in place."""
    path = folder / "model.safetensors"
    data_at, header = read_header(path)
    begin, _ = header[name]["data_offsets"]
    with open(path, "r+b") as f:
        f.seek(data_at + begin)
        byte = f.read(1)[0]
        f.seek(data_at + begin)
        f.write(bytes([byte ^ 0x01]))


@pytest.mark.parametrize("form", ["fp8", "mxfp4-fused"])
def test_a_checkpoint_that_ships_quantized_is_checked_as_stored(tmp_path, form):
    """fp8 codes and scales, MXFP4 blocks (one expert's row at a time when fused) are read as
    stored, without a cast (stages/weights/formats/load.py): each is hashed all the same, and one
    changed byte of a code tensor is refused."""
    transformers = pytest.importorskip("transformers")
    from ..stages.families.conformance import SHAPE, build
    from ..stages.formats import checkpoints as ck

    from tessera.stages.weights.registry import write_manifest

    if form == "fp8":
        source = build(tmp_path, "llama", transformers.LlamaConfig(**SHAPE, intermediate_size=128), seed=5)
        folder = ck.fp8_folder(source, tmp_path / "shipped", block=(16, 16))
    else:
        config = transformers.Qwen3MoeConfig(**SHAPE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                                             intermediate_size=128)
        folder = ck.mxfp4_folder(build(tmp_path, "moe", config, seed=5), tmp_path / "shipped", fused=True)
    write_manifest(folder)
    check = WeightCheck(folder, VerifiedCache(None))
    layer0 = {n for n, e in check.manifest["tensors"]["entries"].items() if e["group"] == "layer.0"}
    stored = sorted(n for n in layer0 if n.endswith(("_scale_inv", "_blocks")))
    assert stored  # the layer holds the shipped form's tensors
    span = check.begin()
    load_stage(folder, start=0, end=1, check=span)
    assert span.done == layer0 and span.stats.hashed == len(layer0)
    altered = next(n for n in sorted(layer0) if n.endswith("_blocks") or n + "_scale_inv" in layer0)
    flip_a_byte(folder, altered)
    with pytest.raises(WeightsMismatch, match=altered):
        load_stage(folder, start=0, end=1, check=WeightCheck(folder, VerifiedCache(None)).begin())


def edit_json(path: Path, **changes) -> None:
    """Rewrite a JSON file of the folder with `changes` (a new file: the manifest is left as it was)."""
    data = json.loads(path.read_text())
    data.update(changes)
    path.unlink()  # it may be a hard link to the original folder's file
    path.write_text(json.dumps(data, indent=2))


def test_a_config_with_another_rope_theta_is_refused_before_it_is_read(model, tmp_path):
    """Genuine weights and manifest, config.json edited: it would load under the genuine model id
    and compute other activations. Refused in one line naming the file and the model id."""
    edit_json(model / "config.json", rope_theta=12345.0)
    with pytest.raises(WeightsMismatch) as refused:
        WeightCheck(model, VerifiedCache(tmp_path / CACHE_FILE))
    line = str(refused.value)
    model_id = json.loads((model / MANIFEST).read_text())["model_id"]
    assert "\n" not in line and "refusing to serve" in line and "config.json" in line and model_id in line
    assert "bytes" in line or "sha256" in line


@pytest.mark.parametrize("change", ["tokenizer_config", "tokenizer", "template added", "generation config removed"])
def test_every_small_file_a_load_reads_is_held_to_the_manifest(model, tmp_path, change):
    from tessera.stages.weights.registry import write_manifest

    if change == "tokenizer_config":
        edit_json(model / "tokenizer_config.json", eos_token="<|im_start|>")
        name = "tokenizer_config.json"
    elif change == "tokenizer":
        data = (model / "tokenizer.json").read_bytes()
        (model / "tokenizer.json").write_bytes(data.replace(b'"a"', b'"b"', 1) if b'"a"' in data else data + b" ")
        name = "tokenizer.json"
    elif change == "template added":  # the model had none: one placed beside it would be read as the model's
        (model / "chat_template.jinja").unlink()
        write_manifest(model, chunk_bytes=4096)
        (model / "chat_template.jinja").write_text("{{ messages }}")
        name = "chat_template.jinja"
    else:
        (model / "generation_config.json").write_text(json.dumps({"temperature": 0.7}))
        write_manifest(model, chunk_bytes=4096)
        (model / "generation_config.json").unlink()
        name = "generation_config.json"
    with pytest.raises(WeightsMismatch, match=name.replace(".", r"\.")):
        WeightCheck(model, VerifiedCache(tmp_path / CACHE_FILE))


def test_an_intact_folder_passes_the_small_file_check(model, tmp_path):
    WeightCheck(model, VerifiedCache(tmp_path / CACHE_FILE))  # raises nothing


def test_the_peer_with_another_rope_theta_refuses_in_one_line(smol_dir, tmp_path):
    """`tessera peer` on SmolLM2 whose weights and manifest are genuine and whose config.json says
    another rope_theta: it exits before loading anything, with one line naming config.json."""
    copy = tmp_path / "smol"
    copy.mkdir()
    for item in smol_dir.iterdir():
        if item.is_file():
            os.link(item, copy / item.name)  # read only: nothing but config.json is written
    edit_json(copy / "config.json", rope_theta=500000.0)
    done = subprocess.run(
        [sys.executable, "-m", "tessera.peer.cli.main", "peer", "--model", str(copy), "--layers", "0:10",
         "--data-dir", str(tmp_path / "data"), "--threads", "1", "--listen", "/ip4/127.0.0.1/tcp/0"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "refusing to serve" in lines[0] and "config.json" in lines[0], done.stderr
    assert "serving layers" not in done.stdout
