"""Every family, one suite: each row of rows.py (a family's configuration, a tiny random model that
transformers builds and saves) against transformers and against itself.

Per row: float32 logits within 1e-4 of transformers and greedy tokens identical; 8 stacked
sessions each equal to its solo run; a prompt prefilled in chunks equal to it prefilled whole; the
model split across two stages exactly equal to it whole; decoding by drafts rolled back by pointer;
where the layers keep a recurrent state, a prefill whole, in chunks and replayed at once against
transformers, a state taken back into a block, and a rollback past the checkpoints refused;
the spec read back from what we write (`read(to_config(spec)) == spec`); the layer's weight
matrices as the weights name them (families/tensors.py `matrix_paths`) exactly the Block's linear
modules; every config key the family does not read refused in one line naming it (a key no family
has, and each key other families' configs carry that this one does not read), and the family's own
refusals (rows.py); a tensor-shard rank refused in one line where the family's layers do not split.
For one row per family, a real 2-peer swarm split mid-model, plain and speculative.
"""

from __future__ import annotations

import json

import pytest
import torch

from tessera.stages.errors import ModelFormatError, UnsupportedModel
from tessera.stages.families.catalog import FAMILIES, layer_matrices, spec_from_config, spec_from_file, to_config
from tessera.stages.families.config import IGNORED_KEYS, ConfigReader
from tessera.stages.layers.block import Block, linear_paths

from ...swarm_helpers import local_swarm
from .conformance import (
    check_back_inside_a_block, check_chunked_prefill, check_matches_transformers, check_out_of_reach_refused,
    check_replayed_prefill, check_rollback, check_shard_refused, check_split, check_stacked_sessions, check_swarm,
)
from .rows import ROWS, saved_config

transformers = pytest.importorskip("transformers")

NAMES = sorted(ROWS)
SWARM_ROWS = sorted(name for name, row in ROWS.items() if row.swarm)
# the rows whose models hold a recurrent state (linear attention, state-space): read from their specs, so a
# family with a recurrent layer kind runs the recurrent checks without being named here
RECURRENT_ROWS = [name for name in NAMES
                  if any(layer.cache.kind == "recurrent" for layer in spec_from_config(saved_config(name)).layers)]
UNKNOWN_KEY = "tessera_test_switch"  # a key no family's config carries


def test_every_family_has_rows_and_one_swarm():
    """A family added to the catalog without a row here runs none of these checks: refused."""
    assert {row.family for row in ROWS.values()} == set(FAMILIES)
    swarmed = [ROWS[name].family for name in SWARM_ROWS]
    assert sorted(swarmed) == sorted(set(swarmed))  # one real swarm per family at most: they are slow
    assert set(swarmed) >= set(FAMILIES) - {"llama", "mistral", "qwen2"}  # tests/stages/test_model_conformance.py's


@pytest.mark.parametrize("name", NAMES)
def test_matches_transformers(family_models, name):
    check_matches_transformers(family_models.folder(name), family_models.reference(name))


@pytest.mark.parametrize("name", NAMES)
def test_stacked_sessions_equal_their_solo_runs(family_models, name):
    check_stacked_sessions(family_models.folder(name))


@pytest.mark.parametrize("name", NAMES)
def test_a_prefill_in_chunks_equals_it_whole(family_models, name):
    check_chunked_prefill(family_models.folder(name))


@pytest.mark.parametrize("name", NAMES)
def test_a_split_across_two_stages_equals_the_whole(family_models, name):
    check_split(family_models.folder(name), ROWS[name].split)


@pytest.mark.parametrize("name", NAMES)
def test_rollback_by_pointer(family_models, name):
    check_rollback(family_models.folder(name), family_models.reference(name)[0])


def test_every_family_with_a_recurrent_state_has_recurrent_rows():
    """The recurrent checks below run on every family whose layers keep a recurrent state."""
    assert {ROWS[name].family for name in RECURRENT_ROWS} == {
        "qwen3_next", "qwen3_5", "qwen3_5_moe", "kimi_linear", "nemotron_h"}


@pytest.mark.parametrize("name", RECURRENT_ROWS)
def test_whole_chunked_and_replayed_prefills_meet_one_reference(family_models, name):
    check_replayed_prefill(family_models.folder(name), family_models.reference(name))


