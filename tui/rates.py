"""Tokens served per second, from the peer's cumulative counters.

The peer counts tokens served since it started (`status()["stats"]["tokens"]`);
the rate is the change between two snapshots over the time between them, measured
on the peer's own clock (each snapshot carries ``at``), so a UI that misses or
repeats a snapshot still gets the right rate.

    history = RateHistory()
    history.add(snapshot["at"], snapshot["stats"]["tokens"])
    history.series(60)  # the last WINDOW seconds in 60 equal buckets, oldest first: the sparkline
    history.current()   # the rate over the last RECENT seconds
"""

from __future__ import annotations

import bisect
import collections

WINDOW = 300.0  # seconds the sparkline spans: "the last minutes"
RECENT = 5.0  # seconds the headline rate averages over: steadier than one interval


class RateHistory:
    """Samples of a cumulative counter over the last `window` seconds."""

    def __init__(self, window: float = WINDOW) -> None:
        self.window = window
        self.samples: collections.deque[tuple[float, int]] = collections.deque()

    def add(self, at: float, total: int) -> bool:
        """Record `total` at time `at`; False (and ignored) if it is not newer than the last sample."""
        if self.samples and at <= self.samples[-1][0]:
            return False
        if self.samples and total < self.samples[-1][1]:
            self.samples.clear()  # the counter restarted (a new peer behind the same UI)
        self.samples.append((at, total))
        while len(self.samples) > 2 and self.samples[1][0] < at - self.window:
            self.samples.popleft()
        return True

    def current(self, recent: float = RECENT) -> float:
        """The average rate over the last `recent` seconds (0.0 until two samples)."""
        if len(self.samples) < 2:
            return 0.0
        end_at, end = self.samples[-1]
        start_at, start = self.samples[-2]
        for at, total in reversed(self.samples):
            if at < end_at - recent:
                break
            start_at, start = at, total
        if start_at == end_at:
            start_at, start = self.samples[-2]
        return (end - start) / (end_at - start_at)

    def series(self, buckets: int) -> list[float]:
        """Average rates over the last `window` seconds in `buckets` equal buckets, oldest first.

        Anchored to the newest sample, so the right edge of a sparkline is always "now"
        and the left edge `window` seconds ago; buckets before the first sample are 0.
        """
        if len(self.samples) < 2 or buckets < 1:
            return [0.0] * max(buckets, 0)
        times = [at for at, _ in self.samples]
        end, width = times[-1], self.window / buckets
        # the counter at each bucket edge: the last sample taken at or before it (or the first)
        totals = [self.samples[max(0, bisect.bisect_right(times, end - self.window + i * width) - 1)][1]
                  for i in range(buckets + 1)]
        return [(b - a) / width for a, b in zip(totals, totals[1:])]
