"""Mixtral (`mixtral`): what only it has beyond the conformance suite (test_conformance.py's rows):
its experts named w1/w3/w2 under `block_sparse_moe` as published, and fused as transformers 5 holds
them, read into the same engine tensors."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")


def test_published_names_and_fused_tensors_load_alike(family_models):
    from tessera.stages.weights.folder import WeightFolder

    published = WeightFolder(family_models.folder("mixtral/published"))
    assert published.has("model.layers.2.block_sparse_moe.experts.7.w2.weight")
    assert published.has("model.layers.2.block_sparse_moe.gate.weight")
    fused = WeightFolder(family_models.folder("mixtral/window-fused"))
    assert fused.has("model.layers.2.mlp.experts.down_proj") and fused.has("model.layers.2.mlp.gate.weight")
    mine, theirs = published.layer_state(2, torch.float32), fused.layer_state(2, torch.float32)
    assert mine.keys() == theirs.keys() and mine["mlp.experts.7.w_gate_up.weight"].shape == (64, 64)
