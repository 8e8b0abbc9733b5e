"""How the outbox's revisions change a live table: holding its lock only a moment.

A revision imports this and ``outbox.exceptions`` only (docs/design.md, the module map's
layering rule 8): it bounds how long a change waits for its lock and creates nothing, so a
fix here reaches every revision without changing what an old one creates.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import sqlalchemy as sa
from alembic import op

from outbox import autocommit

__all__ = ["in_autocommit", "lock_briefly"]


def lock_briefly(
    bind: sa.Connection,
    change: Callable[[], None],
    *,
    table: str,
    revision: str,
    offline: bool,
    tries: int,
    lock_wait: int,
    pause: float,
) -> None:
    """For the outbox's revisions: run ``change`` holding ``table``'s lock only a moment. A
    lock request queued behind a long transaction would make every later write wait behind
    it, so each try waits at most ``lock_wait`` seconds for its lock (``lock_timeout`` in a
    savepoint on PostgreSQL, a transaction of its own in autocommit; ``lock_wait_timeout`` on
    MariaDB), gives way, and tries again after ``pause``, up to ``tries`` times; then one
    error naming the table and what to end. Offline (``alembic upgrade --sql``) the script
    gets the same bound, without the retries. docs/design.md, "Body retention"."""
    dialect = bind.dialect.name
    if dialect not in ("postgresql", "mysql", "mariadb"):
        change()
        return
    if offline:
        if dialect == "postgresql":
            op.execute(f"SET LOCAL lock_timeout = '{lock_wait}s'")  # the script's transaction
            change()
            op.execute("SET LOCAL lock_timeout = DEFAULT")
        else:
            op.execute("SET @outbox_lock_wait = @@SESSION.lock_wait_timeout")
            op.execute(f"SET SESSION lock_wait_timeout = {lock_wait}")
            change()
            op.execute("SET SESSION lock_wait_timeout = @outbox_lock_wait")
        return
    if dialect == "postgresql":
        before = bind.exec_driver_sql("SHOW lock_timeout").scalar_one()
    else:
        before = bind.exec_driver_sql("SELECT @@SESSION.lock_wait_timeout").scalar_one()
    for attempt in range(1, tries + 1):
        try:
            if dialect == "postgresql" and not in_autocommit(bind):
                # a timed-out try rolls back to its savepoint, SET LOCAL with it
                with bind.begin_nested():
                    bind.exec_driver_sql(f"SET LOCAL lock_timeout = '{lock_wait}s'")
                    change()
                    bind.execute(
                        sa.text("SELECT set_config('lock_timeout', :v, true)"), {"v": before}
                    )
            elif dialect == "postgresql":
                # autocommit: a transaction of its own, so the bound goes with the change
                # even through a pooler that hands each statement another server session
                bind.exec_driver_sql("BEGIN")
                try:
                    bind.exec_driver_sql(f"SET LOCAL lock_timeout = '{lock_wait}s'")
                    change()
                except BaseException:
                    bind.exec_driver_sql("ROLLBACK")
                    raise
                bind.exec_driver_sql("COMMIT")
            else:  # MariaDB: its DDL commits by itself
                bind.exec_driver_sql(f"SET SESSION lock_wait_timeout = {lock_wait}")
                try:
                    change()
                finally:
                    bind.exec_driver_sql(f"SET SESSION lock_wait_timeout = {int(before)}")
            return
        except sa.exc.DBAPIError as exc:
            if not _lock_timed_out(exc):
                raise
            if attempt == tries:
                raise RuntimeError(
                    f"{revision}: could not lock {table} for a moment in {attempt} tries: a "
                    "long transaction keeps reading or writing it; end it (pg_stat_activity, "
                    "SHOW PROCESSLIST) and run the upgrade again"
                ) from exc
        time.sleep(pause)


def in_autocommit(bind: sa.Connection) -> bool:
    """Whether every statement on ``bind`` commits by itself: :mod:`outbox.autocommit`'s
    test, here for the revisions (they import only this module and the exceptions)."""
    return autocommit.in_autocommit(bind)


def _lock_timed_out(exc: sa.exc.DBAPIError) -> bool:
    """PostgreSQL's lock_not_available (lock_timeout) or MariaDB's lock wait timeout (1205)."""
    orig = exc.orig
    code = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    args = getattr(orig, "args", ())
    return code == "55P03" or bool(args and args[0] == 1205)
