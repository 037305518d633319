"""The hybrids: Qwen3-Next (`qwen3_next`), Qwen3.5 (`qwen3_5`) and Qwen3.5-MoE (`qwen3_5_moe`).

Gated DeltaNet layers (a fixed recurrent state and a convolution window per session) among gated
full-attention ones, zero-centred norms, gated shared experts. Each configuration against
transformers (float32 logits to 1e-4, greedy identical), stacked sessions against solo ones,
speculative blocks rolled back (a recurrent state goes back only as far as its checkpoints: a
deeper rollback is refused with one line), a whole prefill, a chunked one and a replay of the
history against the same reference, and every config value the engine does not compute refused
with one line. The Qwen3.5 configuration is saved as transformers saves the multimodal model (a
vision tower and the text model under model.language_model.): its text model runs.
"""

from __future__ import annotations

import json

import pytest
import torch

from tessera.stages.engine.stage import Stage
from tessera.stages.errors import ModelFormatError, StateRewindError, UnsupportedModel
from tessera.stages.families.spec import REPLAY_TOKENS
from tessera.stages.families.catalog import spec_from_config, spec_from_file, to_config
from tessera.stages.layers.state import RecurrentState

from .conformance import (
    EOS, PROMPT, SHAPE, TOLERANCE, VOCAB, build, check_matches_transformers, check_shard_refused,
    reference_run, relative_gap, solo_run, until_eos, STACKED_PROMPTS, STACKED_STEPS,
)

transformers = pytest.importorskip("transformers")

LINEAR = dict(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
              linear_num_value_heads=4)
