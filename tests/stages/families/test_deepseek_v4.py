"""DeepSeek-V4 (`deepseek_v4`): what only it has beyond the conformance suite (test_conformance.py's
rows hold it to transformers, stacked, chunked, split after its hash layers, rolled back, through a
real swarm, and its refusals; two indexer heads among the rows): its session state going back by
a pointer as far as its rings reach, to a long step's start, and no further (refused, then replayed
from 0); the bytes a session holds against what admission charges, and the published model's per
position; the hop (its streams and token ids, exact in every float a peer sends; the fp8 wire form
refused); the indexer's selection and the hash table each changing the answer; DeepSeek's
published names and its MTP tensors; parameters counted as transformers builds them; any config
value read or refused by one typed error."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from tessera.protocol.tensors import decode_tensor, encode_wire
from tessera.stages.assembly.stage import load_stage
from tessera.stages.errors import StateRewindError
from tessera.stages.families.catalog import spec_from_config
from tessera.stages.families.spec.compressed import COMPRESSED_REACH, CompressedAttentionSpec
from tessera.stages.layers.cache import SessionCache, session_bytes
from tessera.stages.layers.hop import Hop
from tessera.stages.weights.folder import WeightFolder
from tessera.stages.weights.folder_check import check_folder

from .conformance import PROMPT, STACKED_RTOL, check_any_value_is_read_or_refused, fed_logits, relative_gap
from .rows import ROWS, saved_config

transformers = pytest.importorskip("transformers")

MIXED, TIES = "deepseek_v4/csa-hca-hash-fused", "deepseek_v4/two-index-heads-published"
NAMES = (MIXED, TIES)
# DeepSeek-V4-Flash as DeepseekV4Config defaults to it (its checkpoint, deepseek-ai/DeepSeek-V4-Flash-Base)
FLASH = {**transformers.DeepseekV4Config().to_dict(), "architectures": ["DeepseekV4ForCausalLM"]}


def decode(stage, session: str, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens from `prompt` one step at a time, and the logits of every step ([P, V], then [1, V])."""
    rows = [stage.logits(stage.forward(session, stage.embed(prompt), 0))]
    tokens = [int(rows[-1][-1].argmax())]
    for _ in range(steps - 1):
        rows.append(stage.logits(stage.forward(session, stage.embed(tokens[-1:]), len(prompt) + len(tokens) - 1)))
        tokens.append(int(rows[-1][-1].argmax()))
    return tokens, rows


@pytest.mark.parametrize("name", NAMES)
def test_a_rollback_within_the_reach_is_a_pointer_move_and_further_is_refused_then_replayed(family_models, name):
    stage = load_stage(family_models.folder(name), embed=True, head=True)
    stage.open("s", capacity=128)
    tokens, rows = decode(stage, "s", PROMPT, 60)
    end = stage.position("s")
    near = end - 5  # inside the rings: the rows a step from there reads are still held
    stage.rollback("s", near)
    again = stage.logits(stage.forward("s", stage.embed([tokens[near - len(PROMPT)]]), near))
    assert torch.equal(again, rows[near - len(PROMPT) + 1])
    far = len(PROMPT)  # 60 positions back: past the window (8) and the reach
    assert end - far > COMPRESSED_REACH + 8
    with pytest.raises(StateRewindError, match=f"cannot go back to position {far}") as refused:
        stage.rollback("s", far)
    assert "\n" not in str(refused.value)
    assert stage.position("s") == near + 1  # nothing moved
    stage.rollback("s", 0)  # always reachable: the history replayed from there
    replayed = stage.logits(stage.forward("s", stage.embed(PROMPT), 0))
    assert torch.equal(replayed, rows[0])


