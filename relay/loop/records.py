"""What the loop holds about a claimed message between its claim and its save."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import datetime

from outbox.message import Email
from outbox.schema import AttemptOutcome
from relay import store, tracing
from relay.pause import Scope
from relay.policy import Decision
from relay.senders import Accepted, Ambiguous, Disabled, Outcome, Permanent, Transient

__all__ = ["Done", "InFlight", "Ready", "attempt_record", "by_token", "done_outcome", "fitted"]

# what the relay writes must fit its columns, or a provider's long answer would make a
# finished send unsaveable
_CODE_CHARS, _ID_CHARS, _TEXT_CHARS = 100, 255, 4000

_OUTCOME_NAMES: dict[type, AttemptOutcome] = {
    Accepted: AttemptOutcome.ACCEPTED,
    Transient: AttemptOutcome.TRANSIENT,
    Permanent: AttemptOutcome.PERMANENT,
    Ambiguous: AttemptOutcome.AMBIGUOUS,
    Disabled: AttemptOutcome.DISABLED,
}


@dataclass(kw_only=True, slots=True)
class InFlight:
    """A send running on a thread."""

    claim: store.Claim
    started_at: datetime
    future: Future[tuple[Outcome, float]]  # the outcome, and the provider call's seconds
    deadline: float  # monotonic: past it the lease is no longer renewed (--send-timeout)
    probe: Scope | None = None  # the paused scope this send probes
    overdue: bool = False  # past its deadline, logged once
    dropped: tuple[str, ...] = ()  # suppressed recipients left out of this send
    trace: tracing.Attempt | None = None  # the send's span (tracing on)


@dataclass(kw_only=True, slots=True)
class Ready:
    """A claimed message whose send has not started."""

    claim: store.Claim
    email: Email
    probe: Scope | None = None
    dropped: tuple[str, ...] = ()  # suppressed recipients taken out of ``email``
    trace: tracing.Carrier | None = None  # the enqueue's stored trace context (tracing on)


@dataclass(frozen=True, kw_only=True, slots=True)
class Done:
    """A finished send (or one decided without a call) waiting to be saved."""

    claim: store.Claim
    started_at: datetime | None
    finished_at: datetime
    outcome: Outcome | None  # None: the payload could not be turned into an email
    decision: Decision
    duration: float | None = None  # seconds the provider call took; None: no call
    recorded: AttemptOutcome | None = None  # the attempt's outcome when no call was made
    dropped: tuple[str, ...] = ()  # suppressed recipients not sent to
    trace: tracing.Attempt | None = None  # the attempt's span, linked from its save's


def done_outcome(done: Done) -> AttemptOutcome:
    """The outcome its attempt row records."""
    if done.recorded is not None:
        return done.recorded
    if done.outcome is None:
        return AttemptOutcome.INVALID_PAYLOAD
    return _OUTCOME_NAMES[type(done.outcome)]


def attempt_record(done: Done, relay_id: str, *, stale: bool) -> store.AttemptRecord:
    name = done_outcome(done)
    return store.AttemptRecord(
        message_id=done.claim.id,
        claim_token=done.claim.claim_token,
        relay_id=relay_id,
        started_at=done.started_at,
        finished_at=done.finished_at,
        outcome=name.stale if stale else name,
        error_code=done.decision.code,
        error_message=done.decision.message,
        provider_message_id=done.decision.provider_message_id,
        dropped_recipients=",".join(done.dropped) or None,
    )


def by_token(claims: Iterable[store.Claim]) -> dict[str, list[int]]:
    """Message ids grouped by the claim that holds them (one statement per claim)."""
    grouped: dict[str, list[int]] = {}
    for claim in claims:
        grouped.setdefault(claim.claim_token, []).append(claim.id)
    return grouped


def _storable(value: str | None) -> str | None:
    """``value`` as text every database stores: a NUL (which PostgreSQL text refuses) and a
    lone surrogate (which no UTF-8 column takes) written as escapes. A provider's text is not
    ours to trust, and a value the row cannot hold would leave an accepted send unsaved."""
    if value is None or (value.isprintable() and value.isascii()):
        return value
    if "\x00" in value:
        value = value.replace("\x00", "\\x00")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        value = value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


def fitted(decision: Decision) -> Decision:
    """``decision`` with its code, message and provider id cut to what their columns hold (a
    provider id too long for its column, or one no column stores, is kept whole in the
    message, escaped)."""
    code = _storable(decision.code)
    text = _storable(decision.message)
    provider_id = decision.provider_message_id
    stored_id = _storable(provider_id)
    if provider_id is not None and (stored_id != provider_id or len(provider_id) > _ID_CHARS):
        text = f"provider message id: {stored_id}; {text or ''}"
        provider_id = None if stored_id is None else stored_id[:_ID_CHARS]
    if code is not None and len(code) > _CODE_CHARS:
        code = code[:_CODE_CHARS]
    if text is not None and len(text) > _TEXT_CHARS:
        text = text[:_TEXT_CHARS]
    if (code, text, provider_id) == (
        decision.code,
        decision.message,
        decision.provider_message_id,
    ):
        return decision
    return dataclasses.replace(decision, code=code, message=text, provider_message_id=provider_id)
