"""relay.policy.decide: every outcome x ambiguity policy x attempts left, and the backoff;
both draw their jitter from the random source they are given only."""

from __future__ import annotations

import random
import statistics
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox import AmbiguityPolicy
from outbox.schema import MAX_BACKOFF_SECONDS
from relay.policy import (
    THROTTLE_FLOOR_SECONDS,
    Action,
    Decision,
    LeaseExpired,
    MessageState,
    backoff_seconds,
    decide,
)
from relay.senders import Accepted, Ambiguous, Disabled, Permanent, Transient

NOW = datetime(2030, 6, 1, 8, 30, tzinfo=UTC)
SEED = 16
BASE, CAP, MAX_ATTEMPTS = 2.0, 900.0, 5
HOLD, RESEND = AmbiguityPolicy.HOLD, AmbiguityPolicy.RESEND
SENT, RETRY, FAIL, HOLD_, RELEASE = (
    Action.SENT,
    Action.RETRY,
    Action.FAIL,
    Action.HOLD,
    Action.RELEASE,
)

# attempt_count before this attempt, with max_attempts 5: the first attempt, one with more
# left after it, the last one, and a row already past its budget.
ATTEMPTS = {"first": 0, "more_left": 3, "last": 4, "over_budget": 7}

OUTCOMES = {
    "accepted": Accepted(provider_message_id="ses-123"),
    "accepted_without_id": Accepted(provider_message_id=None),
    "disabled": Disabled(code="SendingPaused", message="account paused"),
    "lease_expired_unstarted": LeaseExpired(send_started=False),
    "permanent": Permanent(code="MessageRejected", message="Email address is not verified"),
    "transient": Transient(code="ServiceUnavailable", message="503"),
    "throttled": Transient(code="Throttling", message="Maximum sending rate", throttled=True),
    "retry_after": Transient(code="TooManyRequests", retry_after=30.0),
    "ambiguous": Ambiguous(code="ReadTimeout", message="no response"),
    "lease_expired_started": LeaseExpired(send_started=True),
}

# The expected action per outcome, per policy, over ATTEMPTS in order
# (first, more_left, last, over_budget).
EXPECTED: dict[str, dict[AmbiguityPolicy, tuple[Action, ...]]] = {
    "accepted": {HOLD: (SENT,) * 4, RESEND: (SENT,) * 4},
    "accepted_without_id": {HOLD: (SENT,) * 4, RESEND: (SENT,) * 4},
    "disabled": {HOLD: (RELEASE,) * 4, RESEND: (RELEASE,) * 4},
    "lease_expired_unstarted": {HOLD: (RELEASE,) * 4, RESEND: (RELEASE,) * 4},
    "permanent": {HOLD: (FAIL,) * 4, RESEND: (FAIL,) * 4},
    "transient": {HOLD: (RETRY, RETRY, FAIL, FAIL), RESEND: (RETRY, RETRY, FAIL, FAIL)},
    "throttled": {HOLD: (RETRY, RETRY, FAIL, FAIL), RESEND: (RETRY, RETRY, FAIL, FAIL)},
    "retry_after": {HOLD: (RETRY, RETRY, FAIL, FAIL), RESEND: (RETRY, RETRY, FAIL, FAIL)},
    "ambiguous": {HOLD: (HOLD_,) * 4, RESEND: (RETRY, RETRY, HOLD_, HOLD_)},
    "lease_expired_started": {HOLD: (HOLD_,) * 4, RESEND: (RETRY, RETRY, HOLD_, HOLD_)},
}

# reconcile decides as hold does when the send happens; what differs comes later (the sweep).
for _per_policy in EXPECTED.values():
    _per_policy[AmbiguityPolicy.RECONCILE] = _per_policy[HOLD]

# The delay floor each retried outcome must honour.
FLOORS = {
    "transient": 0.0,
    "throttled": THROTTLE_FLOOR_SECONDS,
    "retry_after": 30.0,
    "ambiguous": 0.0,
    "lease_expired_started": 0.0,
}

CASES = [
    pytest.param(outcome, policy, label, action, id=f"{outcome}-{policy}-{label}")
    for outcome, per_policy in EXPECTED.items()
    for policy, actions in per_policy.items()
    for label, action in zip(ATTEMPTS, actions, strict=True)
]


