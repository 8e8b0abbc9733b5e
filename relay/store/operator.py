"""The statements of the operator commands (``outbox-relay status``, ``show``, ``resolve``,
``prune``, ``suppressions``) and the operators' log they write, each named by intent.

Each runs on the caller's connection, in the caller's transaction: a change and its log row
commit together or not at all. The bulk ``requeue`` and ``cancel`` are
:func:`relay.store.requeue_many` and :func:`relay.store.cancel_many`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

import sqlalchemy as sa

from outbox.schema import (
    TERMINAL,
    DeliveryStatus,
    OperatorAction,
    RelayState,
    Status,
    SuppressionReason,
    UTCDateTime,
    attempts,
    events,
    messages,
    operator_actions,
    relays,
    suppressions,
)

__all__ = [
    "ADDRESS_FIELDS",
    "LoggedAction",
    "actions_on",
    "add_suppressions",
    "count_droppable_bodies",
    "count_prunable_events",
    "count_prunable_messages",
    "count_stopped_relays",
    "drop_bodies",
    "dropped_payload",
    "events_of",
    "list_suppressions",
    "lock_for_change",
    "log_actions",
    "log_prune",
    "provider_id_of",
    "prune_messages",
    "prune_stopped_relays",
    "prune_unmatched_events",
    "read_delivery_summary",
    "read_event_intake",
    "read_hourly_outcomes",
    "remove_suppressions",
    "resolve_delivered",
    "suppressed_rows",
]

_ADDRESSES_PER_STATEMENT = 500  # suppressed_rows: any number of addresses, a few statements


# -- the operators' log ---------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class LoggedAction:
    """One row of the operators' log, ``outbox_operator_actions``."""

    at: datetime
    actor: str
    action: OperatorAction
    message_id: int | None = None
    address: str | None = None
    reason: str | None = None
    detail: str | None = None  # the action's facts as compact JSON


def _row(entry: LoggedAction) -> dict[str, Any]:
    return {
        "at": entry.at,
        "actor": entry.actor,
        "action": entry.action.value,
        "message_id": entry.message_id,
        "address": entry.address,
        "reason": entry.reason,
        "detail": entry.detail,
    }


def log_actions(conn: sa.Connection, entries: Sequence[LoggedAction]) -> None:
    """Append rows to the operators' log, in the caller's transaction (one executemany for a
    batch)."""
    if entries:
        conn.execute(sa.insert(operator_actions), [_row(e) for e in entries])


def log_prune(conn: sa.Connection, log_id: int | None, entry: LoggedAction) -> int:
    """The prune's one log row: inserted with its first transaction, its detail brought up to
    date in each later one, so the row always says what the committed batches deleted."""
    if log_id is None:
        inserted = conn.execute(sa.insert(operator_actions).values(**_row(entry)))
        key = inserted.inserted_primary_key
        assert key is not None
        return int(key[0])
    conn.execute(
        sa.update(operator_actions)
        .where(operator_actions.c.id == log_id)
        .values(detail=entry.detail)
    )
    return log_id


def actions_on(conn: sa.Connection, message_id: int) -> list[dict[str, Any]]:
    """The operators' log rows of a message, oldest first."""
    stmt = (
        sa.select(
            operator_actions.c.at,
            operator_actions.c.actor,
            operator_actions.c.action,
            operator_actions.c.reason,
            operator_actions.c.detail,
        )
        .where(operator_actions.c.message_id == message_id)
        .order_by(operator_actions.c.id)
    )
    return [dict(r._mapping) for r in conn.execute(stmt)]


# -- messages -------------------------------------------------------------------------------


