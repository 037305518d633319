"""`tessera model fetch ORG/NAME[@REVISION]`: a Hugging Face repository downloaded with the real
`huggingface_hub` client from a local stand-in for the hub (tests/cli/fake_hub.py, via
`HF_ENDPOINT`), verified against the hub's checksums and registered as `model import` does."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tessera.peer.cli.model_files import HUB_FOLDER, FetchError, available, fetch, import_model
from tessera.stages.weights import registry
from tessera.stages.errors import UnsupportedModel
from tessera.stages.weights.synth import CHATML, byte_tokenizer_json

from .fake_hub import FakeHub

transformers = pytest.importorskip("transformers")

REPO = "tiny-org/Tiny-Llama"
EXTRAS = {"README.md": b"# a tiny model\n", "pytorch_model.bin": b"\0" * 1000, "onnx/model.onnx": b"\1" * 500,
          "images/logo.png": b"\2" * 100}


def tiny_model(folder: Path) -> Path:
    """A random-weight Llama that the installed transformers builds and saves, with a tokenizer."""
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    (folder / "tokenizer.json").write_text(byte_tokenizer_json(300))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "bos_token": None}))
    (folder / "chat_template.jinja").write_text(CHATML)
    return folder


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture
def hub(model_folder, monkeypatch, tmp_path):
    monkeypatch.setenv("TESSERA_MODELS", str(tmp_path / "models"))
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    with FakeHub() as hub:
        files = {p.name: p.read_bytes() for p in model_folder.iterdir()}
        hub.add(REPO, {**files, **EXTRAS})
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        yield hub


def test_fetch_downloads_only_what_runs_verifies_and_registers(hub, model_folder):
    """Through the command users run."""
    env = {**os.environ}
    done = subprocess.run([sys.executable, "-m", "tessera.peer.cli.main", "model", "fetch", REPO],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    target = registry.models_root() / "Tiny-Llama"
    assert done.stdout.strip().splitlines()[-1] == str(target)
    assert sorted(registry.model_files(target)) == sorted(p.name for p in model_folder.iterdir())
    assert registry.verify(target) == []
    for extra in EXTRAS:  # nothing a peer does not run was downloaded
        assert not hub.gets("/" + extra), extra
    # the same bytes as importing the original folder: the same model id
    direct = import_model(model_folder, name="direct")
    assert registry.model_id(target) == registry.model_id(direct)
    manifest = registry.read_manifest(target)
    assert manifest["source"]["hub"] == REPO and len(manifest["source"]["revision"]) == 40
    listed = subprocess.run([sys.executable, "-m", "tessera.peer.cli.main", "model", "list"], env=env,
                            capture_output=True, text=True, timeout=120).stdout
    assert "Tiny-Llama" in listed

    # again: nothing is downloaded again (the files are there, at the same commit)
    gets = len(hub.gets(".safetensors"))
    fetch(REPO, log=lambda _: None)
    assert len(hub.gets(".safetensors")) == gets


def test_a_dropped_download_resumes_where_it_stopped(hub, monkeypatch):
    """The first GET of the weights stops half-way; the client asks for the rest (a Range), not all again.
    (huggingface_hub writes what it received in 10 MB pieces: smaller ones here, as a big file has.)"""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 4096)
    hub.cut_once.add("model.safetensors")
    target = fetch(REPO, log=lambda _: None)
    ranges = hub.gets("/model.safetensors")
    assert ranges[0] is None and ranges[1] is not None and int(ranges[1][len("bytes="):-1]) > 0, ranges
    assert registry.verify(target) == []


def test_a_revision_and_another_name(hub, model_folder):
    files = {p.name: p.read_bytes() for p in model_folder.iterdir()}
    config = json.loads(files["config.json"])
    config["rms_norm_eps"] = 1e-5
    old = hub.add(REPO, files, branch="old")
    hub.add(REPO, {**files, "config.json": json.dumps(config).encode()})  # main moves on
    target = fetch(f"{REPO}@{old}", register_as="tiny-old", log=lambda _: None)
    assert target.name == "tiny-old" and registry.read_manifest(target)["source"]["revision"] == old
    assert json.loads((target / "config.json").read_text()) == json.loads(files["config.json"])
    assert fetch(f"{REPO}@old", register_as="tiny-branch", log=lambda _: None).exists()


def test_corrupt_bytes_are_caught_and_not_kept(hub):
    hub.tamper.add("model.safetensors")
    with pytest.raises(FetchError, match="model.safetensors.*checksums"):
        fetch(REPO, log=lambda _: None)
    assert not (registry.models_root() / "Tiny-Llama").exists()
    assert not (registry.models_root() / HUB_FOLDER / "tiny-org--Tiny-Llama" / "model.safetensors").exists()
    hub.tamper.clear()
    assert registry.verify(fetch(REPO, log=lambda _: None)) == []  # the next run gets it right


def test_what_cannot_be_fetched_is_refused_with_one_line(hub, model_folder):
    files = {p.name: p.read_bytes() for p in model_folder.iterdir()}
    with pytest.raises(FetchError, match="no repository 'nobody/nothing'"):
        fetch("nobody/nothing", log=lambda _: None)
    with pytest.raises(FetchError, match="no revision 'v9'"):
        fetch(f"{REPO}@v9", log=lambda _: None)
    hub.add("tiny-org/bin-only", {k: v for k, v in files.items() if not k.endswith(".safetensors")}
            | {"pytorch_model.bin": b"\0" * 64})
    with pytest.raises(FetchError, match="no \\*.safetensors"):
        fetch("tiny-org/bin-only", log=lambda _: None)
    gpt2 = json.loads(files["config.json"]) | {"architectures": ["GPT2LMHeadModel"]}
    hub.add("tiny-org/gpt2", files | {"config.json": json.dumps(gpt2).encode()})
    with pytest.raises(UnsupportedModel, match="GPT2LMHeadModel"):
        fetch("tiny-org/gpt2", log=lambda _: None)
    assert not hub.gets("gpt2/resolve/main/model.safetensors") and not [
        r for r in hub.requests if "gpt2" in r[1] and r[1].endswith(".safetensors")]  # refused before the weights
    with pytest.raises(FetchError, match="unknown model 'no-such-model'"):
        fetch("no-such-model", log=lambda _: None)


def test_list_available_says_what_can_be_fetched():
    rows = dict(available())
    assert "smollm2-135m" in rows and "LlamaForCausalLM" in rows["ORG/NAME[@REVISION]"]
    done = subprocess.run([sys.executable, "-m", "tessera.peer.cli.main", "model", "list", "--available"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "smollm2-135m" in done.stdout and "ORG/NAME" in done.stdout
