"""outbox: each relay's scoped pauses in its row (outbox_relays.paused_scopes)

Revision ID: outbox_0006
Revises: outbox_0005
Create Date: 2026-12-06

One nullable TEXT column with no default: the relay writes its scoped pauses there (compact
JSON, bounded) with each heartbeat, so the console can show them. Adding it is instant on
PostgreSQL, MariaDB 10.3+ and SQLite: it changes only the catalog and rewrites no row;
every existing row reads NULL (no pauses) until its relay beats again. Dropping it (the
downgrade) is instant too on PostgreSQL and MariaDB 10.4+.

What could still stop the relays is the moment's exclusive lock the change needs: queued
behind a long transaction that reads ``outbox_relays`` (a report, a console page), it would
make every heartbeat wait behind it. So, as 0005 does, the change waits at most a second for
its lock (``lock_timeout`` on PostgreSQL, ``lock_wait_timeout`` on MariaDB), gives way when it
cannot have it, and tries again, up to :data:`TRIES` times; MariaDB is told
``ALGORITHM=INSTANT``, so it fails rather than copy the table.

The relay's role must be allowed to update the column (its heartbeat writes it): the example
grants (examples/deploy/grants-*.sql) name it; apply them again after this upgrade
(``outbox-relay doctor`` names a missing grant). Until then, or while this revision is not
applied, a relay of this release beats without the column and says so once. The view
``outbox_relay_health`` is left as it is: the console reads the pauses from the table.
"""

import time
from collections.abc import Callable, Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "outbox_0006"
down_revision: str | Sequence[str] | None = "outbox_0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TRIES = 120  # each waits up to LOCK_WAIT, then a pause: about four minutes in all
LOCK_WAIT = 1  # seconds the change may make the relays' heartbeats wait behind it
PAUSE = 1.0  # seconds between tries, while the heartbeats go through


def _lock_timed_out(exc: sa.exc.DBAPIError) -> bool:
    """PostgreSQL's lock_not_available (lock_timeout) or MariaDB's lock wait timeout (1205)."""
    orig = exc.orig
    code = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    args = getattr(orig, "args", ())
    return code == "55P03" or bool(args and args[0] == 1205)


def _briefly(bind: sa.Connection, change: Callable[[], None], *, offline: bool = False) -> None:
    """Run ``change`` holding its lock only a moment: retried while a transaction holds the
    table (the heartbeats go on in between); an error naming the table after the last try.
    Offline (``alembic upgrade --sql``) the script gets the same bound, without the retries."""
    dialect = bind.dialect.name
    if dialect not in ("postgresql", "mysql", "mariadb"):
        change()
        return
    if offline:
        if dialect == "postgresql":
            op.execute(f"SET LOCAL lock_timeout = '{LOCK_WAIT}s'")  # the script's transaction
            change()
            op.execute("SET LOCAL lock_timeout = DEFAULT")
        else:
            op.execute("SET @outbox_lock_wait = @@SESSION.lock_wait_timeout")
            op.execute(f"SET SESSION lock_wait_timeout = {LOCK_WAIT}")
            change()
            op.execute("SET SESSION lock_wait_timeout = @outbox_lock_wait")
        return
    if dialect == "postgresql":
        before = bind.exec_driver_sql("SHOW lock_timeout").scalar_one()
    else:
        before = bind.exec_driver_sql("SELECT @@SESSION.lock_wait_timeout").scalar_one()
    for attempt in range(1, TRIES + 1):
        try:
            if dialect == "postgresql" and not _autocommit(bind):
                # a timed-out try rolls back to its savepoint, SET LOCAL with it
                with bind.begin_nested():
                    bind.exec_driver_sql(f"SET LOCAL lock_timeout = '{LOCK_WAIT}s'")
                    change()
                    bind.execute(
                        sa.text("SELECT set_config('lock_timeout', :v, true)"), {"v": before}
                    )
            elif dialect == "postgresql":
                # autocommit: a transaction of its own, so the bound goes with the change
                # even through a pooler that hands each statement another server session
                bind.exec_driver_sql("BEGIN")
                try:
                    bind.exec_driver_sql(f"SET LOCAL lock_timeout = '{LOCK_WAIT}s'")
                    change()
                except BaseException:
                    bind.exec_driver_sql("ROLLBACK")
                    raise
                bind.exec_driver_sql("COMMIT")
            else:  # MariaDB: its DDL commits by itself
                bind.exec_driver_sql(f"SET SESSION lock_wait_timeout = {LOCK_WAIT}")
                try:
                    change()
                finally:
                    bind.exec_driver_sql(f"SET SESSION lock_wait_timeout = {int(before)}")
            return
        except sa.exc.DBAPIError as exc:
            if not _lock_timed_out(exc):
                raise
            if attempt == TRIES:
                raise _held(attempt) from exc
        time.sleep(PAUSE)


def _autocommit(bind: sa.Connection) -> bool:
    """Whether the driver commits each statement (no transaction, so no savepoint)."""
    return bool(getattr(bind.connection.dbapi_connection, "autocommit", False))


def _held(tries: int) -> Exception:
    return RuntimeError(
        f"outbox_0006: could not lock outbox_relays for a moment in {tries} tries: a "
        "long transaction keeps reading or writing it; end it (pg_stat_activity, SHOW "
        "PROCESSLIST) and run the upgrade again"
    )


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name in ("mysql", "mariadb"):
        _briefly(
            bind,
            lambda: op.execute(
                "ALTER TABLE outbox_relays ADD COLUMN paused_scopes TEXT NULL, ALGORITHM=INSTANT"
            ),
            offline=op.get_context().as_sql,
        )
    else:
        _briefly(
            bind,
            lambda: op.add_column("outbox_relays", sa.Column("paused_scopes", sa.Text())),
            offline=op.get_context().as_sql,
        )


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name in ("mysql", "mariadb"):
        _briefly(
            bind,
            lambda: op.execute(
                "ALTER TABLE outbox_relays DROP COLUMN paused_scopes, ALGORITHM=INSTANT"
            ),
            offline=op.get_context().as_sql,
        )
    else:
        _briefly(
            bind,
            lambda: op.drop_column("outbox_relays", "paused_scopes"),
            offline=op.get_context().as_sql,
        )
