"""Upgrading a live ``outbox_relays`` to outbox_0006 (each relay's scoped pauses) and back:
the relays' rows come through unchanged, the new column reads NULL (no pauses) until a
heartbeat writes it, and the change waits at most a moment for its lock, so a long
transaction reading the table never makes the relays' heartbeats wait behind it."""

from __future__ import annotations

import contextlib
import io
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from alembic import command

from outbox import migrations
from outbox.schema import RelayState, relays
from relay import store
from tests.support.db import fresh_database
from tests.support.migrating import Holder, Writer

BEFORE, AFTER = "outbox_0005", "outbox_0006"
T0 = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
HELD = 4.0  # seconds the long transaction holds the table


@pytest.fixture
def old_url(backend, tmp_path) -> Iterator[str]:
    """A database of the backend's kind at the revision before the relays' pauses."""
    with fresh_database(backend, tmp_path, "pauses") as url:
        migrations.upgrade(url, BEFORE)
        yield url


def columns(conn: sa.Connection) -> list[str]:
    return [c["name"] for c in sa.inspect(conn).get_columns("outbox_relays")]


OLD = [relays.c[c] for c in ("relay_id", "host", "pid", "started_at", "heartbeat_at", "state")]


def old_rows(conn: sa.Connection) -> list[sa.Row[object]]:
    return list(conn.execute(sa.select(*OLD).order_by(relays.c.relay_id)))


def test_the_relays_rows_come_through_the_upgrade_and_the_downgrade(backend, old_url):
    engine = sa.create_engine(old_url)
    try:
        with engine.begin() as conn:
            for n, state in enumerate(RelayState):
                conn.execute(
                    sa.insert(relays).values(
                        relay_id=f"r{n}",
                        host=f"h{n}",
                        pid=n + 1,
                        started_at=T0,
                        heartbeat_at=T0 + timedelta(seconds=n),
                        state=state.value,
                    )
                )
            before = old_rows(conn)
            assert "paused_scopes" not in columns(conn)
        assert len(before) == len(RelayState)

        migrations.upgrade(engine, AFTER)
        with engine.begin() as conn:
            assert old_rows(conn) == before
            assert set(columns(conn)) == {c.name for c in OLD} | {"paused_scopes"}
            assert store.relay_pauses(conn) == {}  # NULL everywhere: no relay has pauses
            # a relay of this release beats on its row, with its pauses
            text = store.pauses_text([store.PausedScope(kind="identity", name="x.example")])
            assert store.heartbeat_held(
                conn,
                relay_id="r0",
                host="h0",
                pid=1,
                started_at=T0,
                now=T0 + timedelta(minutes=1),
                state=RelayState.RUNNING,
                pauses=text,
            )
        with engine.connect() as conn:
            assert store.relay_pauses(conn) == {"r0": store.read_pauses(text)}

        migrations.downgrade(engine, BEFORE)
        with engine.connect() as conn:
            assert "paused_scopes" not in columns(conn)
            after = old_rows(conn)
        assert after[1:] == before[1:]
        assert after[0].heartbeat_at == T0 + timedelta(minutes=1)
        migrations.upgrade(engine, AFTER)  # and up again
        with engine.connect() as conn:
            assert store.relay_pauses(conn) == {}
    finally:
        engine.dispose()


def _beat(conn: sa.Connection, _i: int) -> None:
    """A relay's heartbeat on its row (only the columns both revisions have)."""
    conn.execute(
        sa.text("UPDATE outbox_relays SET heartbeat_at = :now WHERE relay_id = 'r'"),
        {"now": datetime.now(UTC).replace(tzinfo=None)},
    )


@pytest.mark.parametrize("direction", ["upgrade", "downgrade"])
def test_the_change_waits_out_a_long_transaction_without_stopping_the_heartbeats(
    server_backend, tmp_path, direction
):
    """A transaction holds outbox_relays for 4 s when the upgrade (or the downgrade) starts:
    it finishes after it, and meanwhile the heartbeats go on, none waiting much over the
    change's one second (a plain ALTER would make them wait the whole 4 s behind it)."""
    with fresh_database(server_backend, tmp_path, "pauses") as url:
        migrations.upgrade(url, BEFORE if direction == "upgrade" else AFTER)
        engine = sa.create_engine(url, pool_size=5)
        try:
            with engine.begin() as conn:
                conn.execute(
                    sa.text(
                        "INSERT INTO outbox_relays (relay_id, host, pid, started_at,"
                        " heartbeat_at, state) VALUES ('r', 'h', 1, :t, :t, 'running')"
                    ),
                    {"t": T0.replace(tzinfo=None)},
                )
            beater = Writer(engine, _beat)
            beater.start()
            time.sleep(0.3)
            holder = Holder(engine, "outbox_relays")
            timer = threading.Timer(HELD, holder.end)
            timer.start()
            began = time.monotonic()
            try:
                if direction == "upgrade":
                    migrations.upgrade(url, AFTER)
                else:
                    migrations.downgrade(url, BEFORE)
            finally:
                timer.join()
                changed_in = time.monotonic() - began
                beater.stop.set()
                beater.join(10)
            assert beater.errors == []
            assert changed_in >= HELD - 0.5  # it did wait for the long transaction
            assert len(beater.waits) > 20  # the heartbeats went on meanwhile
            assert max(beater.waits) < 2.5, sorted(beater.waits)[-5:]
            with engine.connect() as conn:
                assert ("paused_scopes" in columns(conn)) == (direction == "upgrade")
        finally:
            engine.dispose()


def test_the_upgrade_renders_as_sql_with_the_same_lock_bound(server_backend):
    config = migrations.alembic_config(server_backend.url)
    out = io.StringIO()
    config.stdout = out
    with contextlib.redirect_stdout(out):
        command.upgrade(config, f"{BEFORE}:{AFTER}", sql=True)
    script = out.getvalue()
    wait = "lock_timeout = '1s'" if server_backend.name == "postgresql" else "lock_wait_timeout = 1"
    back = (
        "SET LOCAL lock_timeout = DEFAULT"
        if server_backend.name == "postgresql"
        else "SET SESSION lock_wait_timeout = @outbox_lock_wait"
    )
    change = script.index("ADD COLUMN paused_scopes TEXT")
    assert script.rindex(wait, 0, change) < change < script.index(back, change)
