"""The operator commands' statements on messages: the rows a :class:`Filter` means (listed,
counted, their ids and statuses), one row with its attempts, the newest payloads, and the
guarded bulk ``requeue`` and ``cancel``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.compiler import compiles

from outbox.schema import Status, attempts, messages
from relay.store.finalize import _requeued_values

__all__ = [
    "CANCELLABLE",
    "REQUEUEABLE",
    "SAFE_READ",
    "Filter",
    "bodies_dropped",
    "cancel",
    "cancel_many",
    "count_messages",
    "get_message",
    "list_messages",
    "message_ids",
    "recent_payloads",
    "requeue",
    "requeue_many",
    "statuses_of",
]

_m = messages
REQUEUEABLE = (Status.UNKNOWN_OUTCOME.value, Status.FAILED.value)
CANCELLABLE = (Status.PENDING.value, Status.RETRYING.value)


def _change_many(
    conn: sa.Connection,
    ids: Sequence[int],
    allowed: Sequence[str],
    values: dict[str, Any],
    *also: sa.ColumnElement[bool],
) -> list[int]:
    """One guarded, set-based UPDATE of the rows among ``ids`` still in an ``allowed``
    status (and meeting ``also``); the ids it changed, ascending. Without RETURNING (MariaDB)
    the rows are locked first (``FOR UPDATE``), so none moves between the SELECT and the
    UPDATE; a claim skips them (``SKIP LOCKED``) rather than wait."""
    if not ids:
        return []
    guard = (_m.c.id.in_(ids), _m.c.status.in_(allowed), *also)
    if conn.dialect.update_returning:
        changed = conn.execute(sa.update(_m).where(*guard).values(**values).returning(_m.c.id))
        return sorted(changed.scalars())
    locked = sorted(conn.execute(sa.select(_m.c.id).where(*guard).with_for_update()).scalars())
    if locked:
        conn.execute(sa.update(_m).where(_m.c.id.in_(locked), *guard[1:]).values(**values))
    return locked


def requeue_many(conn: sa.Connection, *, ids: Sequence[int], now: datetime) -> list[int]:
    """unknown_outcome/failed -> pending, due now, with a fresh attempt budget; the ids
    requeued (the others had moved on, or lost their body to prune meanwhile)."""
    return _change_many(
        conn, ids, REQUEUEABLE, _requeued_values(now), _m.c.body_dropped_at.is_(None)
    )


def cancel_many(conn: sa.Connection, *, ids: Sequence[int], now: datetime) -> list[int]:
    """pending/retrying -> cancelled (a row being sent cannot be); the ids cancelled (the
    others had been claimed or had moved on)."""
    values = {"status": Status.CANCELLED.value, "updated_at": now}
    return _change_many(conn, ids, CANCELLABLE, values)


def requeue(conn: sa.Connection, *, message_id: int, now: datetime) -> bool:
    """:func:`requeue_many` for one message."""
    return requeue_many(conn, ids=[message_id], now=now) == [message_id]


def cancel(conn: sa.Connection, *, message_id: int, now: datetime) -> bool:
    """:func:`cancel_many` for one message."""
    return cancel_many(conn, ids=[message_id], now=now) == [message_id]


@dataclass(frozen=True, kw_only=True, slots=True)
class Filter:
    """Which messages an operator command means. Empty fields match everything."""

    ids: tuple[int, ...] = ()
    statuses: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    key: str | None = None  # exact, or a prefix when it ends with '*'
    created_before: datetime | None = None
    created_after: datetime | None = None
    changed_before: datetime | None = None
    has_body: bool | None = None  # True: prune has not dropped its body; False: it has
    error_code: str | None = None  # the last attempt's error code, exactly
    delivery_status: str | None = None  # what SES's events said, exactly
    recipient: str | None = None  # a part of the recipients (lower case): a scan, no index


def _where(f: Filter) -> list[sa.ColumnElement[bool]]:
    clauses: list[sa.ColumnElement[bool]] = []
    if f.ids:
        clauses.append(_m.c.id.in_(f.ids))
    if f.statuses:
        clauses.append(_m.c.status.in_(f.statuses))
    if f.categories:
        clauses.append(_m.c.category.in_(f.categories))
    if f.key is not None:
        if f.key.endswith("*"):
            prefix = f.key[:-1].replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            clauses.append(_m.c.idempotency_key.like(prefix + "%", escape="\\"))
        else:
            clauses.append(_m.c.idempotency_key == f.key)
    if f.created_before is not None:
        clauses.append(_m.c.created_at < f.created_before)
    if f.created_after is not None:
        clauses.append(_m.c.created_at >= f.created_after)
    if f.changed_before is not None:
        clauses.append(_m.c.updated_at < f.changed_before)
    if f.error_code is not None:
        clauses.append(_m.c.last_error_code == f.error_code)
    if f.delivery_status is not None:
        clauses.append(_m.c.delivery_status == f.delivery_status)
    if f.recipient is not None:
        needle = f.recipient.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        clauses.append(sa.func.lower(_m.c.recipients).like(f"%{needle}%", escape="\\"))
    if f.has_body is not None:
        dropped = _m.c.body_dropped_at
        clauses.append(dropped.is_(None) if f.has_body else dropped.is_not(None))
    return clauses


_LIST_COLUMNS = (
    _m.c.id,
    _m.c.status,
    _m.c.category,
    _m.c.priority,
    _m.c.idempotency_key,
    _m.c.recipients,
    _m.c.subject,
    _m.c.attempt_count,
    _m.c.next_attempt_at,
    _m.c.created_at,
    _m.c.updated_at,
    _m.c.last_error_code,
)


def list_messages(
    conn: sa.Connection,
    f: Filter,
    *,
    limit: int,
    after_id: int | None = None,
    before_id: int | None = None,
    newest_first: bool = False,
) -> list[Any]:
    """One page of messages matching ``f``, by id (keyset paging: ids after ``after_id``,
    before ``before_id``), oldest first or newest first."""
    keyset = []
    if after_id is not None:
        keyset.append(_m.c.id > after_id)
    if before_id is not None:
        keyset.append(_m.c.id < before_id)
    where = [*_where(f), *keyset]
    ordered: sa.ColumnElement[int] = _m.c.id
    if _matches_first(conn, f, keyset, limit=limit, newest_first=newest_first):
        ordered = _m.c.id + 0  # not the primary key's order: the planner reads matches first
    order = ordered.desc() if newest_first else ordered
    stmt = sa.select(*_LIST_COLUMNS).where(*where).order_by(order).limit(limit)
    return list(conn.execute(stmt).all())


SAFE_READ = 50_000  # rows a page may read through a key or date index, whatever else is known


class _Explain(sa.sql.expression.Executable, sa.sql.expression.ClauseElement):
    """``EXPLAIN (FORMAT JSON)`` of a statement, its parameters bound as the statement's."""

    inherit_cache = False

    def __init__(self, stmt: sa.Select[Any]) -> None:
        self.stmt = stmt