def lock_for_change(
    conn: sa.Connection,
    ids: Sequence[int],
    allowed: Sequence[str] | None = None,
    unchanged_since: datetime | None = None,
) -> dict[int, str]:
    """The status of each of ``ids`` (only those in ``allowed``, when given, and only those
    not changed after ``unchanged_since``: what an operator was shown), the rows locked
    ``FOR UPDATE`` on PostgreSQL and MariaDB until the transaction ends: the status logged as
    a change's ``from`` is the one the change replaced. A relay's claim skips the locked rows
    (``SKIP LOCKED``); this waits for a claim that holds one."""
    stmt = sa.select(messages.c.id, messages.c.status).where(messages.c.id.in_(ids))
    if allowed is not None:
        stmt = stmt.where(messages.c.status.in_(allowed))
    if unchanged_since is not None:
        stmt = stmt.where(messages.c.updated_at <= unchanged_since)
    return {row.id: row.status for row in conn.execute(stmt.with_for_update())}


def provider_id_of(conn: sa.Connection, message_id: int) -> str | None:
    """The SES message id a message's row holds, if any."""
    stmt = sa.select(messages.c.provider_message_id).where(messages.c.id == message_id)
    return conn.execute(stmt).scalar_one_or_none()


def resolve_delivered(
    conn: sa.Connection,
    *,
    message_id: int,
    expected: str,
    now: datetime,
    provider_message_id: str | None,
) -> bool:
    """A row an operator knows reached its recipient -> sent, by the database's clock, its
    claim fields cleared; the provider id replaced only when given. Conditional on the status
    the operator saw, so a relay or the event intake moving the row first makes this change
    nothing (no lost update)."""
    values: dict[str, Any] = {
        "status": Status.SENT.value,
        "sent_at": now,
        "claim_token": None,
        "lease_expires_at": None,
        "updated_at": now,
    }
    if provider_message_id is not None:
        values["provider_message_id"] = provider_message_id
    result = conn.execute(
        sa.update(messages)
        .where(messages.c.id == message_id, messages.c.status == expected)
        .values(**values)
    )
    return result.rowcount == 1


def events_of(conn: sa.Connection, message_id: int) -> list[dict[str, Any]]:
    """The provider events matched to a message, in the order they came."""
    stmt = (
        sa.select(
            events.c.event_type,
            events.c.event_at,
            events.c.received_at,
            events.c.detail,
            events.c.recipients,
            events.c.effect,
            events.c.provider_message_id,
            events.c.source,
        )
        .where(events.c.message_id == message_id)
        .order_by(events.c.id)
    )
    return [dict(r._mapping) for r in conn.execute(stmt)]


# -- the views of ``status`` ----------------------------------------------------------------

_COUNT, _SECONDS, _TIME = sa.Integer(), sa.Float(), UTCDateTime()
_DELIVERY_COUNTS = ("sent", *(s.value for s in DeliveryStatus), "no_event")


def read_delivery_summary(conn: sa.Connection) -> list[dict[str, Any]]:
    """``outbox_delivery_summary``, typed alike on every backend (counts as ints, rates as
    floats)."""
    types: dict[str, Any] = {f"{c}_count": _COUNT for c in _DELIVERY_COUNTS}
    stmt = sa.text("SELECT * FROM outbox_delivery_summary").columns(
        **types, bounce_rate=_SECONDS, complaint_rate=_SECONDS
    )
    return [dict(r._mapping) for r in conn.execute(stmt)]


def read_hourly_outcomes(
    conn: sa.Connection, *, now: datetime, hours: int = 24
) -> list[tuple[datetime, int, int]]:
    """(hour's start, messages sent in it, messages that failed in it) for each of the last
    ``hours`` whole hours and the current one, oldest first, by the database's clock ``now``:
    one statement of conditional counts (the console's overview chart)."""
    top = now.replace(minute=0, second=0, microsecond=0)
    starts = [top - timedelta(hours=hours - 1 - n) for n in range(hours)]
    ends = [*starts[1:], now + timedelta(seconds=1)]
    failed = messages.c.status == Status.FAILED.value

    def counted(column: sa.ColumnElement[Any], start: datetime, end: datetime, *also: Any) -> Any:
        inside = sa.and_(column >= start, column < end, *also)
        return sa.func.sum(sa.case((inside, 1), else_=0))

    columns = [
        counted(messages.c.sent_at, start, end) for start, end in zip(starts, ends, strict=True)
    ] + [
        counted(messages.c.updated_at, start, end, failed)
        for start, end in zip(starts, ends, strict=True)
    ]
    since = starts[0]
    row = conn.execute(
        sa.select(*columns).where(
            sa.or_(messages.c.sent_at >= since, sa.and_(failed, messages.c.updated_at >= since))
        )
    ).one()
    return [(start, int(row[n] or 0), int(row[hours + n] or 0)) for n, start in enumerate(starts)]


