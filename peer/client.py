"""The requester: `Swarm`, the Python API for asking a swarm for text.

    async with Swarm.join(["/ip4/127.0.0.1/tcp/4001/p2p/12D3KooW..."]) as swarm:
        async for piece in swarm.generate("What is the capital of France?"):
            print(piece.text, end="", flush=True)

A requester serves no layers. It holds the embedding and the head (as a
pipeline coordinator does), the tokenizer and the sampler; it routes a chain of
peers covering every layer (`peer/routing.py`), streams tokens as they come,
and — through `peer/recovery.py` — carries on past peers that fail.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Sequence

import torch
import trio
from libp2p.peer.id import ID

from protocol.keys import Identity
from stages import registry
from stages.generate import GenerationResult, plan_length, prompt_ids
from stages.sampling import Sampler, SamplingParams
from stages.stage import Stage
from stages.tokenizer import TextStream, Tokenizer
from store.trace import NullTracer, Tracer

from .errors import NoRoute, PeerError
from .gossip import Gossip, Pinger, ViewKeeper
from .emulated_link import LinkEmulation, emulate
from .libp2p_transport import open_libp2p_transport
from .generation import Speculation, plain_tokens, speculative_tokens
from .prefill import route_chunk_size
from .reports import ReportBook
from .verify import GUILTY_BAN, CheckPolicy, SpotChecker
from .recovery import AnswerRewound, ResilientSession
from .route_session import RequesterContext, route_summary
from .routing import Route, route
from .transport import Transport
from .view import PeerInfo, SwarmView

# How long a requester waits for the swarm to cover every layer before it gives up.
DEFAULT_ROUTE_WAIT = 30.0
REFRESH_INTERVAL = 2.0  # gossip and ping period of a requester
# Positions reserved beyond the answer: a pipelined speculative block may run past
# the last token that is finally kept.
SPECULATION_SLACK = 32


@dataclass(frozen=True)
class Piece:
    """One generated token and the text it completes ("" while a character is still partial)."""

    token: int
    text: str


class Swarm:
    """A requester's handle on a swarm (see module docstring)."""

    def __init__(
        self,
        transport: Transport,
        nursery: trio.Nursery,
        *,
        folder: Path,
        identity: Identity,
        tracer: Tracer | None = None,
        clock=time.time,
    ) -> None:
        self.folder = folder
        self.head = Stage.load(folder, start=0, end=0, embed=True, head=True)
        self.spec = self.head.spec
        self.tokenizer = Tokenizer.from_folder(folder)
        self.model_id = registry.model_id(folder)
        self.transport = transport
        self.keeper = ViewKeeper(model_id=self.model_id, num_layers=self.spec.num_layers, clock=clock)
        self.gossip = Gossip(transport, self.keeper)
        self.pinger = Pinger(transport)
        self.ctx = RequesterContext(
            transport=transport, identity=identity, keeper=self.keeper, nursery=nursery,
            num_layers=self.spec.num_layers, hidden_size=self.spec.hidden_size, tracer=tracer or NullTracer(),
        )
        self.peer_id = transport.peer_id
        self.banned: dict[str, float] = {}  # peer id -> until (monotonic); see recovery.py
        self.reports = ReportBook(transport, model_id=self.model_id, on_accept=self._avoid_accused)
        self.active: set[ResilientSession] = set()  # generations running now

    @staticmethod
    @asynccontextmanager
    async def join(
        addrs: Sequence[str],
        *,
        model: str | Path = "smollm2-135m",
        swarm_key: bytes | None = None,
        seed: bytes | None = None,
        tracer: Tracer | None = None,
        listen: Sequence[str] = ("/ip4/127.0.0.1/tcp/0",),
        emulate_link: LinkEmulation | None = None,
    ) -> AsyncIterator["Swarm"]:
        """Join the swarm reachable at `addrs` as a requester (serving nothing).

        `emulate_link` (benchmarks only) delays and paces every frame the requester sends.
        """
        folder = registry.resolve(model)
        identity = Identity.from_seed(seed) if seed else Identity.generate()
        async with open_libp2p_transport(
            identity.seed, listen=listen, swarm_key=swarm_key
        ) as real_transport, emulate(real_transport, emulate_link) as transport:
            async with trio.open_nursery() as nursery:
                swarm = await trio.to_thread.run_sync(
                    lambda: Swarm(transport, nursery, folder=folder, identity=identity, tracer=tracer)
                )
                await swarm.connect(addrs)
                nursery.start_soon(swarm._refresh_forever)
                nursery.start_soon(swarm.reports.run)
                try:
                    yield swarm
                finally:
                    nursery.cancel_scope.cancel()

    async def connect(self, addrs: Sequence[str]) -> None:
        """Dial bootstrap peers and pull their view. Raises PeerUnreachable if none answers."""
        errors = []
        for addr in addrs:
            try:
                peer = await self.transport.connect(addr)
                await self.gossip.exchange(peer)
                await self.reports.pull(peer)
            except PeerError as error:
                errors.append(error)
        if errors and len(errors) == len(addrs):
            raise errors[0]

    async def refresh(self) -> None:
        """Pull views from connected peers and connect to the peers they name."""
        await self.gossip.round()
        await self.pinger.ping_all()

    async def _refresh_forever(self) -> None:
        while True:
            await trio.sleep(REFRESH_INTERVAL)
            await self.refresh()

    # -- the view and routes ------------------------------------------------------------

    def view(self) -> SwarmView:
        """The swarm as this requester sees it, itself included (with its measured RTTs)."""
        me = PeerInfo(peer_id=self.peer_id, model_id=self.model_id, start=0, end=0, throughput=0.0,
                      state="requester", rtt_ms=dict(self.pinger.rtt_ms))
        return self.keeper.snapshot().replace(me)

    def _avoid_accused(self, body) -> None:
        """A verified misbehaviour report: stop using the accused."""
        accused = ID(body.accused.peer_id).to_base58()
        self.banned[accused] = max(self.banned.get(accused, 0.0), time.monotonic() + GUILTY_BAN)

    async def publish_report(self, report) -> int:
        """Record a report we made and share it with every connected peer."""
        return await self.reports.publish(report)

    def is_banned(self, peer: str) -> bool:
        return self.banned.get(peer, 0.0) > time.monotonic()

    def plan(
        self,
        *,
        start: int = 0,
        end: int | None = None,
        source: str | None = None,
        sink: str | None = None,
        exclude: Sequence[str] = (),
        groups: bool = True,
    ) -> Route:
        """The cheapest chain over layers [start, end) from `source` to `sink` (default: this requester).

        `groups`: tensor-shard groups may be hops (they are entered from and left to this
        requester, so a repair that chains between peers passes False; peer/shard_route.py).
        """
        banned = {p for p in self.banned if self.is_banned(p)}
        return route(self.view(), start=start, end=end, source=source or self.peer_id, sink=sink or self.peer_id,
                     exclude=frozenset(banned | set(exclude)), groups=groups)

    async def wait_for_route(self, timeout: float = DEFAULT_ROUTE_WAIT, **plan_args) -> Route:
        """A route, waiting up to `timeout` s for the swarm to cover the layers. Raises NoRoute."""
        with trio.move_on_after(timeout):
            while True:
                chosen = self.plan(**plan_args)
                if chosen.ok:
                    return chosen
                with trio.move_on_after(REFRESH_INTERVAL):
                    await self.keeper.wait_changed()
                await self.refresh()
        gaps = self.keeper.snapshot().gaps()
        raise NoRoute(
            f"no route through the swarm after {timeout:.0f} s; uncovered layers: "
            + (", ".join(f"[{a}, {b})" for a, b in gaps) if gaps else "none (peers busy, banned or unreachable)"),
            gaps,
        )

    # -- generation -------------------------------------------------------------------

    async def _embed(self, ids: Sequence[int]) -> torch.Tensor:
        return await trio.to_thread.run_sync(self.head.embed, list(ids))

    async def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return await trio.to_thread.run_sync(self.head.logits, hidden)

    async def generate_ids(
        self,
        ids: Sequence[int],
        *,
        max_new_tokens: int = 128,
        sampling: SamplingParams = SamplingParams(),
        route_wait: float = DEFAULT_ROUTE_WAIT,
        speculation: Speculation | None = None,
        spot_check: CheckPolicy | None = None,
        info: dict | None = None,
        prefill_chunk: int | None = None,
    ) -> AsyncIterator[int]:
        """Token ids continuing `ids`, one at a time; `info` (if given) receives the routes used.

        With `speculation`, drafted blocks are verified in one pass each (and pipelined
        when confident); greedy output is the same as without. `prefill_chunk`: the prompt
        flows down the chain in chunks of this many tokens (peer/prefill.py); None = chosen
        from the route's measured speeds, 0 = sent whole.
        """
        budget = plan_length(len(ids), max_new_tokens, self.spec.max_position)
        sampler = Sampler(sampling)
        capacity = min(len(ids) + budget + SPECULATION_SLACK, self.spec.max_position)
        session = ResilientSession(self, max_length=capacity, route_wait=route_wait)
        await session.open()
        if spot_check is not None and spot_check.rate > 0:
            session.checker = SpotChecker(self, session, spot_check)
        self.active.add(session)
        eos = self.spec.eos_token_ids
        if prefill_chunk is None:
            prefill_chunk = self.prefill_chunk(len(ids), session)
        if speculation is None:
            tokens = plain_tokens(session, self._embed, self._logits, ids, budget, sampler, eos, prefill_chunk)
        else:
            tokens = speculative_tokens(session, self._embed, self._logits, ids, budget, sampler, eos, speculation,
                                        prefill_chunk)
        try:
            async for token in tokens:
                yield token
        finally:
            await tokens.aclose()
            self.active.discard(session)
            await session.close()
            if info is not None:
                info.update(session.summary())
                if speculation is not None:
                    info["speculation"] = speculation.summary()

    def prefill_chunk(self, n_tokens: int, session: ResilientSession) -> int:
        """The prompt's chunk size on the session's route (peer/prefill.py)."""
        hops = session.routes[-1].hops if session.routes else ()
        spans = [(h.peer_id, h.end - h.start) for h in hops]
        return route_chunk_size(n_tokens, spans, self.keeper.snapshot(), hidden_size=self.spec.hidden_size)

    async def generate(
        self,
        prompt: str,
        *,
        raw: bool = False,
        max_tokens: int = 128,
        sampling: SamplingParams = SamplingParams(),
        info: dict | None = None,
    ) -> AsyncIterator[Piece]:
        """Stream the answer to `prompt` (chat template unless `raw`) as `Piece`s."""
        stream = TextStream(self.tokenizer)
        ids = prompt_ids(self.tokenizer, prompt, raw=raw)
        gen = self.generate_ids(ids, max_new_tokens=max_tokens, sampling=sampling, info=info)
        try:
            async for token in gen:
                yield Piece(token, stream.push(token))
        finally:
            await gen.aclose()

    async def complete_ids(
        self, ids: Sequence[int], *, max_new_tokens: int = 128, sampling: SamplingParams = SamplingParams(),
        info: dict | None = None, **options,
    ) -> list[int]:
        """The whole continuation at once. If a peer is caught returning wrong activations
        after tokens were produced from them, regenerates from the last right token."""
        tokens: list[int] = []
        attempts: list[dict] = []
        try:
            while True:
                start = len(tokens)
                attempts.append({})
                try:
                    async for token in self.generate_ids([*ids, *tokens], max_new_tokens=max_new_tokens - len(tokens),
                                                         sampling=sampling, info=attempts[-1], **options):
                        tokens.append(token)
                    return tokens
                except AnswerRewound as rewound:
                    del tokens[start + rewound.valid :]
        finally:
            if info is not None:
                info.update(merge_infos(attempts))

    async def complete(
        self, prompt: str, *, raw: bool = False, max_tokens: int = 128, sampling: SamplingParams = SamplingParams()
    ) -> GenerationResult:
        """The whole answer at once, with the route(s) it took."""
        ids = prompt_ids(self.tokenizer, prompt, raw=raw)
        info: dict = {}
        started = time.perf_counter()
        tokens = await self.complete_ids(ids, max_new_tokens=max_tokens, sampling=sampling, info=info)
        seconds = time.perf_counter() - started
        return GenerationResult(self.tokenizer.decode(tokens), tokens, len(ids), seconds, extra=info)


def merge_infos(attempts: list[dict]) -> dict:
    """One `info` for an answer that took several sessions (regenerated after a rewind)."""
    merged = dict(attempts[-1]) if attempts else {}
    merged["rewinds"] = len(attempts) - 1
    merged["failovers"] = sum(a.get("failovers", 0) for a in attempts)
    merged["routes"] = [r for a in attempts for r in a.get("routes", [])]
    checks = [a["checks"] for a in attempts if "checks" in a]
    if checks:
        merged["checks"] = {
            key: sum(c[key] for c in checks) for key in ("checks", "rows_compared", "fingerprint_bytes")
        } | {"verdicts": [v for c in checks for v in c["verdicts"]]}
    return merged


__all__ = ["Swarm", "Piece", "route_summary"]
