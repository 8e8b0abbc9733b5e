"""The send budgets: every send booked in ``outbox_send_budget`` before it starts, in each
budget (scope) it belongs to (``--max-send-rate``'s shared one, a ``--key-limit``'s or an
``--identity-limit``'s), one relay at a time under the lock of ``outbox_send_budget_lock``'s
one row, in the transaction that marks the wave; and the slots of the scopes with a most sends
in flight (``outbox_send_slots``). When each may start is relay.ratelimit's arithmetic; none
of this runs without a limit."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from outbox.schema import Status, UTCDateTime, messages, send_budget, send_budget_lock, send_slots
from relay.ratelimit import SHARED, Booking, merged

__all__ = [
    "book_sends",
    "lock_send_budget",
    "prune_send_budget",
    "prune_send_slots",
    "scoped_bookings",
    "send_bookings",
    "send_slots_in_use",
    "take_send_slots",
]

_budget = send_budget
_slots = send_slots
_m = messages
_LOCK_BUDGET = sa.update(send_budget_lock).where(send_budget_lock.c.id == 1).values(id=1)
_SINCE = sa.bindparam("since", type_=UTCDateTime())
_SCOPED_BOOKINGS = (
    sa.select(
        _budget.c.scope, _budget.c.reserved_at, _budget.c.recipients, _budget.c.occupied_until
    )
    .where(
        _budget.c.scope.in_(sa.bindparam("scopes", expanding=True)),
        _budget.c.occupied_until > _SINCE,
    )
    .order_by(_budget.c.reserved_at, _budget.c.id)
)
# A slot counts while its message is processing under the claim that took it: a send saved,
# given back or swept (its relay died) frees it, with nothing to delete first.
_HELD = sa.exists().where(
    _m.c.id == _slots.c.message_id,
    _m.c.claim_token == _slots.c.claim_token,
    _m.c.status == Status.PROCESSING.value,
)
_SLOTS_IN_USE = (
    sa.select(_slots.c.scope, sa.func.count())
    .where(_slots.c.scope.in_(sa.bindparam("scopes", expanding=True)), _HELD)
    .group_by(_slots.c.scope)
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
    """The shared budget's bookings whose hold ends after ``since``, in start order; read under
    :func:`lock_send_budget` (at READ COMMITTED each statement sees what committed before it)."""
    return scoped_bookings(conn, since=since, scopes=(SHARED,))[SHARED]


def scoped_bookings(
    conn: sa.Connection, *, since: datetime, scopes: Collection[str]
) -> dict[str, list[Booking]]:
    """:func:`send_bookings` of each of ``scopes`` (each in start order)."""
    found: dict[str, list[Booking]] = {scope: [] for scope in scopes}
    if not scopes:
        return found
    params = {"since": since, "scopes": sorted(scopes)}
    for row in conn.execute(_SCOPED_BOOKINGS, params):
        if row.scope not in found:
            continue  # MariaDB's IN ignores trailing spaces: another scope's bookings
        found[row.scope].append(
            Booking(start=row.reserved_at, recipients=row.recipients, until=row.occupied_until)
        )
    return found


def book_sends(
    conn: sa.Connection, *, relay_id: str, bookings: Sequence[Booking], scope: str = SHARED
) -> None:
    """Record this relay's new bookings in ``scope``'s budget (sends with the same start and
    hold as one row), under :func:`lock_send_budget`."""
    rows = [
        {
            "relay_id": relay_id,
            "reserved_at": b.start,
            "recipients": b.recipients,
            "occupied_until": b.until,
            "scope": scope,
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


def send_slots_in_use(conn: sa.Connection, *, scopes: Collection[str]) -> dict[str, int]:
    """How many sends of each of ``scopes`` are in flight, on every relay; read under
    :func:`lock_send_budget`."""
    found = dict.fromkeys(scopes, 0)
    if scopes:
        found.update(
            (scope, int(n)) for scope, n in conn.execute(_SLOTS_IN_USE, {"scopes": sorted(scopes)})
        )
    return found


def take_send_slots(
    conn: sa.Connection, *, slots: Sequence[tuple[str, int, str]], now: datetime
) -> None:
    """One slot per (scope, message id, claim token) of a send about to start, under
    :func:`lock_send_budget`, in the transaction that marks it."""
    if slots:
        conn.execute(
            sa.insert(_slots),
            [
                {"scope": scope, "message_id": mid, "claim_token": token, "taken_at": now}
                for scope, mid, token in slots
            ],
        )


def prune_send_slots(conn: sa.Connection) -> int:
    """Delete the slots that no longer count (their send saved, given back or swept)."""
    return int(conn.execute(sa.delete(_slots).where(~_HELD)).rowcount)
