"""outbox_0007 on PostgreSQL: the key's unique constraint becomes a unique index of pattern
order, and created_at gets a BRIN index, on a live table with rows in every status; the key
stays guarded throughout (a duplicate is still swallowed); indexes built beforehand
are kept; an invalid one is refused; a reader holding the table does
not make the app's writes wait behind the upgrade."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert

from outbox import migrations
from outbox.schema import Status, messages
from tests.support.db import fresh_database
from tests.support.migrating import change_past_a_reader, old_row

BEFORE = "outbox_0006"
KEY_INDEX = "ix_outbox_messages_idempotency_key"
DATE_INDEX = "ix_outbox_messages_created_at"
CONSTRAINT = "uq_outbox_messages_idempotency_key"


@pytest.fixture
def old_engine(postgres_backend, tmp_path) -> Iterator[sa.Engine]:
    """A PostgreSQL database at outbox_0006, with a row in every status."""
    with fresh_database(postgres_backend, tmp_path, "keyidx") as url:
        migrations.upgrade(url, BEFORE)
        engine = sa.create_engine(url)
        with engine.begin() as conn:
            for i, status in enumerate(Status):
                conn.execute(sa.insert(messages).values(old_row(i, status.value)))
        try:
            yield engine
        finally:
            engine.dispose()


def _indexes(conn: sa.Connection) -> dict[str, str]:
    return dict(
        conn.execute(
            sa.text(
                "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'outbox_messages'"
            )
        ).all()
    )


def _constraints(conn: sa.Connection) -> set[str]:
    return set(
        conn.execute(
            sa.text(
                "SELECT conname FROM pg_constraint WHERE conrelid = 'outbox_messages'::regclass"
            )
        ).scalars()
    )


def _duplicate_swallowed(conn: sa.Connection) -> bool:
    """Enqueue's own statement for a key already there: nothing inserted, nothing raised."""
    again = old_row(0, "pending")
    inserted = conn.execute(
        pg_insert(messages)
        .values(again)
        .on_conflict_do_nothing(index_elements=["idempotency_key"])
        .returning(messages.c.id)
    ).all()
    return inserted == []


def test_upgrade_swaps_the_constraint_for_the_pattern_index_and_back(old_engine):
    with old_engine.connect() as conn:
        before = conn.execute(sa.select(messages).order_by(messages.c.id)).all()
    migrations.upgrade(old_engine)
    with old_engine.begin() as conn:
        indexes = _indexes(conn)
        assert "varchar_pattern_ops" in indexes[KEY_INDEX]
        assert "UNIQUE" in indexes[KEY_INDEX]
        assert "brin" in indexes[DATE_INDEX]
        assert CONSTRAINT not in _constraints(conn)
        assert conn.execute(sa.select(messages).order_by(messages.c.id)).all() == before
        assert _duplicate_swallowed(conn)
        with pytest.raises(sa.exc.IntegrityError), conn.begin_nested():
            conn.execute(sa.insert(messages).values(old_row(0, "pending")))
    migrations.downgrade(old_engine, BEFORE)
    with old_engine.begin() as conn:
        assert CONSTRAINT in _constraints(conn)
        assert KEY_INDEX not in _indexes(conn)
        assert DATE_INDEX not in _indexes(conn)
        assert _duplicate_swallowed(conn)
    migrations.upgrade(old_engine)


def test_indexes_built_beforehand_are_kept(old_engine):
    """The date index built concurrently, the key's at a quiet time: the upgrade keeps both
    and only swaps the constraint."""
    with old_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.exec_driver_sql(
            f"CREATE INDEX CONCURRENTLY {DATE_INDEX} ON outbox_messages USING brin (created_at)"
        )
        conn.exec_driver_sql(
            f"CREATE UNIQUE INDEX {KEY_INDEX} "
            "ON outbox_messages (idempotency_key varchar_pattern_ops)"
        )
        oids = conn.exec_driver_sql(
            f"SELECT '{KEY_INDEX}'::regclass::oid, '{DATE_INDEX}'::regclass::oid"
        ).one()
    migrations.upgrade(old_engine)
    with old_engine.connect() as conn:
        assert (
            conn.exec_driver_sql(
                f"SELECT '{KEY_INDEX}'::regclass::oid, '{DATE_INDEX}'::regclass::oid"
            ).one()
            == oids
        )
        assert CONSTRAINT not in _constraints(conn)


def test_an_upgrade_without_a_transaction_builds_the_date_index_concurrently(old_engine):
    """In autocommit the BRIN index is built concurrently, the key's under the table's lock
    (a unique index being built concurrently would make racing enqueues of one key raise)."""
    with old_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        migrations.upgrade(conn)
    with old_engine.begin() as conn:
        assert {KEY_INDEX, DATE_INDEX} <= set(_indexes(conn))
        assert CONSTRAINT not in _constraints(conn)
        assert _duplicate_swallowed(conn)


def test_an_invalid_key_index_is_refused_and_the_constraint_kept(old_engine):
    """What a failed CREATE INDEX CONCURRENTLY leaves: an index marked invalid, which would
    not guard the key. The upgrade names it and changes nothing."""
    with old_engine.begin() as conn:
        conn.exec_driver_sql(
            f"CREATE UNIQUE INDEX {KEY_INDEX} ON outbox_messages (idempotency_key)"
        )
        conn.exec_driver_sql(
            f"UPDATE pg_index SET indisvalid = false WHERE indexrelid = '{KEY_INDEX}'::regclass"
        )
    with pytest.raises(RuntimeError, match=f"{KEY_INDEX} is not a valid unique index"):
        migrations.upgrade(old_engine)
    with old_engine.connect() as conn:
        assert CONSTRAINT in _constraints(conn)
        assert migrations.current_heads(old_engine)[0] == {BEFORE}


HELD = 3.0  # seconds a reader holds the table when the upgrade starts


def test_a_reader_holding_the_table_does_not_hold_the_apps_writes(old_engine):
    """A report reads outbox_messages for 3 s when the upgrade starts: the upgrade waits it
    out a second a try, and the app's inserts go on meanwhile, none held long."""
    change_past_a_reader(old_engine, lambda: migrations.upgrade(old_engine), held=HELD)
    with old_engine.connect() as conn:
        assert CONSTRAINT not in _constraints(conn)
