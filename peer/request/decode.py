"""The requester's decoding loops: one token per step, or speculative blocks in a pipeline.

Plain: feed the last token, get one logits row, sample, repeat — one trip
around the ring per token.

Speculative (`Speculation`): a drafter (stages/decoding/speculative.py) proposes K
tokens; [last token, d1..dK] travel the ring as ONE step at positions
[P, P+K]; the acceptance rule keeps a prefix and adds one model token; a
rejected tail is rolled back by starting the next step at the accepted
position (every peer's cache pointer moves there, nothing is recomputed).

Pipelined: when the draft is confident (the previous block was accepted
whole and the drafter can see further), the next block is sent before the
current one returns — guessing that the current block is accepted whole and
that the model's bonus token is the drafter's next one. If the guess fails,
the later block is cancelled down the chain and the loop redrafts; if it
holds, a whole round trip was hidden.

A drafter that reads the model's hidden states (`--speculate mtp`: the model's own MTP
module, stages/decoding/mtp.py) is shown the last layer's rows of every step as they
return (`shown`), the prompt's included; it drafts from them, and the swarm verifies as ever.

Speculation never costs: K adapts to what drafts earn (stages/decoding/speculative.py
`AdaptiveK`): each block's tokens per second of wall time, drafting included,
are weighed against plain one-token steps; after a few blocks that earn less,
K drops to 0 and the loop runs plain steps (an empty draft is exactly a plain
step), re-probing with K = 1 every 16 of them.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Sequence

import torch

from tessera.peer.base.threads import in_worker
from tessera.stages.decoding.constrained import ConstrainedSampler
from tessera.stages.decoding.sampling import Sampler
from tessera.stages.decoding.speculative import AdaptiveK, Draft, Drafter, ReadsHidden, greedy_accept, sampling_accept

from tessera.peer.request.prefill import pipelined_prefill
from tessera.peer.request.repair import AnswerRewound, Pending, ResilientSession, Superseded

Embed = Callable[[Sequence[int]], Awaitable[torch.Tensor]]
Head = Callable[[torch.Tensor], Awaitable[torch.Tensor]]
MAX_IN_FLIGHT = 2  # blocks of one session on the wire at once


@dataclass
class Speculation:
    """How to speculate: a drafter, the starting K, and whether to pipeline blocks."""

    drafter: Drafter
    k: AdaptiveK = field(default_factory=AdaptiveK)
    pipeline: bool = True
    proposed: int = 0
    accepted: int = 0
    blocks: int = 0
    cancelled: int = 0

    def summary(self) -> dict:
        return {"proposed": self.proposed, "accepted": self.accepted, "blocks": self.blocks,
                "cancelled": self.cancelled, "backoffs": self.k.backoffs, "acceptance": round(self.accepted / self.proposed, 4) if self.proposed else 0.0}


@dataclass
class Block:
    """A speculative block in flight: tokens fed at positions [start, start + len(fed))."""

    fed: list[int]
    draft: Draft
    pending: Pending

    @property
    def start(self) -> int:
        return self.pending.start_pos


async def check_rebuilt(session: ResilientSession, head: Head, n_prompt: int, given: Sequence[int],
                        sampler: Sampler) -> None:
    """After a repair that rebuilt the caches from clean inputs: were the tokens already
    given out (greedy) what the clean computation gives? Raises AnswerRewound if not."""
    rows, session.rebuilt = session.rebuilt, None
    if rows is None or not sampler.params.greedy or rows.shape[0] < n_prompt:
        return
    clean = (await head(rows[n_prompt - 1 :])).argmax(-1).tolist()
    for i, (want, got) in enumerate(zip(clean, given)):
        if want != got:
            raise AnswerRewound(i, want)


async def pick(sampler: Sampler, row: torch.Tensor) -> int:
    """One token from a logits row. A constrained draw judges candidates on their text, which
    can take a while for a schema the model fights: off the trio loop, which serves the network."""
    if isinstance(sampler, ConstrainedSampler):
        return await in_worker(lambda: sampler.sample(row))
    return sampler.sample(row)


async def prefill(session: ResilientSession, hidden: torch.Tensor, chunk: int | None) -> torch.Tensor:
    """The prompt's step: whole, or pipelined in chunks when `chunk` cuts it."""
    if chunk is None or chunk <= 0 or chunk >= hidden.shape[0]:
        return await session.step(hidden, 0)
    return await pipelined_prefill(session, hidden, chunk)


async def plain_tokens(
    session: ResilientSession, embed: Embed, head: Head, ids: Sequence[int], budget: int,
    sampler: Sampler, eos: Sequence[int], prefill_chunk: int | None = None,
) -> AsyncIterator[int]:
    """One step per token (the prompt in chunks of `prefill_chunk`, peer/request/prefill.py)."""
    logits = await head((await prefill(session, await embed(ids), prefill_chunk))[-1:])
    given: list[int] = []
    for produced in range(1, budget + 1):
        await check_rebuilt(session, head, len(ids), given, sampler)
        token = await pick(sampler, logits[-1])
        given.append(token)
        yield token
        if token in eos or produced == budget:
            await session.finish()
            await check_rebuilt(session, head, len(ids), given, sampler)
            return
        logits = await head(await session.step(await embed([token]), len(ids) + produced - 1))


