"""outbox_0008 on PostgreSQL: the SES message ids' partial indexes of outbox_messages and
outbox_attempts become hash indexes of the same names and predicate, on a live table with
rows in every status, and b-trees again on the way down; built concurrently in autocommit;
an invalid index a failed concurrent build left is built again; a reader holding a table does
not make the app's writes wait behind the upgrade; an index already of hash is left alone."""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from alembic import command

from outbox import migrations
from outbox.schema import Status, attempts, messages
from tests.support.db import fresh_database
from tests.support.migrating import T0, Writer, change_past_a_reader, old_row

BEFORE = "outbox_0007"
INDEXES = {
    "outbox_messages": "ix_outbox_messages_provider_message_id",
    "outbox_attempts": "ix_outbox_attempts_provider_message_id",
}
BUILT = {table: f"{index}_hash" for table, index in INDEXES.items()}  # the upgrade's own name
PREDICATE = "WHERE (provider_message_id IS NOT NULL)"


def ses_id(i: int) -> str:
    """An SES message id's shape: 60 characters."""
    return f"0100018c{i:08x}-1a2b3c4d-5e6f-7a8b-9c0d-1e2f3a4b5c6d-000000"


@pytest.fixture
def old_engine(postgres_backend, tmp_path) -> Iterator[sa.Engine]:
    """A PostgreSQL database at outbox_0007, with a row in every status (the attempted ones
    with an SES id, as the relay saves it) and an attempt of each sent one."""
    with fresh_database(postgres_backend, tmp_path, "sesidx") as url:
        migrations.upgrade(url, BEFORE)
        engine = sa.create_engine(url, pool_size=5)
        with engine.begin() as conn:
            for i, status in enumerate(Status):
                row = old_row(i, status.value)
                if status in (Status.SENT, Status.UNKNOWN_OUTCOME, Status.FAILED):
                    row["provider_message_id"] = ses_id(i)
                (message_id,) = conn.execute(
                    sa.insert(messages).values(row).returning(messages.c.id)
                ).one()
                conn.execute(
                    sa.insert(attempts).values(
                        message_id=message_id,
                        finished_at=T0,
                        outcome="accepted",
                        provider_message_id=row.get("provider_message_id"),
                    )
                )
        try:
            yield engine
        finally:
            engine.dispose()


def _definitions(conn: sa.Connection) -> dict[str, str]:
    """{index name: its definition} of the SES ids' indexes and the upgrade's own names."""
    names = [*INDEXES.values(), *BUILT.values()]
    found = conn.execute(
        sa.text("SELECT indexname, indexdef FROM pg_indexes WHERE indexname IN :names").bindparams(
            sa.bindparam("names", expanding=True)
        ),
        {"names": names},
    ).all()
    return dict(found)


def _assert_indexes(conn: sa.Connection, method: str) -> None:
    """Both indexes of ``method``, of the same names and predicate, valid; no other left."""
    found = _definitions(conn)
    assert set(found) == set(INDEXES.values()), found
    for table, index in INDEXES.items():
        assert found[index] == (
            f"CREATE INDEX {index} ON public.{table} USING {method} (provider_message_id) "
            f"{PREDICATE}"
        )
        assert conn.execute(
            sa.text("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(:i)"),
            {"i": index},
        ).scalar_one()


def _oids(conn: sa.Connection) -> dict[str, int]:
    return {
        index: conn.execute(sa.text("SELECT to_regclass(:i)::oid"), {"i": index}).scalar_one()
        for index in INDEXES.values()
    }


def _lookup_uses_the_index(conn: sa.Connection, table: str, provider_id: str) -> int:
    """Events' equality lookup by SES id: read through the index; the rows it finds."""
    with conn.begin_nested():
        conn.exec_driver_sql("SET LOCAL enable_seqscan = off")
        where = f"FROM {table} WHERE provider_message_id = :p"
        plan = "\n".join(
            conn.execute(sa.text(f"EXPLAIN SELECT id {where}"), {"p": provider_id}).scalars()
        )
        assert INDEXES[table] in plan, plan
        return int(conn.execute(sa.text(f"SELECT count(*) {where}"), {"p": provider_id}).scalar())


def _stamp(engine: sa.Engine, revision: str) -> None:
    with engine.begin() as conn:
        command.stamp(migrations.alembic_config(connection=conn), revision, purge=True)


