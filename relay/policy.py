"""What to do with a message after an attempt: a pure function from outcome to decision.

``decide`` never touches the database or the clock; the worker applies its decision through
one guarded statement of :mod:`relay.store`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime, timedelta

from tenacity import RetryCallState, wait_random_exponential

from outbox.schema import AmbiguityPolicy
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
    action: Action
    next_attempt_at: datetime | None = None
    code: str | None = None
    message: str | None = None
    provider_message_id: str | None = None

    @property
    def counts_attempt(self) -> bool:
        return self.action is not Action.RELEASE


def backoff_seconds(attempt: int, base: float, cap: float, floor: float = 0.0) -> float:
    """Full-jitter exponential backoff: uniform between ``floor`` and
    ``min(cap, base * 2 ** (attempt - 1))`` (tenacity's ``wait_random_exponential``)."""
    wait = wait_random_exponential(multiplier=base, max=max(cap, floor), min=floor)
    state = RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
    state.attempt_number = max(1, attempt)
    return float(wait(state))


def decide(
    outcome: Outcome | LeaseExpired,
    state: MessageState,
    now: datetime,
) -> Decision:
    """The decision for ``outcome`` of attempt number ``state.attempt_count + 1``."""
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
            floor = max(after or 0.0, THROTTLE_FLOOR_SECONDS if throttled else 0.0)
            delay = backoff_seconds(attempt, state.backoff_base, state.backoff_cap, floor)
            return Decision(
                action=Action.RETRY,
                next_attempt_at=now + timedelta(seconds=delay),
                code=code,
                message=message,
            )
        case Ambiguous(code=code, message=message):
            return _ambiguous(code, message, state, attempt, now)
        case LeaseExpired(send_started=True):
            return _ambiguous(
                "lease_expired_after_send_started",
                "the relay stopped renewing its lease after the send began",
                state,
                attempt,
                now,
            )
    raise TypeError(f"not an outcome: {outcome!r}")


def _ambiguous(
    code: str, message: str, state: MessageState, attempt: int, now: datetime
) -> Decision:
    """Hold (at most once) or retry (at least once, while attempts remain)."""
    if state.ambiguity_policy is AmbiguityPolicy.HOLD or attempt >= state.max_attempts:
        return Decision(action=Action.HOLD, code=code, message=message)
    delay = backoff_seconds(attempt, state.backoff_base, state.backoff_cap)
    return Decision(
        action=Action.RETRY,
        next_attempt_at=now + timedelta(seconds=delay),
        code=code,
        message=message,
    )
