"""What only Kimi Linear (`kimi_linear`) has: Kimi Delta Attention beside NoPE MLA, the published config's form.

The conformance suite (test_conformance.py, its rows in rows.py) holds it to transformers, stacked and
chunked sessions, a split inside the KDA run, rollback, the refusals and a real swarm, and (as every
family with a recurrent state) a whole, a chunked and a replayed prefill against the same reference,
going back into a block and further back refused. Here: the layers as configured (and as the
published `linear_attn_config` numbers them); a KDA layer's fixed state; the chunk-wise rule against
transformers' own kernel over several chunks and against the token-by-token rule; an int8 span; and any value in any key read or refused by one typed error.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tessera.stages.assembly.stage import load_stage
from tessera.stages.families.catalog import spec_from_config, spec_from_file
from tessera.stages.families.shapes import shape_spec
from tessera.stages.families.spec.mla import MlaSpec
from tessera.stages.families.spec.recurrent import KdaSpec
from tessera.stages.layers.recurrent.delta_rule import recurrent_delta_rule
from tessera.stages.layers.recurrent.kda import chunked_kda, l2norm
from tessera.stages.layers.state import RecurrentState

from .conformance import check_any_value_is_read_or_refused
from .rows import saved_config

transformers = pytest.importorskip("transformers")

PUBLISHED = "kimi_linear/groups-shared-published"
FUSED = "kimi_linear/lora-raw-fused"


def test_the_layers_are_read_as_configured():
    spec = spec_from_config(saved_config(PUBLISHED))
    assert [layer.attention.kind for layer in spec.layers] == ["kda", "kda", "mla", "kda"]
    assert [layer.mlp.kind for layer in spec.layers] == ["dense", "moe", "moe", "moe"]
    mla = spec.layers[2].attention
    assert isinstance(mla, MlaSpec) and mla.rope.kind == "none" and mla.q_lora_rank is None
    router = spec.layers[1].mlp.router
    assert (router.kind, router.num_groups, router.topk_groups, router.top_k) == ("sigmoid_group_topk", 2, 1, 2)
    assert spec.layers[1].mlp.shared_width == 32 and router.renormalize and router.scale == 2.446
    # the published form: 1-based KDA and MLA layer numbers and the sizes in `linear_attn_config`
    numbered = {key: value for key, value in saved_config(PUBLISHED).items()
                if key not in ("layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim")}
    numbered["linear_attn_config"] = {"kda_layers": [1, 2, 4], "full_attn_layers": [3], "num_heads": 4,
                                      "head_dim": 8, "short_conv_kernel_size": 4}
    assert spec_from_config(numbered) == spec
    published = shape_spec("kimi-linear-48b-a3b")
    assert [i + 1 for i, layer in enumerate(published.layers) if layer.attention.kind == "mla"] == [
        4, 8, 12, 16, 20, 24, 27]
    assert published.layers[0].attention == KdaSpec(32, 128, 4)


def test_a_kda_layer_holds_a_fixed_state_whatever_the_context(family_models):
    """Admission charges a KDA layer its fixed state (a [d, d] matrix per head, the convolution's window,
    two checkpoints and their inputs), and an MLA layer its latent per position; a store holds no more."""
    spec = spec_from_file(family_models.folder(PUBLISHED) / "config.json")
    kda, mla = spec.layers[0].cache, spec.layers[2].cache
    assert kda.kind == "recurrent" and kda.bytes_per_position(4) == 0 and kda.bytes(1 << 20, 4) == kda.fixed_bytes(4)
    assert (kda.num_heads, kda.key_dim, kda.value_dim, kda.conv_channels) == (4, 8, 8, 96)
    assert mla.bytes_per_position(4) == 4 * (16 + 8)
    assert spec.state_bytes(0, 2, 1 << 20) == spec.state_bytes(0, 2, 1) == 2 * kda.fixed_bytes(4)
    stage = load_stage(family_models.folder(PUBLISHED), embed=True)
    stage.open("s", capacity=64)
    store = stage.sessions["s"].cache.layers[0]
    assert isinstance(store, RecurrentState)
    stage.forward("s", stage.embed(list(range(5, 25))), 0)
    for n in (4, 1, 4, 4, 1, 1, 4):
        stage.forward("s", stage.embed(list(range(5, 5 + n))), stage.position("s"))
        assert store.nbytes <= kda.fixed_bytes(4)


def test_the_chunked_rule_is_transformers_kernel_and_the_token_by_token_rule():
    """Over 150 tokens (three chunks of 64, the last padded) from a nonzero state, our chunk-wise rule
    gives transformers' `chunk_kimi_delta_attention` (outputs and final state) and our one-token rule."""
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention

    g = torch.Generator().manual_seed(0)
    heads, t, d = 3, 150, 8
    q, k, v = (torch.randn(1, t, heads, d, generator=g) for _ in range(3))
    decay = -F.softplus(torch.randn(1, t, heads, d, generator=g))  # per channel, <= 0
    beta = torch.rand(1, t, heads, generator=g)
    state = 0.1 * torch.randn(1, heads, d, d, generator=g)
    want, want_state = chunk_kimi_delta_attention(q, k, v, g=decay, beta=beta, initial_state=state,
                                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
    ours = [x[0].transpose(0, 1) for x in (q, k, v, decay)]  # [heads, T, d]
    ours[0], ours[1] = l2norm(ours[0]) * d ** -0.5, l2norm(ours[1])
    chunked, chunked_state = chunked_kda(*ours, beta[0].t(), state[0])
    stepped, stepped_state = recurrent_delta_rule(*ours, beta[0].t(), state[0])
    assert float((chunked.transpose(0, 1) - want[0]).abs().max()) <= 1e-5
    assert float((chunked_state - want_state[0]).abs().max()) <= 1e-5
    assert float((chunked - stepped).abs().max()) <= 1e-5 and float((chunked_state - stepped_state).abs().max()) <= 1e-5


def test_an_int8_span_matches_its_dequantized_reference(family_models):
    """KDA's projections (in, the two gates' up-projections, out) are stored as integers like any matrix;
    the convolution, the decays and the norms stay float. Against its own dequantized float32 blocks:
    tokens identical, logits within the recurrent rows' bound."""
    from tessera.stages.kernels.quant import Int8Linear, Quant

    from .conformance import RECURRENT_STACKED_RTOL, check_against_dequantized

    folder = family_models.folder(PUBLISHED)
    stage = load_stage(folder, quant=Quant.parse("int8"))
    attn = stage.blocks[0].attn
    assert all(isinstance(m, Int8Linear) for m in (attn.w_in, attn.w_fb, attn.w_gb, attn.w_out))
    check_against_dequantized(folder, stage, rtol=RECURRENT_STACKED_RTOL)


def test_any_value_in_any_key_is_read_or_refused_by_one_typed_error():
    """Keys overwritten at random by JSON values: a spec every layer of which builds, or ModelFormatError /
    UnsupportedModel in one line."""
    base = {**saved_config(PUBLISHED), "linear_attn_config": {"kda_layers": [1, 2, 4], "full_attn_layers": [3]}}
    check_any_value_is_read_or_refused(base, examples=60)