@pytest.fixture
def rng() -> random.Random:
    return random.Random(SEED)


def state(attempt_count: int = 0, policy: AmbiguityPolicy = HOLD, **kw) -> MessageState:
    fields = {
        "attempt_count": attempt_count,
        "max_attempts": MAX_ATTEMPTS,
        "backoff_base": BASE,
        "backoff_cap": CAP,
        "ambiguity_policy": policy,
    }
    fields.update(kw)
    return MessageState(**fields)


def ceiling(attempt: int, base: float = BASE, cap: float = CAP) -> float:
    return min(cap, base * 2 ** (attempt - 1))


def test_the_table_covers_every_outcome_and_policy():
    assert set(EXPECTED) == set(OUTCOMES)
    assert all(set(per_policy) == set(AmbiguityPolicy) for per_policy in EXPECTED.values())
    covered = {type(outcome) for outcome in OUTCOMES.values()}
    assert covered == {Accepted, Disabled, LeaseExpired, Permanent, Transient, Ambiguous}


@pytest.mark.parametrize(("outcome", "policy", "label", "action"), CASES)
def test_decide(outcome, policy, label, action, rng):
    attempt_count = ATTEMPTS[label]
    decision = decide(OUTCOMES[outcome], state(attempt_count, policy), NOW, rng)
    assert isinstance(decision, Decision)
    assert decision.action is action
    if action is not Action.RETRY:
        assert decision.next_attempt_at is None
        return
    assert decision.next_attempt_at is not None
    delay = (decision.next_attempt_at - NOW).total_seconds()
    floor = FLOORS[outcome]
    attempt = attempt_count + 1
    assert floor <= delay <= max(floor, ceiling(attempt)) + 1e-6


@pytest.mark.parametrize("policy", list(AmbiguityPolicy))
def test_accepted_carries_the_provider_message_id(policy, rng):
    decision = decide(Accepted(provider_message_id="ses-9"), state(2, policy), NOW, rng)
    assert decision == Decision(action=Action.SENT, provider_message_id="ses-9")


def test_errors_carry_their_code_and_message(rng):
    for outcome in (
        Permanent(code="MessageRejected", message="nope"),
        Transient(code="ServiceUnavailable", message="503"),
        Ambiguous(code="ReadTimeout", message="no answer"),
        Disabled(code="SendingPaused", message="paused"),
    ):
        decision = decide(outcome, state(0), NOW, rng)
        assert (decision.code, decision.message) == (outcome.code, outcome.message)
        assert decision.provider_message_id is None


def test_exhausted_transient_says_how_many_attempts_were_made(rng):
    decision = decide(Transient(code="ServiceUnavailable", message="503"), state(4), NOW, rng)
    assert decision.action is Action.FAIL
    assert decision.code == "ServiceUnavailable"
    assert decision.message == "5 attempts exhausted; last: 503"


def test_lease_expiry_codes_tell_whether_the_send_had_begun(rng):
    unstarted = decide(LeaseExpired(send_started=False), state(0), NOW, rng)
    started = decide(LeaseExpired(send_started=True), state(0), NOW, rng)
    assert unstarted.code == "lease_expired_before_send"
    assert started.code == "lease_expired_after_send_started"
    assert started.message


def test_a_single_attempt_budget_never_retries(rng):
    for outcome in (Transient(code="x"), Ambiguous(code="y"), LeaseExpired(send_started=True)):
        for policy in AmbiguityPolicy:
            decision = decide(outcome, state(0, policy, max_attempts=1), NOW, rng)
            assert decision.action in (Action.FAIL, Action.HOLD)


def test_something_that_is_not_an_outcome_is_refused(rng):
    with pytest.raises(TypeError, match="not an outcome"):
        decide("Accepted", state(0), NOW, rng)  # type: ignore[arg-type]


def test_decide_is_relative_to_the_now_it_is_given(rng):
    for now in (datetime(1999, 1, 1, tzinfo=UTC), NOW, datetime(2300, 1, 1, tzinfo=UTC)):
        decision = decide(Transient(code="x", retry_after=60.0), state(0), now, rng)
        assert decision.next_attempt_at == now + timedelta(seconds=60)


