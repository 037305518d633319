"""The KV cache grows in chunks as steps reach them (stages/layers/cache.py `SessionCache`), and a session's
outputs are bit for bit those of a cache allocated whole up front."""

from __future__ import annotations

import torch

from tessera.stages.engine.stage import Stage
from tessera.stages.assembly.stage import load_stage
from tessera.stages.layers import cache as cache_module
from tessera.stages.layers.cache import KV_CHUNK, kv_positions

CAPACITY = 2 * KV_CHUNK + 88


def run_steps(stage: Stage, hidden: torch.Tensor) -> tuple[list[torch.Tensor], list[int]]:
    """A prefill, decodes across a chunk's end, a multi-token step across the next, a rollback
    and a step after it; the outputs and the positions allocated after each step."""
    stage.open("s", capacity=CAPACITY)
    cache = stage.sessions["s"].cache
    outs, allocated = [], []
    steps = [(0, KV_CHUNK - 6)] + [(p, 1) for p in range(KV_CHUNK - 6, KV_CHUNK + 4)]
    steps += [(KV_CHUNK + 4, KV_CHUNK + 20), (100, 3)]
    for start, n in steps:
        outs.append(stage.forward("s", hidden[start : start + n], start))
        allocated.append(cache.allocated)
    stage.close("s")
    return outs, allocated


def test_growing_cache_equals_a_whole_one(tiny_llama, monkeypatch):
    stage = load_stage(tiny_llama)
    hidden = torch.randn(CAPACITY, stage.spec.hidden_size, generator=torch.Generator().manual_seed(3))
    grown, allocated = run_steps(stage, hidden)
    assert allocated[0] == KV_CHUNK and allocated[-3] == 2 * KV_CHUNK and allocated[-1] == CAPACITY, allocated
    monkeypatch.setattr(cache_module, "KV_CHUNK", 10**9)  # the whole capacity at the first step
    whole, allocated = run_steps(stage, hidden)
    assert set(allocated) == {CAPACITY}
    for a, b in zip(grown, whole):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_kv_positions_rounds_to_chunks_within_the_capacity():
    assert kv_positions(1, 4096) == KV_CHUNK
    assert kv_positions(KV_CHUNK, 4096) == KV_CHUNK
    assert kv_positions(KV_CHUNK + 1, 4096) == 2 * KV_CHUNK
    assert kv_positions(KV_CHUNK + 1, KV_CHUNK + 10) == KV_CHUNK + 10
    assert kv_positions(1, 40) == 40
