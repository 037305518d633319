"""A stage's sessions: one `SessionCache` per session, over a sub-span of the stage's layers.

Shared by `Stage` (whole heads) and `ShardedStage` (its rank's heads): a session may
use a sub-span of the stage, which is what lets a requester route around a dead peer
with different cut points. Each layer's store is of the layer's cache kind
(`cache_specs`), and its checks come before any allocation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable

import torch

from tessera.stages.errors import ContextOverflow, SpanError, UnknownSession
from tessera.stages.families.spec.model import ModelSpec
from tessera.stages.layers.cache import AnyCacheSpec, SessionCache, session_bytes


@dataclass
class SessionState:
    """One session's cache and the sub-span [start, end) of layers it runs."""

    cache: SessionCache
    start: int
    end: int


def check_session(stage: tuple[int, int], start: int | None, end: int | None, capacity: int,
                  max_position: int) -> tuple[int, int]:
    """The session's span (the whole stage's when not given), or SpanError / ContextOverflow."""
    start = stage[0] if start is None else start
    end = stage[1] if end is None else end
    if not stage[0] <= start <= end <= stage[1]:
        raise SpanError(f"session span [{start}, {end}) is outside this stage's [{stage[0]}, {stage[1]})")
    if not 0 < capacity <= max_position:
        raise ContextOverflow(f"session capacity {capacity!r} is outside (0, {max_position}] (the model's context)")
    return start, end


class SessionTable:
    """Session bookkeeping for a stage class with `start`, `end`, `spec`, `dtype`, `device`,
    `sessions` and `cache_specs` (what its sessions' caches hold per layer)."""

    start: int
    end: int
    spec: ModelSpec
    dtype: torch.dtype
    device: torch.device
    sessions: dict[Hashable, SessionState]

    def cache_specs(self, start: int, end: int) -> list[AnyCacheSpec]:
        """The cache of each layer of [start, end) as this stage keeps it (a shard: its own heads)."""
        return [self.spec.layers[i].cache for i in range(start, end)]

    def open(self, session: Hashable, *, capacity: int, start: int | None = None, end: int | None = None) -> None:
        """Open a session over layers [start, end) whose KV cache may grow to `capacity` positions
        (it is allocated in chunks as steps reach them: layers/cache.py `SessionCache`)."""
        start, end = check_session((self.start, self.end), start, end, capacity, self.spec.max_position)
        self.spec.check_span_start(start, end)
        self.close(session)  # a session opened again starts afresh (and gives back what it held)
        with torch.inference_mode():
            cache = self._new_cache(start, end, capacity)
        self.sessions[session] = SessionState(cache, start, end)

    def _new_cache(self, start: int, end: int, capacity: int) -> SessionCache:
        return SessionCache(self.cache_specs(start, end), capacity, dtype=self.dtype, device=self.device, first=start)

    def close(self, session: Hashable) -> None:
        self.sessions.pop(session, None)

    def position(self, session: Hashable) -> int:
        return self._session(session).cache.length

    def rollback(self, session: Hashable, position: int) -> None:
        self._session(session).cache.rollback(position)

    def session_bytes(self, capacity: int, start: int | None = None, end: int | None = None) -> int:
        """KV bytes a session of `capacity` positions over layers [start, end) (default: the whole
        stage) costs, each layer per its cache kind (to check limits before allocating)."""
        start = self.start if start is None else start
        end = self.end if end is None else end
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return session_bytes(self.cache_specs(start, end), capacity, itemsize)

    def _session(self, session: Hashable) -> SessionState:
        try:
            return self.sessions[session]
        except KeyError:
            raise UnknownSession(f"no session {session!r} on this stage") from None