async def speculative_tokens(
    session: ResilientSession, embed: Embed, head: Head, ids: Sequence[int], budget: int,
    sampler: Sampler, eos: Sequence[int], spec: Speculation, prefill_chunk: int | None = None,
) -> AsyncIterator[int]:
    """Speculative blocks, pipelined when the draft is confident. Yields confirmed tokens."""
    prompt = await prefill(session, await embed(ids), prefill_chunk)  # its last chunk's rows, when chunked
    shown(spec.drafter, len(ids) - prompt.shape[0], ids[len(ids) - prompt.shape[0]:], prompt)
    logits = await head(prompt[-1:])
    tokens = list(ids) + [sampler.sample(logits[-1])]
    produced = 1
    yield tokens[-1]
    in_flight: deque[Block] = deque()

    async def submit(fed: list[int], start: int, draft: Draft) -> Block:
        spec.blocks += 1
        return Block(fed, draft, await session.submit(await embed(fed), start))

    async def drop_all() -> None:
        while in_flight:
            spec.cancelled += 1
            await session.cancel(in_flight.popleft().pending)

    while produced < budget and tokens[-1] not in eos:
        started = time.perf_counter()  # the K controller weighs tokens per second of wall time
        room = budget - produced  # tokens we may still emit; a block emits at most K+1
        if not in_flight:
            draft = spec.drafter.propose(tokens, min(spec.k.k, room - 1))
            in_flight.append(await submit([tokens[-1], *draft.tokens], len(tokens) - 1, draft))
        if spec.pipeline and len(in_flight) < MAX_IN_FLIGHT and confident(spec, in_flight[-1]):
            last = in_flight[-1]
            guess = tokens + last.fed[1:]  # assume the block is accepted whole ...
            ahead = spec.drafter.propose(guess, spec.k.k + 1)  # ... and the bonus is the drafter's next
            if ahead.tokens and len(guess) + len(ahead.tokens) <= len(tokens) + room:
                draft = Draft(ahead.tokens[1:], ahead.probs[1:] if ahead.probs is not None else None)
                in_flight.append(await submit([ahead.tokens[0], *draft.tokens], last.start + len(last.fed), draft))
        block = in_flight.popleft()
        try:
            hidden = await session.wait(block.pending)
        except Superseded:
            await drop_all()
            continue
        rows = await head(hidden)
        shown(spec.drafter, block.start, block.fed, hidden)
        await check_rebuilt(session, head, len(ids), tokens[len(ids):], sampler)
        if sampler.params.greedy and not block.draft.tokens:
            kept, nxt = 0, sampler.sample(rows[-1])  # a plain step (K = 0): exactly plain decoding
        elif sampler.params.greedy:
            kept, nxt = greedy_accept(rows, block.draft.tokens)
        else:
            kept, nxt = sampling_accept(rows, block.draft, sampler)
        spec.proposed += len(block.draft.tokens)
        spec.accepted += kept
        spec.k.update(len(block.draft.tokens), kept, time.perf_counter() - started)
        if nxt is None:  # a near-tie: one exact single-token step decides it
            await drop_all()
            fed_upto = block.fed[: kept + 1]
            hidden = await session.step(await embed(fed_upto[-1:]), block.start + kept)
            rows = await head(hidden)
            shown(spec.drafter, block.start + kept, fed_upto[-1:], hidden)
            nxt = sampler.sample(rows[-1])
        new = [*block.draft.tokens[:kept], nxt]
        # the next block in flight stays valid only if it starts exactly where this one ended
        if in_flight and not (kept == len(block.draft.tokens) and in_flight[0].fed[0] == nxt):
            await drop_all()
        for token in new:
            tokens.append(token)
            produced += 1
            yield token
            if token in eos or produced >= budget:
                await drop_all()
                await session.finish()
                await check_rebuilt(session, head, len(ids), tokens[len(ids):], sampler)
                return
        spec.drafter.accepted(tokens)


def shown(drafter: Drafter, start: int, fed: Sequence[int], hidden: torch.Tensor) -> None:
    """Hand a drafter that reads the model's hidden states (an MTP module's) a step's rows."""
    if isinstance(drafter, ReadsHidden):
        drafter.observe(start, fed, hidden)


def confident(spec: Speculation, block: Block) -> bool:
    """Pipeline only after a block was accepted whole and this one proposes a full K."""
    history = spec.k.history
    return bool(history) and history[-1] == 1.0 and len(block.draft.tokens) >= 2