def test_upgrade_makes_both_indexes_hash_and_the_downgrade_b_trees_again(old_engine):
    with old_engine.connect() as conn:
        _assert_indexes(conn, "btree")
        before = conn.execute(sa.select(messages).order_by(messages.c.id)).all()
        tried = conn.execute(sa.select(attempts).order_by(attempts.c.id)).all()
    migrations.upgrade(old_engine)
    with old_engine.begin() as conn:
        _assert_indexes(conn, "hash")
        assert conn.execute(sa.select(messages).order_by(messages.c.id)).all() == before
        assert conn.execute(sa.select(attempts).order_by(attempts.c.id)).all() == tried
        sent = list(Status).index(Status.SENT)
        assert _lookup_uses_the_index(conn, "outbox_messages", ses_id(sent)) == 1
        assert _lookup_uses_the_index(conn, "outbox_attempts", ses_id(sent)) == 1
        assert _lookup_uses_the_index(conn, "outbox_messages", ses_id(999)) == 0
    migrations.downgrade(old_engine, BEFORE)
    with old_engine.begin() as conn:
        _assert_indexes(conn, "btree")
        assert conn.execute(sa.select(messages).order_by(messages.c.id)).all() == before
        assert _lookup_uses_the_index(conn, "outbox_attempts", ses_id(sent)) == 1
    migrations.upgrade(old_engine)
    with old_engine.connect() as conn:
        _assert_indexes(conn, "hash")


FILL = 200_000  # sent messages, each with an attempt: the builds take a while


def _fill(conn: sa.Connection, n: int) -> None:
    """``n`` sent messages with SES ids, and an attempt of each, in two statements."""
    first = conn.execute(sa.select(sa.func.min(messages.c.id))).scalar_one()
    taken = ("id", "idempotency_key", "status", "provider_message_id")
    names = [c.name for c in messages.c if c.name not in taken]
    conn.execute(
        sa.text(
            f"INSERT INTO outbox_messages (idempotency_key, status, provider_message_id, "
            f"{', '.join(names)}) "
            "SELECT 'bulk-' || g, 'sent', '0100018c' || lpad(to_hex(g), 8, '0') "
            "|| '-1a2b3c4d-5e6f-7a8b-9c0d-' || substr(md5(CAST(g AS text)), 1, 12) || '-000000', "
            f"{', '.join(names)} "
            "FROM outbox_messages CROSS JOIN generate_series(1, :n) AS g WHERE id = :first"
        ),
        {"n": n, "first": first},
    )
    conn.execute(
        sa.text(
            "INSERT INTO outbox_attempts (message_id, finished_at, outcome, provider_message_id) "
            "SELECT id, updated_at, 'accepted', provider_message_id FROM outbox_messages "
            "WHERE idempotency_key LIKE 'bulk-%'"
        )
    )


def _statements(engine: sa.Engine) -> list[str]:
    """Every statement ``engine``'s connections send from now on."""
    sent: list[str] = []

    @sa.event.listens_for(engine, "before_cursor_execute")
    def record(conn, cursor, statement, parameters, context, executemany) -> None:
        sent.append(statement)

    return sent


