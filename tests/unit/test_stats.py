"""The rate and busy-time helpers behind the idleness gauges, on a clock the test moves."""

from __future__ import annotations

import pytest

from services.stats import BusyClock, TrailingRate


def test_trailing_rate_covers_about_the_last_window():
    rate = TrailingRate(window_s=60.0)
    assert rate.add(0.0, 0.0) == 0.0  # one sample: no rate yet
    assert rate.add(30.0, 15.0) == pytest.approx(0.5)
    assert rate.add(60.0, 15.0) == pytest.approx(0.25)  # 15 over the 60 s since t = 0
    # At t = 100 the newest sample at least 60 s old is t = 30: the rate is over (30, 100].
    assert rate.add(100.0, 50.0) == pytest.approx(35.0 / 70.0)
    assert [t for t, _ in rate.samples] == [30.0, 60.0, 100.0]


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_busy_clock_counts_overlapping_work_once():
    clock = Clock()
    busy = BusyClock(clock)
    busy.start()  # t = 0: one request
    clock.now = 2.0
    busy.start()  # t = 2: two overlapping
    clock.now = 3.0
    busy.stop()
    assert busy.busy_s() == pytest.approx(3.0)  # still busy: counts up to now
    clock.now = 5.0
    busy.stop()  # idle from t = 5
    clock.now = 9.0
    assert busy.busy_s() == pytest.approx(5.0)
    busy.start()
    clock.now = 10.0
    assert busy.busy_s() == pytest.approx(6.0)
