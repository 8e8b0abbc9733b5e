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

The key's index is built under the table's lock (a second a try to take it, so the upgrade
never queues the app's writes behind a reader): the app's writes wait for the build, about
2 s a million rows. It is never built concurrently: while a unique index is being built,
every insert checks it but ON CONFLICT does not arbitrate on it yet, so two enqueues of one
key would raise instead of one being swallowed. The BRIN index may be built beforehand with
``CREATE INDEX CONCURRENTLY ix_outbox_messages_created_at ON outbox_messages USING brin
(created_at)``; an upgrade run in autocommit builds it so itself. A key index of the name
found already is kept only if it is a valid unique index of the table on the key alone
(checked in SQL, so an offline script refuses too).
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


# The key index's check, in SQL so an offline script refuses too: the index of that name (in
# the search_path's schema, as every statement here) is a valid unique index of
# outbox_messages on idempotency_key alone. A failed concurrent build leaves one invalid; a
# typo, one on another column or table; either would leave the key unguarded.
CHECK = f"""DO $$
BEGIN
  IF NOT EXISTS (
    SELECT 1 FROM pg_index i
    JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
    WHERE i.indexrelid = to_regclass('{KEY_INDEX}')
      AND i.indrelid = to_regclass('outbox_messages')
      AND a.attname = 'idempotency_key'
      AND i.indisvalid AND i.indisready AND i.indisunique AND i.indimmediate
      AND i.indnatts = 1 AND i.indpred IS NULL AND i.indexprs IS NULL
  ) THEN
    RAISE EXCEPTION 'outbox_0007: {KEY_INDEX} is not a valid unique index of '
      'outbox_messages on idempotency_key alone: DROP INDEX it and run the upgrade again';
  END IF;
END $$"""


def _swap(bind: sa.Connection, statements: list[str]) -> None:
    """``statements`` under the table's lock, taken a second a try; the check's refusal as
    one line."""

    def change() -> None:
        op.execute("LOCK TABLE outbox_messages IN ACCESS EXCLUSIVE MODE")
        for statement in statements:
            op.execute(statement)

    try:
        lock_briefly(
            bind, change, table="outbox_messages", revision=revision,
            offline=op.get_context().as_sql, tries=TRIES, lock_wait=LOCK_WAIT, pause=PAUSE,
        )  # fmt: skip
    except sa.exc.DBAPIError as exc:
        said = str(exc.orig or exc).strip().splitlines()[0]
        if "outbox_0007:" not in said:
            raise
        raise RuntimeError(said[said.index("outbox_0007:") :]) from None


def upgrade() -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    date = f"INDEX {{}}IF NOT EXISTS {DATE_INDEX} ON outbox_messages USING brin (created_at)"
    if not op.get_context().as_sql and in_autocommit(bind):
        op.execute("CREATE " + date.format("CONCURRENTLY "))  # not unique: the app writes on
    # The key's index is never built concurrently: while a unique index is being built every
    # insert checks it, but it is no arbiter of ON CONFLICT yet, so two enqueues of one key
    # would raise instead of one being swallowed. Under the table's lock no insert runs; the
    # key is guarded by the constraint until the index is, then by both, then by the index.
    _swap(
        bind,
        [
            f"CREATE UNIQUE INDEX IF NOT EXISTS {KEY_INDEX} "
            "ON outbox_messages (idempotency_key varchar_pattern_ops)",
            "CREATE " + date.format(""),
            CHECK,
            f"ALTER TABLE outbox_messages DROP CONSTRAINT IF EXISTS {CONSTRAINT}",
        ],
    )


def downgrade() -> None:
    if op.get_bind().dialect.name != "postgresql":
        return
    _swap(
        op.get_bind(),
        [
            f"ALTER TABLE outbox_messages ADD CONSTRAINT {CONSTRAINT} UNIQUE (idempotency_key)",
            f"DROP INDEX IF EXISTS {DATE_INDEX}",
            f"DROP INDEX IF EXISTS {KEY_INDEX}",
        ],
    )
