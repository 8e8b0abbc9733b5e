"""Per-key and per-identity limits: the flags' text (relay.limits) and the planning over
several budgets at once (``SendBudget.plan_scoped``), on a clock the tests set by hand.

The property test plans sends of many keys for several relays in turn, as the budgets' lock
orders them, and checks every key's schedule: no sliding second of its starts over its limit.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from outbox.exceptions import ConfigurationError
from relay.config import RelayConfig
from relay.limits import Limits, ScopeLimit, parse_limit
from relay.ratelimit import (
    IN_FLIGHT_LOOK,
    IN_FLIGHT_WAIT,
    SHARED,
    WINDOW,
    Booking,
    RateController,
    ScopedSend,
    SendBudget,
)
from tests.support.hand_clocks import Clock

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def budget(total: float | None, clock: Clock) -> SendBudget:
    return SendBudget(RateController(total), clock=clock, handoff=0.0)


# -- the flags ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "kind", "expected"),
    [
        ("tenant-*=5/s", "key", ScopeLimit(kind="key", pattern="tenant-*", rate=5.0)),
        ("a=inflight:3", "key", ScopeLimit(kind="key", pattern="a", in_flight=3)),
        ("a=0.5/s, inflight:2", "key", ScopeLimit(kind="key", pattern="a", rate=0.5, in_flight=2)),
        (
            "Example.COM=10/s",
            "identity",
            ScopeLimit(kind="identity", pattern="example.com", rate=10),
        ),
    ],
)
def test_a_limit_reads_its_pattern_rate_and_sends_in_flight(text, kind, expected):
    assert parse_limit(text, kind, "--x") == expected
    assert parse_limit(str(expected), kind, "--x") == expected  # says itself as it was given


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("tenant", "expected PATTERN=RATE/s"),
        ("=5/s", "expected PATTERN=RATE/s"),
        ("a=", "expected PATTERN=RATE/s"),
        ("a=5", "'5' is not understood"),
        ("a=5/m", "'5/m' is not understood"),
        ("a=0/s", "the rate must be from 0.001"),
        ("a=inflight:0", "inflight must be from 1"),
        ("a=5/s,6/s", "'6/s' is not understood"),
        ("a=inflight:1,inflight:2", "'inflight:2' is not understood"),
        ("a=-1/s", "'-1/s' is not understood"),
        ("x=5/s=3/s", "one '=' only"),
    ],
)
def test_a_bad_limit_names_its_flag_and_what_is_wrong(text, says):
    with pytest.raises(ConfigurationError) as raised:
        RelayConfig(database_url="sqlite://", key_limits=(text,))
    assert raised.value.setting == "--key-limit"
    assert says in raised.value.reason


@pytest.mark.parametrize(
    ("first", "then"),
    [("tenant-*=5/s", "tenant-*=inflight:2"), ("*=100/s", "vip-*=5/s"), ("t-*=1/s", "t-1=9/s")],
)
def test_a_limit_an_earlier_one_covers_is_refused_not_dropped(first, then):
    with pytest.raises(ConfigurationError) as raised:
        RelayConfig(database_url="sqlite://", key_limits=(first, then))
    assert raised.value.setting == "--key-limit"
    assert f"'{then}' never applies" in raised.value.reason


@pytest.mark.parametrize(
    ("first", "then"),
    [
        ("example.com=10/s", "*@example.com=2/s"),  # the domain is tried for every address
        ("example.com=10/s", "mail.example.com=2/s"),
        ("example.com=10/s", "shop@mail.example.com=1/s"),
    ],
)
def test_an_identity_limit_a_domain_before_it_covers_is_refused(first, then):
    with pytest.raises(ConfigurationError, match="never applies"):
        RelayConfig(database_url="sqlite://", identity_limits=(first, then))


@pytest.mark.parametrize(
    ("first", "then"),
    [
        ("shop-?????=1/s", "shop-[0-9]=2/s"),
        ("[*]x=1/s", "*x=2/s"),
        ("tenant-?*=1/s", "tenant-*=2/s"),
    ],
)
def test_two_limits_that_each_apply_to_some_key_are_both_kept(first, then):
    config = RelayConfig(database_url="sqlite://", key_limits=(first, then))
    assert len(config.limits) == 2


def test_narrower_patterns_first_are_each_kept():
    config = RelayConfig(database_url="sqlite://", key_limits=("vip-*=5/s", "*=100/s"))
    assert [limit.pattern for limit in config.limits] == ["vip-*", "*"]


def test_one_limit_given_as_text_is_one_limit_not_its_characters():
    config = RelayConfig(database_url="sqlite://", identity_limits="example.com=2/s")  # type: ignore[arg-type]
    assert config.limits == (ScopeLimit(kind="identity", pattern="example.com", rate=2.0),)


def test_each_matching_key_has_a_scope_of_its_own_and_the_first_limit_wins():
    limits = Limits(
        [
            parse_limit("vip-*=50/s", "key", "--key-limit"),
            parse_limit("*=5/s,inflight:2", "key", "--key-limit"),
            parse_limit("*@example.com=1/s", "identity", "--identity-limit"),
            parse_limit("example.com=10/s", "identity", "--identity-limit"),
        ]
    )
    vip = limits.scopes("vip-1", "Shop <Shop@Example.com>")
    assert [(name, limit.rate) for name, limit in vip] == [
        ("key:vip-1", 50.0),
        ("identity:shop@example.com", 1.0),
    ]
    other = limits.scopes("t-9", "news@mail.example.com")
    assert [(name, limit.rate, limit.in_flight) for name, limit in other] == [
        ("key:t-9", 5.0, 2),
        ("identity:example.com", 10.0, None),  # the domain above the address's
    ]
    assert limits.scopes(None, "a@elsewhere.org") == ()
    assert not Limits()


# -- planning over several budgets -----------------------------------------------------------


def send(*rates: tuple[str, float], caps: tuple[tuple[str, int], ...] = ()) -> ScopedSend:
    return ScopedSend(recipients=1, rates=rates, caps=caps)


def test_a_send_its_own_key_holds_back_goes_back_in_line_and_the_next_key_goes_on():
    clock = Clock(T0)
    plan = budget(None, clock)
    a, b = ("key:a", 1.0), ("key:b", 1.0)
    planned = plan.plan_scoped({}, {}, [send(a), send(a), send(b)], T0)
    assert planned[0].start == T0
    assert planned[1].start is None  # a's second: a second and the slack later, past the horizon
    assert planned[1].wait_until is not None
    assert planned[1].wait_until > T0
    assert planned[2].start == T0  # b is not held back by a
    assert [scope for scope, _ in planned[2].bookings] == ["key:b"]


def test_the_shared_budget_full_stops_the_plan_keeping_the_order():
    clock = Clock(T0)
    plan = budget(1.0, clock)
    shared = (SHARED, 1.0)
    planned = plan.plan_scoped({SHARED: []}, {}, [send(shared), send(shared, ("key:b", 9))], T0)
    assert len(planned) == 1  # the second waits in line: the shared second is used
    assert plan.available() == 0


def test_a_send_waits_for_every_budget_it_belongs_to():
    clock = Clock(T0)
    plan = budget(10.0, clock)
    busy = [
        Booking(start=T0 - timedelta(seconds=0.9), recipients=1, until=T0 - timedelta(seconds=0.9))
    ]
    planned = plan.plan_scoped(
        {SHARED: [], "key:a": busy}, {}, [send((SHARED, 10.0), ("key:a", 1.0))], T0
    )
    (only,) = planned
    assert only.start == T0 + timedelta(seconds=0.15)  # when a's one send leaves its span
    assert dict(only.bookings).keys() == {SHARED, "key:a"}


def test_a_key_at_its_sends_in_flight_keeps_a_cap_of_claims_queued_and_sends_back_the_rest():
    """Up to the cap wait in the queue for a slot (a send ending may free one any moment);
    the rest go back in line a while, so they hold no queue place other keys could use."""
    clock = Clock(T0)
    plan = budget(None, clock)
    capped = send(caps=(("key:a", 2),))
    planned = plan.plan_scoped({}, {"key:a": 1}, [capped] * 6, T0)
    assert planned[0].start == T0
    assert planned[0].bookings == ()  # no rate: nothing to book, a slot only
    assert [p.kept for p in planned[1:]] == [True, True, False, False, False]
    assert [p.wait_until for p in planned[3:]] == [T0 + IN_FLIGHT_WAIT] * 3
    assert {(p.held_by, p.retry_at) for p in planned[1:]} == {("key:a", T0 + IN_FLIGHT_LOOK)}


def test_a_key_at_its_rate_is_looked_at_again_when_its_budget_has_room():
    clock = Clock(T0)
    plan = budget(None, clock)
    first, second, third = plan.plan_scoped({}, {}, [send(("key:a", 1.0))] * 3, T0)
    assert first.start == T0
    # its next room: a window and the slack after the first, less how far ahead it books
    opening = T0 + timedelta(seconds=1.05) - plan.reach
    assert (second.retry_at, second.wait_until) == (opening, opening)
    assert third.wait_until == opening + timedelta(seconds=1.05)  # the one after it
    assert second.held_by == third.held_by == "key:a"


def test_what_a_scope_sent_back_in_one_plan_the_next_plan_sends_back_after_it():
    """A key at 1/s whose claims keep coming: each plan's claims go back after the last one
    sent back, a second (and the slack) apart, so each claim goes back about once, not every
    pass."""
    clock = Clock(T0)
    plan = budget(None, clock)
    booked: dict[str, list[Booking]] = {}
    first = plan.plan_scoped(booked, {}, [send(("key:a", 1.0))] * 3, T0)
    assert first[0].start == T0
    clock.advance(0.1)
    second = plan.plan_scoped(booked, {}, [send(("key:a", 1.0))] * 2, clock.now)
    waits = [p.wait_until for p in (*first[1:], *second)]
    assert all(w is not None for w in waits)
    assert waits == sorted(waits)
    # a window and the slack apart, as the budget books them
    assert [round((w - waits[0]).total_seconds(), 3) for w in waits] == [0, 1.05, 2.1, 3.15]


@settings(max_examples=60, deadline=None)
@given(
    rates=st.lists(st.sampled_from([0.5, 1.0, 3.0, 10.0]), min_size=1, max_size=4),
    waves=st.lists(
        st.tuples(st.integers(0, 2), st.lists(st.integers(0, 3), min_size=1, max_size=12)),
        min_size=1,
        max_size=25,
    ),
)
def test_every_keys_sliding_second_stays_within_its_limit_whatever_relays_plan_it(rates, waves):
    """Relays (0-2) plan waves of sends of keys (indexes into ``rates``) in turn, each at a
    clock that moves on by a tenth of a second a wave; every key's starts, merged over all
    relays, keep every sliding second within its rate."""
    clock = Clock(T0)
    relays = [budget(None, clock) for _ in range(3)]
    booked: dict[str, list[Booking]] = {}
    starts: dict[str, list[datetime]] = {}
    for relay, keys in waves:
        sends = [send((f"key:{k % len(rates)}", rates[k % len(rates)])) for k in keys]
        for one, planned in zip(
            sends, relays[relay].plan_scoped(booked, {}, sends, clock.now), strict=True
        ):
            if planned.start is not None:
                ((scope, _rate),) = one.rates
                starts.setdefault(scope, []).append(planned.start)
        booked = {
            scope: [b for b in bs if b.start >= clock.now - 2 * WINDOW]
            for scope, bs in booked.items()
        }
        clock.advance(0.1)
    for scope, times in starts.items():
        rate = rates[int(scope.split(":")[1])]
        times.sort()
        for first in times:
            window = [t for t in times if first <= t < first + WINDOW]
            assert len(window) <= max(1, math.floor(rate)), (scope, rate, times)