HYBRID = dict(SHAPE, num_hidden_layers=4, **LINEAR)  # layers 0-2 linear, 3 full (full_attention_interval 4)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=64)
CONFIGS = {
    # a dense first layer, then sparse ones with the gated shared expert; q, k, v, z grouped per key head
    "qwen3_next": lambda: transformers.Qwen3NextConfig(**HYBRID, **MOE, intermediate_size=96, mlp_only_layers=[0]),
    # dense, saved as the multimodal model (vision tower, text model under model.language_model.)
    "qwen3_5": lambda: transformers.Qwen3_5Config(text_config=dict(HYBRID, intermediate_size=96), vision_config=VISION),
    # every layer sparse; linear and full layers interleaved otherwise; experts saved fused
    "qwen3_5_moe": lambda: transformers.Qwen3_5MoeTextConfig(
        **HYBRID, **MOE, layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"]),
}
# Stacked vs solo, relative to the row's largest logit. Only the matmuls differ (more rows), as for
# the other families (conformance.STACKED_RTOL, 2e-5), but the recurrence carries a rounding
# difference through every later token: measured 2.7e-5 (qwen3_next), 4.5e-6, 1.0e-5 here, where
# Qwen3-MoE's is 1.3e-6. Tokens are identical; the bound is the logits' own.
HYBRID_STACKED_RTOL = TOLERANCE


def build_multimodal(root, name, config, *, seed):
    """`build` for a multimodal config: transformers' ...ForConditionalGeneration, saved whole."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.Qwen3_5ForConditionalGeneration(config).float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in pname else 0.2 * torch.randn_like(p))
    folder = root / name
    model.save_pretrained(folder)
    template = build(root, name + "-tokenizer", transformers.Qwen3_5TextConfig(**dict(HYBRID, intermediate_size=96)),
                     seed=seed)
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / file).write_bytes((template / file).read_bytes())
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3-next")
    out = {}
    for i, (name, make) in enumerate(CONFIGS.items()):
        config = make()
        out[name] = build_multimodal(root, name, config, seed=50 + i) if name == "qwen3_5" else \
            build(root, name, config, seed=50 + i, fused=name == "qwen3_5_moe")
    return out


@pytest.fixture(scope="module")
def references(folders):
    return {name: reference_run(folder) for name, folder in folders.items()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_transformers(folders, references, name):
    check_matches_transformers(folders[name], references[name])


def test_the_layers_are_read_as_configured(folders):
    spec = spec_from_file(folders["qwen3_next"] / "config.json")
    assert [layer.attention.kind for layer in spec.layers] == ["gated_deltanet"] * 3 + ["gqa"]
    assert [layer.mlp.kind for layer in spec.layers] == ["dense", "moe", "moe", "moe"]
    assert spec.layers[1].mlp.shared_gate and spec.layers[1].mlp.shared_width == 48
    assert spec.layers[0].attention.layout == "grouped" and spec.norm_offset == 1.0
    full = spec.layers[3].attention
    assert full.output_gate and full.qk_norm and full.rope_dim == 4  # partial rotary: 0.25 of 16
    multimodal = spec_from_file(folders["qwen3_5"] / "config.json")
    assert multimodal.family == "qwen3_5" and multimodal.prefix == "model.language_model."
    assert {layer.mlp.kind for layer in multimodal.layers} == {"dense"}
    assert multimodal.layers[0].attention.layout == "split"
    moe = spec_from_file(folders["qwen3_5_moe"] / "config.json")
    assert [layer.attention.kind for layer in moe.layers] == ["gated_deltanet", "gqa", "gated_deltanet", "gated_deltanet"]
    assert {layer.mlp.router.renormalize for layer in moe.layers} == {True}


def test_a_linear_layer_holds_a_fixed_state_whatever_the_context(folders):
    """Admission prices a session as fixed + per position x positions, per layer: a linear layer's
    is all fixed, and a store holds no more than its spec says, at any length."""
    spec = spec_from_file(folders["qwen3_next"] / "config.json")
    linear, full = spec.layers[0].cache, spec.layers[3].cache
    assert linear.kind == "recurrent" and linear.bytes_per_position(4) == 0
    assert linear.bytes(16, 4) == linear.bytes(1 << 20, 4) == linear.fixed_bytes(4) > 0
    assert spec.state_bytes(0, 3, 1 << 20) == spec.state_bytes(0, 3, 1)  # a span of linear layers
    assert spec.state_bytes(0, 4, 1000) == spec.state_fixed_bytes(0, 4) + 1000 * full.bytes_per_position(4)
    assert spec.context_tokens(0, 3, linear.fixed_bytes(4) * 3) == spec.max_position
    assert spec.context_tokens(0, 3, linear.fixed_bytes(4) * 3 - 1) == 0
    budget = spec.state_fixed_bytes(0, 4) + 100 * full.bytes_per_position(4)
    assert spec.context_tokens(0, 4, budget) == 100
    stage = Stage.load(folders["qwen3_next"], embed=True)
    stage.open("s", capacity=64)
    store = stage.sessions["s"].cache.layers[0]
    assert isinstance(store, RecurrentState)
    stage.forward("s", stage.embed(list(range(5, 25))), 0)  # a prefill of 20, then blocks of 4 and single tokens
    for n in (4, 1, 4, 4, 1, 1, 4):
        stage.forward("s", stage.embed(list(range(5, 5 + n))), stage.position("s"))
        assert store.nbytes <= linear.fixed_bytes(4)
    assert stage.session_bytes(64, 0, 3) == stage.session_bytes(4096, 0, 3) == 3 * linear.fixed_bytes(4)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_stacked_sessions_equal_their_solo_runs(folders, name):
    """8 sessions of different lengths join two at a time: every stacked step mixes prefills with
    decodes, each session folding its own rows into its own state."""
    stage = Stage.load(folders[name], embed=True, head=True)
    solo = [solo_run(stage, prompt, STACKED_STEPS) for prompt in STACKED_PROMPTS]
    for i in range(len(STACKED_PROMPTS)):
        stage.open(("s", i), capacity=64)
    tokens: list[list[int]] = [[] for _ in STACKED_PROMPTS]
    pending: dict[int, torch.Tensor] = {}
    worst = 0.0
    for step in range(STACKED_STEPS + len(STACKED_PROMPTS) // 2):
        for i in (2 * step, 2 * step + 1):
            if i < len(STACKED_PROMPTS):
                pending[i] = stage.embed(STACKED_PROMPTS[i])
        order = sorted(pending)
        starts = [0 if not tokens[i] else len(STACKED_PROMPTS[i]) + len(tokens[i]) - 1 for i in order]
        outs = stage.forward_batch([(("s", i), pending[i], start) for i, start in zip(order, starts)])
        for i, out in zip(order, outs):
            row = stage.logits(out[-1:])
            worst = max(worst, relative_gap(row, solo[i][1][len(tokens[i])]))
            tokens[i].append(int(row.argmax()))
            if len(tokens[i]) < STACKED_STEPS:
                pending[i] = stage.embed(tokens[i][-1:])
            else:
                del pending[i]
    assert tokens == [t for t, _ in solo]
    assert worst <= HYBRID_STACKED_RTOL, f"{name}: stacked vs solo {worst:.3g}"


def states(stage: Stage, session: str) -> list[torch.Tensor]:
    return [store.state for store in stage.sessions[session].cache.layers if isinstance(store, RecurrentState)]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_whole_chunked_and_replayed_prefills_meet_one_reference(folders, references, name):
    """transformers' run (a prefill, then one token a step) is the reference: ours fed the same tokens
    as one prefill or as chunks of 5 and 7 gives its logits to 1e-4. A replacement is fed the whole
    history in one step (the chunk-wise form of the recurrence where the run folded decoded tokens
    in one at a time: transformers' own two runs differ by up to 4e-4 here): its logits are
    transformers' for that one step, to 1e-4; its recurrent states are the uninterrupted ones, to
    1e-4; and it goes on to the same greedy tokens."""
    tokens, ref = references[name]
    history = PROMPT + tokens[:-1]  # every token the reference fed, prompt and decoded
    stage = Stage.load(folders[name], embed=True, head=True)
    want = [r[-1:] for r in ref]  # the reference's last row of every step
    last = {}
    for how, cuts in (("whole", [len(PROMPT)]), ("chunked", [5, len(PROMPT)])):
        stage.open(how, capacity=64)
        at = 0
        for cut in cuts:
            out = stage.forward(how, stage.embed(PROMPT[at:cut]), at)
            at = cut
        rows = [stage.logits(out[-1:])]
        for i, token in enumerate(tokens[:-1]):  # then decode, as the reference did
            rows.append(stage.logits(stage.forward(how, stage.embed([token]), len(PROMPT) + i)))
        worst = max(float((a - b).abs().max()) for a, b in zip(rows, want))
        assert worst <= TOLERANCE, f"{name} {how}: {worst:.3g}"
        last[how] = rows[-1]
    stage.open("replayed", capacity=64)
    replayed = stage.logits(stage.forward("replayed", stage.embed(history), 0))
    last["replayed"] = replayed[-1:]
    model = transformers.AutoModelForCausalLM.from_pretrained(folders[name], dtype=torch.float32).eval()
    with torch.inference_mode():
        one_step = model(torch.tensor([history])).logits[0]
    assert float((replayed - one_step).abs().max()) <= TOLERANCE
    uninterrupted = states(stage, "whole")
    for how in ("chunked", "replayed"):
        assert max(float((a - b).abs().max()) for a, b in zip(states(stage, how), uninterrupted)) <= 1e-4, how
    went_on = {}
    for session in ("whole", "replayed"):  # and on from there, greedily, the same tokens
        row, seq = last[session], []
        for step in range(4):
            seq.append(int(row[-1].argmax()))
            row = stage.logits(stage.forward(session, stage.embed(seq[-1:]), len(history) + step))
        went_on[session] = seq
    assert went_on["whole"] == went_on["replayed"]


def test_speculative_blocks_roll_back_and_a_deeper_rollback_is_refused(folders, references):
    """Blocks of 3 drafts verified in one pass, every other one cut short: the next block starts
    inside the last, and the state goes back to it (its checkpoint, the accepted tokens folded in
    again). The tokens are the reference's. Going back past the kept checkpoints is refused with
    one line and moves nothing; going back to 0 starts afresh."""
    from tessera.stages.decoding.speculative import greedy_accept

    folder, want = folders["qwen3_next"], until_eos(references["qwen3_next"][0])
    stage = Stage.load(folder, embed=True, head=True)
    stage.open("spec", capacity=64)
    seq = PROMPT + [int(stage.logits(stage.forward("spec", stage.embed(PROMPT), 0))[-1].argmax())]
    cuts = blocks = 0
    while len(seq) - len(PROMPT) < len(want):
        done = len(seq) - len(PROMPT)
        draft = list(want[done : done + 3])
        if blocks % 2:
            draft[-1] = (draft[-1] + 1) % VOCAB
        at = len(seq) - 1
        rows = stage.logits(stage.forward("spec", stage.embed([seq[-1], *draft]), at))
        kept, token = greedy_accept(rows, draft)
        assert token is not None
        cuts += kept < len(draft)
        blocks += 1
        seq += draft[:kept] + [token]
    assert seq[len(PROMPT):][: len(want)] == want and cuts > 0
    # a prefill chunk longer than REPLAY_TOKENS keeps no inputs, and 17 one-token steps fill a run and
    # start another: position 10, inside the chunk, is out of reach
    stage.open("deep", capacity=64)
    stage.forward("deep", stage.embed(list(range(5, 5 + REPLAY_TOKENS + 4))), 0)
    for position in range(REPLAY_TOKENS + 4, 2 * REPLAY_TOKENS + 5):
        stage.forward("deep", stage.embed([7]), position)
    position = stage.position("deep")
    with pytest.raises(StateRewindError, match="cannot go back to position 10") as refused:
        stage.rollback("deep", 10)
    assert "\n" not in str(refused.value) and stage.position("deep") == position
    with pytest.raises(StateRewindError):  # a step written there is refused alike, before anything moves
        stage.forward("deep", stage.embed([1]), 10)
    assert stage.position("deep") == position
    stage.rollback("spec", 0)
    again = stage.logits(stage.forward("spec", stage.embed(PROMPT), 0))[-1]
    assert int(again.argmax()) == want[0]


def test_going_back_inside_a_block_equals_never_having_gone_past_it(folders):
    """A state taken back into a block (its checkpoint, then the accepted tokens' inputs folded in
    again) equals the state of a session that stopped there, to 1e-4."""
    stage = Stage.load(folders["qwen3_5_moe"], embed=True, head=True)
    block = [11, 12, 13, 14, 15]
    for session in ("back", "straight"):
        stage.open(session, capacity=64)
        stage.forward(session, stage.embed(PROMPT), 0)
    stage.forward("back", stage.embed(block), len(PROMPT))
    stage.forward("back", stage.embed([40, 41]), len(PROMPT) + 5)  # a second block after it
    back = stage.logits(stage.forward("back", stage.embed([99]), len(PROMPT) + 2))  # into the first block
    straight = stage.logits(stage.forward("straight", stage.embed([*block[:2], 99]), len(PROMPT)))[-1:]
    assert float((back - straight).abs().max()) <= TOLERANCE
    assert max(float((a - b).abs().max()) for a, b in zip(states(stage, "back"), states(stage, "straight"))) <= 1e-4


def test_a_tensor_shard_rank_is_refused_at_start_with_one_line(folders):
    check_shard_refused(folders["qwen3_5"], "layer 0 is Gated DeltaNet linear attention")


# -- reading configs ---------------------------------------------------------------------------------

def saved(name: str) -> dict:
    config = CONFIGS[name]()
    data = json.loads(json.dumps(config.to_dict()))
    data["architectures"] = [{"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5": "Qwen3_5ForConditionalGeneration",
                              "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}[name]]
    return data


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_what_we_write_reads_back(name):
    spec = spec_from_config(saved(name))
    assert spec.family == name
    assert spec_from_config(to_config(spec)) == spec


def with_text(config: dict, **change) -> dict:
    """`config` with `change` applied where its text model's keys lie."""
    if "text_config" in config:
        return {**config, "text_config": {**config["text_config"], **change}}
    return {**config, **change}


@pytest.mark.parametrize(
    "name, change, words",
    [
        ("qwen3_next", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ("qwen3_5", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ("qwen3_next", {"attn_output_gate": False}, "attn_output_gate False"),
        ("qwen3_next", {"use_sliding_window": True}, "use_sliding_window True"),
        ("qwen3_next", {"sliding_window": 8}, "sliding_window 8"),
        ("qwen3_5_moe", {"layer_types": ["linear_attention"] * 3 + ["sliding_attention"]}, "layer_types"),
        ("qwen3_next", {"layer_types": [{}] * 4}, "layer_types"),
        ("qwen3_5_moe", {"norm_topk_prob": False}, "'norm_topk_prob'"),  # always renormalised here
        ("qwen3_5_moe", {"num_experts": 0}, "num_experts 0"),
        ("qwen3_5", {"num_experts": 8}, "'num_experts'"),  # the dense family: not silently dropped
        ("qwen3_5", {"linear_conv_bias": True}, "'linear_conv_bias'"),
        ("qwen3_next", {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                                "activation_scheme": "dynamic"}}, "ship quantized"),
        ("qwen3_next", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "dynamic"),
    ],
)
def test_values_the_engine_does_not_compute_are_refused_by_name(name, change, words):
    with pytest.raises(UnsupportedModel, match=words) as refused:
        spec_from_config(with_text(saved(name), **change))
    assert "\n" not in str(refused.value)


def test_a_multimodal_config_reads_its_text_model_and_refuses_what_it_cannot():
    config = saved("qwen3_5")
    with pytest.raises(UnsupportedModel, match="'speech_config'"):
        spec_from_config({**config, "speech_config": {}})
    with pytest.raises(UnsupportedModel, match="tie_word_embeddings"):
        spec_from_config({**config, "tie_word_embeddings": True})
    with pytest.raises(ModelFormatError, match="text_config"):
        spec_from_config({**config, "text_config": [1]})
    both = {**with_text(config, bos_token_id=1, eos_token_id=2), "bos_token_id": 1, "eos_token_id": [2, 3]}
    assert (spec_from_config(both).bos_token_id, spec_from_config(both).eos_token_ids) == (1, (2,))  # the text's
    top_only = {**with_text(config, eos_token_id=None), "eos_token_id": [2, 3]}
    assert spec_from_config(top_only).eos_token_ids == (2, 3)  # the top level's, where the text says none
    mrope = with_text(config, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25,
                                               "mrope_section": [1, 1, 0], "mrope_interleaved": True})
    assert spec_from_config(mrope) == spec_from_config(config)  # text positions: M-RoPE is RoPE
    with pytest.raises(ModelFormatError, match="mrope_section"):
        spec_from_config(with_text(config, rope_parameters={"rope_type": "default", "mrope_section": "x"}))


@pytest.mark.parametrize("name, change, words", [
    ("qwen3_next", {"linear_num_value_heads": 3}, "linear_num_value_heads"),  # not a multiple of the key heads
    ("qwen3_next", {"linear_conv_kernel_dim": 0}, "linear_conv_kernel_dim"),
    ("qwen3_5", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.0}},
     "partial_rotary_factor"),
])
def test_impossible_values_are_format_errors(name, change, words):
    with pytest.raises(ModelFormatError, match=words):
        spec_from_config(with_text(saved(name), **change))


