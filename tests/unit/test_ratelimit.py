"""relay.ratelimit: the shared send budget's arithmetic, on clocks the tests set by hand.

Times are datetimes (the database's clock), so the arithmetic is exact to the microsecond.
The property tests book sends for several relays in turn, as the budget's lock orders them,
start each up to the slack late, and check the provider's view: every sliding second of
starts within the limit, every send over the limit alone for its time, the average kept.
"""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relay.ratelimit import (
    HORIZON,
    LATE_START,
    MAX_HANDOFF,
    SLACK,
    WINDOW,
    Booking,
    RateController,
    SendBudget,
    Slot,
    earliest_start,
    merged,
    occupation,
)
from tests.support.hand_clocks import Clock

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
SPAN = WINDOW + SLACK


def s(seconds: float) -> timedelta:
    return timedelta(seconds=seconds)


def at(seconds: float, recipients: int = 1, limit: float = math.inf) -> Booking:
    start = T0 + s(seconds)
    return Booking(start=start, recipients=recipients, until=start + occupation(recipients, limit))


def first(booked: list[Booking], recipients: int, limit: float, now: float = 0.0) -> float:
    start = earliest_start(booked, recipients, limit=limit, now=T0 + s(now), span=SPAN)
    return (start - T0).total_seconds()


def budget(total: float | None, clock: Clock) -> SendBudget:
    """A budget that books from ``now`` itself (no handoff to allow for), so the times the
    tests expect are the arithmetic's alone."""
    return SendBudget(RateController(total), clock=clock, handoff=0.0)


# -- the arithmetic --------------------------------------------------------------------------


def test_a_send_within_the_limit_holds_nothing_past_its_start():
    assert occupation(1, 10) == timedelta(0)
    assert occupation(10, 10) == timedelta(0)


def test_a_send_over_the_limit_holds_the_budget_for_what_its_recipients_are_worth():
    assert occupation(50, 10) == s(4)  # five seconds' worth, less the window holding its start
    assert occupation(11, 10) == s(0.1)
    assert occupation(1, 0.25) == s(3)  # at 0.25/s one recipient is worth four seconds
    assert occupation(3, 7) == timedelta(0)


def test_an_empty_budget_lets_a_send_start_now():
    assert first([], 1, limit=1, now=3.0) == 3.0
    assert first([], 50, limit=10, now=3.0) == 3.0


def test_at_one_per_second_sends_are_a_window_and_the_slack_apart():
    booked: list[Booking] = []
    starts = []
    for _ in range(4):
        start = first(booked, 1, limit=1)
        starts.append(start)
        booked.append(at(start, 1, 1))
    assert starts == [0.0, 1.05, 2.1, 3.15]


def test_a_send_waits_only_until_enough_has_left_the_window():
    booked = [at(0.0, 4), at(0.5, 6)]
    assert first(booked, 4, limit=10, now=0.6) == 1.05  # the 4 left: 6 + 4 fit
    assert first(booked, 5, limit=10, now=0.6) == 1.55  # the 6 must leave too
    assert first(booked, 0 + 1, limit=10, now=2.0) == 2.0  # everything has left


def test_sends_that_fit_together_share_a_start():
    booked = [at(0.0, 4), at(0.0, 5)]
    assert first(booked, 1, limit=10) == 0.0
    assert first(booked, 2, limit=10) == 1.05


def test_nothing_is_booked_before_the_last_booking():
    """Another relay booked a send for later in its horizon: the schedule only grows at its
    end, which is what keeps every window the new send falls in easy to check."""
    assert first([at(0.08, 1)], 1, limit=100, now=0.0) == 0.08


def test_a_send_over_the_limit_goes_alone_and_holds_the_budget_for_its_time():
    limit = 10
    booked = [at(0.0, 1)]
    big = first(booked, 50, limit=limit, now=0.2)
    assert big == 1.05  # alone: the send before it has left its window
    booked.append(at(big, 50, limit))
    assert booked[-1].until == T0 + s(5.05)
    after = first(booked, 1, limit=limit, now=big)
    assert after == pytest.approx(big + 5 + SLACK.total_seconds())  # 50 at 10/s: five seconds
    assert first(booked, 50, limit=limit, now=big) == after


