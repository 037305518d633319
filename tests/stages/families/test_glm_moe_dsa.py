"""GLM-5 (`glm_moe_dsa`): MLA with DeepSeek sparse attention — an indexer picking each query's top-k
positions (fewer than the context here: 6 and 9 of up to 26, so keys are dropped in prefill and
decode), layers reusing the last indexer's selection, its keys cached beside the latent — and
DeepSeek-V3's MoE. Against transformers (both attention paths), stacked, rolled back, through a
swarm split where a span may start; a span starting on a reusing layer, and every key or value the
engine does not compute, refused with one line."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from hypothesis import given, strategies as st

from tessera.stages.errors import ModelFormatError, SpanError, UnsupportedModel
from tessera.stages.families.catalog import spec_from_config, spec_from_file, to_config

from ...swarm_helpers import local_swarm
from .conformance import (
    PROMPT, build, check_against_dequantized, check_matches_transformers, check_rollback, check_stacked_sessions, check_swarm,
    reference_run, check_shard_refused,
)

transformers = pytest.importorskip("transformers")

# 8 indexer heads: a position scores exactly 0 only when every head's relu is 0, so ties at the
# top-k's edge (which transformers' topk breaks its own way) are not met
SHAPE = dict(vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=1024,
             bos_token_id=1, eos_token_id=2, intermediate_size=96, moe_intermediate_size=32, kv_lora_rank=16,
             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, q_lora_rank=24, index_n_heads=8,
             index_head_dim=16)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 256,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
CONFIGS = {
    # top-6 of up to 26 positions; layers 1 and 3 reuse layers 0's and 2's selections; a dense first
    # layer, 16 experts in 4 groups (best 2 searched for the top 3), renormalised, one shared expert, YaRN
    "shared-groups-yarn": (dict(index_topk=6, indexer_types=["full", "shared", "full", "shared"],
                                mlp_layer_types=["dense", "sparse", "sparse", "sparse"], n_routed_experts=16,
                                n_group=4, topk_group=2, num_experts_per_tok=3, n_shared_experts=1,
                                norm_topk_prob=True, routed_scaling_factor=2.5, rope_parameters=YARN), False),
    # every layer its own indexer (top-9), every layer sparse, raw top-2 of 8, no shared experts,
    # biased projections, the experts saved fused
    "full-raw-bias-fused": (dict(index_topk=9, indexer_types=["full"] * 4, mlp_layer_types=["sparse"] * 4,
                                 n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=0, norm_topk_prob=False,
                                 routed_scaling_factor=1.0, attention_bias=True), True),
}
SWARM = "shared-groups-yarn"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("glm-moe-dsa")
    return {name: build(root, name, transformers.GlmMoeDsaConfig(**SHAPE, **extra), seed=70 + i, fused=fused)
            for i, (name, (extra, fused)) in enumerate(CONFIGS.items())}


@pytest.fixture(scope="module")
def references(folders):
    return {name: reference_run(folder) for name, folder in folders.items()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_transformers(folders, references, name):
    """Prefills attend expanded and masked, decode steps absorbed over their picked rows only."""
    check_matches_transformers(folders[name], references[name])


def run_logits(folder, tokens, *, path=None, top_k=None):
    from tessera.stages.assembly.stage import load_stage

    stage = load_stage(folder, embed=True, head=True)
    for block in stage.blocks:
        block.attn.path = path
        if top_k is not None:
            block.attn.dsa = replace(block.attn.dsa, index_topk=top_k)
    stage.open("c", capacity=64)
    out, step, pos = [], PROMPT, 0
    for token in tokens:
        out.append(stage.logits(stage.forward("c", stage.embed(step), pos)))
        pos, step = pos + len(step), [token]
    return out


@pytest.mark.parametrize("path", ["expanded", "absorbed"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_each_attention_path_alone_matches_transformers(folders, references, name, path):
    tokens, want = references[name]
    got = run_logits(folders[name], tokens, path=path)
    worst = max(float((a - b).abs().max()) for a, b in zip(want, got))
    assert worst <= 1e-4, f"{name} {path}: max |logits diff| {worst:.3g}"
    assert [int(g[-1].argmax()) for g in got] == tokens


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_selection_drops_keys_and_that_changes_the_answer(folders, references, name):
    """With a top-k past the context every position is read: the logits move far past the tolerance,
    so the runs above hold the selection (and its reuse) to transformers'."""
    tokens, want = references[name]
    dense = run_logits(folders[name], tokens, top_k=10**6)
    assert max(float((a - b).abs().max()) for a, b in zip(want, dense)) > 1e-2