def test_the_compiled_decode_step_runs_full_attention_compiled_and_linear_layers_eagerly(folders, references):
    """Under `--compile inductor` the gated full-attention layers and the head decode compiled; the
    Gated DeltaNet layers decode eagerly inside the compiled step (no compiled form for a recurrent
    state yet), said once per layer kind; logits are transformers' to 1e-4 and tokens identical."""
    from tessera.stages.engine.compiled.build import compile_decode
    from tessera.stages.engine.compiled.inductor import HEAD

    folder = folders["qwen3_next"]
    stage, said = Stage.load(folder, embed=True, head=True), []
    compile_decode(stage, "inductor", say=said.append, buckets=(1,))
    runner = stage.decode
    linear = {kind for kind in stage.spec.layers if kind.attention.kind == "gated_deltanet"}
    assert set(runner.eager) == linear and runner.compiled == set(stage.spec.layers) - linear | {HEAD}, said
    assert all("gated_deltanet attention" in why for why in runner.eager.values())
    tokens, ref = references["qwen3_next"]
    stage.open("c", capacity=len(PROMPT) + len(tokens) + 1)
    before, rows, step, pos = runner.steps, [], PROMPT, 0
    for token in tokens:
        rows.append(stage.logits(stage.forward("c", stage.embed(step), pos))[-1:])
        pos, step = pos + len(step), [token]
    assert runner.steps - before == len(tokens) - 1  # every decode step through the compiled runner
    assert max(float((a - b[-1:]).abs().max()) for a, b in zip(rows, ref)) <= TOLERANCE
    assert [int(r.argmax()) for r in rows] == tokens


