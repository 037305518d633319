"""Speculative decoding and the async pipeline: exact (greedy), unbiased (sampling), overlapping."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
import trio

from tessera.peer.request.client import Swarm
from tessera.peer.net.emulated import LinkEmulation
from tessera.peer.request.decode import Speculation, plain_tokens, speculative_tokens
from tessera.peer.request.repair import Pending
from tessera.stages.decoding.generate import prompt_ids
from tessera.stages.decoding.sampling import Sampler, SamplingParams
from tessera.stages.decoding.speculative import (
    BACKOFF_MISSES, K_PROBE, REPROBE_EVERY, AdaptiveK, Draft, ModelDrafter, NgramDrafter, greedy_accept,
)
from tessera.stages.engine.stage import Stage
from tessera.stages.assembly.stage import load_stage
from tessera.store.events import Push, Result
from tessera.store.trace import MemoryTracer

from ..swarm_helpers import local_swarm

PROMPTS = [
    ("Repeat this sentence twice: the quick brown fox jumps over the lazy dog.", False),
    ("List the days of the week.", False),
    ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):", True),
]
TOKENS = 40


@pytest.fixture(scope="module")
def three_peers(smol_dir):
    with local_swarm([(0, 10), (10, 20), (20, 30)]) as swarm:
        yield swarm


@pytest.fixture(scope="module")
def references(local_engine, smol_tokenizer):
    return {p: local_engine.generate_ids(prompt_ids(smol_tokenizer, p, raw=raw), max_new_tokens=TOKENS) for p, raw in PROMPTS}


def pinned(k: int) -> AdaptiveK:
    """A K that never backs off to plain decoding: these tests exercise verification, rollback
    and pipelining, which a back-off (tested on its own below) would skip."""
    return AdaptiveK(k, backoff_after=10**9)


def drafters(smol_dir):
    yield "ngram-k1", lambda: Speculation(NgramDrafter(), k=pinned(1), pipeline=False)
    yield "ngram-k4-pipelined", lambda: Speculation(NgramDrafter(), k=pinned(4), pipeline=True)
    yield "ngram-k8", lambda: Speculation(NgramDrafter(), k=pinned(8), pipeline=False)
    draft_stage = load_stage(smol_dir, start=0, end=6, embed=True, head=True)
    yield "self-6-pipelined", lambda: Speculation(ModelDrafter(draft_stage, capacity=512), k=pinned(3), pipeline=True)


@pytest.mark.slow
async def test_greedy_speculation_equals_plain_decoding(three_peers, references, smol_dir):
    async with Swarm.join(three_peers.addrs[:1]) as swarm:
        await swarm.wait_for_route(30)
        totals = Counter()
        for name, make in drafters(smol_dir):
            for prompt, raw in PROMPTS[::2]:  # a repetitive text and code: drafts hit and miss
                spec = make()
                info: dict = {}
                ids = prompt_ids(swarm.tokenizer, prompt, raw=raw)
                got = [t async for t in swarm.generate_ids(ids, max_new_tokens=TOKENS, speculation=spec, info=info)]
                assert got == references[prompt], (name, prompt)
                totals[f"{name} proposed"] += spec.proposed
                totals[f"{name} accepted"] += spec.accepted
                totals[f"{name} rolled back"] += spec.proposed - spec.accepted
        print(dict(totals))
        # the drafts were really used, and really rejected sometimes (rollbacks happened)
        assert totals["ngram-k4-pipelined accepted"] > 0 and totals["self-6-pipelined accepted"] > 0
        assert totals["ngram-k8 rolled back"] > 0 and totals["self-6-pipelined rolled back"] > 0


@pytest.mark.slow
async def test_speculation_survives_a_peer_failure(smol_dir, references):
    prompt, raw = PROMPTS[2]
    with local_swarm([(0, 15), (15, 30), (15, 30)]) as peers:
        async with Swarm.join(peers.addrs[:1]) as swarm:
            await swarm.wait_for_route(30)
            info: dict = {}
            got = []
            spec = Speculation(NgramDrafter(), k=pinned(4), pipeline=True)
            async for token in swarm.generate_ids(prompt_ids(swarm.tokenizer, prompt, raw=raw), max_new_tokens=TOKENS,
                                                  speculation=spec, info=info):
                got.append(token)
                if len(got) == 10:
                    (session,) = swarm.active
                    victim = session.current.hops[1].peer
                    peers.kill(next(i for i, a in enumerate(peers.addrs) if a.endswith(victim)))
    assert got == references[prompt]
    assert info["failovers"] == 1 and spec.accepted > 0


@pytest.mark.slow
async def test_in_flight_steps_overlap_on_a_slow_link(smol_dir):
    """With 30 ms added per hop, the requester's trace shows steps sent before earlier
    ones returned: within a session (pipelined blocks) and across sessions."""
    delay = ["--emulate-link", "delay=30ms"]
    with local_swarm([(0, 15), (15, 30)], extra=delay) as peers:
        tracer = MemoryTracer(peer="requester")
        async with Swarm.join(peers.addrs[:1], tracer=tracer, emulate_link=LinkEmulation(delay=0.03)) as swarm:
            await swarm.wait_for_route(30)

            async def one(prompt: str, raw: bool) -> None:
                ids = prompt_ids(swarm.tokenizer, prompt, raw=raw)
                spec = Speculation(NgramDrafter(), k=pinned(4), pipeline=True)
                async for _ in swarm.generate_ids(ids, max_new_tokens=32, speculation=spec):
                    pass

            async with trio.open_nursery() as nursery:
                for prompt, raw in PROMPTS[::2]:
                    nursery.start_soon(one, prompt, raw)
    sent = {(e.event.session, e.event.step): e.wall for e in tracer.of_kind(Push)}
    back = {(e.event.session, e.event.step): e.wall for e in tracer.of_kind(Result)}
    within = [(k, j) for k in back for j in sent if j[0] == k[0] and j[1] > k[1] and sent[j] < back[k]]
    across = [(k, j) for k in back for j in sent if j[0] != k[0] and sent[k] < sent[j] < back[k]]
    print(f"{len(sent)} steps; {len(within)} overlaps within a session, {len(across)} across sessions")
    assert within and across


# -- sampling: the output distribution is unchanged ---------------------------------------------


class LocalChain:
    """The session interface the generation loops use, over a local stage (no network)."""

    def __init__(self, stage: Stage) -> None:
        self.stage = stage
        self.epoch = 0
        self.rebuilt = None  # never set: a local chain has no repairs
        stage.open("chain", capacity=256)

    async def step(self, hidden: torch.Tensor, start_pos: int) -> torch.Tensor:
        return self.stage.forward("chain", hidden, start_pos)

    async def submit(self, hidden: torch.Tensor, start_pos: int) -> Pending:
        pending = Pending(hidden, start_pos, self.epoch)
        pending.slot = self.stage.forward("chain", hidden, start_pos)  # type: ignore[assignment]
        return pending

    async def wait(self, pending: Pending) -> torch.Tensor:
        return pending.slot  # type: ignore[return-value]

    async def cancel(self, pending: Pending) -> None:
        pass

    async def finish(self) -> None:
        pass


def peaky_model(tiny_llama) -> Stage:
    """The tiny synthetic model with weights scaled up, so that next-token distributions are
    far from uniform (a statistical test needs mass on few tokens)."""
    stage = load_stage(tiny_llama, embed=True, head=True)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in stage.blocks.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.15)
        stage.embedding.copy_(torch.randn(stage.embedding.shape, generator=gen))
        stage.head.copy_(torch.randn(stage.head.shape, generator=gen) * 0.5)  # logits of std ~4
    return stage


async def sample_many(stage: Stage, draft: Stage | None, n: int, *, temperature: float) -> list[tuple[int, ...]]:
    out = []
    ids = [5, 17, 42, 5, 17]

    async def embed(t):
        return stage.embed(list(t))

    async def head(h):
        return stage.logits(h)

    for seed in range(n):
        chain = LocalChain(stage)
        sampler = Sampler(SamplingParams(temperature=temperature, seed=seed))
        if draft is None:
            gen = plain_tokens(chain, embed, head, ids, 4, sampler, ())
        else:
            drafter = ModelDrafter(draft, capacity=64, sampler=Sampler(SamplingParams(temperature=temperature, seed=10**6 + seed)))
            gen = speculative_tokens(chain, embed, head, ids, 4, sampler, (), Speculation(drafter, k=pinned(3), pipeline=False))
        out.append(tuple([t async for t in gen]))
        stage.close("chain")
        if draft is not None:
            drafter.close()
    return out


def chi2_homogeneity(a: Counter, b: Counter) -> tuple[float, int]:
    """Two-sample chi-square statistic and degrees of freedom (bins of < 10 expected merged)."""
    na, nb = sum(a.values()), sum(b.values())
    keys = sorted(set(a) | set(b), key=lambda k: -(a[k] + b[k]))
    bins, rest = [], (0, 0)
    for k in keys:
        if (a[k] + b[k]) * min(na, nb) / (na + nb) >= 10:
            bins.append((a[k], b[k]))
        else:
            rest = (rest[0] + a[k], rest[1] + b[k])
    if sum(rest):
        bins.append(rest)
    stat = 0.0
    for x, y in bins:
        total = x + y
        ex, ey = total * na / (na + nb), total * nb / (na + nb)
        stat += (x - ex) ** 2 / ex + (y - ey) ** 2 / ey
    return stat, len(bins) - 1


def chi2_sf(x: float, k: int) -> float:
    """Upper tail of chi-square (Wilson–Hilferty normal approximation; fine for k >= 3)."""
    z = ((x / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


async def test_speculative_sampling_keeps_the_distribution(tiny_llama):
    stage = peaky_model(tiny_llama)
    draft = Stage(stage.spec, 0, list(stage.blocks[:2]), embedding=stage.embedding, norm=stage.norm, head=stage.head)
    n = 600
    plain = await sample_many(stage, None, n, temperature=1.0)
    spec = await sample_many(stage, draft, n, temperature=1.0)
    for position in (1, 2, 3):  # the first token is sampled before any draft
        a, b = Counter(s[position] for s in plain), Counter(s[position] for s in spec)
        stat, dof = chi2_homogeneity(a, b)
        p = chi2_sf(stat, dof)
        print(f"token {position}: chi2 {stat:.1f} on {dof} dof, p = {p:.3f}")
        assert dof >= 3 and p > 1e-3


def test_greedy_accept_stops_at_near_ties():
    logits = torch.tensor([[0.0, 5.0, 1.0], [0.0, 2.0, 2.0 + 1e-5], [9.0, 0.0, 0.0]])
    assert greedy_accept(logits, [1, 2]) == (1, None)  # row 1 is a near-tie: decide it exactly
    assert greedy_accept(logits[:1], []) == (0, 1)
    assert greedy_accept(torch.tensor([[0.0, 5.0], [3.0, 0.0]]), [0]) == (0, 1)  # wrong draft: model's own token


async def test_the_distribution_test_catches_a_biased_rule(tiny_llama, monkeypatch):
    """Control: accepting every draft token (ignoring p/q) must be detected."""
    import tessera.peer.request.decode

    def always_accept(logits, draft, sampler):
        k = len(draft.tokens)
        return k, sampler.draw(sampler.distribution(logits[k]))

    monkeypatch.setattr(tessera.peer.request.decode, "sampling_accept", always_accept)
    stage = peaky_model(tiny_llama)
    draft = Stage(stage.spec, 0, list(stage.blocks[:2]), embedding=stage.embedding, norm=stage.norm, head=stage.head)
    plain = await sample_many(stage, None, 600, temperature=1.0)
    biased = await sample_many(stage, draft, 600, temperature=1.0)
    worst = min(chi2_sf(*chi2_homogeneity(Counter(s[i] for s in plain), Counter(s[i] for s in biased))) for i in (1, 2, 3))
    print(f"biased rule: smallest p = {worst:.2e}")
    assert worst < 1e-3


# -- the K controller: speculation backs off to plain decoding when drafts do not pay ----------


def test_k_controller_reaches_zero_on_a_stream_that_never_hits_and_reprobes():
    k = AdaptiveK(4)
    for _ in range(BACKOFF_MISSES):
        assert k.k > 0
        k.update(k.k, 0, seconds=0.1)
    assert k.k == 0 and k.backoffs == 1
    for _ in range(REPROBE_EVERY - 1):
        k.update(0, 0, seconds=0.05)  # plain steps: 20 tokens/s
    assert k.k == 0
    k.update(0, 0, seconds=0.05)
    assert k.k == K_PROBE  # a re-probe ...
    k.update(K_PROBE, 0, seconds=0.06)
    assert k.k == 0 and k.backoffs == 2  # ... that missed drops straight back


def test_k_controller_returns_on_a_stream_that_hits():
    k = AdaptiveK(0)
    for _ in range(REPROBE_EVERY):
        k.update(0, 0, seconds=0.05)  # plain: 20 tokens/s
    assert k.k == K_PROBE
    for _ in range(4):
        k.update(k.k, k.k, seconds=0.06)  # whole blocks accepted, (k+1)/0.06 s >> 20 tokens/s
    assert k.k == K_PROBE + 4 and k.misses == 0


def test_k_controller_counts_time_not_just_acceptance():
    """Blocks that keep a token but take longer per token than plain steps do not pay."""
    k = AdaptiveK(4)
    k.update(0, 0, seconds=0.05)  # an empty draft: a plain step, timed (20 tokens/s)
    for _ in range(BACKOFF_MISSES):
        k.update(k.k, 1, seconds=0.2)  # 2 tokens in 0.2 s = 10 tokens/s
    assert k.k == 0
    fast = AdaptiveK(4)
    fast.update(0, 0, seconds=0.05)
    for _ in range(BACKOFF_MISSES):
        fast.update(fast.k, 1, seconds=0.08)  # 2 tokens in 0.08 s = 25 tokens/s: pays
    assert fast.k > 0 and fast.misses == 0


class WrongDrafter:
    """Always proposes a token the greedy model does not choose (the argmin of the last row)."""

    def __init__(self, stage: Stage) -> None:
        self.stage = stage

    def propose(self, tokens, k: int) -> Draft:
        if k <= 0:
            return Draft([])
        self.stage.open("wrong", capacity=256)
        try:
            hidden = self.stage.forward("wrong", self.stage.embed(list(tokens)), 0)
            return Draft([int(self.stage.logits(hidden[-1:])[-1].argmin())] * k)
        finally:
            self.stage.close("wrong")

    def accepted(self, tokens) -> None:
        pass


async def test_drafts_that_never_hit_back_off_to_plain_decoding_with_the_same_tokens(tiny_llama):
    stage = load_stage(tiny_llama, embed=True, head=True)
    ids = [5, 17, 42, 5, 17]
    budget = 3 * REPROBE_EVERY

    async def embed(t):
        return stage.embed(list(t))

    async def head(h):
        return stage.logits(h)

    async def run(spec: Speculation | None) -> list[int]:
        chain = LocalChain(stage)
        sampler = Sampler(SamplingParams())
        gen = (plain_tokens(chain, embed, head, ids, budget, sampler, ()) if spec is None
               else speculative_tokens(chain, embed, head, ids, budget, sampler, (), spec))
        out = [t async for t in gen]
        stage.close("chain")
        return out

    spec = Speculation(WrongDrafter(stage), k=AdaptiveK(4), pipeline=False)
    assert await run(spec) == await run(None)
    assert spec.accepted == 0 and spec.k.backoffs >= 2  # backed off, re-probed, backed off again
    # only the first misses and one probe per REPROBE_EVERY plain steps drafted anything
    assert spec.proposed <= 4 + 3 + 2 + 2 * K_PROBE
