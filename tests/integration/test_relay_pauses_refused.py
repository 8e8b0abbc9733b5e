"""A relay whose database will not take ``outbox_relays.paused_scopes``: deployed before the
migration that adds it (all three databases), or with a role granted before it (PostgreSQL's
column grants, as the example grants give). It registers, beats, sends and stops as before,
without showing its scoped pauses, and says so once: the column is for showing, the
heartbeat is what keeps the relay's id."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import sqlalchemy as sa

from outbox import migrations
from outbox.schema import RelayState, relays
from relay.testing import FakeSender
from tests.support.db import fresh_database
from tests.support.factories import email, enqueue
from tests.support.inprocess import relay_for, running
from tests.support.relays import statuses
from tests.support.waiting import wait_for

BEFORE = "outbox_0005"  # the revision before paused_scopes


def _relay_row(engine: sa.Engine) -> sa.Row[object]:
    with engine.connect() as conn:
        return conn.execute(sa.select(relays.c.state, relays.c.heartbeat_at)).one()


def _runs_beats_and_stops(engine: sa.Engine, url: str, caplog: pytest.LogCaptureFixture) -> None:
    """A relay on ``engine`` sends what was enqueued, beats at least twice, stops cleanly, and
    says once that it beats without its pauses."""
    enqueue(engine, [email(n, short=True) for n in range(3)])
    sender = FakeSender()
    relay = relay_for(None, sender, engine=engine, url=url)  # beats every 1.25 s
    with caplog.at_level(logging.WARNING, logger="relay"), running(relay):
        wait_for(lambda: statuses(engine)["sent"] == 3, what="the three sends")
        first = _relay_row(engine).heartbeat_at
        wait_for(lambda: _relay_row(engine).heartbeat_at > first, what="a later heartbeat")
        assert _relay_row(engine).state == RelayState.RUNNING.value
    assert _relay_row(engine).state == RelayState.STOPPED.value
    assert len(sender.sent_ids) == 3
    said = [r for r in caplog.records if getattr(r, "action", None) == "pauses_not_shown"]
    assert len(said) == 1, [r.getMessage() for r in said]
    assert "paused_scopes" in said[0].getMessage()


def test_a_relay_deployed_before_the_migration_beats_without_its_pauses(backend, tmp_path, caplog):
    with fresh_database(backend, tmp_path, "nopauses") as url:
        migrations.upgrade(url, BEFORE)
        engine = sa.create_engine(url)
        try:
            _runs_beats_and_stops(engine, url, caplog)
        finally:
            engine.dispose()


@pytest.fixture
def old_grant_url(postgres_backend, tmp_path) -> Iterator[str]:
    """A migrated PostgreSQL database and a role that may update every outbox_relays column
    the relay wrote before this release, but not paused_scopes."""
    with fresh_database(postgres_backend, tmp_path, "oldgrant") as url:
        migrations.upgrade(url)
        owner = sa.create_engine(url)
        role = "outbox_old_grant_relay"
        with owner.begin() as conn:
            conn.exec_driver_sql(f"DROP ROLE IF EXISTS {role}")
            conn.exec_driver_sql(f"CREATE ROLE {role} LOGIN")
            conn.exec_driver_sql(
                f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}"
            )
            conn.exec_driver_sql(f"REVOKE UPDATE ON outbox_relays FROM {role}")
            conn.exec_driver_sql(
                f"GRANT UPDATE (host, pid, started_at, heartbeat_at, state) ON outbox_relays "
                f"TO {role}"
            )
        try:
            yield sa.make_url(url).set(username=role).render_as_string(hide_password=False)
        finally:
            with owner.begin() as conn:
                conn.exec_driver_sql(f"DROP OWNED BY {role}")
            owner.dispose()


def test_a_relay_role_granted_before_the_column_beats_without_its_pauses(old_grant_url, caplog):
    engine = sa.create_engine(old_grant_url)
    try:
        _runs_beats_and_stops(engine, old_grant_url, caplog)
    finally:
        engine.dispose()
