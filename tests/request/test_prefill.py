"""Chunk size of a pipelined prefill (peer/request/prefill.py): a pure function."""

from __future__ import annotations

import pytest

from tessera.peer.request.prefill import MIN_CHUNK, chunk_size, chunks, route_chunk_size
from tessera.peer.plan.view import PeerInfo, SwarmView


def test_worked_example_of_the_docstring():
    assert chunk_size(2000, 4, step_seconds=0.02, token_seconds=0.001) == 128


def test_of_the_multiples_around_the_optimum_the_faster_is_taken():
    # c* = sqrt(2000 * 0.013 / (3 * 0.00095)) = 95.5, nearer 64 than 128; but T(64) = 2.58 s and
    # T(128) = 2.56 s: a chunk too small costs more than one too large by as much
    assert chunk_size(2000, 4, step_seconds=0.013, token_seconds=0.00095) == 128


@pytest.mark.parametrize("n", [1, 37, 2 * MIN_CHUNK - 1])
def test_short_prompts_are_never_cut(n):
    assert chunk_size(n, 4, step_seconds=0.001, token_seconds=1.0) == n


def test_one_stage_has_nothing_to_overlap():
    assert chunk_size(2000, 1, step_seconds=0.02, token_seconds=0.001) == 2000


def test_chunks_are_multiples_of_the_minimum_and_grow_with_fixed_cost():
    cheap = chunk_size(4000, 4, step_seconds=0.001, token_seconds=0.001)
    costly = chunk_size(4000, 4, step_seconds=0.1, token_seconds=0.001)
    assert cheap == MIN_CHUNK  # the floor
    assert costly % MIN_CHUNK == 0 and costly > cheap


def test_a_chunk_over_half_the_prompt_means_no_chunking():
    assert chunk_size(200, 2, step_seconds=1.0, token_seconds=0.0001) == 200


def test_chunks_cover_the_prompt_in_order():
    assert chunks(300, 64) == [(0, 64), (64, 128), (128, 192), (192, 256), (256, 300)]


def test_route_chunk_size_uses_the_slowest_measured_hop():
    view = SwarmView.of(30, [PeerInfo("a", "m", 0, 15, throughput=2000.0), PeerInfo("b", "m", 15, 30, throughput=200.0)])
    fast = route_chunk_size(2000, [("a", 15), ("a", 15)], view, hop_width=576)
    slow_unknown = route_chunk_size(2000, [("b", 15), ("x", 15)], view, hop_width=576)
    assert fast % MIN_CHUNK == 0 and slow_unknown % MIN_CHUNK == 0
    # a slower stage makes the fixed cost of a step a smaller share of the link time: not smaller chunks
    assert slow_unknown >= fast
