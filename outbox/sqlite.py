"""SAVEPOINT support for SQLite.

Before Python 3.12, the ``sqlite3`` module begins transactions on its own and breaks
SAVEPOINT (and so the outbox's duplicate-key guard). The SQLAlchemy documentation's fix: let the
driver do nothing, and emit ``BEGIN`` ourselves when SQLAlchemy starts a transaction. Apply it
to every SQLite engine that enqueues::

    engine = create_engine("sqlite:///app.db")
    outbox.sqlite.enable_savepoints(engine)

It works for ``pysqlite`` and ``aiosqlite`` engines (pass the AsyncEngine itself).
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncEngine

__all__ = ["enable_savepoints"]


def enable_savepoints(engine: sa.Engine | AsyncEngine) -> None:
    """Make SAVEPOINT work on a SQLite ``engine`` (a no-op for other databases). Idempotent."""
    sync_engine = engine.sync_engine if isinstance(engine, AsyncEngine) else engine
    if sync_engine.dialect.name != "sqlite":
        return
    if event.contains(sync_engine, "connect", _on_connect):
        return
    event.listen(sync_engine, "connect", _on_connect)
    event.listen(sync_engine, "begin", _on_begin)


def _on_connect(dbapi_connection: Any, connection_record: Any) -> None:
    dbapi_connection.isolation_level = None


def _on_begin(conn: sa.Connection) -> None:
    conn.exec_driver_sql("BEGIN")
