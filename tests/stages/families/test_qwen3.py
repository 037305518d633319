"""Qwen3 (`qwen3`): what only it has beyond the conformance suite (test_conformance.py's rows): the
window and the per-head norms read per layer, and tensor shards, which split its layers across ranks."""

from __future__ import annotations

import pytest

from .conformance import DECODE_STEPS, PROMPT

pytest.importorskip("transformers")

WINDOW = "qwen3/window-bias"  # layer 0 full, layers 1 and 2 within 8 positions; biases everywhere


def test_the_window_and_the_norms_are_read_per_layer(family_models):
    from tessera.stages.families.catalog import spec_from_file

    spec = spec_from_file(family_models.folder(WINDOW) / "config.json")
    assert [layer.attention.window for layer in spec.layers] == [None, 8, 8]
    assert all(layer.attention.qk_norm and layer.attention.o_bias for layer in spec.layers)
    assert [layer.cache.kind for layer in spec.layers] == ["full", "sliding", "sliding"]


def test_tensor_shards_match_the_unsharded_stage(family_models):
    """Qwen3 splits across a group of 2: each rank norms its own heads (the per-head norm needs no
    exchange), adds its slice of the output bias, and windows its own KV heads; the audit holds."""
    from tessera.peer.plan.audit import check
    from tessera.stages.assembly.stage import load_stage

    from ...shard_helpers import LOGITS_TOLERANCE, InProcessGroup, greedy_run

    folder = family_models.folder(WINDOW)
    head = load_stage(folder, start=0, end=0, embed=True, head=True)
    group = InProcessGroup(folder, start=0, end=3, count=2)
    tokens, logits = greedy_run(head, [group], PROMPT, steps=DECODE_STEPS - 1)
    ref_tokens, ref_logits = greedy_run(head, [load_stage(folder)], PROMPT, steps=DECODE_STEPS - 1, session="ref")
    assert tokens == ref_tokens
    assert max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits)) <= LOGITS_TOLERANCE
    report = check(group.logs)
    assert report.ok, report.summary()
