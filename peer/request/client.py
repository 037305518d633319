"""The requester: `Swarm`, the Python API for asking a swarm for text.

    async with Swarm.join(["/ip4/127.0.0.1/tcp/4001/p2p/12D3KooW..."]) as swarm:
        async for piece in swarm.generate("What is the capital of France?"):
            print(piece.text, end="", flush=True)

A requester serves no layers. It holds the embedding and the head (as a
pipeline coordinator does), the tokenizer and the sampler; it routes a chain of
peers covering every layer (`peer/plan/routing.py`), streams tokens as they come,
and — through `peer/request/repair.py` — carries on past peers that fail.

`Swarm` is given its transport, identity, model (`RequesterModel`, peer/request/requester_model.py:
spec, embedding and head, tokenizer), tracer and clocks; `Swarm.join` wires a real one (libp2p, the model's
files, the wall clock). The simulator runs the same class over the memory transport on
trio's clock, with a weightless model and one shared view (peer/sim/requester.py).
"""

from __future__ import annotations

import logging
import math
import random
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import AsyncIterator, Callable, Literal, Sequence

import torch
import trio

from tessera.protocol.admission import MAX_SESSIONS_PER_REQUESTER
from tessera.protocol.keys import Identity
from tessera.protocol.tensors import WIRE_FORMS
from tessera.stages.weights import registry
from tessera.stages.decoding.generate import GenerationResult, plan_length, prompt_ids
from tessera.stages.decoding.constrained import ConstrainedSampler, JsonConstraint
from tessera.stages.kernels.quant import NO_QUANT, Quant
from tessera.stages.decoding.sampling import Sampler, SamplingParams
from tessera.stages.text.tokenizer import TextStream
from tessera.store import events
from tessera.store.trace import NullTracer, Tracer

from tessera.peer.base.ids import peer_id_text
from tessera.peer.base.errors import ModelMismatch, PeerError, PeerUnreachable, UnknownPeer
from tessera.peer.net.gossip import Gossip, ViewKeeper
from tessera.peer.net.pinger import Pinger
from tessera.peer.net.join import why_unreachable
from tessera.peer.net.other_model import other_model_reason
from tessera.peer.net.emulated import LinkEmulation, emulate
from tessera.peer.net.libp2p import open_libp2p_transport
from tessera.peer.request.decode import Speculation, plain_tokens, speculative_tokens
from tessera.peer.request.reports import ReportBook
from tessera.peer.request.verify import DEFAULT_SPOT_CHECKS, SpotChecker
from tessera.peer.request.dispute import DISPUTE_MEMORY, SpanWeights
from tessera.peer.base.backoff import BUSY_WAIT, ROUTE_WAIT, Bans
from tessera.peer.base.threads import in_worker
from tessera.peer.request.ports import CheckPolicy
from tessera.peer.request.repair import AnswerRewound, ResilientSession
from tessera.peer.request.route_wait import RouteWait
from tessera.peer.request.policy import RequesterPolicy, check_peer_id
from tessera.peer.request.chain_state import RequesterContext
from tessera.peer.plan.cost import SPREAD_WIDTH, Spread
from tessera.peer.plan.routing import Route, route, why_not_preferred
from tessera.peer.request.loads import LoadBook
from tessera.peer.net.transport import Transport
from tessera.peer.plan.view import PeerInfo, SwarmView
from tessera.peer.request.prefill import route_chunk_size
from tessera.peer.request.answer import Piece, Rewind, merge_infos
from tessera.peer.request.requester_model import RequesterModel

log = logging.getLogger(__name__)

# How long a requester waits for the swarm to cover every layer before it gives up: one
# policy with the bans (peer/base/backoff.py says why 30 s).
DEFAULT_ROUTE_WAIT = ROUTE_WAIT
REFRESH_INTERVAL = 2.0  # gossip and ping period of a requester
# A refresh that ended this recently serves another caller as well (`Swarm.refresh`). Every answer
# waiting for a route refreshes after each wake (a ban's end, a view change), and a requester
# carrying hundreds of answers in a full swarm pinged every connected peer hundreds of times a
# second, to learn what one round had just told it. Half the refresh period: a route wait still
# sees a view and loads at most a refresh period old.
REFRESH_SHARED = REFRESH_INTERVAL / 2
PLAN_MEMO_ENTRIES = 256  # routes remembered per view snapshot (keyed by bans, range, RTTs, running sessions)
# Embedding a decode step's tokens (one, or a speculative block's few) reads a few rows of
# the table: microseconds on a CPU. A worker thread's round trip costs 0.2-0.3 ms on a
# 2-core machine (more after the idle wait for the swarm), on every step's critical path,
# so those run on the loop; a prompt's embedding (megabytes) still goes to a worker.
INLINE_EMBED_TOKENS = 64
# Positions reserved beyond the answer: a pipelined speculative block may run past
# the last token that is finally kept.
SPECULATION_SLACK = 32


