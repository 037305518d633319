"""Mixtral (`mixtral`): a sparse MLP in every layer (8 experts, top 2, renormalised), experts named
w1/w3/w2 under `block_sparse_moe` as published, or fused as transformers 5 holds them; a sliding
window. Against transformers, stacked, rolled back, and through a swarm."""

from __future__ import annotations

import pytest
import torch

from ...swarm_helpers import local_swarm
from .conformance import (
    SHAPE, build, check_matches_transformers, check_rollback, check_stacked_sessions, check_swarm,
    reference_run,
)

transformers = pytest.importorskip("transformers")

MOE = dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32)
CONFIGS = {
    "published": (dict(**MOE, rope_parameters={"rope_type": "default", "rope_theta": 1e6}), False),
    "window-fused": (dict(**MOE, sliding_window=8), True),  # windowed within 8 (< the prompt); fused experts
}
SWARM = "window-fused"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixtral")
    return {name: build(root, name, transformers.MixtralConfig(**SHAPE, **extra), seed=20 + i, fused=fused)
            for i, (name, (extra, fused)) in enumerate(CONFIGS.items())}


@pytest.fixture(scope="module")
def references(folders):
    """transformers' greedy tokens and logits for each configuration."""
    return {name: reference_run(folder) for name, folder in folders.items()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_transformers(folders, references, name):
    check_matches_transformers(folders[name], references[name])


def test_published_names_and_fused_tensors_load_alike(folders):
    from tessera.stages.weights.folder import WeightFolder

    published = WeightFolder(folders["published"])
    assert published.has("model.layers.2.block_sparse_moe.experts.7.w2.weight")
    assert published.has("model.layers.2.block_sparse_moe.gate.weight")
    fused = WeightFolder(folders["window-fused"])
    assert fused.has("model.layers.2.mlp.experts.down_proj") and fused.has("model.layers.2.mlp.gate.weight")
    mine, theirs = published.layer_state(2, torch.float32), fused.layer_state(2, torch.float32)
    assert mine.keys() == theirs.keys() and mine["mlp.experts.7.w_gate_up.weight"].shape == (64, 64)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_stacked_sessions_equal_their_solo_runs(folders, name):
    check_stacked_sessions(folders[name])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_rollback_by_pointer(folders, references, name):
    check_rollback(folders[name], references[name][0])


@pytest.fixture(scope="module")
def swarm(folders):
    with local_swarm([(0, 2), (2, 3)], model=str(folders[SWARM])) as procs:
        yield procs


@pytest.mark.slow
async def test_a_two_peer_swarm_matches_transformers(swarm, folders, references):
    await check_swarm(swarm, folders[SWARM], references[SWARM][0])
