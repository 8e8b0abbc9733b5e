"""What the migrations made, read back: the outbox tables a database lacks, the operator
views (``outbox_status_summary``, ``outbox_lag``, ...) typed alike on every backend, and the
metrics' reads of the lag (per category, and per fairness key for the busiest keys)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from outbox.migrations import VIEWS
from outbox.schema import CLAIMABLE, UTCDateTime, messages
from outbox.schema import metadata as _outbox_metadata

__all__ = [
    "OUTBOX_TABLES",
    "DueByKey",
    "KeyDue",
    "missing_tables",
    "read_due_by_key",
    "read_lag",
    "read_view",
]

OUTBOX_TABLES = tuple(sorted(_outbox_metadata.tables))


def missing_tables(conn: sa.Connection) -> list[str]:
    """The outbox tables the database lacks (all of them if it was never migrated)."""
    present = set(sa.inspect(conn).get_table_names())
    return [name for name in OUTBOX_TABLES if name not in present]


_COUNT, _SECONDS, _TIME = sa.Integer(), sa.Float(), UTCDateTime()
_VIEW_TYPES: dict[str, dict[str, sa.types.TypeEngine[Any]]] = {
    "outbox_status_summary": {
        "message_count": _COUNT,
        "oldest_created_at": _TIME,
        "oldest_next_attempt_at": _TIME,
    },
    "outbox_lag": {"due_count": _COUNT, "oldest_due_at": _TIME, "lag_seconds": _SECONDS},
    "outbox_unknown_outcomes": {
        "id": _COUNT,
        "claimed_at": _TIME,
        "send_started_at": _TIME,
        "attempt_count": _COUNT,
        "updated_at": _TIME,
    },
    "outbox_failures": {"message_count": _COUNT, "newest_at": _TIME, "newest_message_id": _COUNT},
    "outbox_relay_health": {
        "pid": _COUNT,
        "started_at": _TIME,
        "heartbeat_at": _TIME,
        "heartbeat_age_seconds": _SECONDS,
    },
    "outbox_fairness": {
        "due_count": _COUNT,
        "queued_count": _COUNT,
        "processing_count": _COUNT,
        "oldest_due_at": _TIME,
        "lag_seconds": _SECONDS,
    },
}


def read_view(conn: sa.Connection, name: str) -> list[dict[str, Any]]:
    """The rows of one of the operator views, typed alike on every backend: timestamps aware
    in UTC (SQLite gives text, MariaDB naive UTC, PostgreSQL the session's zone), ages as
    float seconds (PostgreSQL and MariaDB give ``Decimal``), counts and ids as ints."""
    if name not in VIEWS:
        raise ValueError(f"not an outbox view: {name}")
    stmt = sa.text(f"SELECT * FROM {name}").columns(**_VIEW_TYPES.get(name, {}))
    return [dict(row._mapping) for row in conn.execute(stmt)]


_LAG = sa.text("SELECT category, due_count, lag_seconds FROM outbox_lag")


def read_lag(conn: sa.Connection) -> Sequence[sa.Row[Any]]:
    """Each category's ``category``, ``due_count`` and ``lag_seconds``, as ``outbox_lag`` has
    them (the metrics' gauges)."""
    return conn.execute(_LAG).all()


@dataclass(frozen=True, kw_only=True, slots=True)
class KeyDue:
    """The due messages of one fairness key, or of several summed (``key`` None)."""

    key: str | None
    due_count: int
    oldest_due_at: datetime | None  # None: none due


@dataclass(frozen=True, kw_only=True, slots=True)
class DueByKey:
    """Due messages by fairness key: the ``top`` keys (most due first), the ``rest`` of the
    keys summed, and the messages without a key (``unkeyed``)."""

    top: list[KeyDue]
    rest: KeyDue
    unkeyed: KeyDue


_m = messages
_NOW = sa.bindparam("k_now", type_=UTCDateTime())
# literals, as in the claim: a partial index is used only for a condition it can match
_DUE = sa.and_(
    _m.c.status.in_([sa.literal_column(f"'{s.value}'", sa.String) for s in CLAIMABLE]),
    _m.c.next_attempt_at <= _NOW,
)
_PER_KEY = (
    sa.select(
        _m.c.fairness_key.label("key"),
        sa.func.count().label("due_count"),
        sa.func.min(_m.c.next_attempt_at).label("oldest_due_at"),
    )
    .where(_DUE)
    .group_by(_m.c.fairness_key)
    .subquery("per_key")
)


def _number(n: int) -> sa.ColumnElement[int]:
    return sa.literal_column(str(n), sa.Integer)


_RANKED = sa.select(
    _PER_KEY,
    sa.func.row_number()
    .over(
        order_by=(
            # the unkeyed take no rank
            sa.case((_PER_KEY.c.key.is_(None), _number(1)), else_=_number(0)),
            _PER_KEY.c.due_count.desc(),
            _PER_KEY.c.key,
        )
    )
    .label("rank"),
).subquery("ranked")


@functools.cache
def _due_by_key(top: int) -> sa.Select[Any]:
    # bucket 0: no key; 1 to top: a key of its own, by rank; top + 1: the rest
    r = _RANKED.c
    bucket = sa.case(
        (r.key.is_(None), _number(0)), (r.rank <= _number(top), r.rank), else_=_number(top + 1)
    )
    buckets = sa.select(bucket.label("bucket"), r.key, r.due_count, r.oldest_due_at).subquery()
    b = buckets.c
    return (
        sa.select(
            b.bucket,
            sa.func.min(b.key).label("key"),
            sa.func.sum(b.due_count).label("due_count"),
            sa.func.min(b.oldest_due_at).label("oldest_due_at"),
        )
        .group_by(b.bucket)
        .order_by(b.bucket)
    )


def read_due_by_key(conn: sa.Connection, *, now: datetime, top: int) -> DueByKey:
    """The messages due at ``now`` (claimable, ``next_attempt_at`` passed, as ``outbox_lag``
    counts them) by fairness key: the ``top`` keys with the most (ties by key), the other
    keys summed, the unkeyed apart. One statement; at most ``top + 2`` rows come back however
    many keys there are."""
    if isinstance(top, bool) or not isinstance(top, int) or top < 0:
        raise ValueError(f"top must be an int, 0 or more, not {top!r}")
    top_keys: list[KeyDue] = []
    rest = unkeyed = KeyDue(key=None, due_count=0, oldest_due_at=None)
    for row in conn.execute(_due_by_key(top), {"k_now": now}):
        due = KeyDue(key=row.key, due_count=int(row.due_count), oldest_due_at=row.oldest_due_at)
        if row.bucket == 0:
            unkeyed = due
        elif row.bucket > top:
            rest = KeyDue(key=None, due_count=due.due_count, oldest_due_at=due.oldest_due_at)
        else:
            top_keys.append(due)
    return DueByKey(top=top_keys, rest=rest, unkeyed=unkeyed)