def test_a_send_of_exactly_the_limit_needs_an_empty_window():
    assert first([at(0.0, 1)], 10, limit=10) == 1.05
    assert first([at(0.0, 10)], 1, limit=10) == 1.05


def test_a_limit_below_one_per_second_spaces_single_recipients():
    booked: list[Booking] = []
    for expected in (0.0, 4.05, 8.1):
        start = first(booked, 1, limit=0.25)
        assert start == pytest.approx(expected)
        booked.append(at(start, 1, 0.25))


def test_merged_keeps_the_schedule_in_fewer_bookings():
    rows = merged([at(0, 1), at(0, 2), at(0, 50, 10), at(1, 1), at(1, 1)])
    assert [(b.start, b.recipients) for b in rows] == [
        (T0, 3),
        (T0, 50),
        (T0 + s(1), 2),
    ]


# -- planning a wave -------------------------------------------------------------------------


def test_plan_books_what_starts_within_the_horizon_and_remembers_when_to_look_again():
    clock = Clock(T0)
    plan = budget(1.0, clock)
    assert plan.available() == 1
    booked = plan.plan([], [1, 1, 1], clock.now)
    assert [b.start for b in booked] == [T0]
    assert plan.available() == 0  # the next send could start at +1.05: beyond the horizon
    assert plan.seconds_until_available() == pytest.approx((SPAN - HORIZON).total_seconds())
    clock.advance((SPAN - HORIZON).total_seconds())
    assert plan.available() == 1
    assert plan.seconds_until_available() == 0


def test_plan_books_ahead_within_the_horizon():
    clock = Clock(T0)
    plan = budget(10.0, clock)
    booked = [at(-1.0, 8)]  # leaves the window at -1 + 1.05 = +0.05
    wave = plan.plan(booked, [2, 5, 1], clock.now)
    assert [(b.start - T0).total_seconds() for b in wave] == [0.0, 0.05, 0.05]


def test_plan_keeps_the_order_of_the_wave():
    """A small send behind one that must wait is not booked before it."""
    clock = Clock(T0)
    plan = budget(10.0, clock)
    wave = plan.plan([at(0.0, 5)], [8, 1], clock.now)
    assert wave == []
    assert plan.seconds_until_available() == pytest.approx((SPAN - HORIZON).total_seconds())


def test_a_throttled_relay_books_with_half_the_limit():
    ticks = [0.0]
    controller = RateController(10.0, clock=lambda: ticks[0])
    clock = Clock(T0)
    plan = SendBudget(controller, clock=clock)
    controller.on_throttle()
    assert plan.rate == 5.0
    wave = plan.plan([], [3, 3], clock.now)
    assert len(wave) == 1  # 6 > 5


def test_without_a_limit_there_is_no_budget():
    clock = Clock(T0)
    plan = budget(None, clock)
    assert plan.rate is None
    assert plan.available() == math.inf
    assert plan.seconds_until_available() == 0
    with pytest.raises(ValueError, match="no send limit"):
        plan.plan([], [1], clock.now)


def test_old_bookings_are_pruned_once_a_second():
    clock = Clock(T0)
    ticks = [100.0]
    plan = SendBudget(RateController(5.0), clock=clock, monotonic=lambda: ticks[0])
    assert plan.prune_due(clock.now) == T0 - SPAN
    assert plan.prune_due(clock.now) is None
    ticks[0] += 1.0
    assert plan.prune_due(clock.now + s(1)) == T0 + s(1) - SPAN


def slot(start: float) -> Slot:
    return Slot(planned=time.monotonic(), start=start)


def test_a_send_thread_waits_for_its_slot_and_refuses_to_start_late():
    plan = budget(1.0, Clock(T0))
    start = time.monotonic() + 0.03
    assert plan.wait(slot(start)) is None
    assert time.monotonic() >= start
    tolerated = LATE_START.total_seconds()
    assert plan.wait(slot(time.monotonic() - tolerated / 2)) is None  # late, but allowed
    late = plan.wait(slot(time.monotonic() - tolerated - 0.01))  # too late: no send
    assert late is not None
    assert late > tolerated
    assert LATE_START < SLACK  # the rest of the slack is for the way to the provider