def test_a_long_steps_start_is_kept_and_nothing_inside_it(family_models):
    """A step longer than the reach keeps a snapshot of what a step from its start reads: going back there
    is a pointer move and gives the same answer; a position inside it the rings no longer hold is refused."""
    stage = load_stage(family_models.folder(MIXED), embed=True, head=True)
    stage.open("s", capacity=128)
    long = list(range(10, 10 + COMPRESSED_REACH + 8))
    stage.forward("s", stage.embed(PROMPT[:4]), 0)
    first = stage.logits(stage.forward("s", stage.embed(long), 4))
    for i in range(5):
        stage.forward("s", stage.embed([7 + i]), 4 + len(long) + i)
    with pytest.raises(StateRewindError, match="cannot go back to position 10"):
        stage.rollback("s", 10)
    stage.rollback("s", 4)
    assert torch.equal(stage.logits(stage.forward("s", stage.embed(long), 4)), first)


def test_a_session_holds_what_admission_charges(family_models):
    """Every layer's store, grown to a session's positions and holding every snapshot it keeps, is what
    `session_bytes` charges (a peer's admission) less one compressed entry per layer (the rounding the
    charge keeps: its per-position bytes are rounded up)."""
    stage = load_stage(family_models.folder(MIXED), embed=True, head=True)
    specs = stage.cache_specs(stage.start, stage.end)
    stage.open("s", capacity=512)
    # long steps: the two starts past 0 are kept (snapshots), each where the most open projections are
    # (a position before a window closes: 3 of the CSA's overlapping windows of 2, 3 of the HCA's of 4)
    for start, end in ((0, 103), (103, 203), (203, 303)):
        stage.forward("s", stage.embed([3 + i % 200 for i in range(start, end)]), start)
    cache: SessionCache = stage.sessions["s"].cache
    assert [len(store.snapshots) for store in cache.layers] == [2] * len(specs)
    rounding = sum(s.entry_width * 4 for s in specs if s.ratio)
    assert session_bytes(specs, cache.allocated, 4) == cache.nbytes + rounding


def test_the_published_models_state_per_position():
    """DeepSeek-V4-Flash: a compressed sparse layer holds (512 + 128) values every 4 positions, a heavily
    compressed one 512 every 128, a window-only one nothing per position (its window is fixed)."""
    spec = spec_from_config(FLASH)
    per_position = {}
    for layer in spec.layers:
        at = layer.attention
        assert isinstance(at, CompressedAttentionSpec)
        per_position[(at.ratio, at.indexed)] = layer.cache.bytes_per_position(2)
    assert per_position[(4, True)] == (512 + 128) * 2 // 4  # 160 values: MLA's latent is 576
    assert per_position[(128, False)] == 512 * 2 // 128
    # the streams and the id's digits cross into every layer alike: the hop is as wide at every cut
    assert {spec.hop_width(layer) for layer in range(spec.num_layers + 1)} == {4 * 4096 + 3}
    assert spec.hop_bytes(0, 2) == 2 * (4 * 4096 + 3)


