"""Keeping a generation alive while peers refuse, fail or vanish.

`ResilientSession` wraps a `RouteSession`: opening it routes around peers that
refuse (busy, draining) and bans ones that fail. (Mid-answer failover is added
on top of this in the recovery work.)
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from .errors import NoRoute, PeerFailed, SessionRefused
from .route_session import RouteSession, route_summary
from .routing import Route

if TYPE_CHECKING:
    from .client import Swarm

MAX_OPEN_ATTEMPTS = 5
# A peer that refused (busy, draining) is skipped for this long by this requester.
REFUSED_BACKOFF = 10.0
# A peer that failed is banned for this long, doubling with each further failure.
BAN_BASE = 30.0
BAN_CAP = 3600.0


class ResilientSession:
    def __init__(self, swarm: "Swarm", *, max_length: int, route_wait: float) -> None:
        self.swarm = swarm
        self.max_length = max_length
        self.route_wait = route_wait
        self.current: RouteSession | None = None
        self.routes: list[Route] = []
        self.failovers = 0
        self._strikes: dict[str, int] = {}

    def ban(self, peer: str, reason: str, *, seconds: float | None = None) -> None:
        strikes = self._strikes[peer] = self._strikes.get(peer, 0) + 1
        duration = seconds if seconds is not None else min(BAN_CAP, BAN_BASE * 2 ** (strikes - 1))
        self.swarm.banned[peer] = time.monotonic() + duration
        self.swarm.ctx.tracer.emit("ban", remote=peer, detail={"reason": reason[:200], "seconds": duration})

    async def open(self) -> None:
        last_error: Exception | None = None
        for _ in range(MAX_OPEN_ATTEMPTS):
            chosen = await self.swarm.wait_for_route(self.route_wait)
            session = RouteSession(self.swarm.ctx, chosen, max_length=self.max_length)
            try:
                await session.open()
            except SessionRefused as refused:
                self.ban(refused.peer, f"refused: {refused.code}", seconds=REFUSED_BACKOFF)
                last_error = refused
                continue
            except PeerFailed as failed:
                self.ban(failed.peer, failed.reason)
                last_error = failed
                continue
            self.current = session
            self.routes.append(chosen)
            return
        raise NoRoute(f"could not open a session after {MAX_OPEN_ATTEMPTS} routes: {last_error}")

    async def step(self, hidden: torch.Tensor, start_pos: int) -> torch.Tensor:
        assert self.current is not None, "open() first"
        return await self.current.step(hidden, start_pos)

    async def close(self) -> None:
        if self.current is not None:
            await self.current.close()

    def summary(self) -> dict:
        return {
            "route": route_summary(self.routes[-1]) if self.routes else [],
            "routes": [route_summary(r) for r in self.routes],
            "failovers": self.failovers,
        }
