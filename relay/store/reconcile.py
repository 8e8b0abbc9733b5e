"""The reconcile sweep over unknown_outcome rows of the reconcile policy: resolved sent when
SES answered after all, requeued once when the event intake provably flowed past their
window. The proof and its limits: docs/design.md, "Decisions"."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from outbox.schema import (
    MAX_BACKOFF_SECONDS,
    AttemptOutcome,
    EventType,
    Status,
    UTCDateTime,
    attempts,
    events,
    intakes,
    messages,
)
from relay.clock import read_database_time
from relay.store.attempts import AttemptRecord, record_attempts
from relay.store.finalize import _requeued_values
from relay.store.relays import RECEIVE_AFTER_HEARTBEAT

__all__ = [
    "MAX_RECONCILE_AFTER",
    "Confirmed",
    "Reconciled",
    "reconcile_unknown",
    "resolve_confirmed",
]

_log = logging.getLogger("relay")
_m = messages

# the longest reconcile window Category allows (30 days): a row outside (0, this] was edited
# in the database, and waits for a human
MAX_RECONCILE_AFTER = MAX_BACKOFF_SECONDS
# no timestamp read for a window is this late (MariaDB's last is 9999-12-31, and a window
# added to it overflows): a later one was edited, and proves nothing
_FAR = datetime(9000, 1, 1, tzinfo=UTC)
# SQS's longest visibility timeout (12 hours): an outbox_intakes row outside [0, this] is not
# a queue's, and proves nothing
_MAX_VISIBILITY_SECONDS = 12 * 3600.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Reconciled:
    """An unknown_outcome row :func:`reconcile_unknown` requeued."""

    id: int
    category: str
    send_started_at: datetime  # the ambiguous attempt's start (the database's clock)
    reconcile_after: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Confirmed:
    """An unknown_outcome row :func:`resolve_confirmed` settled as sent."""

    id: int
    category: str
    provider_message_id: str


def _plus_seconds(
    dialect: str, at: sa.ColumnElement[Any], seconds: sa.ColumnElement[Any]
) -> sa.ColumnElement[Any]:
    """``at + seconds`` computed by the database, in the form its timestamps are stored in (so
    a comparison can use the other column's index). SQLite's date functions keep milliseconds
    and cut up to one each way, so its sum is put 3 ms later: late by under 3 ms, never
    early."""
    if dialect == "postgresql":
        interval = sa.func.make_interval(0, 0, 0, 0, 0, 0, seconds, type_=sa.Interval())
        return at + interval
    if dialect in ("mysql", "mariadb"):
        micros = sa.cast(sa.func.round(seconds * 1_000_000), sa.BigInteger())
        return sa.func.timestampadd(sa.literal_column("MICROSECOND"), micros, at)
    modifier = sa.literal("+") + sa.cast(seconds + 0.003, sa.Text()) + sa.literal(" seconds")
    return sa.func.strftime("%Y-%m-%d %H:%M:%f", at, modifier)


def _usable_window() -> sa.ColumnElement[bool]:
    """A window the database can add: ``reconcile_after`` in (0, 30 days] and a start before
    :data:`_FAR`. ``<=`` refuses infinity and PostgreSQL's NaN (greater than every number);
    SQLite stores NaN as NULL, MariaDB neither. A negative window would end before the send."""
    window = _m.c.reconcile_after
    return sa.and_(
        window > 0,
        window <= MAX_RECONCILE_AFTER,
        _m.c.send_started_at < sa.literal(_FAR, UTCDateTime()),
    )


def _window_end(dialect: str) -> sa.ColumnElement[Any]:
    """``send_started_at + reconcile_after`` seconds, never earlier than the true end; NULL
    for a window :func:`_usable_window` refuses. Inside a CASE, so the database never computes
    it for an edited row (a WHERE's conditions run in any order) and one row cannot fail the
    statement."""
    end = _plus_seconds(dialect, _m.c.send_started_at, _m.c.reconcile_after)
    return sa.case((_usable_window(), end), else_=sa.null())


def _plus_visibility(
    dialect: str,
    at: sa.ColumnElement[Any],
    visibility: sa.ColumnElement[Any],
    extra: float = 0.0,
) -> sa.ColumnElement[Any]:
    """``at`` plus a visibility timeout in seconds, plus ``extra``; NULL (inside a CASE) for a
    timeout outside [0, 12 h] or a time past :data:`_FAR`, so nothing compared with it holds."""
    return sa.case(
        (
            sa.and_(
                visibility >= 0,
                visibility <= _MAX_VISIBILITY_SECONDS,
                at < sa.literal(_FAR, UTCDateTime()),
            ),
            _plus_seconds(dialect, at, visibility + extra if extra else visibility),
        ),
        else_=sa.null(),
    )


def _drained_after(dialect: str, event: sa.FromClause, db_now: datetime) -> sa.ColumnElement[bool]:
    """Every intake replica of the queue that recorded ``event`` vouches that nothing older is
    left there: at least one found it empty (``caught_up_at``, no later than ``db_now``) more
    than its visibility timeout after ``event`` committed, and each other one did too or is
    dead (another found it empty :data:`RECEIVE_AFTER_HEARTBEAT` plus both visibility
    timeouts after its last heartbeat). Why, and what it leaves open: docs/design.md,
    "Decisions" (the intake's drained proof)."""
    recorder = intakes.alias("recorder")
    queue = (
        sa.select(recorder.c.queue_url)
        .where(
            recorder.c.intake_id == event.c.intake_id,
            recorder.c.started_at <= event.c.received_at,
        )
        .correlate_except(recorder)
        .scalar_subquery()
    )
    now = sa.literal(db_now, UTCDateTime())
    vouching = intakes.alias("vouching")
    j = intakes.alias("peer")
    i = intakes.alias("witness")

    def found_empty_after(row: sa.FromClause) -> sa.ColumnElement[bool]:
        return sa.and_(
            row.c.caught_up_at <= now,
            row.c.caught_up_at
            > _plus_visibility(dialect, event.c.received_at, row.c.visibility_timeout),
        )

    reach = RECEIVE_AFTER_HEARTBEAT
    dead = sa.exists().where(
        i.c.queue_url == j.c.queue_url,
        i.c.caught_up_at <= now,
        i.c.caught_up_at
        > _plus_visibility(dialect, j.c.heartbeat_at, i.c.visibility_timeout, reach),
        i.c.caught_up_at
        > _plus_visibility(dialect, j.c.heartbeat_at, j.c.visibility_timeout, reach),
    )
    vouched = sa.case((found_empty_after(j), 1), else_=0) == 1
    one = sa.exists().where(vouching.c.queue_url == queue, found_empty_after(vouching))
    silent = sa.exists().where(j.c.queue_url == queue, ~vouched, ~dead)
    return sa.and_(event.c.intake_id.is_not(None), one, ~silent)


def _reconcilable(dialect: str, db_now: datetime) -> list[sa.ColumnElement[bool]]:
    """An unknown_outcome row of the reconcile policy, with no event matched to it, never
    requeued by a reconcile and never answered by SES, whose window the intake provably
    flowed past: one of our Send events (matched by its tags) committed (``received_at``, the
    database's clock) and about mail SES took (``mail_at``, SES's clock) after the attempt's
    start plus the window, on a queue :func:`_drained_after` finds drained. ``db_now`` is the
    database's clock."""
    end = _window_end(dialect)
    event = events.alias("flowing")
    flowed = sa.exists().where(
        event.c.event_type == EventType.SEND.value,
        event.c.message_id.is_not(None),
        event.c.claim_token.is_not(None),
        event.c.received_at > end,
        event.c.mail_at > end,
        _drained_after(dialect, event, db_now),
    )
    matched = sa.exists().where(events.c.message_id == _m.c.id)
    requeued = sa.exists().where(
        attempts.c.message_id == _m.c.id,
        attempts.c.outcome == AttemptOutcome.RECONCILE_REQUEUED.value,
    )
    # SES answered one of its sends with a MessageId: a requeue could only send it twice
    answered = sa.exists().where(
        attempts.c.message_id == _m.c.id, attempts.c.provider_message_id.is_not(None)
    )
    return [
        _m.c.status == Status.UNKNOWN_OUTCOME.value,
        _m.c.reconcile_after.is_not(None),
        _m.c.send_started_at.is_not(None),
        _usable_window(),
        ~matched,
        ~requeued,
        ~answered,
        flowed,
    ]


def _alone(conn: sa.Connection, update: sa.Update, message_id: int, what: str) -> bool:
    """Run one row's guarded ``update`` on its own: whether it moved the row. A data or
    integrity error (a row edited into something the database cannot compute or store) is
    rolled back alone (a savepoint, but on SQLite) and logged, leaving the row for a human
    and the pass going; anything else raises, for the caller to retry the pass."""
    try:
        if conn.dialect.name == "sqlite":  # a failed statement leaves its transaction usable
            return bool(conn.execute(update).rowcount == 1)
        with conn.begin_nested():
            return bool(conn.execute(update).rowcount == 1)
    except (sa.exc.DataError, sa.exc.IntegrityError) as exc:
        if exc.connection_invalidated:
            raise
        _log.error(
            "reconcile: the database refused to %s a row; left for an operator: %s",
            what,
            exc.orig if exc.orig is not None else exc,
            extra={"action": "reconcile_refused", "message_id": message_id},
        )
        return False


def reconcile_unknown(
    conn: sa.Connection, *, now: datetime, relay_id: str, limit: int = 100, lock: bool = True
) -> list[Reconciled]:
    """Requeue, once, ambiguous sends of the reconcile policy that no provider event named
    while the event intake provably flowed past their window (:func:`_reconcilable`); each
    gets a ``reconcile:requeued`` attempt. Without events and ``outbox_intakes`` rows nothing
    qualifies, ever.

    At most ``limit`` rows, oldest attempt first, read ``FOR UPDATE SKIP LOCKED``
    (``lock=False``: unlocked, so tests can race two reconciles). Each row's UPDATE repeats
    every condition and names its ``send_started_at``, so racing replicas requeue it once, a
    stale read never requeues a later attempt, and an event matched in between wins. Runs in
    the caller's transaction; ``now`` is the database's clock.
    """
    if conn.execute(sa.select(sa.func.max(events.c.received_at))).scalar() is None:
        return []  # no intake has ever committed an event: never requeue
    where = _reconcilable(conn.dialect.name, read_database_time(conn))
    stmt = (
        sa.select(_m.c.id, _m.c.category, _m.c.send_started_at, _m.c.reconcile_after)
        .where(*where)
        .order_by(_m.c.send_started_at, _m.c.id)
        .limit(limit)
    )
    rows = conn.execute(stmt.with_for_update(skip_locked=True) if lock else stmt).all()
    done: list[Reconciled] = []
    for row in rows:
        guard = (_m.c.id == row.id, _m.c.send_started_at == row.send_started_at, *where)
        update = sa.update(_m).where(*guard).values(_requeued_values(now))
        if not _alone(conn, update, row.id, "requeue"):
            continue  # moved by an event, an operator or another relay since the read
        done.append(
            Reconciled(
                id=row.id,
                category=row.category,
                send_started_at=row.send_started_at,
                reconcile_after=row.reconcile_after,
            )
        )
    record_attempts(
        conn,
        (
            AttemptRecord(
                message_id=r.id,
                claim_token=None,
                relay_id=relay_id,
                started_at=None,
                finished_at=now,
                outcome=AttemptOutcome.RECONCILE_REQUEUED,
                error_code="reconcile_requeued",
                error_message=(
                    f"no event for the attempt started {r.send_started_at.isoformat()} while "
                    f"the intake flowed {r.reconcile_after:g}s past it; requeued by {relay_id}"
                ),
            )
            for r in done
        ),
    )
    return done


_confirming = attempts.alias("confirming")
# an attempt of the row with SES's MessageId, begun no earlier than its ambiguous attempt:
# SES's answer to that very call (saved ``stale:`` once the claim was gone) or a later one
_CONFIRMS = (
    _confirming.c.message_id == _m.c.id,
    _confirming.c.provider_message_id.is_not(None),
    _confirming.c.started_at >= _m.c.send_started_at,
)


def resolve_confirmed(
    conn: sa.Connection, *, now: datetime, relay_id: str, limit: int = 100, lock: bool = True
) -> list[Confirmed]:
    """unknown_outcome -> sent, for ambiguous sends of the reconcile policy that SES answered
    with its MessageId after all (a relay that thawed past its lease saved ``stale:accepted``),
    with that id and the answer's time as ``sent_at``; each gets a ``reconciled`` attempt.
    Why: docs/design.md, "Decisions" (SES's late answer).

    Each row moves by its own guarded UPDATE naming the ambiguous attempt's start, so racing
    replicas resolve it once. Runs in the caller's transaction; ``now`` is the database's
    clock.
    """
    where = (
        _m.c.status == Status.UNKNOWN_OUTCOME.value,
        _m.c.reconcile_after.is_not(None),
        _m.c.send_started_at.is_not(None),
    )
    stmt = (
        sa.select(_m.c.id, _m.c.category, _m.c.send_started_at)
        .where(*where, sa.exists().where(*_CONFIRMS))
        .order_by(_m.c.send_started_at, _m.c.id)
        .limit(limit)
    )
    rows = conn.execute(stmt.with_for_update(skip_locked=True) if lock else stmt).all()
    done: list[tuple[Confirmed, str | None]] = []
    for row in rows:
        answer = (
            sa.select(
                _confirming.c.provider_message_id,
                _confirming.c.claim_token,
                _confirming.c.finished_at,
            )
            .where(_m.c.id == row.id, *_CONFIRMS)
            .order_by(_confirming.c.id.desc())
            .limit(1)
        )
        found = conn.execute(answer).first()
        if found is None:
            continue
        update = (
            sa.update(_m)
            .where(_m.c.id == row.id, _m.c.send_started_at == row.send_started_at, *where)
            .values(
                status=Status.SENT.value,
                provider_message_id=found.provider_message_id,
                sent_at=found.finished_at,
                claim_token=None,
                lease_expires_at=None,
                last_error_code=None,
                last_error_message=None,
                updated_at=now,
            )
        )
        if not _alone(conn, update, row.id, "resolve"):
            continue  # moved by an event, an operator or another relay since the read
        confirmed = Confirmed(
            id=row.id, category=row.category, provider_message_id=found.provider_message_id
        )
        done.append((confirmed, found.claim_token))
    record_attempts(
        conn,
        (
            AttemptRecord(
                message_id=c.id,
                claim_token=token,
                relay_id=relay_id,
                started_at=None,
                finished_at=now,
                outcome=AttemptOutcome.RECONCILED,
                provider_message_id=c.provider_message_id,
                error_code="provider_answered",
                error_message=(
                    f"SES answered the held attempt with {c.provider_message_id} after its "
                    f"claim was gone; resolved sent by {relay_id}"
                ),
            )
            for c, token in done
        ),
    )
    return [c for c, _ in done]
