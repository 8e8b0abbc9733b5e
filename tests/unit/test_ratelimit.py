"""relay.ratelimit.SlidingWindowLimiter, on a fake clock the tests move by hand."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from relay.ratelimit import RateController, SlidingWindowLimiter


class Clock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def limiter(rate: float | None, clock: Clock, window: float = 1.0) -> SlidingWindowLimiter:
    return SlidingWindowLimiter(rate, window=window, clock=clock)


def test_no_rate_means_no_limit():
    clock = Clock()
    unlimited = limiter(None, clock)
    assert all(unlimited.try_take(50) for _ in range(10_000))
    assert unlimited.available() == math.inf
    assert unlimited.seconds_until_available() == 0.0


def test_the_rate_is_a_hard_cap_within_one_window():
    clock = Clock()
    lim = limiter(10, clock)
    assert lim.available() == 10
    assert lim.try_take(4)
    assert lim.try_take(6)
    assert lim.available() == 0
    assert not lim.try_take(1)
    clock.advance(0.5)
    assert not lim.try_take(1)
    clock.advance(0.25)
    assert not lim.try_take(1)
    assert lim.seconds_until_available() == 0.25


def test_a_refused_take_consumes_nothing():
    clock = Clock()
    lim = limiter(5, clock)
    assert lim.try_take(3)
    assert not lim.try_take(3)
    assert lim.available() == 2
    assert lim.try_take(2)
    assert lim.available() == 0


def test_capacity_frees_as_the_oldest_sends_leave_the_window():
    clock = Clock()
    lim = limiter(10, clock)
    assert lim.try_take(4)  # at t=0
    clock.advance(0.5)
    assert lim.try_take(6)  # at t=0.5
    assert lim.seconds_until_available() == 0.5
    clock.advance(0.25)  # t=0.75: both still in the window
    assert lim.available() == 0
    assert lim.seconds_until_available() == 0.25
    clock.advance(0.25)  # t=1.0: the first send leaves the window
    assert lim.available() == 4
    assert lim.seconds_until_available() == 0.0
    assert not lim.try_take(5)
    assert lim.try_take(4)
    assert lim.seconds_until_available() == 0.5
    clock.advance(0.5)  # t=1.5: the second send leaves
    assert lim.available() == 6
    clock.advance(1.0)  # t=2.5: everything has left
    assert lim.available() == 10
    assert lim.try_take(10)


def test_waiting_the_time_it_reports_is_enough_and_no_longer():
    clock = Clock()
    lim = limiter(3, clock)
    for _ in range(30):
        clock.advance(lim.seconds_until_available())
        assert lim.try_take(1)
    # Three at t=0, three at t=1, ... three at t=9: never early, never later than needed.
    assert clock.now == 1009.0


def test_a_message_bigger_than_the_rate_goes_alone():
    clock = Clock()
    lim = limiter(5, clock)
    assert lim.try_take(8)  # an empty window lets it through
    assert lim.available() == 0
    assert not lim.try_take(1)
    clock.advance(0.5)
    assert not lim.try_take(1)
    assert lim.seconds_until_available() == 0.5
    clock.advance(0.5)
    assert lim.available() == 5
    assert lim.try_take(1)
    # Not in a window that already holds something.
    assert not lim.try_take(8)
    clock.advance(1.0)
    assert lim.try_take(8)


def test_a_longer_window_counts_over_its_whole_length():
    clock = Clock()
    lim = limiter(100, clock, window=60.0)
    assert lim.try_take(50)
    clock.advance(30.0)
    assert lim.try_take(50)
    clock.advance(29.0)
    assert not lim.try_take(1)
    assert lim.seconds_until_available() == 1.0
    clock.advance(1.0)
    assert lim.available() == 50


@given(
    rate=st.integers(min_value=1, max_value=20),
    steps=st.lists(
        st.tuples(st.integers(min_value=0, max_value=700), st.integers(min_value=1, max_value=30)),
        max_size=80,
    ),
)
def test_no_window_ever_holds_more_than_the_rate(rate, steps):
    """Integer milliseconds with a 1000 ms window, so the arithmetic is exact."""
    clock = Clock(start=0)
    lim = limiter(rate, clock, window=1000)
    taken: list[tuple[int, int]] = []
    for wait, recipients in steps:
        clock.advance(wait)
        recent = sum(n for t, n in taken if t > clock.now - 1000)
        allowed = lim.try_take(recipients)
        # It refuses only when the message would not fit next to what is in the window.
        assert allowed == (recent == 0 or recent + recipients <= rate)
        if allowed:
            taken.append((clock.now, recipients))
    for start, _ in taken:
        window = [n for t, n in taken if start <= t < start + 1000]
        assert sum(window) <= rate or len(window) == 1


class Tick:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_rate_controller_splits_the_total_between_live_relays():

    limiter = SlidingWindowLimiter(None)
    controller = RateController(limiter, 90.0)
    assert limiter.rate == 90.0
    controller.set_replicas(3)
    assert limiter.rate == 30.0
    controller.set_replicas(0)  # never divide by zero: this relay is alive
    assert limiter.rate == 90.0
    controller.set_total(None)
    assert limiter.rate is None


def test_rate_controller_halves_on_throttling_and_recovers_linearly():

    clock = Tick()
    limiter = SlidingWindowLimiter(None, clock=clock)
    controller = RateController(limiter, 100.0, clock=clock)
    controller.on_throttle()
    assert limiter.rate == 50.0
    controller.on_throttle()
    assert limiter.rate == 25.0
    clock.t += 5.0
    controller.tick()
    assert limiter.rate == pytest.approx(50.0)  # +5% of the share per second
    clock.t += 100.0
    controller.tick()
    assert limiter.rate == 100.0
    for _ in range(20):
        controller.on_throttle()
    assert limiter.rate == pytest.approx(100.0 * RateController.FLOOR)


def test_a_rate_below_one_per_second_widens_the_window():
    clock = Tick()
    limiter = SlidingWindowLimiter(0.25, clock=clock)
    assert limiter.try_take(1)
    clock.t += 3.9
    assert not limiter.try_take(1)
    clock.t += 0.2
    assert limiter.try_take(1)