def test_an_int8_span_matches_its_dequantized_reference_and_holds_what_placement_counts(folders):
    """The in- and out-projections of the linear layers are stored as integers like any matrix; the
    convolution, the decays and the norms stay float."""
    from tessera.stages.weights.quant import Int8Linear, Quant, span_bytes

    from .conformance import check_against_dequantized

    folder, quant = folders["qwen3_5_moe"], Quant.parse("int8")
    stage = Stage.load(folder, quant=quant)
    assert stage.weight_bytes == span_bytes(stage.spec, 0, 4, 4, quant)
    assert isinstance(stage.blocks[0].attn.w_in, Int8Linear) and stage.blocks[0].attn.conv.dtype == torch.float32
    check_against_dequantized(folder, stage)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_any_value_in_any_key_is_read_or_refused_by_one_typed_error(name):
    """Keys overwritten at random by JSON values (the text model's keys, in a multimodal config):
    a spec every layer of which builds, or ModelFormatError / UnsupportedModel in one line."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tessera.stages.layers.block import Block

    base = saved(name)
    text = base.get("text_config", base)
    values = st.recursive(
        st.none() | st.booleans() | st.integers(-3, 40) | st.floats(allow_nan=True, allow_infinity=True)
        | st.text(max_size=4),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
        max_leaves=6)

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(data=st.data())
    def check(data):
        keys = data.draw(st.lists(st.sampled_from(sorted(set(text) - {"architectures"})), min_size=1, max_size=3))
        change = {key: data.draw(values) for key in keys}
        try:
            spec = spec_from_config(with_text(base, **change))
        except (ModelFormatError, UnsupportedModel) as refused:
            assert "\n" not in str(refused)
            return
        with torch.device("meta"):
            for layer in set(spec.layers):
                Block(spec, layer)

    check()
