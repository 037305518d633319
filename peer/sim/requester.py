"""A simulated requester: `tessera.peer.request.client.Swarm`'s generation loop without a tokenizer or a head.

`ResilientSession` (peer/request/repair.py) drives a generation through a `Swarm`; it
needs only `ctx` (a `RequesterContext`), `keeper`, `bans` and `clock`, `is_banned()`,
`plan()` and `wait_for_route()`. `SimRequester` provides exactly those, as `Swarm` does —
same routing call, same wait-and-refresh loop — over the memory transport, so
opening, stepping, refusals, bans and failover run the real code. What it does
not have is what needs weights: the embedding (hidden states are a constant
tensor of the right shape) and the head (there is no sampling; a request
produces the number of tokens its plan says).

Two adaptations:

- its `clock` is trio's (simulated time), so the shared `Backoff` keeps bans on it.
- `plan` memoises routes per (shared view snapshot, bans, RTTs): routing is a
  pure function of them, and a thousand-peer route costs milliseconds.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import trio

from tessera.peer.base.errors import NoRoute, PeerError
from tessera.peer.net.gossip import Gossip, Pinger
from tessera.peer.net.memory import MemoryTransport
from tessera.peer.base.backoff import Backoff
from tessera.peer.request.ports import BAN_BASE, BAN_CAP
from tessera.peer.request.repair import ResilientSession
from tessera.peer.request.policy import RequesterPolicy
from tessera.peer.request.chain_state import RequesterContext
from tessera.peer.plan.routing import Route, route
from tessera.peer.plan.view import PeerInfo
from tessera.peer.sim.scenario import RequestPlan
from tessera.peer.sim.world import World

# The constant every simulated hidden state holds (any finite value passes the checks).
HIDDEN_FILL = 0.5


class SimRequester:
    """One requester of a simulation (duck-types what ResilientSession uses of `Swarm`)."""

    def __init__(self, world: World, label: str, identity, transport: MemoryTransport, nursery: trio.Nursery) -> None:
        self.world = world
        self.label = label
        self.transport = transport
        self.peer_id = transport.peer_id
        self.model_id = world.model_id
        self.keeper = world.new_keeper()
        self.tracer = world.tracer(self.peer_id)
        self.pinger = Pinger(transport)
        self.gossip = Gossip(transport, self.keeper) if world.view_mode == "gossip" else None
        self.ctx = RequesterContext(
            transport=transport, identity=identity, keeper=self.keeper, nursery=nursery,
            num_layers=world.spec.num_layers, hidden_size=world.spec.hidden_size, tracer=self.tracer,
        )
        self.clock = trio.current_time  # bans run on simulated time
        self.bans = Backoff(BAN_BASE, BAN_CAP)
        self.policy = RequesterPolicy()  # as Swarm.policy: a simulated requester trusts every peer
        self._memo_view = None
        self._memo: dict[tuple, Route] = {}
        self._hidden: dict[int, torch.Tensor] = {}

    # -- Swarm's view / plan / wait_for_route ---------------------------------------------------

    def view(self):
        me = PeerInfo(peer_id=self.peer_id, model_id=self.model_id, start=0, end=0, throughput=0.0,
                      state="requester", rtt_ms=dict(self.pinger.rtt_ms))
        return self.keeper.snapshot().replace(me)

    def is_banned(self, peer: str) -> bool:
        return self.bans.is_banned(peer, self.clock())

    def plan(self, *, start: int = 0, end: int | None = None, source: str | None = None, sink: str | None = None,
             exclude: Sequence[str] = (), groups: bool = True, policy: RequesterPolicy | None = None) -> Route:
        """As Swarm.plan: the cheapest chain over [start, end) from `source` to `sink` (default: this requester)."""
        banned = tuple(sorted(self.bans.banned(self.clock())))
        snapshot = self.keeper.snapshot()
        if snapshot is not self._memo_view:
            self._memo_view, self._memo = snapshot, {}
        policy = self.policy.narrowed(policy)
        key = (banned, tuple(sorted(exclude)), start, end, source, sink, groups,
               tuple(sorted(self.pinger.rtt_ms.items())), policy)
        chosen = self._memo.get(key)
        if chosen is None:
            chosen = self._memo[key] = route(policy.apply(self.view(), keep=(self.peer_id,)), start=start, end=end,
                                             source=source or self.peer_id, sink=sink or self.peer_id, exclude=frozenset(banned) | frozenset(exclude),
                                             groups=groups)
        return chosen

    async def wait_for_route(self, timeout: float | None = None, **plan_args: Any) -> Route:
        """As Swarm.wait_for_route: a route, waiting for the view to change. Raises NoRoute."""
        timeout = self.world.timings.route_wait if timeout is None else timeout
        refresh = self.world.timings.requester_refresh
        with trio.move_on_after(timeout):
            while True:
                chosen = self.plan(**plan_args)
                if chosen.ok:
                    return chosen
                with trio.move_on_after(refresh):
                    await self.keeper.wait_changed()
                await self.refresh()
        gaps = self.keeper.snapshot().gaps()
        raise NoRoute(f"no route through the swarm after {timeout:.0f} s; uncovered: {gaps}", gaps)

    async def connect(self, addrs: Sequence[str]) -> None:
        """As Swarm.connect (gossip mode): dial bootstrap peers and pull their view."""
        for addr in addrs:
            try:
                peer = await self.transport.connect(addr)
                if self.gossip is not None:
                    await self.gossip.exchange(peer)
            except PeerError:
                continue  # a bootstrap peer that left; the others will do

    async def refresh(self) -> None:
        """As Swarm.refresh; with the shared view there is nothing to pull, only RTTs to measure."""
        if self.gossip is not None:
            await self.gossip.round()
        await self.pinger.ping_all()

    async def refresh_forever(self) -> None:
        while True:
            await trio.sleep(self.world.timings.requester_refresh)
            await self.refresh()

    # -- one generation (Swarm.generate_ids without embedding, head or sampling) -------------------

    def hidden(self, n: int) -> torch.Tensor:
        tensor = self._hidden.get(n)
        if tensor is None:
            tensor = self._hidden[n] = torch.full((n, self.world.spec.hidden_size), HIDDEN_FILL)
        return tensor

    async def run_request(self, request: RequestPlan) -> None:
        recorder = self.world.recorder
        outcome = recorder.request_started(request)
        session = ResilientSession(self, max_length=request.max_length or request.prompt_tokens + request.new_tokens,
                                   route_wait=self.world.timings.route_wait)
        try:
            with trio.fail_after(self.world.timings.request_timeout):
                await session.open()
                outcome.opened = trio.current_time()
                await session.step(self.hidden(request.prompt_tokens), 0)
                outcome.token_at(trio.current_time())
                for produced in range(1, request.new_tokens):
                    await session.step(self.hidden(1), request.prompt_tokens + produced - 1)
                    outcome.token_at(trio.current_time())
        except PeerError as error:
            outcome.error = f"{type(error).__name__}: {error}"
        except trio.TooSlowError:
            outcome.error = f"timeout: still running after {self.world.timings.request_timeout:g} s"
        finally:
            outcome.failovers = session.failovers
            outcome.routes = [[(self.world.label(h.peer_id), h.start, h.end) for h in r.hops] for r in session.routes]
            with trio.CancelScope(shield=True):
                await session.close()
            recorder.request_finished(outcome)


__all__ = ["SimRequester"]
