"""Deferred events: those that came while their row was being sent (``processing``), applied
by a later pass once the relay saved what its call returned (:func:`apply_deferred`)."""

from __future__ import annotations

import logging
from datetime import datetime

import sqlalchemy as sa

from outbox.schema import EventType
from relay.db import blames_the_row
from relay.events import SesEvent, recorded_status
from relay.intake.apply import ACTOR, settle
from relay.intake.outcome import Applied, log_applied
from relay.store import events as event_sql
from relay.store.events import DeferredEvent, Effect

__all__ = ["DEFERRED_BATCH", "apply_deferred"]

_log = logging.getLogger("relay.intake")

DEFERRED_BATCH = 100  # deferred events applied per intake pass, oldest first


def _recorded_event(found: DeferredEvent) -> SesEvent | None:
    """The event as the intake parsed it, from its ``outbox_events`` row (its suppressions
    were made when it arrived: none again)."""
    try:
        kind = EventType(found.event_type)
    except ValueError:
        return None
    return SesEvent(
        key=found.event_key,
        source=found.source,
        type=kind,
        event_at=found.event_at,
        mail_at=found.mail_at,
        provider_message_id=found.provider_message_id,
        tagged_message_id=found.tagged_message_id,
        claim_token=found.claim_token,
        detail=found.detail,
        recipients=tuple(a for a in (found.recipients or "").split(", ") if "@" in a),
        suppress=(),
        delivery_status=recorded_status(kind, found.detail),
        error=None,
    )


def _apply_deferred_one(
    conn: sa.Connection, found: DeferredEvent, now: datetime, actor: str
) -> Applied | None:
    event = _recorded_event(found)
    row = found.row
    event_id = found.event_id
    if event is None or not event_sql.take_deferred(conn, event_id=event_id):
        return None
    effect, resolved = settle(conn, event, row, now, actor)
    if effect is not Effect.RECORDED:
        event_sql.set_event_effect(conn, event_id=event_id, effect=effect)
    return Applied(
        event=event,
        effect=effect,
        event_id=event_id,
        message_id=row.id,
        category=row.category,
        resolved=resolved,
    )


def apply_deferred(
    conn: sa.Connection, *, now: datetime, actor: str = ACTOR, limit: int = DEFERRED_BATCH
) -> list[Applied]:
    """Apply, in the caller's transaction, up to ``limit`` events recorded ``deferred`` (they
    came while their row was being sent) whose row is no longer being sent, oldest first: the
    same effects as on arrival, once the relay saved what its call returned. A Send or
    Delivery that came while the call was still waiting resolves the row the call left
    unknown_outcome (or retrying); a bounce that beat the relay's save sets the sent row's
    delivery status; the first attempt's event that came during a requeued send shows the
    row sent twice (``duplicate_send``). Each event's effect replaces ``deferred`` once,
    whichever replica applies it; one whose row is taken again before its UPDATE stays
    deferred for the next pass."""
    done: list[Applied] = []
    isolate = conn.dialect.name != "sqlite"
    for found in event_sql.find_deferred(conn, limit=limit):
        if not isolate:
            applied = _apply_deferred_one(conn, found, now, actor)
        else:
            try:
                with conn.begin_nested():
                    applied = _apply_deferred_one(conn, found, now, actor)
            except sa.exc.DBAPIError as exc:
                if not blames_the_row(exc):
                    raise
                _log.error(
                    "the database refused a deferred event's effect; left deferred: %s",
                    getattr(exc, "orig", None) or exc,
                    extra={"action": "event_refused", "event_id": found.event_id},
                )
                continue
        if applied is not None:
            done.append(applied)
            log_applied(applied)
    return done
