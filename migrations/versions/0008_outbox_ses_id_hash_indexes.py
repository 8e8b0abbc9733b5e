"""outbox: the SES message ids' indexes by hash (PostgreSQL)

Revision ID: outbox_0008
Revises: outbox_0007
Create Date: 2026-12-06

PostgreSQL only; MariaDB and SQLite are left as they are. The partial indexes on
``provider_message_id`` of ``outbox_messages`` and ``outbox_attempts`` become hash indexes of
the same names and predicate: events look an SES id up by equality only, and a hash entry is
a fixed ~34 bytes whatever the id's length, against a b-tree's 87 for SES's 60 characters
(33.6 MB against 86.5 MB a million rows): what every sent message keeps for a month.

Each is built under a name of its own (``<index>_hash``), then swapped in under the table's
lock (a second a try to take it, so the upgrade never queues the app's writes behind a
reader): the old index dropped, the new one renamed. An upgrade run in autocommit builds
them with ``CREATE INDEX CONCURRENTLY`` first, so under the lock it only swaps; otherwise
they are built under the lock, and the app's writes wait for the builds, about 2 s a million
rows each (a million messages and their attempts: some 4 s); both tables' locks are taken in
one try then, so one is never held while the other is waited for. They may be built beforehand:
``CREATE INDEX CONCURRENTLY ix_outbox_messages_provider_message_id_hash ON outbox_messages
USING hash (provider_message_id) WHERE provider_message_id IS NOT NULL`` (and
``ix_outbox_attempts_provider_message_id_hash`` on ``outbox_attempts``). A built index is
kept only if it is a valid hash index of its table on the id, of the predicate; one left
invalid by a failed concurrent build is dropped and built again. An index already of hash
is left alone. Decided in SQL, so an offline script does the same. The downgrade is the
same the other way (b-tree, ``<index>_btree``), concurrent in autocommit too.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

from outbox.lockwait import in_autocommit, lock_briefly

revision: str = "outbox_0008"
down_revision: str | Sequence[str] | None = "outbox_0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

TRIES = 120  # each waits up to LOCK_WAIT, then a pause: about four minutes in all
LOCK_WAIT = 1  # seconds a statement may make the app's writes wait behind it
PAUSE = 1.0  # seconds between tries, while the app's writes go through
INDEXES = {  # table: its index on the SES message id
    "outbox_messages": "ix_outbox_messages_provider_message_id",
    "outbox_attempts": "ix_outbox_attempts_provider_message_id",
}
PREDICATE = "provider_message_id IS NOT NULL"


def _is(index: str, table: str, method: str) -> str:
    """SQL: whether ``index`` (in the search_path's schema, as every statement here) is a
    valid ``method`` index of ``table`` on provider_message_id alone, of the predicate. A
    failed concurrent build leaves one invalid, which would never be read."""
    return f"""EXISTS (
    SELECT 1 FROM pg_index i
    JOIN pg_class c ON c.oid = i.indexrelid
    JOIN pg_am am ON am.oid = c.relam
    JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = i.indkey[0]
    WHERE i.indexrelid = to_regclass('{index}')
      AND i.indrelid = to_regclass('{table}')
      AND am.amname = '{method}' AND a.attname = 'provider_message_id'
      AND i.indisvalid AND i.indisready AND NOT i.indisunique
      AND i.indnatts = 1 AND i.indexprs IS NULL
      AND pg_get_expr(i.indpred, i.indrelid) = '({PREDICATE})'
  )"""


def _build(index: str, table: str, method: str, how: str = "") -> str:
    return (
        f"CREATE INDEX {how}{index} ON {table} USING {method} (provider_message_id) "
        f"WHERE {PREDICATE}"
    )


def _swap(table: str, method: str) -> str:
    """Under the table's lock: the index made a ``method`` one, from the one built under its
    own name (built here if missing or not right), unless it is one already. In SQL, so an
    offline script decides the same."""
    index = INDEXES[table]
    built = f"{index}_{method}"
    return f"""DO $$
BEGIN
  IF {_is(index, table, method)} THEN
    DROP INDEX IF EXISTS {built};
    RETURN;
  END IF;
  IF NOT {_is(built, table, method)} THEN
    DROP INDEX IF EXISTS {built};
    {_build(built, table, method)};
  END IF;
  DROP INDEX IF EXISTS {index};
  ALTER INDEX {built} RENAME TO {index};
END $$"""


def _prebuild(bind: sa.Connection, table: str, method: str) -> None:
    """In autocommit: the index built concurrently under its own name, while the app writes
    on; an invalid one left by a failed build dropped first (IF NOT EXISTS would keep it)."""
    index = INDEXES[table]
    built = f"{index}_{method}"
    if bind.execute(sa.text(f"SELECT {_is(index, table, method)}")).scalar():
        return  # already of ``method``
    found = f"SELECT to_regclass('{built}') IS NOT NULL AND NOT {_is(built, table, method)}"
    if bind.execute(sa.text(found)).scalar():
        op.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {built}")
    op.execute(_build(built, table, method, "CONCURRENTLY IF NOT EXISTS "))


def _lock_and_swap(bind: sa.Connection, tables: Sequence[str], method: str) -> None:
    """``tables``' indexes swapped under their locks, taken in one try (outbox_messages
    first, as the relay's and the intake's writes take them), a second a try."""

    def change() -> None:
        op.execute(f"LOCK TABLE {', '.join(tables)} IN ACCESS EXCLUSIVE MODE")
        for table in tables:
            op.execute(_swap(table, method))

    lock_briefly(
        bind, change, table=" and ".join(tables), revision=revision,
        offline=op.get_context().as_sql, tries=TRIES, lock_wait=LOCK_WAIT, pause=PAUSE,
    )  # fmt: skip


def _change(method: str) -> None:
    bind = op.get_bind()
    if bind.dialect.name != "postgresql":
        return
    if not op.get_context().as_sql and in_autocommit(bind):
        # each table in a transaction of its own: its lock goes at its commit
        for table in INDEXES:
            _prebuild(bind, table, method)
            _lock_and_swap(bind, [table], method)
        return
    # In a transaction a lock lasts until the commit: both tables in one try, so neither's
    # lock is held while the other's is waited for; the app's writes wait for the builds.
    _lock_and_swap(bind, list(INDEXES), method)


def upgrade() -> None:
    _change("hash")


def downgrade() -> None:
    _change("btree")
