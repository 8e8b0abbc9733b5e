"""outbox: body retention (when a finished message's payload was dropped)

Revision ID: outbox_0005
Revises: outbox_0004
Create Date: 2026-12-05

One nullable column with no default: on PostgreSQL, MariaDB 10.3+ and SQLite adding it changes
only the catalog and rewrites no row. What could still stop the app's writes is the moment's
exclusive lock the change needs: queued behind a long transaction that reads the table, it
would make every write wait behind it. So the change waits at most a second for its lock
(``lock_timeout`` on PostgreSQL, ``lock_wait_timeout`` on MariaDB), gives way when it cannot
have it, and tries again, up to :data:`TRIES` times; MariaDB is told ``ALGORITHM=INSTANT``, so
it fails rather than copy the table. See docs/design.md, "Body retention".
"""

from collections.abc import Callable, Sequence
from datetime import datetime

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import mysql

from outbox.lockwait import lock_briefly

revision: str = "outbox_0005"
down_revision: str | Sequence[str] | None = "outbox_0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TRIES = 120  # each waits up to LOCK_WAIT, then a pause: about four minutes in all
LOCK_WAIT = 1  # seconds the change may make the app's writes wait behind it
PAUSE = 1.0  # seconds between tries, while the app's writes go through


def _ts() -> sa.types.TypeEngine[datetime]:
    return sa.DateTime(timezone=True).with_variant(mysql.DATETIME(fsp=6), "mysql", "mariadb")


def _briefly(bind: sa.Connection, change: Callable[[], None], *, offline: bool = False) -> None:
    """Run ``change`` holding outbox_messages's lock only a moment (retried while a transaction
    holds the table; an error naming it after the last try): ``outbox.migrations``'
    ``_lock_briefly``, with this revision's bounds, read when called."""
    lock_briefly(
        bind, change, table="outbox_messages", revision=revision, offline=offline, tries=TRIES,
        lock_wait=LOCK_WAIT, pause=PAUSE,
    )  # fmt: skip


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name in ("mysql", "mariadb"):
        _briefly(
            bind,
            lambda: op.execute(
                "ALTER TABLE outbox_messages ADD COLUMN body_dropped_at DATETIME(6) NULL,"
                " ALGORITHM=INSTANT"
            ),
            offline=op.get_context().as_sql,
        )
    else:
        _briefly(
            bind,
            lambda: op.add_column("outbox_messages", sa.Column("body_dropped_at", _ts())),
            offline=op.get_context().as_sql,
        )


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name in ("mysql", "mariadb"):
        _briefly(
            bind,
            lambda: op.execute(
                "ALTER TABLE outbox_messages DROP COLUMN body_dropped_at, ALGORITHM=INSTANT"
            ),
            offline=op.get_context().as_sql,
        )
    else:
        _briefly(
            bind,
            lambda: op.drop_column("outbox_messages", "body_dropped_at"),
            offline=op.get_context().as_sql,
        )
