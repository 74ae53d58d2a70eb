"""Small aggregation helpers shared by the processes' metrics."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable


def mean_by_key(rows: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the mean over the rows that have it (a metric that does not apply to a row,
    like `asked` for a follow-up context, is not counted as zero)."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for row in rows:
        for name, value in row.items():
            sums[name] = sums.get(name, 0.0) + value
            counts[name] = counts.get(name, 0) + 1
    return {name: sums[name] / counts[name] for name in sums}


class TrailingRate:
    """How fast a growing total grew over about the last `window_s` seconds, from samples
    (time, total) taken as it grows: busy seconds per second is a busy ratio, tokens per
    second over a budget's rate its utilisation. The oldest sample kept is the newest one
    at least `window_s` old, so the rate covers the whole window once there is one."""

    def __init__(self, window_s: float = 60.0) -> None:
        self.window_s = window_s
        self.samples: deque[tuple[float, float]] = deque()

    def add(self, now: float, total: float) -> float:
        """Record a sample; returns the rate since the oldest sample kept (0 with one)."""
        self.samples.append((now, total))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()
        start, start_total = self.samples[0]
        return (total - start_total) / (now - start) if now > start else 0.0


class BusyClock:
    """Seconds during which at least one piece of work was in progress (overlapping work
    counts once): an engine is busy while any request is being generated."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.active = 0
        self.since = 0.0
        self.total_s = 0.0

    def start(self) -> None:
        if self.active == 0:
            self.since = self.clock()
        self.active += 1

    def stop(self) -> None:
        self.active -= 1
        if self.active == 0:
            self.total_s += self.clock() - self.since

    def busy_s(self) -> float:
        """Busy seconds so far, the current busy stretch included."""
        return self.total_s + (self.clock() - self.since if self.active else 0.0)