def test_an_upgrade_in_autocommit_builds_concurrently_while_the_app_writes_on(old_engine):
    """In autocommit each hash index is built with CREATE INDEX CONCURRENTLY under its own
    name while the app inserts, then swapped in under the table's lock: no insert waits for
    a build."""
    with old_engine.begin() as conn:
        _fill(conn, FILL)
    sent = _statements(old_engine)
    writer = Writer(old_engine)
    writer.start()
    time.sleep(0.3)
    try:
        with old_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            migrations.upgrade(conn)
    finally:
        writer.stop.set()
        writer.join(10)
    assert writer.errors == []
    assert len(writer.waits) > 10  # the app kept writing meanwhile
    assert max(writer.waits) < 1.5, sorted(writer.waits)[-5:]
    for table in INDEXES:
        assert any(
            s.startswith(f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {BUILT[table]} ON {table}")
            for s in sent
        ), table
    with old_engine.connect() as conn:
        _assert_indexes(conn, "hash")
        assert conn.execute(sa.select(sa.func.count()).select_from(messages)).scalar_one() == (
            len(Status) + FILL + len(writer.waits)
        )


def test_an_index_built_beforehand_is_swapped_in(old_engine):
    """The guide's prebuild, run by a DBA: the upgrade keeps it (the same index, renamed)."""
    with old_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        built = {}
        for table, name in BUILT.items():
            conn.exec_driver_sql(
                f"CREATE INDEX CONCURRENTLY {name} ON {table} USING hash (provider_message_id) "
                "WHERE provider_message_id IS NOT NULL"
            )
            built[INDEXES[table]] = conn.execute(
                sa.text("SELECT to_regclass(:i)::oid"), {"i": name}
            ).scalar_one()
    migrations.upgrade(old_engine)
    with old_engine.connect() as conn:
        _assert_indexes(conn, "hash")
        assert _oids(conn) == built


@pytest.mark.parametrize("autocommit", [True, False], ids=["autocommit", "transaction"])
def test_an_invalid_index_left_by_a_failed_concurrent_build_is_built_again(old_engine, autocommit):
    """What a failed CREATE INDEX CONCURRENTLY leaves under the upgrade's own name: an index
    marked invalid, never read. It is dropped and built again (concurrently in autocommit,
    under the lock otherwise), and the result is a valid hash index."""
    with old_engine.begin() as conn:
        conn.exec_driver_sql(
            f"CREATE INDEX {BUILT['outbox_messages']} ON outbox_messages "
            "USING hash (provider_message_id) WHERE provider_message_id IS NOT NULL"
        )
        conn.exec_driver_sql(  # the test's user is a superuser
            "UPDATE pg_index SET indisvalid = false "
            f"WHERE indexrelid = '{BUILT['outbox_messages']}'::regclass"
        )
        invalid = conn.execute(
            sa.text("SELECT to_regclass(:i)::oid"), {"i": BUILT["outbox_messages"]}
        ).scalar_one()
    sent = _statements(old_engine)
    if autocommit:
        with old_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            migrations.upgrade(conn)
    else:
        migrations.upgrade(old_engine)
    dropped = f"DROP INDEX CONCURRENTLY IF EXISTS {BUILT['outbox_messages']}"
    assert (dropped in sent) == autocommit
    with old_engine.begin() as conn:
        _assert_indexes(conn, "hash")
        assert invalid not in _oids(conn).values()
        sent = list(Status).index(Status.SENT)
        assert _lookup_uses_the_index(conn, "outbox_messages", ses_id(sent)) == 1


HELD = 3.0  # seconds a reader holds the table when the upgrade starts


@pytest.mark.parametrize("table", list(INDEXES))
@pytest.mark.parametrize("autocommit", [True, False], ids=["autocommit", "transaction"])
def test_a_reader_holding_the_table_does_not_hold_the_apps_writes(old_engine, autocommit, table):
    """A report reads the table for 3 s when the upgrade starts: the upgrade waits it out a
    second a try, and the app's inserts go on meanwhile, none held long; the upgrade
    finishes once the reader ends."""

    def upgrade() -> None:
        if autocommit:
            with old_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
                migrations.upgrade(conn)
        else:
            migrations.upgrade(old_engine)

    change_past_a_reader(old_engine, upgrade, held=HELD, table=table)
    with old_engine.connect() as conn:
        _assert_indexes(conn, "hash")


def test_an_upgrade_over_hash_indexes_changes_nothing(old_engine):
    """Run again over its own result (stamped back to outbox_0007), in autocommit and in a
    transaction: the same indexes, nothing built, nothing left."""
    migrations.upgrade(old_engine)
    with old_engine.connect() as conn:
        oids = _oids(conn)
    _stamp(old_engine, BEFORE)
    sent = _statements(old_engine)
    with old_engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        migrations.upgrade(conn)
    assert not any(s.startswith("CREATE INDEX") for s in sent)
    _stamp(old_engine, BEFORE)
    migrations.upgrade(old_engine)
    with old_engine.connect() as conn:
        _assert_indexes(conn, "hash")
        assert _oids(conn) == oids
        assert migrations.current_heads(old_engine)[0] == {"outbox_0008"}


def test_the_offline_script_makes_the_same_change_under_the_same_lock_bound(old_engine):
    """``alembic upgrade --sql`` (a DBA's script): no concurrent build (a script is one
    transaction), the lock bound set first, and the decisions in SQL: run over an invalid
    index left under the upgrade's own name, it still ends with valid hash indexes."""
    with old_engine.begin() as conn:
        conn.exec_driver_sql(
            f"CREATE INDEX {BUILT['outbox_attempts']} ON outbox_attempts "
            "USING hash (provider_message_id) WHERE provider_message_id IS NOT NULL"
        )
        conn.exec_driver_sql(
            "UPDATE pg_index SET indisvalid = false "
            f"WHERE indexrelid = '{BUILT['outbox_attempts']}'::regclass"
        )
    config = migrations.alembic_config(old_engine.url.render_as_string(hide_password=False))
    out = io.StringIO()
    config.stdout = out
    with contextlib.redirect_stdout(out):
        command.upgrade(config, f"{BEFORE}:outbox_0008", sql=True)
    script = out.getvalue()
    assert "CONCURRENTLY" not in script
    assert script.index("lock_timeout = '1s'") < script.index("LOCK TABLE outbox_messages")
    raw = old_engine.raw_connection()
    try:
        raw.driver_connection.autocommit = True
        raw.driver_connection.execute(script)  # the DBA runs the script
    finally:
        raw.invalidate()
    with old_engine.connect() as conn:
        _assert_indexes(conn, "hash")
        assert migrations.current_heads(old_engine)[0] == {"outbox_0008"}