@pytest.mark.parametrize("config", [FLASH, *(saved_config(name) for name in NAMES)], ids=["flash", *NAMES])
def test_parameters_are_counted_as_transformers_builds_them(config):
    """`ModelSpec.param_count` (what placement and folder checks count) equals the parameters and saved
    buffers (the hash tables, the correction biases) of transformers' model of the config."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.DeepseekV4Config(**{
            k: v for k, v in config.items() if k != "architectures"}))
    saved = model.state_dict()
    count = sum(p.numel() for p in model.parameters()) + sum(
        b.numel() for name, b in model.named_buffers() if name in saved)
    assert spec_from_config(config).param_count == count


@given(ids=st.lists(st.integers(0, FLASH["vocab_size"] - 1), min_size=1, max_size=16),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_a_hop_carries_its_token_ids_exactly_in_any_float(ids, dtype):
    spec = spec_from_config(FLASH)
    hop = Hop(spec)
    ids_t = torch.tensor(ids)
    packed = hop.from_embedding(torch.randn(len(ids), spec.hidden_size), ids_t)
    assert packed.shape == (len(ids), spec.hop_width(0))
    residual, back, per_layer = hop.split(packed.to(dtype))
    assert residual.shape == (len(ids), 4, spec.hidden_size) and torch.equal(back, ids_t) and per_layer is None
    encoded, _ = encode_wire(packed, "bfloat16")  # a requester's compact wire form
    assert torch.equal(hop.split(decode_tensor(encoded))[1], ids_t)
    encoded, _ = encode_wire(packed, "fp8")  # rounds digits away: refused for such a model (below)
    assert hop.split(decode_tensor(encoded))[1].shape == ids_t.shape


def test_one_hop_carries_streams_token_ids_and_the_per_layer_inputs_still_to_run():
    """The hop is one notion (stages/layers/hop.py): V4-Flash's streams and digits with per-layer inputs
    of 8 a layer added (no family has all three; the columns compose): the width into layer l drops by 8
    a layer run, a stage's layers peel their inputs off the front, and split and join are inverse."""
    flash = spec_from_config(FLASH)
    spec = replace(flash, layers=tuple(replace(layer, per_layer_input=8) for layer in flash.layers),
                   per_layer_vocab=flash.vocab_size)
    base, n = 4 * 4096 + 3, spec.num_layers
    assert [spec.hop_width(layer) for layer in (0, 1, n)] == [base + 8 * n, base + 8 * (n - 1), base]
    hop, ids = Hop(spec), torch.tensor([5, 129_279, 0])
    per_layer = torch.randn(3, 8 * n)
    packed = hop.from_embedding(torch.randn(3, spec.hidden_size), ids, per_layer)
    assert packed.shape == (3, spec.hop_width(0))
    residual, back, inputs = hop.split(packed)
    assert residual.shape == (3, 4, 4096) and torch.equal(back, ids) and torch.equal(inputs, per_layer)
    after_one = hop.join(hop.split(packed)._replace(per_layer=inputs[:, 8:]))  # what layer 0 hands on
    assert after_one.shape == (3, spec.hop_width(1)) and torch.equal(after_one[:, :base], packed[:, :base])
    assert torch.equal(hop.join(hop.split(after_one)), after_one)


def test_the_fp8_wire_form_is_refused_for_a_model_whose_hops_carry_token_ids(family_models):
    from tessera.peer.request.client import Swarm

    with pytest.raises(ValueError, match="fp8 wire form rounds away the token ids") as refused:
        Swarm(None, None, identity=None, folder=family_models.folder(MIXED), wire="fp8")  # refused before any I/O
    assert "\n" not in str(refused.value)


def test_the_selection_and_the_hash_table_each_change_the_answer(family_models):
    """With a top-k past the context every entry is read, and with the hash table rolled every token takes
    other experts: either moves the logits far past the tolerance, so the runs against transformers hold
    both (and the streams they travel in) to it."""
    folder = family_models.folder(MIXED)
    tokens, want = family_models.reference(MIXED)

    def logits(change) -> list[torch.Tensor]:
        stage = load_stage(folder, embed=True, head=True)
        for block in stage.blocks:
            change(block)
        return fed_logits(stage, tokens)

    def read_all(block):
        block.attn.spec = replace(block.attn.spec, index_topk=10**6)

    def roll_table(block):
        if block.by_token:
            block.mlp.router.table = block.mlp.router.table.roll(1, dims=0)

    for change in (read_all, roll_table):
        worst = max(float((a - b).abs().max()) for a, b in zip(want, logits(change)))
        assert worst > 100 * 1e-4, f"{change.__name__}: {worst:.3g}"


