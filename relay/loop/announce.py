"""Announcements: each transition's log line and signal, from one table."""

from __future__ import annotations

import logging
from typing import Any

from blinker import NamedSignal

from outbox.schema import AttemptOutcome
from relay import signals, store
from relay.loop.records import Done, done_outcome
from relay.policy import Action, Decision

__all__ = [
    "TRANSITIONS",
    "announce",
    "announce_expired",
    "announce_reconciled",
    "announce_saved",
    "announce_swept",
]

_log = logging.getLogger("relay")

# a decision's action: its log action and its signal
TRANSITIONS: dict[Action, tuple[str, NamedSignal]] = {
    Action.SENT: ("sent", signals.sent),
    Action.RETRY: ("retry_scheduled", signals.retry_scheduled),
    Action.FAIL: ("failed", signals.failed),
    Action.HOLD: ("unknown_outcome", signals.unknown_outcome),
    Action.RELEASE: ("released", signals.released),
}


def announce(
    source: Any,
    claim: store.Claim,
    decision: Decision,
    *,
    applied: bool,
    swept: bool = False,
    duration: float | None = None,
    outcome: AttemptOutcome | None = None,
) -> None:
    """Log and signal a saved decision (``source``: the relay, the signals' sender); one
    whose claim was gone is a ``stale_finalize``."""
    action, signal = TRANSITIONS[decision.action]
    extra = {
        "action": action if applied else "stale_finalize",
        "message_id": claim.id,
        "code": decision.code,
        "swept": True if swept else None,
    }
    if not applied:
        _log.warning(
            "claim no longer held; attempt recorded, message left as it is",
            extra={**extra, "provider_message_id": decision.provider_message_id},
        )
        signal = signals.stale_finalize
    else:
        level = logging.WARNING if decision.action is Action.HOLD else logging.INFO
        _log.log(level, action, extra=extra)
    signal.send(
        source,
        message_id=claim.id,
        category=claim.category,
        code=decision.code,
        provider_message_id=decision.provider_message_id,
        duration=duration,
        outcome=outcome,
    )


def announce_saved(source: Any, batch: list[Done], applied: list[bool]) -> None:
    for done, ok in zip(batch, applied, strict=True):
        announce(
            source,
            done.claim,
            done.decision,
            applied=ok,
            duration=done.duration,
            outcome=done_outcome(done),
        )


def announce_expired(source: Any, expired: list[store.Expired]) -> None:
    for gone in expired:
        _log.info("expired unsent", extra={"action": "expired", "message_id": gone.id})
        signals.expired.send(source, message_id=gone.id, category=gone.category)


def announce_swept(source: Any, swept: list[tuple[store.StaleLease, Decision]]) -> None:
    for lease, decision in swept:
        announce(
            source,
            lease.claim,
            decision,
            applied=True,
            swept=True,
            outcome=AttemptOutcome.LEASE_EXPIRED,
        )


def announce_reconciled(
    source: Any, confirmed: list[store.Confirmed], requeued: list[store.Reconciled]
) -> None:
    for c in confirmed:
        _log.info(
            "sent: SES answered the ambiguous send with its MessageId after the sweep",
            extra={
                "action": "reconcile_sent",
                "message_id": c.id,
                "provider_message_id": c.provider_message_id,
            },
        )
        signals.reconciled.send(
            source,
            message_id=c.id,
            category=c.category,
            result="sent",
            provider_message_id=c.provider_message_id,
        )
    for r in requeued:
        _log.warning(
            "requeued: no event for the ambiguous send while the intake flowed past its window",
            extra={"action": "reconcile_requeued", "message_id": r.id},
        )
        signals.reconciled.send(
            source,
            message_id=r.id,
            category=r.category,
            result="requeued",
            provider_message_id=None,
        )