def test_the_selection_is_the_k_best_earlier_positions_ties_as_a_one_token_step_picks():
    from tessera.stages.layers.dsa import select

    scores = torch.tensor([[3.0, 1.0, 2.0, 1.5, 9.0], [0.5, 2.0, 3.0, 7.0, 1.0]])
    picked = select(scores, start=3, top_k=3)  # queries at positions 3 and 4, over positions 0..4
    # position 3 cannot read 4 (its 9.0): its three best earlier ones
    assert picked.tolist() == [[True, False, True, True, False], [False, True, True, True, False]]
    assert select(scores, start=0, top_k=5) is None  # no query has more than k positions: all read


def test_ties_at_the_kth_place_are_picked_per_query_however_the_step_is_cut():
    """Index scores tie at exactly 0 wherever every head's relu is 0 (few indexer heads): of the tied
    positions, a query reads those torch.topk picks on its own causal row (transformers' pick for a
    one-token step), whether the query comes alone, in a prefill, or in a chunk of one."""
    from tessera.stages.layers.dsa import select

    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(12, 12, generator=gen).relu() * (torch.rand(12, 12, generator=gen) > 0.6)
    whole = select(scores, start=0, top_k=4)
    ties = 0
    for p in range(12):
        alone = select(scores[p : p + 1, : p + 1], start=p, top_k=4)
        own = scores[p, : p + 1]
        if p + 1 > 4:
            want = torch.zeros(p + 1, dtype=torch.bool).scatter_(0, own.topk(4).indices, True)
            assert alone[0].tolist() == want.tolist() == whole[p, : p + 1].tolist()
            ranked = own.sort(descending=True).values
            ties += bool(ranked[3] == ranked[4])
        for cut in (3, 7):  # the same query in a chunk [cut, 12) of a prefill cut there
            if p >= cut:
                chunk = select(scores[cut:, :], start=cut, top_k=4)
                assert chunk[p - cut].tolist() == whole[p].tolist()
    assert ties > 0, "no tie at the k-th place: the test above held nothing"


def test_the_layers_are_read_as_configured(folders):
    first = spec_from_file(folders[SWARM] / "config.json")
    assert [layer.attention.shared for layer in first.layers] == [False, True, False, True]
    assert [layer.mlp.kind for layer in first.layers] == ["dense", "moe", "moe", "moe"]
    attention = first.layers[0].attention
    assert (attention.kind, attention.index_heads, attention.index_head_dim, attention.index_topk) == ("dsa", 8, 16, 6)
    assert (attention.mla.q_lora_rank, attention.mla.rope_interleave, attention.rope.kind) == (24, True, "yarn")
    assert first.span_starts == (0, 2, 4)
    full = spec_from_file(folders["full-raw-bias-fused"] / "config.json")
    assert full.span_starts == (0, 1, 2, 3, 4) and full.layers[0].attention.mla.bias
    for spec in (first, full):
        assert spec_from_config(to_config(spec)) == spec


