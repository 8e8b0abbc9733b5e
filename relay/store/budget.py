"""The shared send budget (``--max-send-rate``): every send booked in ``outbox_send_budget``
before it starts, one relay at a time under the lock of ``outbox_send_budget_lock``'s one row,
in the transaction that marks the wave. When each may start is relay.ratelimit's arithmetic;
none of this runs without a send limit."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from outbox.schema import UTCDateTime, send_budget, send_budget_lock
from relay.ratelimit import Booking, merged

__all__ = ["book_sends", "lock_send_budget", "prune_send_budget", "send_bookings"]

_budget = send_budget
_LOCK_BUDGET = sa.update(send_budget_lock).where(send_budget_lock.c.id == 1).values(id=1)
_BOOKINGS = (
    sa.select(_budget.c.reserved_at, _budget.c.recipients, _budget.c.occupied_until)
    .where(_budget.c.occupied_until > sa.bindparam("since", type_=UTCDateTime()))
    .order_by(_budget.c.reserved_at, _budget.c.id)
)


def _seed_budget_lock(dialect: str) -> sa.Insert:
    """The lock's row, inserted unless it exists (another relay may insert it at once)."""
    if dialect == "postgresql":
        return postgresql.insert(send_budget_lock).values(id=1).on_conflict_do_nothing()
    if dialect == "sqlite":
        return sqlite.insert(send_budget_lock).values(id=1).on_conflict_do_nothing()
    return sa.insert(send_budget_lock).values(id=1).prefix_with("IGNORE")


def lock_send_budget(conn: sa.Connection) -> None:
    """Hold the budget's lock until this transaction ends, so bookings are made one relay at
    a time, each seeing every booking committed before it.

    An UPDATE of the lock's row (a row lock; SQLite's write lock), which the migration
    inserts; put back first if the table was emptied."""
    if conn.execute(_LOCK_BUDGET).rowcount == 1:
        return
    conn.execute(_seed_budget_lock(conn.dialect.name))
    conn.execute(_LOCK_BUDGET)


def send_bookings(conn: sa.Connection, *, since: datetime) -> list[Booking]:
    """The bookings whose hold on the budget ends after ``since``, in start order; read under
    :func:`lock_send_budget` (at READ COMMITTED each statement sees what committed before it)."""
    return [
        Booking(start=row.reserved_at, recipients=row.recipients, until=row.occupied_until)
        for row in conn.execute(_BOOKINGS, {"since": since})
    ]


def book_sends(conn: sa.Connection, *, relay_id: str, bookings: Sequence[Booking]) -> None:
    """Record this relay's new bookings (sends with the same start and hold as one row), under
    :func:`lock_send_budget`."""
    rows = [
        {
            "relay_id": relay_id,
            "reserved_at": b.start,
            "recipients": b.recipients,
            "occupied_until": b.until,
        }
        for b in merged(bookings)
    ]
    if rows:
        conn.execute(sa.insert(_budget), rows)


def prune_send_budget(conn: sa.Connection, *, before: datetime) -> int:
    """Delete bookings whose hold ended before ``before``: they can no longer affect a new
    one."""
    result = conn.execute(sa.delete(_budget).where(_budget.c.occupied_until < before))
    return int(result.rowcount)
