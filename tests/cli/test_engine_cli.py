"""The command line: answers, JSON output, and one clear error line for every bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import FRANCE
from ..resident import ROOT

TESSERA = [sys.executable, "-m", "tessera.peer.cli.main"]


def tessera(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*TESSERA, *args], capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


def assert_clean_error(done: subprocess.CompletedProcess, needle: str) -> None:
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("error: "), done.stderr
    assert needle in done.stderr, done.stderr


def test_generate_local_json(smol_dir):
    done = tessera("generate", FRANCE, "--local", "--json", "--threads", "1")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])  # the last of its JSON lines: the whole answer
    assert out["text"] == "The capital of France is Paris."
    assert out["prompt_tokens"] == 37 and out["tokens"][-1] == 2
    assert set(out) >= {"text", "tokens", "prompt_tokens", "seconds", "tokens_per_second"} and out["done"] is True
    # it streams (issue 46): a JSON line per token as it comes, whose pieces make up the text
    pieces = [json.loads(line) for line in done.stdout.splitlines()[:-1]]
    assert [p["token"] for p in pieces if "token" in p] == out["tokens"]
    assert "".join(p["piece"] for p in pieces) == out["text"]


def test_generate_local_streams_text(smol_dir):
    done = tessera("generate", "The quick brown fox", "--local", "--raw", "--max-tokens", "8", "--threads", "1")
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.strip()) > 0


def test_model_path_prints_the_folder(smol_dir):
    done = tessera("model", "path", "smollm2-135m")
    assert done.returncode == 0 and Path(done.stdout.strip()) == smol_dir


def test_fetch_is_idempotent(smol_dir):
    done = tessera("model", "fetch", "smollm2-135m")
    assert done.returncode == 0, done.stderr
    assert "already present and verified" in done.stdout


@pytest.fixture()
def broken_copy(smol_dir, tmp_path) -> Path:
    """A copy of the model folder (weights symlinked) to break in different ways."""
    folder = tmp_path / "broken"
    folder.mkdir()
    for f in smol_dir.iterdir():
        if f.name != "source.gguf":
            (folder / f.name).symlink_to(f)
    return folder


def test_missing_model(tmp_path):
    assert_clean_error(tessera("generate", "hi", "--local", "--model", str(tmp_path / "nowhere")), "no model")


def test_corrupt_weights_file(broken_copy):
    (broken_copy / "model.safetensors").unlink()
    (broken_copy / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    assert_clean_error(tessera("generate", "hi", "--local", "--model", str(broken_copy)), "safetensors")


def test_wrong_shapes_in_weights(broken_copy, tmp_path):
    config = json.loads((broken_copy / "config.json").read_text())
    config["hidden_size"] = 640  # the tensors say 576
    (broken_copy / "config.json").unlink()
    (broken_copy / "config.json").write_text(json.dumps(config))
    assert_clean_error(tessera("generate", "hi", "--local", "--model", str(broken_copy)), "has shape")


def test_unknown_architecture(broken_copy):
    config = json.loads((broken_copy / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (broken_copy / "config.json").unlink()
    (broken_copy / "config.json").write_text(json.dumps(config))
    assert_clean_error(tessera("generate", "hi", "--local", "--model", str(broken_copy)), "unknown architecture")


def test_prompt_longer_than_context(broken_copy):
    config = json.loads((broken_copy / "config.json").read_text())
    config["max_position_embeddings"] = 16
    (broken_copy / "config.json").unlink()
    (broken_copy / "config.json").write_text(json.dumps(config))
    assert_clean_error(tessera("generate", FRANCE, "--local", "--model", str(broken_copy)), "context")


def test_bad_parameter_values(smol_dir):
    assert_clean_error(tessera("generate", "hi", "--local", "--top-p", "1.5"), "top_p")
    assert_clean_error(tessera("generate", "hi", "--local", "--max-tokens", "0"), "max-tokens")


def test_import_folder_and_gguf(smol_dir, tmp_path):
    env = {"TESSERA_MODELS": str(tmp_path / "registry")}
    done = tessera("model", "import", str(smol_dir), "--name", "linked", env=env)
    assert done.returncode == 0, done.stderr
    linked = Path(done.stdout.strip())
    assert (linked / "model.safetensors").is_symlink()
    manifest = json.loads((linked / "manifest.json").read_text())
    original = json.loads((smol_dir / "manifest.json").read_text())
    assert manifest["model_id"] == original["model_id"]  # same config + weights = same model id
    done = tessera("model", "import", str(smol_dir / "source.gguf"), "--name", "from-gguf", "--dequantize", env=env)
    assert done.returncode == 0, done.stderr
    converted = json.loads((Path(done.stdout.strip()) / "manifest.json").read_text())
    assert converted["model_id"] == original["model_id"]  # dequantised: the same floats, the same id
    done = tessera("model", "import", str(smol_dir / "source.gguf"), "--name", "as-shipped", env=env)
    assert done.returncode == 0, done.stderr
    kept = Path(done.stdout.strip())
    config = json.loads((kept / "config.json").read_text())
    assert config["quantization_config"]["tensor_types"]["model.layers.0.mlp.up_proj.weight"] == "Q4_1"
    # the file's blocks, not floats: the folder is the GGUF's size, and its own model id
    assert (kept / "model.safetensors").stat().st_size < 1.1 * (smol_dir / "source.gguf").stat().st_size
    assert json.loads((kept / "manifest.json").read_text())["model_id"] != original["model_id"]


def test_import_sharded_folder(tiny_llama, tmp_path):
    """A Hugging Face folder with its weights in several shards and an index."""
    from safetensors.torch import load_file, save_file

    from tessera.stages.assembly.stage import load_stage

    folder = tmp_path / "sharded"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_llama / name, folder / name)
    state = load_file(str(tiny_llama / "model.safetensors"))
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(folder / file))
        weight_map.update({k: file for k in keys})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    done = tessera("model", "import", str(folder), "--name", "sharded", env={"TESSERA_MODELS": str(tmp_path / "r")})
    assert done.returncode == 0, done.stderr
    a = load_stage(tiny_llama, embed=True, head=True)
    b = load_stage(Path(done.stdout.strip()), embed=True, head=True)
    for s in (a, b):
        s.open("x", capacity=8)
    ids = [5, 6, 7]
    assert (a.logits(a.forward("x", a.embed(ids), 0)) == b.logits(b.forward("x", b.embed(ids), 0))).all()


SPAN_RSS = """
import gc, sys, torch
from pathlib import Path
from tessera.stages.assembly.stage import load_stage
from tests.resident import held_bytes, mib, no_huge_pages, resident_parts
no_huge_pages()
torch.set_num_threads(1)
gc.collect()
before = held_bytes()
stage = load_stage(Path(sys.argv[1]), start=int(sys.argv[2]), end=int(sys.argv[3]))
stage.open("s", capacity=4)
stage.forward("s", torch.zeros(1, stage.spec.hidden_size), 0)  # every weight touched, so resident
gc.collect()
print(mib(resident_parts()), file=sys.stderr)
print(held_bytes() - before, stage.weight_bytes)
"""


def test_span_load_costs_about_the_span(smol_dir):
    """Memory held after loading (and running) 3 of 30 layers (anonymous and weight-file pages, no
    huge pages: tests/resident.py) is about those layers' bytes, not the model's."""
    def load(start: int, end: int) -> tuple[int, int]:
        done = subprocess.run([sys.executable, "-c", SPAN_RSS, str(smol_dir), str(start), str(end)],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        grown, weights = map(int, done.stdout.split())
        print(f"layers [{start}, {end}): {done.stderr.strip()}")
        return grown, weights

    span_grown, span_bytes = load(0, 3)
    whole_grown, whole_bytes = load(0, 30)
    print(f"span: +{span_grown / 2**20:.0f} MiB for {span_bytes / 2**20:.0f} MiB of weights; "
          f"all layers: +{whole_grown / 2**20:.0f} MiB for {whole_bytes / 2**20:.0f} MiB")
    assert span_bytes * 0.8 < span_grown < 1.3 * span_bytes + 16 * 2**20
    assert whole_grown > 0.8 * whole_bytes
