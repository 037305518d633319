"""Pipelined (chunked) prefill: a long prompt flows down the chain in chunks.

Sent whole, a prompt's prefill is computed by stage 1, then stage 2, ... — the
first token waits for the sum of all stages. Cut into m chunks sent one behind
the other (the requester does not wait for chunk c before sending c+1), stage
i computes chunk c while stage i+1 computes chunk c-1, so the first token waits
for one stage's whole prompt plus (S-1) chunks' worth of the other stages.

A chunk is an ordinary step at its positions: every peer's KV cache already
takes a start position, and a session's steps run in arrival order on each
peer. So the output is the same computation as an unchunked prefill (causal
attention over the same keys), and failover is unchanged: each chunk's input
and every span's tap land in the requester's history at their positions
(peer/request/chain.py), exactly as consecutive decode steps do.

Chunk size (`chunk_size`). Model each stage's time for a chunk of c tokens as
a + b·c (a: the fixed cost of a step — frame work, hand-off, a decode step's
worth; b: prefill cost per token, plus its bytes on the link). With m = n/c
chunks through S stages, the first token waits about

    T(c) = (m + S - 1)(a + b·c) = n·b + (S-1)·a + n·a/c + (S-1)·b·c,

minimised at c* = sqrt(n·a / ((S-1)·b)). Link latency is paid once per hop
whatever c is (chunks stream), so it does not move c*. Chunks are multiples of
`MIN_CHUNK`: of the two around c*, the one with the smaller T(c) (T rises much
faster below c* than above it, so plain rounding picks too small a chunk).

Worked example: n = 2000 tokens, S = 4 stages, a = 20 ms, b = 1 ms/token:
c* = sqrt(2000·0.02 / (3·0.001)) = sqrt(13333) ≈ 115, between 64 and 128;
T(64) = 35·0.084 = 2.94 s, T(128) = 19·0.148 = 2.81 s: 128, 16 chunks, against 4·(0.02 + 2.0) =
8.1 s unchunked.

The route gives a and b from the slowest hop's measured decode speed: a = the
span's decode step times `PREFILL_STEP_COST`, b = that step / `PREFILL_TOKENS_PER_STEP`
plus a token's bytes on the link.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from tessera.peer.plan.view import SwarmView
from tessera.peer.request.repair import Pending, ResilientSession, Superseded

# Chunks are multiples of this many tokens, and a prompt shorter than two of them is
# never cut: below ~64 tokens a CPU matmul stops amortising its per-call cost, so a
# smaller chunk would only add steps.
MIN_CHUNK = 64
# Prefill of a chunk runs this many times more tokens per second than decode steps do
# (one matmul over c rows instead of c one-row steps). Measured on SmolLM2-135M, 10
# layers, one torch thread (a loaded machine): a 1-token step 51 ms, a 256-token chunk at
# position 256 923 ms, i.e. 14 tokens in the time of one decode step. The advertised
# throughput is decode speed, hence this factor.
PREFILL_TOKENS_PER_STEP = 15.0
# A chunk step's fixed cost, in decode steps: a prefill-shaped step (masked attention over
# its rows, a KV write of many positions) costs more than a one-token step besides its
# per-token work. Measured on SmolLM2-135M, 8 layers, one torch thread, at position 1024:
# 1 token 13.2 ms; 64 tokens 78 ms, 128 136 ms, 256 257 ms, 512 530 ms, i.e. a + b·c with
# b = 0.93 ms (a decode step / 14) and a = 18.8 ms (1.4 decode steps). Taking a for one
# decode step chose 64-token chunks for a 2,000-token prompt over bench/swarm.py's four
# emulated WAN stages, 6.7 s to the first token; 128 took 5.6 s (256: 5.3 s).
PREFILL_STEP_COST = 1.4
# When no link speed was measured: 100 Mbit/s, a home uplink.
ASSUMED_LINK_BYTES_PER_S = 100e6 / 8
BYTES_PER_VALUE = 4  # float32 activations on the wire


def chunk_size(n_tokens: int, n_stages: int, *, step_seconds: float, token_seconds: float) -> int:
    """The prefill chunk (in tokens) minimising time to first token; `n_tokens` = no chunking.

    `step_seconds` (a): the fixed cost of one step on the slowest stage; `token_seconds` (b):
    that stage's prefill cost per token plus its link time per token. See module docstring.
    """
    if n_tokens < 2 * MIN_CHUNK or n_stages < 2 or token_seconds <= 0:
        return n_tokens
    best = math.sqrt(n_tokens * step_seconds / ((n_stages - 1) * token_seconds))

    def first_token_seconds(chunk: int) -> float:  # T(c) of the module docstring
        return (math.ceil(n_tokens / chunk) + n_stages - 1) * (step_seconds + token_seconds * chunk)

    below = max(MIN_CHUNK, MIN_CHUNK * math.floor(best / MIN_CHUNK))
    chunk = min((below, below + MIN_CHUNK), key=first_token_seconds)
    return n_tokens if chunk * 2 > n_tokens else chunk


def route_chunk_size(
    n_tokens: int, spans: Sequence[tuple[str, int]], view: "SwarmView", *, hop_width: int,
    link_bytes_per_s: float = ASSUMED_LINK_BYTES_PER_S,
) -> int:
    """`chunk_size` from the route's advertised (measured) layer throughputs.

    `spans`: (peer id, number of layers) per hop. A peer without a measured speed counts
    as the slowest measured one (or one token per second through a layer if none is).
    """
    infos = [view.get(p) for p, _ in spans]
    speeds = [i.throughput for i in infos if i is not None and i.throughput > 0]
    fallback = min(speeds) if speeds else 1.0
    steps = []
    for (_, layers), info in zip(spans, infos):
        speed = info.throughput if info is not None and info.throughput > 0 else fallback
        steps.append(layers / speed)  # seconds for one decode step through the span
    slowest = max(steps) if steps else 0.0
    link = hop_width * BYTES_PER_VALUE / link_bytes_per_s  # a token's hop (ModelSpec.hop_width: the widest, the first) on each link
    return chunk_size(n_tokens, len(spans), step_seconds=slowest * PREFILL_STEP_COST,
                      token_seconds=slowest / PREFILL_TOKENS_PER_STEP + link)


def chunks(n_tokens: int, chunk: int) -> list[tuple[int, int]]:
    """[start, end) of each chunk of a prompt of `n_tokens`."""
    chunk = max(1, chunk)
    return [(s, min(s + chunk, n_tokens)) for s in range(0, n_tokens, chunk)]


async def pipelined_prefill(session: "ResilientSession", hidden: torch.Tensor, chunk: int) -> torch.Tensor:
    """Prefill positions [0, T) of `hidden` [T, H] in chunks sent back to back.

    Returns the last chunk's output (the last layer's rows for its positions; the first
    token needs only its last row). Earlier chunks' outputs are waited for (so that a
    failing peer is found and repaired at the first chunk it fails) but not kept.
    A repair supersedes the chunks sent before it: they are sent again after it.
    """
    spans = chunks(hidden.shape[0], chunk)
    in_flight: list[Pending] = [await session.submit(hidden[a:b], a) for a, b in spans]
    output = None
    i = 0
    while i < len(spans):
        try:
            output = await session.wait(in_flight[i])
        except Superseded:
            # a repair happened while waiting for an earlier chunk: chunk i and later were
            # sent into the old route; send them again (their positions are overwritten)
            in_flight[i:] = [await session.submit(hidden[a:b], a) for a, b in spans[i:]]
            continue
        i += 1
    assert output is not None
    return output
