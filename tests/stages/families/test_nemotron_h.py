"""What only Nemotron-H (`nemotron_h`) has: layers of one mixer or one MLP, Mamba2, the pattern string.

The conformance suite (test_conformance.py, its rows in rows.py) holds it to transformers, stacked and
chunked sessions, a split between two Mamba2 layers, rollback, the refusals and a real swarm, and
(as every family with a recurrent state) a whole, a chunked and a replayed prefill against the same
reference, going back into a block and further back refused. Here: the layers as configured (a
pattern string or a list, legacy names), each with the one norm of its half; a Mamba2 layer's fixed
state and an MLP layer's none; the chunked scan against transformers' own over several chunks and
against the one-token step, and dt's clamp where transformers' two paths disagree; the compiled
decode step (NoPE attention compiled); an int8 span; and any value in any key read
or refused by one typed error.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.stages.assembly.stage import load_stage
from tessera.stages.families.catalog import spec_from_config, spec_from_file
from tessera.stages.families.shapes import shape_spec
from tessera.stages.layers.block import Block
from tessera.stages.layers.cache import NoState
from tessera.stages.layers.recurrent.mamba2 import Mamba2Mixer, chunked_scan, recurrent_scan
from tessera.stages.layers.state import RecurrentState

from .conformance import check_any_value_is_read_or_refused, check_compiled_decode
from .rows import saved_config

transformers = pytest.importorskip("transformers")

MLP = "nemotron_h/mamba-mlp-attention"
MOE = "nemotron_h/moe"


def test_the_layers_are_read_as_configured():
    config = saved_config(MLP)
    spec = spec_from_config(config)
    assert [(layer.attention_kind, layer.mlp_kind) for layer in spec.layers] == [
        ("mamba2", "none"), ("mamba2", "none"), ("none", "dense"), ("gqa", "none"), ("none", "dense"), ("mamba2", "none")]
    assert spec.layers[3].attention.rope.kind == "none" and spec.layers[2].mlp.glu.kind == "relu2"
    assert spec.prefix == "backbone." and spec.layers[0].attention.dt_min == 0.0  # time_step_limit [0, inf]
    listed = {k: v for k, v in config.items() if k != "layers_block_type"}
    assert spec_from_config({**listed, "hybrid_override_pattern": "MM-*-M"}) == spec
    legacy = ["mamba", "mamba", "mlp", "attention", "mlp", "mamba"]
    assert spec_from_config({**listed, "layers_block_type": legacy}) == spec
    with torch.device("meta"):
        mixer, mlp = Block(spec, spec.layers[0]), Block(spec, spec.layers[2])
    assert mixer.mlp is None and mixer.mlp_norm is None and mlp.attn is None and mlp.attn_norm is None
    moe = spec_from_config(saved_config(MOE))
    sparse = moe.layers[1].mlp
    assert (sparse.kind, sparse.glu.kind, sparse.num_experts, sparse.shared_width) == ("moe", "relu2", 8, 48)
    assert (sparse.router.kind, sparse.router.num_groups, sparse.router.scale) == ("sigmoid_group_topk", 2, 2.0)
    assert not moe.layers[0].attention.conv_bias
    published = shape_spec("nemotron-h-8b")
    kinds = [layer.attention_kind if layer.attention is not None else layer.mlp_kind for layer in published.layers]
    assert (kinds.count("mamba2"), kinds.count("gqa"), kinds.count("dense")) == (24, 4, 24)


def test_a_mamba_layer_holds_a_fixed_state_and_an_mlp_layer_none(family_models):
    """Admission charges a Mamba2 layer its fixed state ([P, N] per head, the convolution's window, two
    checkpoints and their inputs), an attention layer its keys and values per position, an MLP layer
    nothing; a store holds no more."""
    spec = spec_from_file(family_models.folder(MLP) / "config.json")
    mamba, mlp, attention = spec.layers[0].cache, spec.layers[2].cache, spec.layers[3].cache
    assert mamba.kind == "recurrent" and mamba.bytes_per_position(4) == 0
    assert (mamba.num_heads, mamba.key_dim, mamba.value_dim, mamba.conv_channels) == (4, 8, 16, 32 + 2 * 2 * 16)
    assert mlp.kind == "none" and mlp.bytes(1 << 20, 4) == 0
    assert attention.bytes_per_position(4) == 2 * 2 * 16 * 4
    assert spec.state_bytes(0, 3, 1 << 20) == spec.state_bytes(0, 3, 1) == 2 * mamba.fixed_bytes(4)
    stage = load_stage(family_models.folder(MLP), embed=True)
    stage.open("s", capacity=64)
    stores = stage.sessions["s"].cache.layers
    assert isinstance(stores[0], RecurrentState) and isinstance(stores[2], NoState)
    stage.forward("s", stage.embed(list(range(5, 25))), 0)
    for n in (4, 1, 4, 4, 1, 1, 4):
        stage.forward("s", stage.embed(list(range(5, 5 + n))), stage.position("s"))
        assert stores[0].nbytes <= mamba.fixed_bytes(4) and stores[2].nbytes == 0


def scan_inputs(t: int, heads: int = 4, head_dim: int = 8, state: int = 16, groups: int = 2):
    g = torch.Generator().manual_seed(1)
    return dict(x=torch.randn(1, t, heads, head_dim, generator=g), dt=torch.randn(1, t, heads, generator=g) - 2.0,
                dt_bias=0.2 * torch.randn(heads, generator=g), A=-torch.exp(0.2 * torch.randn(heads, generator=g)),
                B=torch.randn(1, t, groups, state, generator=g), C=torch.randn(1, t, groups, state, generator=g),
                D=torch.randn(heads, generator=g), state=0.1 * torch.randn(1, heads, head_dim, state, generator=g))


def our_scan(i: dict, *, dt_min: float, chunk: int, one_token: bool = False):
    heads, groups = i["x"].shape[2], i["B"].shape[2]
    dt = F.softplus(i["dt"][0] + i["dt_bias"]).clamp(min=dt_min)
    b, c = (m[0].repeat_interleave(heads // groups, dim=1) for m in (i["B"], i["C"]))
    if one_token:
        y, state = recurrent_scan(i["x"][0], dt, i["A"], b, c, i["state"][0])
    else:
        y, state = chunked_scan(i["x"][0], dt, i["A"], b, c, i["state"][0], chunk)
    return y + i["D"][:, None] * i["x"][0], state


def test_the_chunked_scan_is_transformers_scan_and_the_one_token_step():
    """Over 150 tokens (five chunks of 32, the last padded) from a nonzero state: our chunked scan gives
    transformers' `mamba2_chunk_scan` (outputs and final state) and our one-token step."""
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan

    i = scan_inputs(150)
    want, want_state = mamba2_chunk_scan(i["x"], i["dt"], i["A"], i["B"], i["C"], chunk_size=32, D=i["D"],
                                         dt_bias=i["dt_bias"], initial_states=i["state"], dt_softplus=True,
                                         dt_limit=(0.0, float("inf")), return_final_states=True)
    chunked, chunked_state = our_scan(i, dt_min=0.0, chunk=32)
    stepped, stepped_state = our_scan(i, dt_min=0.0, chunk=32, one_token=True)
    assert float((chunked - want[0]).abs().max()) <= 1e-5 and float((chunked_state - want_state[0]).abs().max()) <= 1e-5
    assert float((chunked - stepped).abs().max()) <= 1e-4 and float((chunked_state - stepped_state).abs().max()) <= 1e-5