def read_event_intake(conn: sa.Connection) -> dict[str, Any]:
    """``outbox_event_intake``'s one row, typed alike on every backend; the counts 0, not
    NULL, when no event came in 24 hours."""
    stmt = sa.text("SELECT * FROM outbox_event_intake").columns(
        events_24h=_COUNT,
        unmatched_24h=_COUNT,
        malformed_24h=_COUNT,
        newest_received_at=_TIME,
        newest_age_seconds=_SECONDS,
        newest_event_at=_TIME,
    )
    intake = dict(conn.execute(stmt).one()._mapping)
    for name in ("events_24h", "unmatched_24h", "malformed_24h"):
        intake[name] = intake[name] or 0
    return intake


# -- prune ----------------------------------------------------------------------------------


def _prunable(before: datetime, statuses: Sequence[str]) -> list[sa.ColumnElement[bool]]:
    """The messages a prune deletes: in ``statuses``, created and last changed before
    ``before``."""
    return [
        messages.c.status.in_(statuses),
        messages.c.created_at < before,
        messages.c.updated_at < before,
    ]


def count_prunable_messages(
    conn: sa.Connection, *, before: datetime, statuses: Sequence[str]
) -> int:
    """How many messages a prune with this cutoff would delete."""
    stmt = sa.select(sa.func.count()).select_from(messages).where(*_prunable(before, statuses))
    return int(conn.execute(stmt).scalar_one())


def count_prunable_events(
    conn: sa.Connection, *, before: datetime, statuses: Sequence[str], unmatched_before: datetime
) -> int:
    """The events a prune with these cutoffs would delete: those of the messages it deletes,
    and those matched to no message received before ``unmatched_before``."""
    of_old = sa.select(messages.c.id).where(*_prunable(before, statuses))
    stmt = sa.select(sa.func.count()).where(
        sa.or_(
            events.c.message_id.in_(of_old),
            sa.and_(events.c.message_id.is_(None), events.c.received_at < unmatched_before),
        )
    )
    return int(conn.execute(stmt).scalar_one())


def prune_messages(
    conn: sa.Connection, *, before: datetime, limit: int, statuses: Sequence[str]
) -> tuple[int, int]:
    """Delete up to ``limit`` messages in ``statuses`` created and last changed before
    ``before``, with their attempts and events; (messages, events) deleted. Rows another
    transaction holds are skipped (``SKIP LOCKED``), and the delete re-checks the status, so
    a row that moved meanwhile stays."""
    ids = list(
        conn.execute(
            sa.select(messages.c.id)
            .where(*_prunable(before, statuses))
            .order_by(messages.c.id)
            .limit(limit)
            .with_for_update(skip_locked=True)
        ).scalars()
    )
    if not ids:
        return 0, 0
    conn.execute(sa.delete(attempts).where(attempts.c.message_id.in_(ids)))
    gone = conn.execute(sa.delete(events).where(events.c.message_id.in_(ids))).rowcount
    result = conn.execute(
        sa.delete(messages).where(messages.c.id.in_(ids), messages.c.status.in_(statuses))
    )
    return int(result.rowcount), int(gone)


_DONE_WITH = tuple(s.value for s in TERMINAL if s is not Status.FAILED)  # never requeued