# -- floors ------------------------------------------------------------------------------


def test_a_throttled_retry_waits_at_least_the_floor_even_with_a_tiny_base(rng):
    tiny = state(0, backoff_base=0.001, backoff_cap=0.001)
    for _ in range(200):
        decision = decide(Transient(code="Throttling", throttled=True), tiny, NOW, rng)
        assert decision.next_attempt_at is not None
        assert decision.next_attempt_at - NOW >= timedelta(seconds=THROTTLE_FLOOR_SECONDS)


def test_retry_after_is_honoured_even_above_the_cap(rng):
    capped = state(0, backoff_base=1.0, backoff_cap=10.0)
    decision = decide(Transient(code="TooManyRequests", retry_after=120.0), capped, NOW, rng)
    assert decision.next_attempt_at == NOW + timedelta(seconds=120)


def test_the_larger_of_retry_after_and_the_throttle_floor_wins(rng):
    small = Transient(code="Throttling", throttled=True, retry_after=0.2)
    for _ in range(100):
        decision = decide(small, state(0, backoff_base=0.001, backoff_cap=0.001), NOW, rng)
        assert decision.next_attempt_at == NOW + timedelta(seconds=THROTTLE_FLOOR_SECONDS)
    big = Transient(code="Throttling", throttled=True, retry_after=7.0)
    for _ in range(100):
        decision = decide(big, state(2), NOW, rng)  # third attempt: up to 8 s
        assert decision.next_attempt_at is not None
        assert 7.0 <= (decision.next_attempt_at - NOW).total_seconds() <= 8.0 + 1e-6


def test_an_ambiguous_resend_gets_no_throttle_floor(rng):
    delays = [
        (
            decide(Ambiguous(code="x"), state(0, RESEND), NOW, rng).next_attempt_at - NOW
        ).total_seconds()
        for _ in range(300)
    ]
    assert all(0.0 <= d <= BASE for d in delays)
    assert min(delays) < THROTTLE_FLOOR_SECONDS


# -- backoff -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("attempt", "base", "cap"),
    [(1, 2.0, 900.0), (2, 2.0, 900.0), (5, 2.0, 900.0), (10, 2.0, 900.0), (40, 0.5, 60.0)],
)
def test_backoff_samples_stay_within_bounds_and_are_jittered(attempt, base, cap, rng):
    high = ceiling(attempt, base, cap)
    samples = [backoff_seconds(attempt, base, cap, 0.0, rng) for _ in range(1000)]
    assert all(0.0 <= s <= high for s in samples)
    assert len(set(samples)) > 900
    # Full jitter: uniform over [0, high], so both halves are used and the mean is central.
    assert min(samples) < 0.25 * high
    assert max(samples) > 0.75 * high
    assert 0.4 * high < statistics.fmean(samples) < 0.6 * high


def test_backoff_grows_exponentially_up_to_the_cap(rng):
    highs = [
        max(backoff_seconds(a, 1.0, 100.0, 0.0, rng) for _ in range(400)) for a in range(1, 10)
    ]
    for attempt, high in enumerate(highs, start=1):
        assert high <= min(100.0, 2.0 ** (attempt - 1))
        assert high > 0.9 * min(100.0, 2.0 ** (attempt - 1))


def test_backoff_treats_attempt_zero_as_the_first(rng):
    assert all(backoff_seconds(0, 3.0, 900.0, 0.0, rng) <= 3.0 for _ in range(200))


def test_backoff_of_a_huge_attempt_number_is_the_cap_at_most(rng):
    samples = [backoff_seconds(1000, 2.0, 900.0, 0.0, rng) for _ in range(200)]
    assert all(0.0 <= s <= 900.0 for s in samples)
    assert max(samples) > 450.0