@compiles(_Explain, "postgresql")
def _compile_explain(element: _Explain, compiler: Any, **kw: Any) -> str:
    return "EXPLAIN (FORMAT JSON) " + str(compiler.process(element.stmt, **kw))


def _estimate(conn: sa.Connection, where: Sequence[sa.ColumnElement[bool]]) -> float:
    """The planner's estimate of the rows meeting ``where``: one EXPLAIN, nothing read."""
    plan = conn.execute(_Explain(sa.select(sa.literal(1)).select_from(_m).where(*where)))
    found = plan.scalar_one()
    found = json.loads(found) if isinstance(found, str) else found
    return max(float(found[0]["Plan"]["Plan Rows"]), 1.0)


def _matches_first(
    conn: sa.Connection,
    f: Filter,
    keyset: Sequence[sa.ColumnElement[bool]],
    *,
    limit: int,
    newest_first: bool,
) -> bool:
    """PostgreSQL: whether a page of ``f`` should read its matches through the key's or
    created_at's index and sort them, rather than walk the primary key and test each row.

    The planner prices the walk as if matches were spread evenly over the ids, but a date
    range or a key prefix (``order-42*``) picks rows that sit together, often far from the
    newest: the walk then reads every row in between. So the two are priced here, from the
    planner's estimates: reading the matches costs the rows the key or date index yields; the
    walk costs the rows it passes before the range's edge, then ``limit`` matches at the
    range's density. A read of at most :data:`SAFE_READ` rows is taken whatever the walk
    would cost, as a key prefix's rows may gather anywhere. docs/design.md, "The console's
    messages page"."""
    if conn.dialect.name != "postgresql" or (
        f.key is None and f.created_after is None and f.created_before is None
    ):
        return False
    ranged = _where(Filter(created_after=f.created_after, created_before=f.created_before))
    keyed = _where(Filter(key=f.key)) if f.key is not None else []
    reads = [_estimate(conn, [*keyset, *c]) for c in (keyed, ranged) if c]
    read = min(reads)
    if read <= SAFE_READ:
        return True
    edge = f.created_before if newest_first else f.created_after
    passed = 0.0
    if edge is not None:
        beyond = _m.c.created_at >= edge if newest_first else _m.c.created_at < edge
        passed = _estimate(conn, [*keyset, beyond])
    span = _estimate(conn, [*keyset, *ranged])
    walk = passed + limit * span / _estimate(conn, [*keyset, *_where(f)])
    return read < walk


