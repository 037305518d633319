"""GLM-5 (`glm_moe_dsa`): what only it has beyond the conformance suite (test_conformance.py's rows,
which hold it to transformers, stacked, chunked, split, rolled back, through a swarm split where a
span may start, and its refusals; two indexer heads among the rows): each attention path alone
against transformers, the selection dropping keys (and that changing the answer), its ties, the
layers and indexer types read as transformers reads them, the index keys cached and counted, a span
never starting on a layer that reuses a selection, per-layer bytes, int8 against its reference."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from hypothesis import given, strategies as st

from tessera.stages.errors import SpanError
from tessera.stages.families.catalog import spec_from_config, spec_from_file

from .conformance import check_against_dequantized, fed_logits
from .rows import ROWS, saved_config

transformers = pytest.importorskip("transformers")

SHARED, FULL, TWO_HEADS = "glm_moe_dsa/shared-groups-yarn", "glm_moe_dsa/full-raw-bias-fused", "glm_moe_dsa/two-index-heads"
NAMES = (SHARED, FULL, TWO_HEADS)


def run_logits(folder, tokens, *, path=None, top_k=None):
    from tessera.stages.assembly.stage import load_stage

    stage = load_stage(folder, embed=True, head=True)
    for block in stage.blocks:
        block.attn.path = path
        if top_k is not None:
            block.attn.dsa = replace(block.attn.dsa, index_topk=top_k)
    return fed_logits(stage, tokens)


@pytest.mark.parametrize("path", ["expanded", "absorbed"])
@pytest.mark.parametrize("name", NAMES)
def test_each_attention_path_alone_matches_transformers(family_models, name, path):
    tokens, want = family_models.reference(name)
    got = run_logits(family_models.folder(name), tokens, path=path)
    worst = max(float((a - b).abs().max()) for a, b in zip(want, got))
    assert worst <= 1e-4, f"{name} {path}: max |logits diff| {worst:.3g}"
    assert [int(g[-1].argmax()) for g in got] == tokens


@pytest.mark.parametrize("name", NAMES)
def test_the_selection_drops_keys_and_that_changes_the_answer(family_models, name):
    """With a top-k past the context every position is read: the logits move far past the tolerance,
    so the runs above hold the selection (and its reuse) to transformers'."""
    tokens, want = family_models.reference(name)
    dense = run_logits(family_models.folder(name), tokens, top_k=10**6)
    assert max(float((a - b).abs().max()) for a, b in zip(want, dense)) > 1e-2


def test_with_two_index_heads_transformers_own_prefill_picks_other_ties_than_its_steps(family_models):
    """Why the two-index-heads row holds us to transformers stepped token by token: on it, transformers'
    whole-prompt prefill and its one-token steps disagree (torch.topk over rows padded with the masked
    future picks other tied positions), while with 8 heads they agree; we take the one-token pick
    (layers/dsa.py `select`), which any cut of a prompt gives alike."""
    from .conformance import reference_run

    for name, apart in ((TWO_HEADS, True), (FULL, False)):
        whole, stepped = reference_run(family_models.folder(name)), family_models.reference(name)
        if ROWS[name].stepped:
            gap = max(float((a - b).abs().max()) for a, b in zip(whole[1], stepped[1]))
        else:
            gap = max(float((a - b).abs().max()) for a, b in zip(whole[1], reference_run(
                family_models.folder(name), stepped=True)[1]))
        assert (gap > 1e-2) == apart, f"{name}: transformers' prefill against its steps {gap:.3g}"


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


def test_the_layers_are_read_as_configured(family_models):
    first = spec_from_file(family_models.folder(SHARED) / "config.json")
    assert [layer.attention.shared for layer in first.layers] == [False, True, False, True]
    assert [layer.mlp.kind for layer in first.layers] == ["dense", "moe", "moe", "moe"]
    attention = first.layers[0].attention
    assert (attention.kind, attention.index_heads, attention.index_head_dim, attention.index_topk) == ("dsa", 8, 16, 6)
    assert (attention.mla.q_lora_rank, attention.mla.rope_interleave, attention.rope.kind) == (24, True, "yarn")
    assert first.span_starts == (0, 2, 4)
    full = spec_from_file(family_models.folder(FULL) / "config.json")
    assert full.span_starts == (0, 1, 2, 3, 4) and full.layers[0].attention.mla.bias