def _droppable(
    before: datetime | None, failed_before: datetime | None
) -> list[sa.ColumnElement[bool]]:
    """The bodies a prune drops: of sent, cancelled and expired messages last changed before
    ``before``, and of failed ones (which an operator may requeue once the cause is fixed)
    before ``failed_before``; None: none of those. Never of unknown_outcome or queued rows."""
    # status = each literal, not IN (...): an expanding IN cannot go in drop_bodies' executemany
    finished = [
        sa.and_(
            sa.or_(*(messages.c.status == sa.literal(status) for status in statuses)),
            messages.c.updated_at < cutoff,
        )
        for statuses, cutoff in ((_DONE_WITH, before), ((Status.FAILED.value,), failed_before))
        if cutoff is not None
    ]
    return [sa.or_(sa.false(), *finished), messages.c.body_dropped_at.is_(None)]


ADDRESS_FIELDS = ("to", "cc", "bcc")  # what a dropped body keeps of its payload


def dropped_payload(to: Any, cc: Any, bcc: Any) -> dict[str, list[str]]:
    """What a body becomes when prune drops it: its address lists alone, which the event
    intake screens a late bounce's or complaint's addresses against (the ``recipients``
    column holds the same, but as one string a server in non-strict mode may have cut).
    No sender and no content: no email, so a row that somehow came back to the queue fails
    as invalid_payload, never sent."""
    return {
        name: [a for a in value if isinstance(a, str)]
        for name, value in zip(ADDRESS_FIELDS, (to, cc, bcc), strict=True)
        if isinstance(value, list) and value
    }


def count_droppable_bodies(
    conn: sa.Connection,
    *,
    before: datetime | None,
    failed_before: datetime | None,
    pruned_before: datetime,
    statuses: Sequence[str],
) -> int:
    """How many bodies :func:`drop_bodies` with these cutoffs would drop after a prune with
    these (whose rows go whole, and are not counted here)."""
    stmt = (
        sa.select(sa.func.count())
        .select_from(messages)
        .where(
            *_droppable(before, failed_before),
            sa.not_(sa.and_(*_prunable(pruned_before, statuses))),
        )
    )
    return int(conn.execute(stmt).scalar_one())


def drop_bodies(
    conn: sa.Connection,
    *,
    before: datetime | None,
    failed_before: datetime | None,
    now: datetime,
    limit: int,
    after_id: int = 0,
) -> tuple[int, int | None]:
    """Drop the payload of up to ``limit`` finished messages (ids above ``after_id``) last
    changed before the cutoffs (:func:`_droppable`): (bodies dropped, the last id looked at,
    None when no row was left). Rows another transaction holds are skipped (``SKIP
    LOCKED``), and the update re-checks the status, so a row an operator requeued meanwhile
    keeps its body. ``updated_at`` is left alone: the drop is not a change of the message's
    state."""
    droppable = _droppable(before, failed_before)
    payload = messages.c.payload
    rows = conn.execute(
        sa.select(messages.c.id, *(payload[name] for name in ADDRESS_FIELDS))
        .where(messages.c.id > after_id, *droppable)
        .order_by(messages.c.id)
        .limit(limit)
        .with_for_update(skip_locked=True)
    ).all()
    if not rows:
        return 0, None
    # one guarded UPDATE per row (each keeps its own addresses), sent as one executemany
    update = (
        sa.update(messages)
        .where(messages.c.id == sa.bindparam("row_id"), *droppable)
        .values(payload=sa.bindparam("kept"), body_dropped_at=now)
    )
    params = [{"row_id": row[0], "kept": dropped_payload(*row[1:])} for row in rows]
    conn.execute(update, params)
    dropped = conn.execute(
        sa.select(sa.func.count())
        .select_from(messages)
        .where(messages.c.id.in_([row[0] for row in rows]), messages.c.body_dropped_at == now)
    ).scalar_one()
    return int(dropped), rows[-1][0]


