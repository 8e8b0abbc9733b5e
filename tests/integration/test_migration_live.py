"""Upgrading a live table to outbox_0005 (body retention): rows in every status come through
unchanged, and the app's writes wait at most a moment even while a long transaction holds
the table (the change gives way and tries again)."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import sqlalchemy as sa
from alembic import command

from outbox import migrations
from outbox.schema import Status, attempts, messages
from tests.support.db import fresh_database
from tests.support.migrating import T0, Holder, Writer, old_row

BEFORE = "outbox_0004"
NEW_COLUMNS = {"body_dropped_at"}
MIGRATION = Path(migrations.__file__).parent / "_migrations/versions/0005_outbox_body_retention.py"


@pytest.fixture
def old_url(backend, tmp_path) -> Iterator[str]:
    """A database of the backend's kind at the revision before body retention."""
    with fresh_database(backend, tmp_path, "live") as url:
        migrations.upgrade(url, BEFORE)
        yield url


def columns(conn: sa.Connection) -> list[str]:
    return [c["name"] for c in sa.inspect(conn).get_columns("outbox_messages")]


def test_rows_in_every_status_come_through_the_upgrade_unchanged(backend, old_url):
    engine = sa.create_engine(old_url)
    try:
        with engine.begin() as conn:
            old = [messages.c[c] for c in columns(conn) if c not in NEW_COLUMNS]
            for i, status in enumerate(Status):
                conn.execute(sa.insert(messages).values(old_row(i, status.value)))
            first = conn.execute(sa.select(messages.c.id).order_by("id")).scalars().first()
            conn.execute(
                sa.insert(attempts).values(message_id=first, finished_at=T0, outcome="accepted")
            )
            before = conn.execute(sa.select(*old).order_by("id")).all()
        assert len(before) == len(Status)
        migrations.upgrade(engine)
        with engine.connect() as conn:
            assert conn.execute(sa.select(*old).order_by("id")).all() == before
            assert {c.name for c in old} | NEW_COLUMNS == set(columns(conn))
            assert conn.execute(sa.select(messages.c.body_dropped_at)).scalars().all() == [
                None
            ] * len(Status)
            assert conn.execute(sa.select(sa.func.count()).select_from(attempts)).scalar_one() == 1
        migrations.downgrade(engine, BEFORE)  # and back, and up again
        with engine.connect() as conn:
            assert "body_dropped_at" not in columns(conn)
        migrations.upgrade(engine)
    finally:
        engine.dispose()


def _load_migration() -> ModuleType:
    spec = importlib.util.spec_from_file_location("outbox_0005_under_test", MIGRATION)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


HELD = 4.0  # seconds the long transaction holds the table


@pytest.mark.parametrize("direction", ["upgrade", "downgrade"])
def test_the_change_waits_out_a_long_transaction_without_stopping_the_apps_writes(
    server_backend, tmp_path, direction
):
    """A transaction holds the table for 4 s when the upgrade (or the downgrade) starts: it
    finishes after it, and meanwhile the app's inserts go on, none waiting much over the
    change's one second (a plain ALTER would make them wait the whole 4 s behind it)."""
    with fresh_database(server_backend, tmp_path, "live") as url:
        migrations.upgrade(url, BEFORE if direction == "upgrade" else "heads")
        engine = sa.create_engine(url, pool_size=5)
        try:
            writer = Writer(engine)
            writer.start()
            time.sleep(0.3)
            holder = Holder(engine)
            timer = threading.Timer(HELD, holder.end)
            timer.start()
            began = time.monotonic()
            try:
                if direction == "upgrade":
                    migrations.upgrade(url)
                else:
                    migrations.downgrade(url, BEFORE)
            finally:
                timer.join()
                changed_in = time.monotonic() - began
                writer.stop.set()
                writer.join(10)
            assert writer.errors == []
            assert changed_in >= HELD - 0.5  # it did wait for the long transaction
            assert len(writer.waits) > 20  # the app kept writing meanwhile
            assert max(writer.waits) < 2.5, sorted(writer.waits)[-5:]
            with engine.connect() as conn:
                assert ("body_dropped_at" in columns(conn)) == (direction == "upgrade")
        finally:
            engine.dispose()


def test_the_change_gives_up_with_a_line_naming_the_table_when_the_lock_never_comes(
    server_backend, tmp_path
):
    module = _load_migration()
    module.TRIES, module.PAUSE = 2, 0.1
    with fresh_database(server_backend, tmp_path, "live") as url:
        migrations.upgrade(url, BEFORE)
        engine = sa.create_engine(url)
        holder = Holder(engine)
        try:
            with engine.connect() as conn, conn.begin():
                setting = (
                    "SHOW lock_timeout"
                    if server_backend.name == "postgresql"
                    else "SELECT @@SESSION.lock_wait_timeout"
                )
                own = conn.exec_driver_sql(setting).scalar_one()
                with pytest.raises(RuntimeError) as stopped:
                    module._briefly(
                        conn,
                        lambda conn=conn: conn.exec_driver_sql(
                            "ALTER TABLE outbox_messages ADD COLUMN probe INTEGER"
                        ),
                    )
                assert conn.exec_driver_sql(setting).scalar_one() == own  # put back
            assert str(stopped.value).startswith(
                "outbox_0005: could not lock outbox_messages for a moment in 2 tries"
            )
            with engine.connect() as conn:
                assert "probe" not in columns(conn)
        finally:
            holder.end()
            engine.dispose()


def test_the_upgrade_runs_on_a_connection_in_autocommit(backend, old_url):
    engine = sa.create_engine(old_url)
    try:
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            migrations.upgrade(conn)
        with engine.connect() as conn:
            assert "body_dropped_at" in columns(conn)
            if backend.name == "postgresql":  # the session setting did not leak into the pool
                assert conn.exec_driver_sql("SHOW lock_timeout").scalar_one() == "0"
    finally:
        engine.dispose()


def test_the_upgrade_renders_as_sql_for_a_dba_with_the_same_lock_bound(server_backend):
    """``alembic upgrade --sql`` (offline): the script sets the lock wait before the change
    and restores it after."""
    config = migrations.alembic_config(server_backend.url)
    out = io.StringIO()
    config.stdout = out
    with contextlib.redirect_stdout(out):
        command.upgrade(config, f"{BEFORE}:outbox_0005", sql=True)
    script = out.getvalue()
    wait = "lock_timeout = '1s'" if server_backend.name == "postgresql" else "lock_wait_timeout = 1"
    assert wait in script
    assert script.index(wait) < script.index("body_dropped_at")
    back = (  # and puts the session's own wait back after it, for the app's later revisions
        "SET LOCAL lock_timeout = DEFAULT"
        if server_backend.name == "postgresql"
        else "SET SESSION lock_wait_timeout = @outbox_lock_wait"
    )
    assert script.index("body_dropped_at") < script.index(back)
