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

from collections.abc import Callable, Sequence

import sqlalchemy as sa
from alembic import op

from outbox.lockwait import lock_briefly

revision: str = "outbox_0006"
down_revision: str | Sequence[str] | None = "outbox_0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TRIES = 120  # each waits up to LOCK_WAIT, then a pause: about four minutes in all
LOCK_WAIT = 1  # seconds the change may make the relays' heartbeats wait behind it
PAUSE = 1.0  # seconds between tries, while the heartbeats go through


def _briefly(bind: sa.Connection, change: Callable[[], None], *, offline: bool = False) -> None:
    """Run ``change`` holding outbox_relays's lock only a moment (retried while a transaction
    holds the table; an error naming it after the last try): ``outbox.migrations``'
    ``_lock_briefly``, with this revision's bounds, read when called."""
    lock_briefly(
        bind, change, table="outbox_relays", revision=revision, offline=offline, tries=TRIES,
        lock_wait=LOCK_WAIT, pause=PAUSE,
    )  # fmt: skip


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