def prune_unmatched_events(conn: sa.Connection, *, before: datetime, limit: int) -> int:
    """Delete up to ``limit`` events matched to no message (another deployment's, foreign,
    malformed, or for a row already pruned) received before ``before``. They change nothing
    and dedupe nothing of ours (a redelivered one is only recorded again), so they need not
    wait for the dedup window: whoever can write to the events queue must not fill the table
    for a month."""
    ids = list(
        conn.execute(
            sa.select(events.c.id)
            .where(events.c.message_id.is_(None), events.c.received_at < before)
            .order_by(events.c.id)
            .limit(limit)
            .with_for_update(skip_locked=True)
        ).scalars()
    )
    if not ids:
        return 0
    return int(conn.execute(sa.delete(events).where(events.c.id.in_(ids))).rowcount)


def _stopped_before(before: datetime) -> sa.ColumnElement[bool]:
    """Relays that stopped cleanly, last heard of before ``before``."""
    return sa.and_(relays.c.state == RelayState.STOPPED.value, relays.c.heartbeat_at < before)


def prune_stopped_relays(conn: sa.Connection, *, before: datetime) -> int:
    """Delete the rows of relays that stopped cleanly before ``before``: every rollout adds
    one per pod, and a stopped relay's id is free anyway. A relay that died without stopping
    keeps its row (its id is taken over when reused)."""
    return int(conn.execute(sa.delete(relays).where(_stopped_before(before))).rowcount)


def count_stopped_relays(conn: sa.Connection, *, before: datetime) -> int:
    """How many relay rows :func:`prune_stopped_relays` would delete."""
    count = sa.select(sa.func.count()).select_from(relays).where(_stopped_before(before))
    return int(conn.execute(count).scalar_one())


# -- suppressions ---------------------------------------------------------------------------


def suppressed_rows(conn: sa.Connection, addresses: Sequence[str]) -> dict[str, Any]:
    """The suppression rows of those of ``addresses`` that have one, by address, locked
    ``FOR UPDATE`` (PostgreSQL, MariaDB) until the transaction ends."""
    found: dict[str, Any] = {}
    for start in range(0, len(addresses), _ADDRESSES_PER_STATEMENT):
        chunk = addresses[start : start + _ADDRESSES_PER_STATEMENT]
        stmt = sa.select(suppressions).where(suppressions.c.address.in_(chunk))
        found.update((r.address, r) for r in conn.execute(stmt.with_for_update()))
    return found


def add_suppressions(
    conn: sa.Connection,
    rows: Sequence[tuple[str, SuppressionReason, str | None]],
    *,
    now: datetime,
    actor: str,
) -> None:
    """Insert suppression rows, each (address, reason, detail)."""
    if not rows:
        return
    conn.execute(
        sa.insert(suppressions),
        [
            {"address": a, "reason": r.value, "detail": d, "created_at": now, "actor": actor}
            for a, r, d in rows
        ],
    )


def remove_suppressions(conn: sa.Connection, addresses: Sequence[str]) -> None:
    """Delete the suppression rows of ``addresses``."""
    conn.execute(sa.delete(suppressions).where(suppressions.c.address.in_(addresses)))


def list_suppressions(
    conn: sa.Connection,
    *,
    reasons: Sequence[str],
    limit: int,
    after: str | None,
    offset: int = 0,
) -> list[dict[str, Any]]:
    """One page of suppression rows in address order (keyset paging after ``after``, or
    ``offset`` rows on), only those of ``reasons`` when given."""
    stmt = sa.select(suppressions).order_by(suppressions.c.address).limit(limit).offset(offset)
    if reasons:
        stmt = stmt.where(suppressions.c.reason.in_(reasons))
    if after is not None:
        stmt = stmt.where(suppressions.c.address > after)
    return [dict(r._mapping) for r in conn.execute(stmt)]