@given(
    attempt=st.integers(min_value=1, max_value=1000),
    base=st.floats(min_value=0.001, max_value=100.0),
    cap_factor=st.floats(min_value=1.0, max_value=1000.0),
    floor=st.one_of(st.just(0.0), st.floats(min_value=0.0, max_value=3600.0)),
    seed=st.integers(min_value=0, max_value=2**32),
)
def test_backoff_is_always_between_the_floor_and_the_capped_exponential(
    attempt, base, cap_factor, floor, seed
):
    cap = base * cap_factor
    delay = backoff_seconds(attempt, base, cap, floor, random.Random(seed))
    assert floor <= delay
    assert delay <= max(floor, ceiling(attempt, base, cap)) * (1 + 1e-9)


# -- determinism -------------------------------------------------------------------------


@pytest.mark.parametrize(("outcome", "policy", "label", "action"), CASES)
def test_the_same_seed_gives_the_same_decision(outcome, policy, label, action):
    given = (OUTCOMES[outcome], state(ATTEMPTS[label], policy), NOW)
    random.seed(1)  # the module's own source plays no part
    first = decide(*given, random.Random(SEED))
    random.seed(2)
    assert decide(*given, random.Random(SEED)) == first
    assert first.action is action


def test_the_jitter_comes_from_the_source_given():
    retried = Transient(code="ServiceUnavailable", message="503")
    times = {
        decide(retried, state(3), NOW, random.Random(seed)).next_attempt_at for seed in range(50)
    }
    assert len(times) == 50


def test_the_same_seed_gives_the_same_backoffs():
    def draws(seed: int) -> list[float]:
        rng = random.Random(seed)
        return [backoff_seconds(a, 2.0, 900.0, 1.0, rng) for a in range(1, 30)]

    assert draws(SEED) == draws(SEED)
    assert draws(SEED) != draws(SEED + 1)


@pytest.mark.parametrize(
    ("attempt", "base", "cap", "floor", "high"),
    [
        (1, 2.0, 900.0, 0.0, 2.0),
        (4, 2.0, 900.0, 0.0, 16.0),
        (11, 2.0, 900.0, 0.0, 900.0),
        (3, 2.0, 900.0, 30.0, 30.0),  # the floor above the exponential: the floor itself
        (1, 1.0, 10.0, 120.0, 120.0),  # and above the cap
        (2000, 2.0, 900.0, 5.0, 900.0),  # 2 ** 1999 is beyond a float: the cap
    ],
)
def test_a_backoff_is_the_floor_plus_the_draw_times_the_span(attempt, base, cap, floor, high):
    """Uniform between the floor and the capped exponential: ``floor + (high - floor) * u``
    for the source's next ``u``, as ``random.uniform`` draws it."""
    u = random.Random(SEED).random()
    delay = backoff_seconds(attempt, base, cap, floor, random.Random(SEED))
    assert delay == pytest.approx(floor + (high - floor) * u)


@pytest.mark.parametrize("hint", [float("nan"), float("inf"), 1e20, -5.0, 0.0])
def test_any_retry_after_a_sender_gives_is_a_retry_within_the_longest_backoff(rng, hint):
    """A hostile or broken hint must not raise in the relay's loop (a NaN or a delay past
    datetime's range did, killing the relay with its finished sends unsaved)."""
    decision = decide(
        Transient(code="Throttling", throttled=True, retry_after=hint), state(0), NOW, rng
    )
    assert decision.action is RETRY
    assert decision.next_attempt_at is not None
    delay = (decision.next_attempt_at - NOW).total_seconds()
    assert THROTTLE_FLOOR_SECONDS <= delay <= MAX_BACKOFF_SECONDS


@pytest.mark.parametrize(
    ("base", "cap"),
    [(2.0, 1e12), (float("inf"), float("inf")), (2.0, float("nan")), (1e300, 1e308)],
)
def test_a_rows_backoff_policy_beyond_any_date_is_a_retry_within_the_longest_backoff(base, cap):
    """A row's policy is copied at enqueue and may be edited in the database: attempt 46 of a
    cap of 1e12 s raised OverflowError before."""
    hostile = state(45, backoff_base=base, backoff_cap=cap, max_attempts=60)
    for seed in range(50):
        decision = decide(Transient(code="x"), hostile, NOW, random.Random(seed))
        assert decision.action is RETRY
        delay = (decision.next_attempt_at - NOW).total_seconds()
        assert 0.0 <= delay <= MAX_BACKOFF_SECONDS
