"""What to do with a message after an attempt: a pure function from outcome to decision.

``decide`` never touches the database or the clock, and draws its jitter from the random
source it is given, so one seed gives one decision; the worker applies its decision through
one guarded statement of :mod:`relay.store`.
"""

from __future__ import annotations

import enum
import math
import random
from dataclasses import dataclass
from datetime import datetime, timedelta

from outbox.schema import MAX_BACKOFF_SECONDS, AmbiguityPolicy
from relay.senders import Accepted, Ambiguous, Disabled, Outcome, Permanent, Transient

__all__ = [
    "THROTTLE_FLOOR_SECONDS",
    "Action",
    "Decision",
    "LeaseExpired",
    "MessageState",
    "backoff_seconds",
    "decide",
]

THROTTLE_FLOOR_SECONDS = 1.0


class Action(enum.StrEnum):
    """The transition a decision asks for."""

    SENT = "sent"  # -> sent
    RETRY = "retry"  # -> retrying at ``next_attempt_at``
    FAIL = "fail"  # -> failed
    HOLD = "hold"  # -> unknown_outcome, for an operator
    RELEASE = "release"  # -> back to pending/retrying, no attempt counted


@dataclass(frozen=True, kw_only=True, slots=True)
class LeaseExpired:
    """Not a provider answer: the relay holding the message stopped renewing its lease.

    ``send_started`` tells whether the send may have begun (``send_started_at`` was set)."""

    send_started: bool


@dataclass(frozen=True, kw_only=True, slots=True)
class MessageState:
    """The per-row policy (copied from its category at enqueue) and its attempts so far."""

    attempt_count: int
    max_attempts: int
    backoff_base: float
    backoff_cap: float
    ambiguity_policy: AmbiguityPolicy


@dataclass(frozen=True, kw_only=True, slots=True)
class Decision:
    """The transition for a message, and what its row records: the retry's due time, the
    error code and text, the provider's message id."""

    action: Action
    next_attempt_at: datetime | None = None
    code: str | None = None
    message: str | None = None
    provider_message_id: str | None = None


def backoff_seconds(
    attempt: int, base: float, cap: float, floor: float, rng: random.Random
) -> float:
    """Full-jitter exponential backoff: uniform (drawn from ``rng``) between ``floor`` and
    ``min(cap, base * 2 ** (attempt - 1))``, or ``floor`` itself when that is above it.
    Attempt 0 counts as the first."""
    try:
        ceiling = min(cap, math.ldexp(base, max(1, attempt) - 1))
    except OverflowError:  # 2 ** (attempt - 1) beyond a float: the cap
        ceiling = cap
    # a row's policy or a provider's hint may be any float: a delay is a finite number of
    # seconds within MAX_BACKOFF_SECONDS, so that ``now + delay`` is always a date
    floor = min(floor, MAX_BACKOFF_SECONDS) if floor > 0 else 0.0  # NaN, <= 0: no floor
    if not ceiling <= MAX_BACKOFF_SECONDS:  # NaN and inf included
        ceiling = MAX_BACKOFF_SECONDS
    return rng.uniform(floor, max(floor, ceiling))


def decide(
    outcome: Outcome | LeaseExpired,
    state: MessageState,
    now: datetime,
    rng: random.Random,
) -> Decision:
    """The decision for ``outcome`` of attempt number ``state.attempt_count + 1``; a retry's
    jitter is drawn from ``rng``."""
    attempt = state.attempt_count + 1
    match outcome:
        case Accepted(provider_message_id=provider_id, refused=()):
            return Decision(action=Action.SENT, provider_message_id=provider_id)
        case Accepted(provider_message_id=provider_id, refused=refused):
            # sent to the others; the refused recipients are named in the attempt row
            return Decision(
                action=Action.SENT,
                provider_message_id=provider_id,
                code="recipients_refused",
                message=f"{len(refused)} refused for good: " + "; ".join(refused),
            )
        case Disabled(code=code, message=message):
            return Decision(action=Action.RELEASE, code=code, message=message)
        case LeaseExpired(send_started=False):
            return Decision(action=Action.RELEASE, code="lease_expired_before_send")
        case Permanent(code=code, message=message):
            return Decision(action=Action.FAIL, code=code, message=message)
        case Transient(code=code, message=message, throttled=throttled, retry_after=after):
            if attempt >= state.max_attempts:
                return Decision(
                    action=Action.FAIL,
                    code=code,
                    message=f"{attempt} attempts exhausted; last: {message}".strip(),
                )
            hint = after if after is not None and after > 0 else 0.0  # NaN and <= 0 ignored
            floor = max(hint, THROTTLE_FLOOR_SECONDS if throttled else 0.0)
            delay = backoff_seconds(attempt, state.backoff_base, state.backoff_cap, floor, rng)
            return Decision(
                action=Action.RETRY,
                next_attempt_at=now + timedelta(seconds=delay),
                code=code,
                message=message,
            )
        case Ambiguous(code=code, message=message):
            return _ambiguous(code, message, state, attempt, now, rng)
        case LeaseExpired(send_started=True):
            return _ambiguous(
                "lease_expired_after_send_started",
                "the relay stopped renewing its lease after the send began",
                state,
                attempt,
                now,
                rng,
            )
    raise TypeError(f"not an outcome: {outcome!r}")


def _ambiguous(
    code: str,
    message: str,
    state: MessageState,
    attempt: int,
    now: datetime,
    rng: random.Random,
) -> Decision:
    """Hold (at most once: ``hold`` and ``reconcile``) or retry (at least once, while attempts
    remain)."""
    if state.ambiguity_policy is not AmbiguityPolicy.RESEND or attempt >= state.max_attempts:
        return Decision(action=Action.HOLD, code=code, message=message)
    delay = backoff_seconds(attempt, state.backoff_base, state.backoff_cap, 0.0, rng)
    return Decision(
        action=Action.RETRY,
        next_attempt_at=now + timedelta(seconds=delay),
        code=code,
        message=message,
    )
