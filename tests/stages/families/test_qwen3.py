"""Qwen3 (`qwen3`): per-head q/k RMSNorm; sliding-window layers among full ones; attention bias
on q, k, v and the output. Against transformers, stacked, rolled back, and through a swarm."""

from __future__ import annotations

import pytest

from ...swarm_helpers import local_swarm
from .conformance import (
    DECODE_STEPS, PROMPT, SHAPE, build, check_matches_transformers, check_rollback, check_stacked_sessions, check_swarm,
    reference_run,
)

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "tied": dict(tie_word_embeddings=True, intermediate_size=96),
    # layer 0 full, layers 1 and 2 within 8 positions (shorter than the prompt); biases everywhere
    "window-bias": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1, attention_bias=True,
                        intermediate_size=96),
}
SWARM = "window-bias"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3")
    return {name: build(root, name, transformers.Qwen3Config(**SHAPE, **extra), seed=i)
            for i, (name, extra) in enumerate(CONFIGS.items())}


@pytest.fixture(scope="module")
def references(folders):
    """transformers' greedy tokens and logits for each configuration."""
    return {name: reference_run(folder) for name, folder in folders.items()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_transformers(folders, references, name):
    check_matches_transformers(folders[name], references[name])


def test_the_window_and_the_norms_are_read_per_layer(folders):
    from tessera.stages.families.catalog import spec_from_file

    spec = spec_from_file(folders["window-bias"] / "config.json")
    assert [layer.attention.window for layer in spec.layers] == [None, 8, 8]
    assert all(layer.attention.qk_norm and layer.attention.o_bias for layer in spec.layers)
    assert [layer.cache.kind for layer in spec.layers] == ["full", "sliding", "sliding"]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_stacked_sessions_equal_their_solo_runs(folders, name):
    check_stacked_sessions(folders[name])


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_rollback_by_pointer(folders, references, name):
    check_rollback(folders[name], references[name][0])


def test_tensor_shards_match_the_unsharded_stage(folders):
    """Qwen3 splits across a group of 2: each rank norms its own heads (the per-head norm needs no
    exchange), adds its slice of the output bias, and windows its own KV heads; the audit holds."""
    from tessera.peer.plan.audit import check
    from tessera.stages.assembly.stage import load_stage

    from ...shard_helpers import LOGITS_TOLERANCE, InProcessGroup, greedy_run

    folder = folders[SWARM]
    head = load_stage(folder, start=0, end=0, embed=True, head=True)
    group = InProcessGroup(folder, start=0, end=3, count=2)
    tokens, logits = greedy_run(head, [group], PROMPT, steps=DECODE_STEPS - 1)
    ref_tokens, ref_logits = greedy_run(head, [load_stage(folder)], PROMPT, steps=DECODE_STEPS - 1, session="ref")
    assert tokens == ref_tokens
    assert max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits)) <= LOGITS_TOLERANCE
    report = check(group.logs)
    assert report.ok, report.summary()


@pytest.fixture(scope="module")
def swarm(folders):
    with local_swarm([(0, 1), (1, 3)], model=str(folders[SWARM])) as procs:
        yield procs


@pytest.mark.slow
async def test_a_two_peer_swarm_matches_transformers(swarm, folders, references):
    await check_swarm(swarm, folders[SWARM], references[SWARM][0])
