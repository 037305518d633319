"""Tokens served per second, from the peer's cumulative counters.

The peer counts tokens served since it started (`status()["stats"]["tokens"]`);
the rate is the change between two snapshots over the time between them, measured
on the peer's own clock (each snapshot carries ``at``), so a UI that misses or
repeats a snapshot still gets the right rate.

    history = RateHistory()
    history.add(snapshot["at"], snapshot["stats"]["tokens"])
    history.series(60)  # the last WINDOW seconds in 60 equal buckets, oldest first: the sparkline
    history.current()   # the rate over the last RECENT seconds
    history.peak        # the highest `current()` since the UI opened

Tokens of the interval ending at a sample count at that sample (the counter is
only known at samples). `current()` always divides by the same RECENT seconds, so
it cannot rise while the counter stands still, and the peak — the highest
`current()` seen — only moves when tokens are served.
"""

from __future__ import annotations

import bisect
import collections
import math

WINDOW = 300.0  # seconds the sparkline spans: "the last minutes"
RECENT = 5.0  # seconds the headline rate averages over: steadier than one interval


class RateHistory:
    """Samples of a cumulative counter over the last `window` seconds."""

    def __init__(self, window: float = WINDOW) -> None:
        self.window = window
        self.samples: collections.deque[tuple[float, int]] = collections.deque()
        self.peak = 0.0  # the highest current() seen at any sample; kept when old samples age out

    def add(self, at: float, total: int) -> bool:
        """Record `total` at time `at`; False (and ignored) if it is not newer than the last sample."""
        if self.samples and at <= self.samples[-1][0]:
            return False
        if self.samples and total < self.samples[-1][1]:
            self.samples.clear()  # the counter restarted (a new peer behind the same UI)
            self.peak = 0.0
        self.samples.append((at, total))
        while len(self.samples) > 2 and self.samples[1][0] < at - self.window:
            self.samples.popleft()
        self.peak = max(self.peak, self.current())
        return True

    def current(self, recent: float = RECENT) -> float:
        """Tokens counted in the last `recent` seconds over those seconds (0.0 until two samples).

        The counter at the window's start is the last sample at or before it, and the
        divisor is `recent` itself (or the time since the first sample, if shorter): as the
        window slides over a still counter, the count can only fall and the divisor stays.
        """
        if len(self.samples) < 2:
            return 0.0
        end_at, end = self.samples[-1]
        first_at = self.samples[0][0]
        start_at = max(end_at - recent, first_at)
        times = [at for at, _ in self.samples]
        start = self.samples[max(0, bisect.bisect_right(times, start_at) - 1)][1]
        return (end - start) / (end_at - start_at)

    def series(self, buckets: int) -> list[float]:
        """Average rates over the last `window` seconds in `buckets` equal buckets, oldest first.

        The bucket edges sit on a fixed grid (multiples of the bucket's width), the last one
        at or just after the newest sample, so a counter that stands still gives the same
        series until the grid moves on a bucket (it scrolls once a bucket, 5 s, not at every
        snapshot: edges anchored to the newest sample slid over the samples twice a second and
        redrew an idle sparkline as often); buckets before the first sample are 0.
        """
        if len(self.samples) < 2 or buckets < 1:
            return [0.0] * max(buckets, 0)
        times = [at for at, _ in self.samples]
        width = self.window / buckets
        end = math.ceil(times[-1] / width) * width
        # the counter at each bucket edge: the last sample taken at or before it (or the first)
        totals = [self.samples[max(0, bisect.bisect_right(times, end - self.window + i * width) - 1)][1]
                  for i in range(buckets + 1)]
        return [(b - a) / width for a, b in zip(totals, totals[1:])]
