"""`outbox-relay migrate` and the quickstart, run as a user runs them: real subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox import migrations
from outbox.schema import messages

ROOT = Path(__file__).resolve().parents[2]
RELAY = str(Path(sys.executable).with_name("outbox-relay"))


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        check=False,
    )


@pytest.fixture
def fresh_url(backend, tmp_path):
    """An empty database of the backend's kind, dropped afterwards."""
    if backend.name == "sqlite":
        yield f"sqlite:///{tmp_path / 'cli.db'}"
        return
    url = sa.make_url(backend.url)
    server = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    with server.connect() as conn:
        conn.exec_driver_sql("DROP DATABASE IF EXISTS outbox_cli_test")
        conn.exec_driver_sql("CREATE DATABASE outbox_cli_test")
    yield url.set(database="outbox_cli_test").render_as_string(hide_password=False)
    with server.connect() as conn:
        force = " WITH (FORCE)" if backend.name == "postgresql" else ""
        conn.exec_driver_sql(f"DROP DATABASE IF EXISTS outbox_cli_test{force}")
    server.dispose()


def test_migrate_creates_tables_and_views_and_is_repeatable(fresh_url):
    first = run(RELAY, "migrate", "--database-url", fresh_url)
    assert first.returncode == 0, first.stderr
    assert "up to date" in first.stdout
    again = run(RELAY, "migrate", env={"OUTBOX_DATABASE_URL": fresh_url})
    assert again.returncode == 0, again.stderr
    engine = sa.create_engine(fresh_url)
    try:
        inspector = sa.inspect(engine)
        assert {"outbox_messages", "outbox_attempts", "outbox_relays"} <= set(
            inspector.get_table_names()
        )
        assert set(inspector.get_view_names()) >= migrations.VIEWS
        applied, heads = migrations.current_heads(engine)
        assert applied == heads
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--database-url", "nosuchdb://x"], "--database-url"),
        ([], "--database-url"),
        (["--database-url", "sqlite://", "--bogus"], "--bogus"),
    ],
    ids=["bad-url", "missing-url", "unknown-flag"],
)
def test_migrate_refuses_bad_settings_with_one_clear_line(args, expected):
    done = run(RELAY, "migrate", *args, env={"OUTBOX_DATABASE_URL": ""})
    assert done.returncode == 2
    assert expected in done.stderr
    assert "Traceback" not in done.stderr


def test_migrate_reports_an_unreachable_database_without_a_traceback():
    done = run(
        RELAY, "migrate", "--database-url", "postgresql+psycopg://nobody:secret@127.0.0.1:1/none"
    )
    assert done.returncode == 2  # a start-up error, like a bad URL
    assert "cannot connect to postgresql+psycopg://nobody:***@127.0.0.1:1/none" in done.stderr
    assert "secret" not in done.stderr
    assert "Traceback" not in done.stderr


def test_quickstart_runs_twice_and_leaves_exactly_the_expected_rows(tmp_path):
    url = f"sqlite:///{tmp_path / 'quickstart.db'}"
    for _ in range(2):
        done = run(sys.executable, str(ROOT / "examples" / "quickstart.py"), url)
        assert done.returncode == 0, done.stderr
    assert "refused: subject" in done.stdout
    # what the SES emulator (moto, started by the script) received, through the real SesSender
    assert "the SES emulator received 4 emails" in done.stdout
    for n, customer in ((1, "ada"), (3, "cy"), (4, "dee"), (5, "eve")):
        assert f"-> {customer}@example.com: 'Order {n} confirmed'" in done.stdout
    assert "Order 2 confirmed" not in done.stdout
    after = done.stdout.split("outbox_status_summary (after the relay):")[1]
    assert [line.split() for line in after.strip().splitlines()] == [
        ["category", "status", "messages"],
        ["default", "sent", "3"],
        ["transactional", "sent", "1"],
    ]
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            got = conn.execute(
                sa.select(
                    messages.c.idempotency_key, messages.c.status, messages.c.provider_message_id
                ).order_by(messages.c.id)
            ).all()
            orders = conn.exec_driver_sql("SELECT id FROM quickstart_orders ORDER BY id").all()
    finally:
        engine.dispose()
    assert [(key, status) for key, status, _ in got] == [
        ("order-confirmation:1", "sent"),
        ("order-confirmation:3", "sent"),
        ("order-confirmation:4", "sent"),
        ("order-confirmation:5", "sent"),
    ]
    assert all(provider_id for *_, provider_id in got)  # SES message ids from the emulator
    assert [r[0] for r in orders] == [1, 3, 4, 5]