def test_dt_is_clamped_alike_in_both_forms_where_transformers_clamps_only_its_prefill():
    """transformers' chunked scan clamps dt at `time_step_min` (its `time_step_limit`), its one-token step
    does not: with dt below 0.001 the two disagree. Ours clamps at the config's `time_step_limit` floor in
    both forms: at 0 (the published configs) a one-token step is transformers' one-token step; at 0.001
    our chunked scan is transformers' chunked scan."""
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan, mamba2_selective_state_update

    i = scan_inputs(1)
    i["dt"] = torch.full_like(i["dt"], -9.0)  # softplus ~1.2e-4: under time_step_min
    head_dim, state = i["x"].shape[3], i["B"].shape[3]
    theirs_state = i["state"].clone()
    theirs_step = mamba2_selective_state_update(
        theirs_state, i["x"][:, 0], i["dt"][:, 0, :, None].expand(-1, -1, head_dim),
        i["A"][:, None, None].expand(-1, head_dim, state), i["B"][:, 0], i["C"][:, 0],
        i["D"][:, None].expand(-1, head_dim), dt_bias=i["dt_bias"][:, None].expand(-1, head_dim), dt_softplus=True)
    theirs_chunk, _ = mamba2_chunk_scan(i["x"], i["dt"], i["A"], i["B"], i["C"], chunk_size=8, D=i["D"],
                                        dt_bias=i["dt_bias"], initial_states=i["state"], dt_softplus=True,
                                        dt_limit=(0.001, float("inf")), return_final_states=True)
    assert float((theirs_step - theirs_chunk[:, 0]).abs().max()) > 1e-3  # transformers' two forms disagree
    ours, ours_state = our_scan(i, dt_min=0.0, chunk=8, one_token=True)
    assert float((ours - theirs_step).abs().max()) <= 1e-6 and float((ours_state - theirs_state[0]).abs().max()) <= 1e-6
    clamped, _ = our_scan(i, dt_min=0.001, chunk=8)
    assert float((clamped - theirs_chunk[0]).abs().max()) <= 1e-6
    assert float((our_scan(i, dt_min=0.001, chunk=8, one_token=True)[0] - clamped).abs().max()) <= 1e-6