def test_sends_are_booked_as_far_ahead_as_their_handoff_to_a_thread_takes():
    """A booking reaches its send thread only after the transaction commits: the budget
    learns how long that takes and books that far ahead, so threads wait instead of being
    late, and forgets a slow handoff again."""
    clock = Clock(T0)
    ticks = [100.0]
    plan = SendBudget(RateController(10.0), clock=clock, monotonic=lambda: ticks[0])
    assert plan.lead == s(0.05)  # a first guess: the first commit of a process is slow
    assert plan.plan([], [1], clock.now)[0].start == T0 + s(0.05)
    plan.wait(Slot(planned=ticks[0] - 0.08, start=ticks[0]))
    assert plan.lead == s(0.08)
    plan.wait(Slot(planned=ticks[0] - 0.01, start=ticks[0]))
    assert plan.lead == s(0.08)  # the longest of the last ones counts, not the last
    plan.wait(Slot(planned=ticks[0] - 1.0, start=ticks[0]))
    assert plan.lead == s(1.0)  # a database far away: book that far ahead, however far
    assert plan.plan([], [1], clock.now)[0].start == T0 + s(1.0)  # within reach: booked
    ticks[0] += 30.0  # three half-lives of quick handoffs
    plan.wait(Slot(planned=ticks[0] - 0.001, start=ticks[0]))
    assert plan.lead == s(0.125)  # 1 s faded to 1/8 s
    ticks[0] += 50.0
    plan.wait(Slot(planned=ticks[0] - 0.001, start=ticks[0]))
    assert plan.lead < s(0.01)
    plan.wait(Slot(planned=ticks[0] - 60.0, start=ticks[0]))  # a process frozen for a minute
    assert plan.lead == s(MAX_HANDOFF)


def test_a_handoff_longer_than_the_horizon_is_learnt_from_one_missed_slot():
    """With the database tens of milliseconds away, the commit alone outlasts the first guess:
    the first send misses its slot, and the next is booked far enough ahead to make its own
    (a lead capped below the handoff missed every slot, for ever)."""
    clock = Clock(T0)
    ticks = [100.0]
    plan = SendBudget(RateController(10.0), clock=clock, monotonic=lambda: ticks[0])
    handoff = 0.205  # four round trips of 50 ms and a thread's start
    first = plan.plan([], [1], clock.now)[0]
    late = plan.wait(Slot(planned=ticks[0] - handoff, start=ticks[0] - handoff + 0.05))
    assert late is not None  # missed, given back
    assert first.start == T0 + s(0.05)
    again = plan.plan([], [1], clock.now)
    assert again, "nothing booked: the lead outgrew the horizon"
    assert again[0].start >= clock.now + s(handoff)
    assert plan.wait(Slot(planned=ticks[0] - handoff, start=ticks[0])) is None  # on time


def test_rate_controller_halves_on_throttling_and_recovers_linearly():
    ticks = [0.0]
    controller = RateController(100.0, clock=lambda: ticks[0])
    controller.on_throttle()
    assert controller.rate == 50.0
    controller.on_throttle()
    assert controller.rate == 25.0
    ticks[0] += 5.0
    controller.tick()
    assert controller.rate == pytest.approx(50.0)  # +5% of the total per second
    ticks[0] += 100.0
    controller.tick()
    assert controller.rate == 100.0
    for _ in range(20):
        controller.on_throttle()
    assert controller.rate == pytest.approx(100.0 * RateController.FLOOR)


# -- properties: what the provider sees --------------------------------------------------------


def valid(bookings: list[Booking], limit: float, span: timedelta) -> bool:
    """Every window of ``span`` within the limit; one that meets a send over the limit (its
    start to the end of its hold) meets nothing else."""
    for a in sorted({b.start for b in bookings} | {b.until for b in bookings}):
        for lo in (a, a - span + timedelta(microseconds=1)):
            inside = [b for b in bookings if b.start < lo + span and b.until >= lo]
            big = [b for b in inside if b.recipients > limit]
            if big and len(inside) > 1:
                return False
            if sum(b.recipients for b in inside) > limit and not big:
                return False
    return True