def test_indexer_types_are_derived_as_transformers_derives_them(folders):
    config = json.loads((folders[SWARM] / "config.json").read_text())
    del config["indexer_types"]
    for extra in ({}, {"index_topk_freq": 2}, {"index_topk_freq": 3, "index_skip_topk_offset": 1},
                  {"index_topk_pattern": "FSFF"}):
        theirs = transformers.GlmMoeDsaConfig(**{k: v for k, v in config.items() if k != "architectures"}, **extra)
        ours = spec_from_config({**config, **extra})
        assert ["shared" if layer.attention.shared else "full" for layer in ours.layers] == theirs.indexer_types


def test_the_index_keys_are_cached_and_counted(folders):
    """An indexer layer keeps C + Dr + Di values a position (16 + 8 + 16), a reusing one C + Dr: what a
    session allocates and what admission budgets; a rollback is the pointer."""
    from tessera.stages.assembly.stage import load_stage
    from tessera.stages.layers.cache import IndexedLatentRows, LatentRows

    stage = load_stage(folders[SWARM])
    assert stage.spec.kv_bytes_per_position(0, 4, 4) == 2 * (16 + 8 + 16) * 4 + 2 * (16 + 8) * 4
    stage.open("s", capacity=100)
    stores = stage.sessions["s"].cache.layers
    assert [type(s) for s in stores] == [IndexedLatentRows, LatentRows, IndexedLatentRows, LatentRows]
    stage.sessions["s"].cache.reserve(0, 100)
    assert stage.sessions["s"].cache.nbytes == stage.session_bytes(100)


def test_a_span_never_starts_on_a_layer_that_reuses_a_selection(folders):
    from tessera.stages.assembly.stage import load_stage

    with pytest.raises(SpanError, match="cannot start at layer 1 .* reuses the sparse-attention selection of layer 0") \
            as refused:
        load_stage(folders[SWARM], start=1, end=4)
    assert "\n" not in str(refused.value)
    stage = load_stage(folders[SWARM], start=0, end=4)
    with pytest.raises(SpanError, match="cannot start at layer 3"):
        stage.open("s", capacity=16, start=3)
    stage.open("tail", capacity=16, start=2)  # a session may start at the next indexer layer
    load_stage(folders[SWARM], start=2, end=4)


@given(st.integers(0, 7), st.integers(1, 8), st.lists(st.booleans(), min_size=8, max_size=8))
def test_a_claimed_span_is_aligned_where_sparse_attention_lets_a_span_start(start, length, shared):
    """What a peer claims where placement chose [start, end): ends at span starts; inside the window when
    a span fits in it, else the one indexer layer's group the start falls in; unchanged without reusing layers."""
    end = min(start + length, 8)
    config = {k: v for k, v in CONFIG_AS_SAVED.items() if k != "layer_types"}
    spec = spec_from_config({**config, "num_hidden_layers": 8, "mlp_layer_types": ["dense"] * 8,
                             "indexer_types": ["full"] + ["shared" if s else "full" for s in shared[1:]]})
    a, b = spec.aligned_span(start, end)
    assert a < b and a in spec.span_starts and b in spec.span_starts
    fits = [i for i in spec.span_starts if start <= i <= end]
    if len(fits) >= 2:
        assert (a, b) == (fits[0], fits[-1])
    else:
        assert a <= start and not any(a < i < b for i in spec.span_starts)
    if not any(shared[1:]):
        assert (a, b) == (start, end)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_stacked_sessions_equal_their_solo_runs(folders, name):
    check_stacked_sessions(folders[name])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_rollback_by_pointer(folders, references, name):
    check_rollback(folders[name], references[name][0])


def test_placement_counts_each_layer_and_the_span_holds_it(folders):
    from tessera.stages.assembly.stage import load_stage
    from tessera.stages.kernels.quant import span_bytes

    folder = folders[SWARM]
    spec = spec_from_file(folder / "config.json")
    indexer = 8 * 16 * 24 + 16 * 64 + 2 * 16 + 8 * 64  # Wq_i, Wk, the key norm, the head weights
    assert spec.layer_bytes(4, layer=2) - spec.layer_bytes(4, layer=3) == 4 * indexer
    for start, end in ((0, 2), (2, 4), (0, 4)):
        assert load_stage(folder, start=start, end=end).weight_bytes == span_bytes(spec, start, end, 4)


