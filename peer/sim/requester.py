"""A simulated requester: the real `Swarm` (peer/request/client.py) on simulated parts.

Routing, waiting for a route, refreshing the view, bans (the swarm's one `Backoff`, on
trio's clock) and every failover run in `Swarm` and `ResilientSession` as on a real
requester. What it is given instead of a real one's parts: the memory transport, trio's
clock, the world's counting tracer and (``view="shared"``) the one shared view, without
gossip; no misbehaviour reports. What it lacks is what needs weights: a request's hidden
states are a constant tensor of the right shape, and there is no head (no sampling: a
request produces the number of tokens its plan says) — `run_request` is
`Swarm.generate_ids` without the embedding, the head and the sampler.
"""

from __future__ import annotations

from typing import Sequence

import torch
import trio

from tessera.protocol.keys import Identity

from tessera.peer.base.errors import PeerError
from tessera.peer.net.memory import MemoryTransport
from tessera.peer.request.client import Swarm
from tessera.peer.request.requester_model import RequesterModel
from tessera.peer.request.repair import ResilientSession
from tessera.peer.sim.report import TIMEOUT, classify_failure
from tessera.peer.sim.scenario import RequestPlan
from tessera.peer.sim.world import World, derive_seed, node_rng

# The constant every simulated hidden state holds (any finite value passes the checks).
HIDDEN_FILL = 0.5


class SimRequester:
    """One requester of a simulation: a `Swarm`, and the requests it is given."""

    def __init__(self, world: World, label: str, identity: Identity, transport: MemoryTransport,
                 nursery: trio.Nursery) -> None:
        self.world = world
        self.label = label
        self.swarm = Swarm(
            transport, nursery, identity=identity, model=RequesterModel(world.spec, world.model_id),
            tracer=world.tracer(transport.peer_id), clock=trio.current_time, ban_clock=trio.current_time,
            keeper=world.new_keeper(), gossip=world.view_mode == "gossip", reports=False,
            refresh_interval=world.timings.requester_refresh,
            # its routing draws (peer/plan/cost.py Spread) follow from the seed: a run re-takes its routes
            route_seed=int.from_bytes(derive_seed(world.seed, "routes", label)[:8], "big"),
            # and its gossip partners (it dials the peers it asks for their load: more to draw from)
            gossip_rng=node_rng(world.seed, "requester-gossip", label),
        )
        self._hidden: dict[int, torch.Tensor] = {}

    async def connect(self, addrs: Sequence[str]) -> None:
        """Dial the bootstrap peers (and pull their view, with gossip)."""
        try:
            await self.swarm.connect(addrs)
        except PeerError:
            pass  # every bootstrap peer just left: the view arrives with the next refresh

    def hidden(self, n: int) -> torch.Tensor:
        tensor = self._hidden.get(n)
        if tensor is None:
            tensor = self._hidden[n] = torch.full((n, self.world.spec.hop_width(0)), HIDDEN_FILL)  # into layer 0
        return tensor

    async def run_request(self, request: RequestPlan) -> None:
        world = self.world
        outcome = world.recorder.request_started(request)
        session = ResilientSession(self.swarm, max_length=request.max_length or request.prompt_tokens + request.new_tokens,
                                   route_wait=world.timings.route_wait)
        try:
            with trio.fail_after(world.timings.request_timeout):
                await session.open()
                outcome.opened = trio.current_time()
                await session.step(self.hidden(request.prompt_tokens), 0)
                outcome.token_at(trio.current_time())
                for produced in range(1, request.new_tokens):
                    await session.step(self.hidden(1), request.prompt_tokens + produced - 1)
                    outcome.token_at(trio.current_time())
        except PeerError as error:
            outcome.error = world.in_labels(f"{type(error).__name__}: {error}")
            outcome.failure = classify_failure(error, world.recorder.uncovered)
        except trio.TooSlowError:
            outcome.error = f"timeout: still running after {world.timings.request_timeout:g} s"
            outcome.failure = TIMEOUT
        finally:
            outcome.failovers = session.failovers
            outcome.avoided = dict(session.avoided)
            outcome.routes = [[(world.label(h.peer_id), h.start, h.end) for h in r.hops] for r in session.routes]
            with trio.CancelScope(shield=True):
                await session.close()
            world.recorder.request_finished(outcome)


__all__ = ["SimRequester"]