@pytest.mark.parametrize("name", RECURRENT_ROWS)
def test_going_back_inside_a_block_equals_never_having_gone_past_it(family_models, name):
    check_back_inside_a_block(family_models.folder(name))


@pytest.mark.parametrize("name", RECURRENT_ROWS)
def test_going_back_past_the_checkpoints_is_refused_and_moves_nothing(family_models, name):
    check_out_of_reach_refused(family_models.folder(name))


@pytest.mark.parametrize("name", NAMES)
def test_the_spec_reads_back_from_what_we_write(name):
    spec = spec_from_config(saved_config(name))
    assert spec.family == ROWS[name].family
    assert spec_from_config(to_config(spec)) == spec
    assert spec_from_config(json.loads(json.dumps(to_config(spec)))) == spec  # as a file holds it


@pytest.mark.parametrize("name", NAMES)
def test_the_weights_name_exactly_the_blocks_matrices(name):
    """What the weights read as a layer's matrices (from tensor names: quantized, or kept as shipped) is
    what the layer's modules multiply by: no Block module left without a matrix, none read for nothing."""
    spec = spec_from_config(saved_config(name))
    for layer in range(spec.num_layers):
        with torch.device("meta"):
            block = Block(spec, spec.layers[layer])
        assert sorted(layer_matrices(spec, layer)) == sorted(linear_paths(block))


@pytest.mark.parametrize("name", NAMES)
def test_a_key_the_family_does_not_read_is_refused_by_name(name):
    """A key no family has, and each key another row's saved config carries that this family does not
    read (another family's switch: `n_group`, `use_qk_norm`, `rotary_dim` ...; but those of
    families/config.py IGNORED_KEYS, which change no arithmetic), is refused in one line naming it:
    never silently dropped."""
    config = saved_config(name)
    reader = ConfigReader(config, ROWS[name].family)
    FAMILIES[ROWS[name].family].read(reader)
    others = {key: value for other in NAMES if ROWS[other].family != ROWS[name].family
              for key, value in saved_config(other).items() if key not in config and value is not None}
    unread = {key: value for key, value in others.items() if key not in reader.read and key not in IGNORED_KEYS}
    assert unread, "the other rows carry no key this family does not read: the check below holds nothing"
    for key, value in [(UNKNOWN_KEY, 2), *sorted(unread.items())]:
        with pytest.raises(UnsupportedModel, match=f"config key '{key}' .* is not one tessera knows") as refused:
            spec_from_config({**config, key: value})
        assert "\n" not in str(refused.value)


@pytest.mark.parametrize("name, change, error, words", [
    (name, change, error, words) for name in NAMES for change, error, words in ROWS[name].refusals])
def test_what_the_family_does_not_compute_is_refused_by_name(name, change, error, words):
    with pytest.raises(error, match=words) as refused:
        spec_from_config({**saved_config(name), **change})
    assert "\n" not in str(refused.value)
    assert issubclass(error, (ModelFormatError, UnsupportedModel))


@pytest.mark.parametrize("name", [name for name in NAMES if ROWS[name].shard is not None])
def test_a_tensor_shard_rank_is_refused_at_start_with_one_line(family_models, name):
    check_shard_refused(family_models.folder(name), ROWS[name].shard)


@pytest.mark.parametrize("name", NAMES)
def test_the_folder_reads_as_the_row_says(family_models, name):
    """The saved folder's spec is the config's (transformers writes what it was given)."""
    assert spec_from_file(family_models.folder(name) / "config.json") == spec_from_config(saved_config(name))


@pytest.fixture(scope="module", params=SWARM_ROWS)
def swarm(request, family_models):
    """A real 2-peer swarm over the row's model, split at the row's `split`."""
    name = request.param
    with local_swarm(list(ROWS[name].spans), model=str(family_models.folder(name))) as procs:
        yield name, procs


@pytest.mark.slow
async def test_a_two_peer_swarm_matches_transformers(swarm, family_models):
    name, procs = swarm
    await check_swarm(procs, family_models.folder(name), family_models.reference(name)[0])