def test_the_compiled_decode_step_runs_the_attention_compiled_and_the_rest_eagerly(family_models):
    """Under `--compile inductor` the attention layer (NoPE: identity rotary tables) and the head decode
    compiled; the Mamba2 and MLP-only layers decode eagerly inside the compiled step, said once per layer
    kind; logits are transformers' to 1e-4 and tokens identical."""
    from tessera.stages.engine.compiled.build import compile_decode
    from tessera.stages.engine.compiled.inductor import HEAD

    folder = family_models.folder(MLP)
    stage, said = load_stage(folder, embed=True, head=True), []
    compile_decode(stage, "inductor", say=said.append, buckets=(1,))
    runner = stage.decode
    attention = {kind for kind in stage.spec.layers if kind.attention_kind == "gqa"}
    assert runner.compiled == attention | {HEAD} and set(runner.eager) == set(stage.spec.layers) - attention, said
    check_compiled_decode(stage, family_models.reference(MLP))


def test_an_int8_span_matches_its_dequantized_reference(family_models):
    """Mamba2's in- and out-projections and the relu^2 experts are stored as integers like any matrix; the
    convolution, dt, A, D and the norms stay float. Against its own dequantized float32 blocks: tokens
    identical, logits within the recurrent rows' bound."""
    from tessera.stages.kernels.quant import Int8Linear, Quant

    from .conformance import RECURRENT_STACKED_RTOL, check_against_dequantized

    folder = family_models.folder(MOE)
    stage = load_stage(folder, quant=Quant.parse("int8"))
    assert isinstance(stage.blocks[0].attn, Mamba2Mixer) and isinstance(stage.blocks[0].attn.w_in, Int8Linear)
    assert isinstance(stage.blocks[1].mlp.experts[0].w_up, Int8Linear)
    check_against_dequantized(folder, stage, rtol=RECURRENT_STACKED_RTOL)


def test_any_value_in_any_key_is_read_or_refused_by_one_typed_error():
    """Keys overwritten at random by JSON values: a spec every layer of which builds, or ModelFormatError /
    UnsupportedModel in one line."""
    base = {**saved_config(MLP), "hybrid_override_pattern": "MM-*-M"}
    check_any_value_is_read_or_refused(base, examples=60)
