"""outbox: the key's uniqueness in pattern order, and created_at's block ranges (PostgreSQL)

Revision ID: outbox_0007
Revises: outbox_0006
Create Date: 2026-12-06

PostgreSQL only; MariaDB and SQLite are left as they are. The key's unique constraint becomes
a unique index of ``varchar_pattern_ops``, so a key prefix is a range of it whatever the
database's collation, and ``created_at`` gets a BRIN index, so a date range reads its own
rows: the console's messages page at a million rows (docs/design.md, "The console's
messages page"). Both cost the send path almost nothing: the key is written once, and a
BRIN index of rows that come in time order is a few pages that a new row rarely changes.

On a big live table, build the two indexes first without blocking writes, then upgrade; the
upgrade finds them and only swaps the constraint, a moment's lock::

    CREATE UNIQUE INDEX CONCURRENTLY ix_outbox_messages_idempotency_key
        ON outbox_messages (idempotency_key varchar_pattern_ops);
    CREATE INDEX CONCURRENTLY ix_outbox_messages_created_at
        ON outbox_messages USING brin (created_at);

An upgrade run without a transaction (autocommit) builds them concurrently itself; inside a
transaction it builds them as it goes, which holds the app's writes for the build. Every
statement that locks the table waits at most a second for its lock and tries again, as
outbox_0005's do. A key index a failed concurrent build left invalid is refused: it would not
guard the key.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from outbox.lockwait import in_autocommit, lock_briefly

revision: str = "outbox_0007"
down_revision: str | Sequence[str] | None = "outbox_0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TRIES = 120  # each waits up to LOCK_WAIT, then a pause: about four minutes in all
LOCK_WAIT = 1  # seconds a statement may make the app's writes wait behind it
PAUSE = 1.0  # seconds between tries, while the app's writes go through
KEY_INDEX = "ix_outbox_messages_idempotency_key"
DATE_INDEX = "ix_outbox_messages_created_at"
CONSTRAINT = "uq_outbox_messages_idempotency_key"


def _briefly(bind: sa.Connection, statement: str) -> None:
    """Run ``statement`` holding the table's lock only a moment, as outbox_0005 does."""
    lock_briefly(
        bind, lambda: op.execute(statement), table="outbox_messages", revision=revision,
        offline=op.get_context().as_sql, tries=TRIES, lock_wait=LOCK_WAIT, pause=PAUSE,
    )  # fmt: skip


def _check_key_index(bind: sa.Connection) -> None:
    """Refuse a key index that is not a valid unique index on the key alone."""
    found = bind.execute(
        sa.text(
            "SELECT i.indisvalid, i.indisunique, i.indnatts, i.indpred IS NULL, "
            "i.indexprs IS NULL FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid "
            "WHERE c.relname = :name AND c.relnamespace = "
            "(SELECT relnamespace FROM pg_class WHERE oid = i.indrelid)"
        ),
        {"name": KEY_INDEX},
    ).one_or_none()
    if found is None or not all(found[:2]) or found[2] != 1 or not all(found[3:]):
        raise RuntimeError(
            f"outbox_0007: {KEY_INDEX} is not a valid unique index on idempotency_key alone "
            "(a concurrent build that failed leaves it invalid): DROP INDEX it and run the "
            "upgrade again"
        )


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    offline = op.get_context().as_sql
    builds = (
        f"UNIQUE INDEX {{}}IF NOT EXISTS {KEY_INDEX} "
        "ON outbox_messages (idempotency_key varchar_pattern_ops)",
        f"INDEX {{}}IF NOT EXISTS {DATE_INDEX} ON outbox_messages USING brin (created_at)",
    )
    drop = f"ALTER TABLE outbox_messages DROP CONSTRAINT IF EXISTS {CONSTRAINT}"
    if not offline and in_autocommit(bind):
        for build in builds:
            op.execute("CREATE " + build.format("CONCURRENTLY "))  # the app writes on
        _check_key_index(bind)
        _briefly(bind, drop)  # the key guarded by both until here: no gap
        return
    # In a transaction every lock is kept to its end: take the one the drop needs first, a
    # second a try, so no build holds the app's writes while the drop waits for a reader.
    _briefly(bind, "LOCK TABLE outbox_messages IN ACCESS EXCLUSIVE MODE")
    for build in builds:
        op.execute("CREATE " + build.format(""))
    if not offline:
        _check_key_index(bind)
    op.execute(drop)


def downgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    if op.get_context().as_sql or not in_autocommit(bind):
        _briefly(bind, "LOCK TABLE outbox_messages IN ACCESS EXCLUSIVE MODE")  # as upgrade
    for statement in (
        f"ALTER TABLE outbox_messages ADD CONSTRAINT {CONSTRAINT} UNIQUE (idempotency_key)",
        f"DROP INDEX IF EXISTS {DATE_INDEX}",
        f"DROP INDEX IF EXISTS {KEY_INDEX}",
    ):
        _briefly(bind, statement)