class Swarm:
    """A requester's handle on a swarm (see module docstring)."""

    def __init__(
        self,
        transport: Transport,
        nursery: trio.Nursery,
        *,
        identity: Identity,
        folder: Path | None = None,
        model: RequesterModel | None = None,
        tracer: Tracer | None = None,
        clock: Callable[[], float] = time.time,
        ban_clock: Callable[[], float] = time.monotonic,
        keeper: ViewKeeper | None = None,
        gossip: bool = True,
        reports: bool = True,
        refresh_interval: float = REFRESH_INTERVAL,
        policy: RequesterPolicy | None = None,
        quant: Quant = NO_QUANT,
        accept_mixed: bool = False,
        compile: str = "off",
        spot_check: CheckPolicy | None = DEFAULT_SPOT_CHECKS,
        wire: str = "",
        route_seed: int | None = None,
        spread: float = SPREAD_WIDTH,
        gossip_rng: random.Random | None = None,
        span_weights: SpanWeights | None = None,
        dispute_memory: int = DISPUTE_MEMORY,
    ) -> None:
        """`model`, or the one in `folder` (loaded here, its head compiled as `compile` says); `clock` dates the view's records,
        `ban_clock` the bans. `keeper`: a view fed from elsewhere (then `gossip=False`: a
        simulation's shared view); `reports`: keep and pull misbehaviour reports.
        `spot_check`: how every answer is checked unless it says otherwise (None: not at all; the
        default is off with a compact `wire`, and another policy with one is a ValueError).
        `wire`: the form activations cross the wire in (protocol/tensors.py WIRE_FORMS; "" exact,
        the default). `route_seed`: the seed of the stream routing's spread draws from (None: a
        random one); `spread`: how widely routing spreads answers among chains of nearly the same
        price (peer/plan/cost.py SPREAD_WIDTH; 0: always the cheapest chain, ties by peer id).
        `gossip_rng`: what its gossip draws partners from (a simulation seeds it; None: a random one).
        `span_weights`: how a dispute no third peer can break is decided here, by loading the
        disputed span's weights and recomputing it (peer/request/dispute.py; None: such a
        dispute stays undecided, and both peers are avoided); `dispute_memory`: the bytes that may take."""
        if wire not in WIRE_FORMS:
            raise ValueError(f"activation wire form {wire!r} is not one of {list(WIRE_FORMS)}")
        self.folder = folder
        self.span_weights = span_weights
        self.dispute_memory = dispute_memory
        # who may compute this requester's answers (peer/request/policy.py); a revocation adds to `deny`
        self.policy = policy or RequesterPolicy()
        # spot checks of every answer (peer/request/verify.py); off when None or at rate 0, and the
        # default is off with a compact wire form (a check compares at float32 tolerances: an
        # honest peer's rounded activations would fail it), which an explicit policy cannot ask for
        if wire and spot_check is DEFAULT_SPOT_CHECKS:
            spot_check = None
        if wire and spot_check is not None and spot_check.rate > 0:
            raise ValueError(f"spot checks need exact activations on the wire, not {wire!r}")
        self.spot_check = spot_check if spot_check is not None and spot_check.rate > 0 else None
        model = model or RequesterModel.load(folder, quant, compile=compile)
        self.head = model.head
        self.spec = model.spec
        if wire == "fp8" and self.spec.hop_id_digits:  # stages/layers/hop.py: its digits must cross exactly
            raise ValueError(f"the fp8 wire form rounds away the token ids a {self.spec.family} model's hops carry")
        self.tokenizer = model.tokenizer
        # the peers it chains: those of its quantization (their advertised model id says it), or any
        self.model_id = model.model_id
        self.transport = transport
        self.keeper = keeper or ViewKeeper(model_id=self.model_id, num_layers=self.spec.num_layers, clock=clock,
                                           accept_mixed=accept_mixed)
        self.gossip = Gossip(transport, self.keeper, rng=gossip_rng) if gossip else None
        self.refresh_interval = refresh_interval
        self.ctx = RequesterContext(
            transport=transport, identity=identity, keeper=self.keeper, nursery=nursery,
            num_layers=self.spec.num_layers, hidden_size=self.spec.hidden_size, tracer=tracer or NullTracer(),
            wire=wire, hop_widths=self.spec.hop_width, loads=LoadBook(ban_clock),
        )
        # pings' echoes carry the pinged peer's load (peer/serve/load.py): routing prices it
        self.pinger = Pinger(transport, tracer=self.ctx.tracer, on_load=self.ctx.loads.report)
        # the stream routing's spread draws from, one draw per open or re-route (peer/plan/cost.py Spread)
        self.route_seed = route_seed if route_seed is not None else random.SystemRandom().getrandbits(64)
        self.route_draws = random.Random(self.route_seed)
        self.spread = spread
        self.peer_id = transport.peer_id
        self.ctx.tracer.bind(self.peer_id)  # a TraceWriter made before this requester had an id
        self.clock: Callable[[], float] = ban_clock  # what `bans` measures time on
        self.bans = Bans()  # who is avoided, why and until when; strikes survive from one answer to the next
        self.ctx.link_reset = self.bans.link_reset  # a neighbour's report of a reset link (chain._fail)
        self.reports = ReportBook(transport, model_id=self.model_id, on_accept=self._avoid_accused) if reports else None
        # routes memoised per (view snapshot, bans, exclusions, RTTs, policy): routing is a pure
        # function of them, and where snapshots are shared (a simulation) a route costs milliseconds
        self._memo_view: SwarmView | None = None
        self._memo: dict[tuple, Route] = {}
        # and the view they are routed on, per (RTTs, policy) for the same snapshot: one object,
        # so that routing's per-view preparation (peer/plan/routing.py `_prepared`) is reused
        self._routing_views: dict[tuple, SwarmView] = {}
        self.active: set[ResilientSession] = set()  # generations running now
        self._refreshing: trio.Event | None = None  # set when the refresh running now ends
        self._refreshed = -math.inf  # when the last refresh ended (on `clock`)
        # Told, once a second while `wait_for_route` waits, what it is waiting for (the CLI prints it)
        self.on_route_wait: Callable[[str], None] | None = None
        self.route_wait = RouteWait(keeper=self.keeper, bans=self.bans, clock=self.clock, transport=transport,
                                    tracer=self.ctx.tracer, num_layers=self.spec.num_layers, plan=self.plan,
                                    view=self.view, refresh=self.refresh, refresh_interval=refresh_interval,
                                    policy=lambda: self.policy, at_own_limit=self.at_own_limit,
                                    ping=self.pinger.ping)

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
        policy: RequesterPolicy | None = None,
        quant: Quant = NO_QUANT,
        accept_mixed: bool = False,
        dedicated: bool = True,
        compile: str = "off",
        spot_check: CheckPolicy | None = DEFAULT_SPOT_CHECKS,
        wire: str = "",
        span_weights: SpanWeights | None = None,
        dispute_memory: int = DISPUTE_MEMORY,
    ) -> AsyncIterator["Swarm"]:
        """Join the swarm reachable at `addrs` as a requester (serving nothing).

        `policy` says which peers may compute its answers (every answer; a request may narrow it).
        `quant`: route only through peers serving that quantization (default: unquantized);
        `accept_mixed`: through peers of any quantization of the model.
        `wire`: activations between peers in a compact form, "bfloat16" or "fp8" (a scale per row):
        fewer bytes, NOT exact (docs/pages/quantization.md states the error); "" exact (the default).

        `dedicated`: run sessions on connections of their own where a peer takes them
        (peer/net/dedicated/); False keeps every stream on the libp2p connection.
        `emulate_link` (benchmarks only) delays and paces every frame the requester sends.
        `compile`: --compile for the requester's head (off by default: a one-answer requester would
        spend longer compiling than it saves).
        `spot_check`: how answers are checked (peer/request/verify.py; None: not at all).
        `span_weights`, `dispute_memory`: how a dispute between two holders is decided (as `Swarm`'s).
        """
        folder = registry.resolve(model)
        identity = Identity.from_seed(seed) if seed else Identity.generate()
        async with open_libp2p_transport(
            identity.seed, listen=listen, swarm_key=swarm_key, dedicated=dedicated, dedicated_listen=False,
        ) as real_transport, emulate(real_transport, emulate_link) as transport:
            async with trio.open_nursery() as nursery:
                swarm = await in_worker(
                    lambda: Swarm(transport, nursery, folder=folder, identity=identity, tracer=tracer, policy=policy,
                                  quant=quant, accept_mixed=accept_mixed, compile=compile, spot_check=spot_check,
                                  wire=wire, span_weights=span_weights, dispute_memory=dispute_memory)
                )
                await swarm.connect(addrs, swarm_key_given=swarm_key is not None)
                nursery.start_soon(swarm.refresh_forever)
                nursery.start_soon(swarm.reports.run)
                try:
                    yield swarm
                finally:
                    nursery.cancel_scope.cancel()

    async def connect(self, addrs: Sequence[str], *, swarm_key_given: bool = False) -> None:
        """Dial bootstrap peers and pull their view. Raises PeerUnreachable if none answers.

        An address that answers TCP but not libp2p is, nearly always, a swarm on another
        key: the error says so (as a serving peer's join does) rather than "no answer".
        """
        errors = []
        for addr in addrs:
            try:
                peer = await self.transport.connect(addr)
                if self.gossip is not None:
                    await self.gossip.exchange(peer)
                if self.reports is not None:
                    await self.reports.pull(peer)
            except PeerUnreachable:  # said as a peer's join says it (peer/net/join.py)
                errors.append(PeerUnreachable(f"cannot join {addr}: {await why_unreachable(addr, swarm_key_given)}"))
            except PeerError as error:
                errors.append(error)
        if errors and len(errors) == len(addrs):
            raise errors[0]
        if self.gossip is not None and not self.keeper.snapshot().peers and self.keeper.foreign_models:
            # every peer it heard of serves another model: say which and what to pass, now, rather
            # than wait for a route none of them will ever give (peer/net/join.py)
            raise ModelMismatch(other_model_reason(self.keeper.foreign_models.values(), self.model_id,
                                                   self.folder.name))
        # when it joined, with the view it pulled: a replay starts the requester then (peer/sim/replay.py)
        self.ctx.tracer.emit(events.Join(addrs=self.transport.addrs(), model=self.model_id))

    async def refresh(self) -> None:
        """Pull views from connected peers and connect to the peers they name; measure RTTs. One
        at a time: a caller that finds one running waits for it, and one that finds one ended less
        than REFRESH_SHARED ago takes what it brought (see there)."""
        if self._refreshing is not None:
            await self._refreshing.wait()
            return
        if self.clock() - self._refreshed < REFRESH_SHARED:
            return
        self._refreshing = trio.Event()
        try:
            if self.gossip is not None:
                await self.gossip.round()
            await self.pinger.ping_all()
        finally:
            self._refreshed = self.clock()
            self._refreshing.set()
            self._refreshing = None

    async def refresh_forever(self) -> None:
        while True:
            await trio.sleep(self.refresh_interval)
            await self.refresh()

    # -- the view and routes ------------------------------------------------------------

    def view(self) -> SwarmView:
        """The swarm as this requester sees it, itself included (with its measured RTTs)."""
        me = PeerInfo(peer_id=self.peer_id, model_id=self.model_id, start=0, end=0, throughput=0.0,
                      state="requester", rtt_ms=dict(self.pinger.rtt_ms))
        return self.keeper.snapshot().replace(me)

    def _avoid_accused(self, body) -> None:
        """A verified misbehaviour report: stop using the accused."""
        accused = peer_id_text(body.accused.peer_id)
        self.bans.prove_guilty(accused, self.clock())

    async def publish_report(self, report) -> int:
        """Record a report we made and share it with every connected peer (0: reports are not kept)."""
        return await self.reports.publish(report) if self.reports is not None else 0

    def is_banned(self, peer: str) -> bool:
        return self.bans.is_banned(peer, self.clock())

    async def ask_loads(self, peers: Sequence[str]) -> None:
        """Ping `peers` at once (dialling those not connected): their echoes say their load,
        which routing then prices (peer/request/loads.py)."""
        async def one(peer: str) -> None:
            await self.pinger.ping(peer, addrs=self.keeper.addrs(peer))

        async with trio.open_nursery() as nursery:
            for peer in peers:
                nursery.start_soon(one, peer)

    def draw(self) -> Spread | None:
        """The next draw of this requester's seeded stream, for one routing decision (None: no spread)."""
        salt = self.route_draws.getrandbits(64)
        return Spread(salt, self.spread) if self.spread > 0 else None

    def plan(
        self,
        *,
        start: int = 0,
        end: int | None = None,
        source: str | None = None,
        sink: str | None = None,
        exclude: Sequence[str] = (),
        groups: bool = True,
        policy: RequesterPolicy | None = None,
        spread: Spread | None = None,
    ) -> Route:
        """The cheapest chain over layers [start, end) from `source` to `sink` (default: this requester),
        each of this requester's running sessions on a peer priced as a step queued there, and each
        peer's reported load and wait as it said them (peer/request/loads.py); with `spread`, chosen
        among chains of nearly the same price by that draw (peer/plan/cost.py `Spread`).

        `groups`: tensor-shard groups may be hops (they are entered from and left to this
        requester, so a repair that chains between peers passes False; peer/request/segmented.py).
        Only peers this requester's policy, narrowed by `policy`, admits are used.
        """
        banned = tuple(sorted(self.bans.banned(self.clock())))
        exclude = tuple(exclude) + self.at_own_limit()
        snapshot = self.keeper.snapshot()
        if snapshot is not self._memo_view:
            self._memo_view, self._memo, self._routing_views = snapshot, {}, {}
        policy = self.policy.narrowed(policy)
        rtts = tuple(sorted(self.pinger.rtt_ms.items()))
        running = tuple(sorted(self.ctx.running.items()))
        reported = self.ctx.loads.reported()
        key = (banned, tuple(sorted(exclude)), start, end, source, sink, groups, rtts, policy, running,
               tuple(sorted(reported.items())), spread)
        chosen = self._memo.get(key)
        if chosen is None:
            view = self._routing_views.get((rtts, policy))
            if view is None:  # self.view() reads the same snapshot, with our RTTs as they are now
                view = self._routing_views[rtts, policy] = policy.apply(self.view(), keep=(self.peer_id,))
            if len(self._memo) >= PLAN_MEMO_ENTRIES:  # one snapshot may see many running-session counts
                self._memo.clear()
            chosen = self._memo[key] = route(view, start=start, end=end, source=source or self.peer_id,
                                             sink=sink or self.peer_id, exclude=frozenset(banned) | frozenset(exclude),
                                             groups=groups, own_sessions=dict(running), reported=reported,
                                             spread=spread)
            if policy.prefer and log.isEnabledFor(logging.INFO):  # `-v`: why the cost model chose a peer not preferred
                for line in why_not_preferred(view, chosen, prefer=policy.prefer, source=source or self.peer_id,
                                              sink=sink or self.peer_id, exclude=frozenset(banned) | frozenset(exclude)):
                    log.info("route: %s", line)
        return chosen

    def at_own_limit(self) -> tuple[str, ...]:
        """Peers that hold as many of this requester's sessions as a peer admits of one requester
        (protocol/admission.py MAX_SESSIONS_PER_REQUESTER), counted from the moment a route is
        chosen (RequesterContext.hold): an open there is refused at once, so routing passes them
        by until one of those sessions ends. Without this, a requester carrying hundreds of answers
        opened whole routes that such a peer refused, closed them, and tried again as the skip
        ended (bench/load.py, 2 requesters at load 0.8: 56 sessions opened an answer)."""
        return tuple(sorted(p for p, n in self.ctx.running.items() if n >= MAX_SESSIONS_PER_REQUESTER))

    async def wait_for_route(self, timeout: float = DEFAULT_ROUTE_WAIT, *, paroled: set[str] | None = None,
                             **plan_args) -> Route:
        """A route, waiting up to `timeout` s for the swarm to cover the layers. Raises NoRoute
        naming the uncovered layers and the peers that are there but not usable, and why.
        It re-plans whenever the view changes, a ban or skip ends, or a banned peer that
        dropped or timed out answers a probe, refreshing the view after each wake (and at least
        every `refresh_interval`). `paroled`: the only covers of a span that had their one
        parole in this wait (peer/base/backoff.py); given, a banned peer that is the only cover
        of missing layers and not in it is probed once its parole is due and, if it answers,
        paroled and added to it. While it waits, `on_route_wait` (if set) hears what it waits
        for once a second. The wait itself: peer/request/route_wait.py."""
        return await self.route_wait.wait(timeout, paroled=paroled, on_wait=self.on_route_wait, **plan_args)

    def covered_but_busy(self, **plan_args) -> bool:
        """Whether only busy peers block a route (a queue to wait in: RouteWait.covered_but_busy)."""
        return self.route_wait.covered_but_busy(**plan_args)

    # -- generation -------------------------------------------------------------------

    async def _embed(self, ids: Sequence[int]) -> torch.Tensor:
        if len(ids) <= INLINE_EMBED_TOKENS and self.head.device.type == "cpu":
            return self.head.embed(list(ids))  # a lookup of a few rows: no blocking work to hand off
        return await in_worker(lambda: self.head.embed(list(ids)))

    async def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return await in_worker(lambda: self.head.logits(hidden))

    async def generate_ids(
        self,
        ids: Sequence[int],
        *,
        max_new_tokens: int = 128,
        sampling: SamplingParams = SamplingParams(),
        route_wait: float = DEFAULT_ROUTE_WAIT,
        busy_wait: float = BUSY_WAIT,
        speculation: Speculation | None = None,
        spot_check: CheckPolicy | None | Literal["swarm"] = "swarm",
        info: dict | None = None,
        constraint: JsonConstraint | None = None,
        policy: RequesterPolicy | None = None,
        prefill_chunk: int | None = None,
    ) -> AsyncIterator[int]:
        """Token ids continuing `ids`, one at a time; `info` (if given) receives the routes used.

        `policy` narrows this requester's policy for this answer only (see `Swarm.plan`).

        With `speculation`, drafted blocks are verified in one pass each (and pipelined
        when confident); greedy output is the same as without. With `constraint`, only
        tokens it allows are drawn (stages/decoding/constrained.py; the mask is applied here, where
        the head runs, so the answer is the local constrained one). `prefill_chunk`: the prompt
        flows down the chain in chunks of this many tokens (peer/request/prefill.py); None = chosen
        from the route's measured speeds, 0 = sent whole.

        `spot_check`: how this answer is checked (peer/request/verify.py); "swarm" (the default)
        means as the requester was told (`Swarm.spot_check`: on at DEFAULT_SPOT_CHECKS' rate
        unless turned off), None means not at all. A constrained answer is not checked by
        default: a check's rewind compares unmasked tokens (and asking for both is an error).
        """
        if spot_check == "swarm":
            spot_check = self.spot_check if constraint is None else None
        if constraint is not None and (speculation is not None or spot_check is not None):
            # drafts are accepted against unmasked rows, and a spot check's rewind compares them
            raise ValueError("constrained decoding does not combine with speculation or spot checks")
        budget = plan_length(len(ids), max_new_tokens, self.spec.max_position)
        if constraint is not None:
            constraint.limit(budget)  # it closes within the budget, or CannotClose before any session opens
        sampler = Sampler(sampling) if constraint is None else ConstrainedSampler(sampling, constraint)
        capacity = min(len(ids) + budget + SPECULATION_SLACK, self.spec.max_position)
        if spot_check is not None and spot_check.rate > 0 and self.ctx.wire:
            # a check compares outputs at float32 tolerances; a compact form rounds them far beyond
            raise ValueError(f"spot checks need exact activations on the wire, not {self.ctx.wire!r}")
        session = ResilientSession(self, max_length=capacity, route_wait=route_wait, busy_wait=busy_wait,
                                   policy=policy)
        await session.open()
        if spot_check is not None and spot_check.rate > 0:
            session.checker = SpotChecker(self, spot_check, max_length=capacity,
                                          admits=lambda peer: session.policy.admits(peer))
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
        """The prompt's chunk size on the session's route (peer/request/prefill.py)."""
        hops = session.routes[-1].hops if session.routes else ()
        spans = [(h.peer_id, h.end - h.start) for h in hops]
        # what crosses the first hop, the widest (Gemma 4's per-layer inputs narrow at every layer run)
        return route_chunk_size(n_tokens, spans, self.keeper.snapshot(), hop_width=self.spec.hop_width(0))

    async def generate(
        self,
        prompt: str,
        *,
        raw: bool = False,
        max_tokens: int = 128,
        sampling: SamplingParams = SamplingParams(),
        info: dict | None = None,
        policy: RequesterPolicy | None = None,
    ) -> AsyncIterator[Piece]:
        """Stream the answer to `prompt` (chat template unless `raw`) as `Piece`s."""
        stream = TextStream(self.tokenizer)
        ids = prompt_ids(self.tokenizer, prompt, raw=raw)
        gen = self.generate_ids(ids, max_new_tokens=max_tokens, sampling=sampling, info=info, policy=policy)
        try:
            async for token in gen:
                yield Piece(token, stream.push(token))
        finally:
            await gen.aclose()

    async def answer_ids(
        self, ids: Sequence[int], *, max_new_tokens: int = 128, info: dict | None = None, **options,
    ) -> AsyncIterator[int | Rewind]:
        """Token ids continuing `ids`, as `generate_ids` gives them, carrying on past a rewind:
        when a peer is caught returning wrong activations after tokens were produced from them
        (`AnswerRewound`), a `Rewind` says how many of the tokens given so far stand, and the
        answer goes on from the last right one (a new session, regenerating from there). The one
        loop every caller that shows an answer uses (`complete_ids`, `tessera generate`, the
        HTTP gateway). `info` receives every session's routes and checks (`merge_infos`)."""
        tokens: list[int] = []
        attempts: list[dict] = []
        try:
            while True:
                start = len(tokens)
                attempts.append({})
                gen = self.generate_ids([*ids, *tokens], max_new_tokens=max_new_tokens - len(tokens),
                                        info=attempts[-1], **options)
                try:
                    async for token in gen:
                        tokens.append(token)
                        yield token
                    return
                except AnswerRewound as rewound:
                    del tokens[start + rewound.valid :]
                finally:
                    await gen.aclose()
                yield Rewind(len(tokens))
        finally:
            if info is not None:
                info.update(merge_infos(attempts))

    async def complete_ids(
        self, ids: Sequence[int], *, max_new_tokens: int = 128, sampling: SamplingParams = SamplingParams(),
        info: dict | None = None, **options,
    ) -> list[int]:
        """The whole continuation at once. If a peer is caught returning wrong activations
        after tokens were produced from them, regenerates from the last right token."""
        tokens: list[int] = []
        answer = self.answer_ids(ids, max_new_tokens=max_new_tokens, sampling=sampling, info=info, **options)
        try:
            async for item in answer:
                if isinstance(item, Rewind):
                    del tokens[item.kept :]
                else:
                    tokens.append(item)
        finally:
            await answer.aclose()
        return tokens

    async def complete(
        self, prompt: str, *, raw: bool = False, max_tokens: int = 128, sampling: SamplingParams = SamplingParams(),
        policy: RequesterPolicy | None = None,
    ) -> GenerationResult:
        """The whole answer at once, with the route(s) it took."""
        ids = prompt_ids(self.tokenizer, prompt, raw=raw)
        info: dict = {}
        started = time.perf_counter()
        tokens = await self.complete_ids(ids, max_new_tokens=max_tokens, sampling=sampling, info=info, policy=policy)
        seconds = time.perf_counter() - started
        return GenerationResult(self.tokenizer.decode(tokens), tokens, len(ids), seconds, extra=info)

    # -- revocation ---------------------------------------------------------------------

    async def revoke(self, peer_id: str) -> int:
        """Stop trusting `peer_id`, now: it is denied for every later route, and removed from
        every running session — its span moves to an allowed replacement by the failover's
        replay, the answer goes on unchanged, and the peer is told to drop the session's KV
        cache and keys (it gets no further frame for it). Returns how many running sessions
        it was removed from.

        Raises BadPeerId (not a peer id) or UnknownPeer (neither in this requester's view
        nor in a running session); nothing changes then.
        """
        peer_id = check_peer_id(peer_id, what="revoke")
        running = [s for s in self.active if s.uses(peer_id)]
        if not running and self.keeper.snapshot().get(peer_id) is None:
            raise UnknownPeer(f"revoke: no peer {peer_id} in this requester's view of the swarm or in its sessions")
        self.policy = self.policy.denying(peer_id)
        for session in running:
            await session.revoke(peer_id)
        return len(running)
