"""Whether a connection's statements commit one by one: the enqueue refuses such a
connection (the email would commit without the caller's transaction), the relay too (its
claim's locks would end between its read and its write), and a revision builds its indexes
concurrently on one. One test for all three, so a driver's quirk is fixed once.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

__all__ = ["in_autocommit"]


def in_autocommit(bind: sa.Connection) -> bool:
    """Whether every statement on ``bind`` commits by itself (no transaction, so no savepoint
    and no lock held from one statement to the next): ``isolation_level="AUTOCOMMIT"`` on the
    connection or its engine, or autocommit set on the driver's own connection
    (``connect_args``, an ``init_command``, a sqlite3 or aiosqlite ``isolation_level`` of None
    with nobody emitting BEGIN). Call it after the connection has run a statement."""
    level = bind.get_execution_options().get("isolation_level")
    if level is None:
        level = getattr(bind.dialect, "_on_connect_isolation_level", None)
    if level == "AUTOCOMMIT":
        return True
    raw = bind.connection.dbapi_connection
    get_autocommit = getattr(raw, "get_autocommit", None)  # PyMySQL, mysqlclient, aiomysql
    if callable(get_autocommit):
        return bool(get_autocommit())
    if getattr(raw, "autocommit", None) is True:  # psycopg, sqlite3 on Python 3.12+
        return True
    if bind.dialect.name == "sqlite":
        driver: Any = bind.connection.driver_connection
        # aiosqlite's connection does not pass sqlite3's autocommit (Python 3.12+) on, and
        # in that mode isolation_level stays "" while COMMIT does nothing: read its sqlite3's
        inner = getattr(driver, "_conn", driver)
        if getattr(inner, "autocommit", None) is True:
            return True
        return bool(driver.isolation_level is None and not driver.in_transaction)
    return False
