"""The domain modules on their own: the sparse MLP against its reference sum, computing only the
experts picked (each once, stacked sessions sharing them), and each layer's cache kind budgeted
as it is allocated."""

from __future__ import annotations

import pytest
import torch

from tessera.stages.engine.stage import Stage
from tessera.stages.families.models.llama import llama_spec
from tessera.stages.families.spec.attention import AttentionSpec
from tessera.stages.families.spec.layer import LayerSpec
from tessera.stages.families.spec.mlp import MlpSpec, RouterSpec
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.layers.block import Block
from tessera.stages.layers.moe import MoE

HIDDEN = 32


def random_moe(renormalize: bool, experts: int = 6, top_k: int = 2) -> MoE:
    torch.manual_seed(1)
    moe = MoE(HIDDEN, MlpSpec(16, "moe", experts, RouterSpec("softmax_topk", top_k, renormalize)))
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    return moe.requires_grad_(False)


@pytest.mark.parametrize("renormalize", [True, False])
def test_the_sparse_mlp_is_its_reference_sum(renormalize):
    """out[t] = sum over t's top-k experts e of w[t, e] * expert_e(x[t]), w the softmax over all
    experts' logits (divided by the top-k's sum when renormalised), token by token."""
    moe = random_moe(renormalize)
    x = torch.randn(9, HIDDEN)
    probs = (x @ moe.router.weight.T).softmax(-1)
    out = moe(x)
    for t in range(x.shape[0]):
        top = probs[t].topk(2)
        weights = top.values / top.values.sum() if renormalize else top.values
        want = sum(w * moe.experts[int(e)](x[t : t + 1])[0] for w, e in zip(weights, top.indices))
        assert torch.allclose(out[t], want, atol=1e-6)
    if not renormalize:
        assert float(moe.router(x)[0].sum(-1).max()) < 1  # the raw top-2 probabilities


def count_expert_rows(moe: MoE) -> list[list[int]]:
    """Wrap every expert's forward to record the rows of each call it gets."""
    calls: list[list[int]] = [[] for _ in moe.experts]
    for i, expert in enumerate(moe.experts):
        def counted(x: torch.Tensor, forward=expert.forward, i=i) -> torch.Tensor:
            calls[i].append(x.shape[0])
            return forward(x)
        expert.forward = counted  # type: ignore[method-assign]
    return calls


def test_only_the_picked_experts_run_each_once_over_their_rows():
    moe = random_moe(True, experts=8, top_k=2)
    calls = count_expert_rows(moe)
    moe(torch.randn(1, HIDDEN))  # a decode step: 2 experts of 8, one row each
    assert sorted(len(c) for c in calls) == [0] * 6 + [1, 1] and sum(map(sum, calls)) == 2
    for c in calls:
        c.clear()
    rows = torch.randn(24, HIDDEN)  # rows of several sessions stacked in one step
    moe(rows)
    assert all(len(c) <= 1 for c in calls), "an expert ran twice in one step"
    assert sum(map(sum, calls)) == 24 * 2  # every (row, pick) once


def random_stage(spec: ModelSpec) -> Stage:
    torch.manual_seed(2)
    blocks = []
    for layer in spec.layers:
        block = Block(spec, layer)
        with torch.no_grad():
            for p in block.parameters():
                p.copy_(0.1 * torch.randn_like(p))
        blocks.append(block.requires_grad_(False))
    return Stage(spec, 0, blocks)


def test_what_admission_budgets_is_what_a_session_allocates():
    """Per layer of its cache kind (here full and sliding, 2 and 4 KV heads), for the session's
    own sub-span: the bytes checked before allocating are the bytes allocated (a cache grows as
    steps reach positions: reserving all 20 allocates them all)."""
    full = AttentionSpec(4, 2, 8)
    sliding = AttentionSpec(8, 4, 8, window=4)
    dense, sparse = MlpSpec(24), MlpSpec(8, "moe", 4, RouterSpec(top_k=2))
    spec = ModelSpec("qwen3_moe", 64, HIDDEN, (LayerSpec(full, dense), LayerSpec(sliding, sparse),
                                              LayerSpec(sliding, sparse)))
    stage = random_stage(spec)
    for start, end in ((0, 3), (1, 3), (0, 1)):
        stage.open((start, end), capacity=20, start=start, end=end)
        assert stage.sessions[(start, end)].cache.nbytes == 0
        stage.sessions[(start, end)].cache.reserve(0, 20)
        assert stage.sessions[(start, end)].cache.nbytes == stage.session_bytes(20, start, end)
        assert stage.session_bytes(20, start, end) == 20 * spec.kv_bytes_per_position(start, end)
    assert spec.kv_bytes_per_position(1, 2) == 2 * spec.kv_bytes_per_position(0, 1)  # twice the KV heads
    assert [layer.cache.kind for layer in spec.layers] == ["full", "sliding", "sliding"]


def test_a_uniform_model_has_one_layer_size_and_a_mixed_one_names_its_layer():
    spec = llama_spec(vocab_size=64, hidden_size=HIDDEN, intermediate_size=48, num_layers=3, num_heads=4,
                      num_kv_heads=2)
    assert spec.uniform and spec.layer_bytes(4) == spec.layer_bytes(4, layer=2) == spec.max_layer_bytes(4)
    mixed = ModelSpec("qwen3_moe", 64, HIDDEN, (spec.layers[0], LayerSpec(
        spec.layers[0].attention, MlpSpec(24, "moe", 4, RouterSpec(top_k=2)))))
    assert not mixed.uniform and mixed.max_layer_bytes(4) == mixed.layer_bytes(4, layer=1)
    with pytest.raises(ValueError, match="name the layer"):
        mixed.layer_bytes(4)