def test_a_quantized_span_matches_its_dequantized_reference(folders):
    """int8 MLA projections and experts; Wkv_b, the norms, the routers and the indexers stay float."""
    from tessera.stages.assembly.stage import load_stage
    from tessera.stages.kernels.quant import Int8Linear, Quant, span_bytes

    folder, quant = folders[SWARM], Quant.parse("int8")
    spec = spec_from_file(folder / "config.json")
    stage = load_stage(folder, quant=quant)
    assert stage.weight_bytes == span_bytes(spec, 0, 4, 4, quant)
    block = stage.blocks[2]
    assert all(isinstance(m, Int8Linear) for m in (block.attn.wq_b, block.attn.wkv_a, block.mlp.shared.w_down))
    assert block.attn.indexer.wq.dtype == torch.float32 and block.attn.wkv_b.dtype == torch.float32
    check_against_dequantized(folder, stage)


def test_a_tensor_shard_rank_is_refused_at_start_with_one_line(folders):
    check_shard_refused(folders[SWARM], "tensor shards of glm_moe_dsa are not supported: layer 0 is 'dsa'")


CONFIG_AS_SAVED = {**json.loads(json.dumps(transformers.GlmMoeDsaConfig(**SHAPE, **CONFIGS[SWARM][0]).to_dict())),
                   "architectures": ["GlmMoeDsaForCausalLM"]}


@pytest.mark.parametrize("change, error, words", [
    ({"indexer_types": ["shared", "full", "full", "full"]}, UnsupportedModel, "indexer_types .* layer 0 reuses"),
    ({"indexer_types": ["full", "dense", "full", "full"]}, UnsupportedModel, "indexer_types"),
    ({"indexer_types": ["full"]}, ModelFormatError, "indexer_types"),
    ({"layer_types": ["full_attention"] * 4}, UnsupportedModel, "layer_types"),
    ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, ModelFormatError, "mlp_layer_types"),
    ({"mlp_bias": True}, UnsupportedModel, "mlp_bias True"),
    ({"index_topk": 0}, ModelFormatError, "index_topk"),
    ({"index_head_dim": 4}, ModelFormatError, "index_head_dim"),  # narrower than the rope dims it turns
    ({"q_lora_rank": None}, ModelFormatError, "q_lora_rank"),  # the indexer's queries come from it
    ({"hidden_act": "gelu"}, UnsupportedModel, "hidden_act 'gelu'"),
    ({"rope_interleave": False}, UnsupportedModel, "'rope_interleave'"),  # DeepSeek's key: GLM-5 always interleaves
    ({"rope_parameters": {**YARN, "rope_type": "longrope"}}, UnsupportedModel, "longrope"),
    # fp8 loads block-scaled (stages/families/shipped.py); one scale per tensor does not
    ({"quantization_config": {"quant_method": "fp8"}}, UnsupportedModel, "weight_block_size null"),
    ({"quantization_config": {"quant_method": "awq"}}, UnsupportedModel, "quant_method 'awq'"),
])
def test_what_the_engine_does_not_compute_is_refused_by_name(change, error, words):
    with pytest.raises(error, match=words) as refused:
        spec_from_config({**CONFIG_AS_SAVED, **change})
    assert "\n" not in str(refused.value)


@pytest.fixture(scope="module")
def swarm(folders):
    with local_swarm([(0, 2), (2, 4)], model=str(folders[SWARM])) as procs:
        yield procs


@pytest.mark.slow
async def test_a_two_peer_swarm_matches_transformers(swarm, folders, references):
    """Split at layer 2, where an indexer layer starts the second peer's span."""
    await check_swarm(swarm, folders[SWARM], references[SWARM][0])
