"""What the migrations made, read back: the outbox tables a database lacks, and the operator
views (``outbox_status_summary``, ``outbox_lag``, ...) typed alike on every backend."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sqlalchemy as sa

from outbox.migrations import VIEWS
from outbox.schema import UTCDateTime
from outbox.schema import metadata as _outbox_metadata

__all__ = ["OUTBOX_TABLES", "missing_tables", "read_lag", "read_view"]

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