def count_messages(conn: sa.Connection, f: Filter) -> int:
    """How many messages match ``f``."""
    stmt = sa.select(sa.func.count()).select_from(_m).where(*_where(f))
    return int(conn.execute(stmt).scalar_one())


def message_ids(conn: sa.Connection, f: Filter) -> list[int]:
    """Every id matching ``f``, in order (for a bulk operator command)."""
    return list(conn.execute(sa.select(_m.c.id).where(*_where(f)).order_by(_m.c.id)).scalars())


_IDS_PER_STATEMENT = 10_000  # PostgreSQL takes at most 65,535 parameters in one statement


def statuses_of(conn: sa.Connection, ids: Sequence[int]) -> dict[int, str]:
    """The current status of each existing id, ``_IDS_PER_STATEMENT`` ids a statement, so an
    operator may give any number of ids."""
    return _by_id(conn, ids, _m.c.status)


def _by_id(
    conn: sa.Connection, ids: Sequence[int], column: sa.Column[Any], *where: Any
) -> dict[int, Any]:
    """``column`` of each of ``ids`` that exists (and meets ``where``), read
    ``_IDS_PER_STATEMENT`` ids a statement."""
    found: dict[int, Any] = {}
    for start in range(0, len(ids), _IDS_PER_STATEMENT):
        chunk = ids[start : start + _IDS_PER_STATEMENT]
        rows = conn.execute(sa.select(_m.c.id, column).where(_m.c.id.in_(chunk), *where)).all()
        found.update((row[0], row[1]) for row in rows)
    return found


def bodies_dropped(conn: sa.Connection, ids: Sequence[int]) -> dict[int, datetime]:
    """When prune dropped the body of each of ``ids`` that lost it."""
    dropped = _m.c.body_dropped_at
    return _by_id(conn, ids, dropped, dropped.is_not(None))


def get_message(
    conn: sa.Connection, message_id: int
) -> tuple[sa.Row[Any] | None, list[sa.Row[Any]]]:
    """A message row and all its attempts, oldest first."""
    row = conn.execute(sa.select(_m).where(_m.c.id == message_id)).one_or_none()
    history = conn.execute(
        sa.select(attempts).where(attempts.c.message_id == message_id).order_by(attempts.c.id)
    ).all()
    return row, list(history)


def recent_payloads(conn: sa.Connection, *, limit: int = 1000) -> list[Any]:
    """The payloads of the newest ``limit`` messages that still have their body, newest
    first: where ``doctor`` finds the From addresses and configuration sets in use. Read back
    along the primary key among the newest ``10 * limit`` rows, so its cost does not grow
    with the table, even when prune has dropped every body (``--keep-bodies 0``)."""
    newest = (
        sa.select(_m.c.id, _m.c.body_dropped_at)  # no payloads: MariaDB copies this out
        .order_by(_m.c.id.desc())
        .limit(10 * limit)
        .subquery()
    )
    stmt = (
        sa.select(_m.c.payload)
        .join(newest, newest.c.id == _m.c.id)
        .where(newest.c.body_dropped_at.is_(None))
        .order_by(_m.c.id.desc())
        .limit(limit)
    )
    return list(conn.execute(stmt).scalars())