def test_deepseeks_published_names_and_its_mtp_tensors(family_models, tmp_path):
    """A folder as DeepSeek publishes it (`layers.{i}.attn.wq_a`, `embed.weight`, `head.weight`,
    `hc_head_fn`: the save_original_format names without `model.`) with its multi-token-prediction layer
    (`mtp.0.*`) passes the folder check, gives the same logits, and its MTP tensors read by name."""
    source = family_models.folder(TIES)
    state = load_file(source / "model.safetensors")
    edges = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
             "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
             "model.hc_head.hc_scale": "hc_head_scale"}
    published = {edges.get(k, k.removeprefix("model.")): v for k, v in state.items()}
    assert "head.weight" in published and "layers.0.attn.wq_a.weight" in published
    mtp = {k.replace("layers.3.", "mtp.0.", 1): v.clone() for k, v in published.items() if k.startswith("layers.3.")}
    folder = tmp_path / "published"
    folder.mkdir()
    save_file({**published, **mtp}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (folder / name).write_bytes((source / name).read_bytes())
    check_folder(folder)
    ids = PROMPT + [40, 41, 42]
    runs = []
    for path in (source, folder):
        stage = load_stage(path, embed=True, head=True)
        stage.open("p", capacity=32)
        runs.append(stage.logits(stage.forward("p", stage.embed(ids), 0)))
    assert torch.equal(runs[0], runs[1])
    name = "mtp.0.attn.wq_a.weight"
    read = WeightFolder(folder).read({name: tuple(mtp[name].shape)}, torch.float32)[name]
    assert torch.equal(read, mtp[name])


@pytest.mark.parametrize("name", NAMES)
def test_chunked_and_stacked_runs_close_the_same_entries(family_models, name):
    """A prompt fed a token at a time closes every compressed window in its own step: the same logits
    as fed whole (within the stacked bound), so entries depend on positions, never on how steps cut them."""
    stage = load_stage(family_models.folder(name), embed=True, head=True)
    stage.open("whole", capacity=64)
    stage.open("stepped", capacity=64)
    whole = stage.logits(stage.forward("whole", stage.embed(PROMPT), 0))
    stepped = torch.cat([stage.logits(stage.forward("stepped", stage.embed([t]), i)) for i, t in enumerate(PROMPT)])
    assert relative_gap(stepped, whole) <= STACKED_RTOL


@pytest.mark.parametrize("name", NAMES)
def test_any_value_in_any_key_is_read_or_refused_by_one_typed_error(name):
    """Keys overwritten at random by JSON values: a spec every layer of which builds, or ModelFormatError /
    UnsupportedModel in one line."""
    check_any_value_is_read_or_refused(saved_config(name), examples=80)


def test_rows_cover_every_layer_type_and_both_scores():
    kinds = {(a.ratio > 0, a.indexed) for name in NAMES for layer in spec_from_config(saved_config(name)).layers
             for a in [layer.attention]}
    assert kinds == {(False, False), (True, True), (True, False)}
    scores = {spec_from_config(saved_config(name)).layers[-1].mlp.router.kind for name in NAMES}
    assert scores == {"sqrtsoftplus_topk", "sigmoid_group_topk"}
    assert all(ROWS[name].family == "deepseek_v4" for name in NAMES)


def test_a_quantized_span_matches_its_dequantized_reference(family_models):
    """int8 query, key-value and output projections and experts; the grouped output block, the compressors,
    the indexer, the hyper-connections, the routers and the hash table stay as read."""
    from tessera.stages.kernels.quant import Int8Linear, Quant

    from .conformance import check_against_dequantized

    folder = family_models.folder(MIXED)
    stage = load_stage(folder, quant=Quant.parse("int8"))
    block = stage.blocks[1]
    assert all(isinstance(m, Int8Linear) for m in (block.attn.wq_b, block.attn.wkv, block.mlp.shared.w_down))
    assert block.attn.compressor.wkv.dtype == torch.float32 and block.attn.wo_a.dtype == torch.float32
    assert stage.blocks[0].mlp.router.table.dtype == torch.int64
    check_against_dequantized(folder, stage)