def test_indexer_types_are_derived_as_transformers_derives_them(family_models):
    config = json.loads((family_models.folder(SHARED) / "config.json").read_text())
    del config["indexer_types"]
    for extra in ({}, {"index_topk_freq": 2}, {"index_topk_freq": 3, "index_skip_topk_offset": 1},
                  {"index_topk_pattern": "FSFF"}):
        theirs = transformers.GlmMoeDsaConfig(**{k: v for k, v in config.items() if k != "architectures"}, **extra)
        ours = spec_from_config({**config, **extra})
        assert ["shared" if layer.attention.shared else "full" for layer in ours.layers] == theirs.indexer_types


def test_the_index_keys_are_cached_and_counted(family_models):
    """An indexer layer keeps C + Dr + Di values a position (16 + 8 + 16), a reusing one C + Dr: what a
    session allocates and what admission budgets; a rollback is the pointer."""
    from tessera.stages.assembly.stage import load_stage
    from tessera.stages.layers.cache import IndexedLatentRows, LatentRows

    stage = load_stage(family_models.folder(SHARED))
    assert stage.spec.kv_bytes_per_position(0, 4, 4) == 2 * (16 + 8 + 16) * 4 + 2 * (16 + 8) * 4
    stage.open("s", capacity=100)
    stores = stage.sessions["s"].cache.layers
    assert [type(s) for s in stores] == [IndexedLatentRows, LatentRows, IndexedLatentRows, LatentRows]
    stage.sessions["s"].cache.reserve(0, 100)
    assert stage.sessions["s"].cache.nbytes == stage.session_bytes(100)


def test_a_span_never_starts_on_a_layer_that_reuses_a_selection(family_models):
    from tessera.stages.assembly.stage import load_stage

    with pytest.raises(SpanError, match="cannot start at layer 1 .* reuses the sparse-attention selection of layer 0") \
            as refused:
        load_stage(family_models.folder(SHARED), start=1, end=4)
    assert "\n" not in str(refused.value)
    stage = load_stage(family_models.folder(SHARED), start=0, end=4)
    with pytest.raises(SpanError, match="cannot start at layer 3"):
        stage.open("s", capacity=16, start=3)
    stage.open("tail", capacity=16, start=2)  # a session may start at the next indexer layer
    load_stage(family_models.folder(SHARED), start=2, end=4)


@given(st.integers(0, 7), st.integers(1, 8), st.lists(st.booleans(), min_size=8, max_size=8))
def test_a_claimed_span_is_aligned_where_sparse_attention_lets_a_span_start(start, length, shared):
    """What a peer claims where placement chose [start, end): ends at span starts; inside the window when
    a span fits in it, else the one indexer layer's group the start falls in; unchanged without reusing layers."""
    end = min(start + length, 8)
    config = {k: v for k, v in saved_config(SHARED).items() if k != "layer_types"}
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


def test_placement_counts_each_layer_and_the_span_holds_it(family_models):
    from tessera.stages.assembly.stage import load_stage
    from tessera.stages.kernels.quant import span_bytes

    folder = family_models.folder(SHARED)
    spec = spec_from_file(folder / "config.json")
    indexer = 8 * 16 * 24 + 16 * 64 + 2 * 16 + 8 * 64  # Wq_i, Wk, the key norm, the head weights
    assert spec.layer_bytes(4, layer=2) - spec.layer_bytes(4, layer=3) == 4 * indexer
    for start, end in ((0, 2), (2, 4), (0, 4)):
        assert load_stage(folder, start=start, end=end).weight_bytes == span_bytes(spec, start, end, 4)


def test_a_quantized_span_matches_its_dequantized_reference(family_models):
    """int8 MLA projections and experts; Wkv_b, the norms, the routers and the indexers stay float."""
    from tessera.stages.assembly.stage import load_stage
    from tessera.stages.kernels.quant import Int8Linear, Quant, span_bytes

    folder, quant = family_models.folder(SHARED), Quant.parse("int8")
    spec = spec_from_file(folder / "config.json")
    stage = load_stage(folder, quant=quant)
    assert stage.weight_bytes == span_bytes(spec, 0, 4, 4, quant)
    block = stage.blocks[2]
    assert all(isinstance(m, Int8Linear) for m in (block.attn.wq_b, block.attn.wkv_a, block.mlp.shared.w_down))
    assert block.attn.indexer.wq.dtype == torch.float32 and block.attn.wkv_b.dtype == torch.float32
    check_against_dequantized(folder, stage)