@st.composite
def runs(draw):
    limit = draw(st.sampled_from([0.25, 1.0, 2.5, 10.0, 25.0]))
    passes = draw(
        st.lists(
            st.tuples(
                st.integers(min_value=0, max_value=1_500_000),  # µs since the previous pass
                st.lists(st.integers(min_value=1, max_value=60), min_size=1, max_size=6),
            ),
            min_size=1,
            max_size=25,
        )
    )
    lateness = draw(
        st.lists(
            st.integers(min_value=0, max_value=SLACK // timedelta(microseconds=1)),
            min_size=150,
            max_size=150,
        )
    )
    return limit, passes, lateness


def book(limit: float, passes) -> list[tuple[datetime, Booking]]:
    """Relays taking turns at the budget (its lock orders them): each pass books what its
    wave may start within the horizon. Returns (the pass's now, booking) in booking order."""
    clock = Clock(T0)
    plan = budget(limit, clock)
    schedule: list[Booking] = []
    made = []
    for gap, sizes in passes:
        clock.advance(gap / 1e6)
        since = plan.lookback(clock.now)
        booked = [b for b in schedule if b.until > since]
        for booking in plan.plan(booked, sizes, clock.now):
            assert clock.now <= booking.start <= clock.now + HORIZON
            schedule.append(booking)
            made.append((clock.now, booking))
    return made


@settings(max_examples=300, deadline=None)
@given(runs())
def test_no_second_at_the_provider_ever_holds_more_than_the_limit(run):
    limit, passes, lateness = run
    made = book(limit, passes)
    # each send really starts at its booking or up to the slack later
    starts = sorted(
        (b.start + timedelta(microseconds=lateness[i % len(lateness)]), b.recipients)
        for i, (_, b) in enumerate(made)
    )
    for i, (start, recipients) in enumerate(starts):
        window = [r for t, r in starts if start <= t < start + WINDOW]
        if recipients > limit:
            worth = timedelta(microseconds=math.ceil(recipients * 1e6 / limit))
            others = [t for j, (t, _) in enumerate(starts) if j != i]
            assert all(t <= start - WINDOW or t >= start + worth for t in others), (start, worth)
        elif all(r <= limit for t, r in starts if start <= t < start + WINDOW):
            assert sum(window) <= limit, (start, window)
    if starts:
        (t0, _), (tn, rn) = starts[0], starts[-1]
        total = sum(r for _, r in starts)
        worth_last = max(1.0, rn / limit)
        assert total <= limit * ((tn - t0).total_seconds() + worth_last) + 1e-6


def brute_earliest(schedule: list[Booking], recipients: int, limit: float, floor: datetime):
    """The earliest valid start no earlier than ``floor``, by trying every moment where a
    window's contents change (a booking leaving the stretch, a hold ending)."""
    candidates = {floor} | {t + SPAN for b in schedule for t in (b.start, b.until)}
    for start in sorted(c for c in candidates if c >= floor):
        trial = Booking(
            start=start, recipients=recipients, until=start + occupation(recipients, limit)
        )
        if valid([*schedule, trial], limit, SPAN):
            return start
    raise AssertionError("no valid start")


@settings(max_examples=200, deadline=None)
@given(runs())
def test_every_booking_is_the_earliest_that_keeps_the_windows(run):
    """Exact, not merely safe: each send is booked at the earliest moment a brute-force search
    finds, and one left for later could not have started within the horizon."""
    limit, passes, _ = run
    clock = Clock(T0)
    plan = budget(limit, clock)
    schedule: list[Booking] = []
    for gap, sizes in passes:
        clock.advance(gap / 1e6)
        wave = plan.plan(schedule, sizes, clock.now)
        for recipients, booking in zip(sizes, wave, strict=False):
            floor = max([clock.now, *(b.start for b in schedule[-1:])])
            assert booking.start == brute_earliest(schedule, recipients, limit, floor)
            schedule.append(booking)
        if len(wave) < len(sizes):
            floor = max([clock.now, *(b.start for b in schedule[-1:])])
            waiting = brute_earliest(schedule, sizes[len(wave)], limit, floor)
            assert waiting > clock.now + HORIZON
            assert plan.seconds_until_available() == pytest.approx(
                (waiting - HORIZON - clock.now).total_seconds(), abs=1e-6
            )
        assert valid(schedule, limit, SPAN)
