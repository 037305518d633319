"""One keyed back-off/ban policy: who is avoided until when, doubling per repeat.

A failure of `key` bans it for `base` seconds, doubling with each further failure
(strikes) up to `cap`. Strikes are kept: a peer that failed before is avoided longer when
it fails again, however well it served in between (`cap` bounds the ban). Pure: every call
takes `now` (whatever clock the owner runs on: time.monotonic in a live requester, trio's
MockClock in the simulator), so the same object serves both and tests need no clock.
The requester's `Swarm` owns one (the simulator's requesters are `Swarm`s too), so strikes
survive from one answer to the next.
"""

from __future__ import annotations

from typing import Iterator


class Backoff:
    """Bans keyed by peer id: `until(key)` is when the ban on `key` ends (0.0: never banned)."""

    def __init__(self, base: float, cap: float) -> None:
        if not 0 < base <= cap:
            raise ValueError(f"back-off base must be > 0 and <= cap, got base={base!r} cap={cap!r}")
        self.base = base
        self.cap = cap
        self._strikes: dict[str, int] = {}
        self._until: dict[str, float] = {}

    def register_failure(self, key: str, now: float, *, seconds: float | None = None) -> float:
        """Count a strike against `key` and ban it from `now` for `seconds`, or, when not
        given, for base * 2 ** (strikes - 1) capped at `cap`. Returns the ban's length."""
        strikes = self._strikes[key] = self._strikes.get(key, 0) + 1
        duration = seconds if seconds is not None else min(self.cap, self.base * 2 ** (strikes - 1))
        self._until[key] = now + duration
        return duration

    def ban_until(self, key: str, until: float) -> None:
        """Avoid `key` until at least `until` (no strike: a ban for what others proved)."""
        self._until[key] = max(self._until.get(key, 0.0), until)

    def is_banned(self, key: str, now: float) -> bool:
        return self._until.get(key, 0.0) > now

    def until(self, key: str) -> float:
        return self._until.get(key, 0.0)

    def strikes(self, key: str) -> int:
        return self._strikes.get(key, 0)

    def banned(self, now: float) -> Iterator[str]:
        """The keys banned at `now`, in the order they were first banned."""
        return (key for key, until in self._until.items() if until > now)

    def clear(self) -> None:
        """Forget every ban and strike."""
        self._strikes.clear()
        self._until.clear()
