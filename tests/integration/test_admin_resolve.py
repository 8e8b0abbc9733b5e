"""``outbox-relay resolve`` and the operators' log, through the real CLI on SQLite, PostgreSQL
and MariaDB: each way a row can be resolved and each refusal, the log rows written in the
transaction of the change they record (a log that cannot be written rolls the change back:
resolve, requeue, suppressions, prune), ``--actor`` and its default, and a resolve racing a
relay for the same row."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from outbox.schema import attempts, messages, operator_actions, suppressions
from relay import store
from relay.admin import batches
from relay.cli import main
from relay.clock import read_database_time
from relay.db import make_engine
from relay.store import operator as ops
from tests.support.db import attempt_rows, row
from tests.support.factories import enqueue
from tests.support.relays import RELAY, clean_env
from tests.support.waiting import wait_for

PROVIDER_ID = "0100018c1d2e3f4a-1b2c3d4e-5f60-4a7b-8c9d-0e1f2a3b4c5d-000000"


def cli(backend: Any, *args: str, **env: str) -> Any:
    return CliRunner().invoke(
        main, list(args), env={"OUTBOX_DATABASE_URL": backend.url, **env}, catch_exceptions=False
    )


def set_row(engine: sa.Engine, message_id: int, **values: Any) -> None:
    with engine.begin() as conn:
        conn.execute(messages.update().where(messages.c.id == message_id).values(**values))


def log_rows(engine: sa.Engine) -> list[Any]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(operator_actions).order_by(operator_actions.c.id)))


def suppressed(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return sorted(conn.execute(sa.select(suppressions.c.address)).scalars())


def one_message(engine: sa.Engine, status: str, **values: Any) -> int:
    (mid,) = enqueue(engine, 1, short=True)
    set_row(engine, mid, status=status, **values)
    return mid


@contextmanager
def refusing_log(engine: sa.Engine, above: int = -1) -> Iterator[None]:
    """A trigger that makes every insert into the operators' log fail (only rows of a
    message id above ``above``, with it; rows of no message always), dropped afterwards."""
    name = "outbox_test_refuse_log"
    when = f"NEW.message_id IS NULL OR NEW.message_id > {int(above)}"
    dialect = engine.dialect.name
    with engine.begin() as conn:
        if dialect == "postgresql":
            conn.exec_driver_sql(
                f"CREATE FUNCTION {name}() RETURNS trigger LANGUAGE plpgsql AS "
                "$$ BEGIN RAISE EXCEPTION 'the log refused the row'; END $$"
            )
            conn.exec_driver_sql(
                f"CREATE TRIGGER {name} BEFORE INSERT ON outbox_operator_actions FOR EACH ROW "
                f"WHEN ({when}) EXECUTE FUNCTION {name}()"
            )
        elif dialect in ("mysql", "mariadb"):
            conn.exec_driver_sql(
                f"CREATE TRIGGER {name} BEFORE INSERT ON outbox_operator_actions FOR EACH ROW "
                f"BEGIN IF {when} THEN SIGNAL SQLSTATE '45000' "
                "SET MESSAGE_TEXT = 'the log refused the row'; END IF; END"
            )
        else:
            conn.exec_driver_sql(
                f"CREATE TRIGGER {name} BEFORE INSERT ON outbox_operator_actions "
                f"WHEN {when} BEGIN SELECT RAISE(ABORT, 'the log refused the row'); END"
            )
    try:
        yield
    finally:
        with engine.begin() as conn:
            if dialect == "postgresql":
                conn.exec_driver_sql(f"DROP TRIGGER {name} ON outbox_operator_actions")
                conn.exec_driver_sql(f"DROP FUNCTION {name}()")
            else:
                conn.exec_driver_sql(f"DROP TRIGGER {name}")


def database_now(engine: sa.Engine) -> datetime:
    with engine.connect() as conn:
        return read_database_time(conn)


@pytest.mark.parametrize("status", ["unknown_outcome", "failed", "expired", "pending", "retrying"])
def test_resolve_delivered_makes_the_row_sent_and_logs_it(backend, status):
    engine = backend.engine
    mid = one_message(engine, status, last_error_code="ReadTimeoutError", claim_token="t-1")
    before = database_now(engine)
    done = cli(
        backend, "resolve", str(mid), "--delivered", "--provider-message-id", PROVIDER_ID,
        "--reason", "in the SES event history", "--actor", "alice", "--json",
    )  # fmt: skip
    after = database_now(engine)
    assert done.exit_code == 0, done.output
    result = json.loads(done.output)
    assert (result["resolution"], result["previous_status"], result["status"]) == (
        "delivered",
        status,
        "sent",
    )
    stored = row(engine, mid)
    assert stored.status == "sent"
    assert before <= stored.sent_at <= after  # the database's clock
    assert stored.provider_message_id == PROVIDER_ID
    assert stored.claim_token is None
    (attempt,) = attempt_rows(engine, mid)
    assert attempt.outcome == "resolved"
    assert attempt.relay_id == "operator:alice"
    assert attempt.error_message == "in the SES event history"
    assert attempt.provider_message_id == PROVIDER_ID
    (logged,) = log_rows(engine)
    assert (logged.action, logged.actor, logged.message_id, logged.reason) == (
        "resolve_delivered",
        "alice",
        mid,
        "in the SES event history",
    )
    assert logged.at == attempt.finished_at == stored.sent_at
    assert json.loads(logged.detail) == {
        "previous_status": status,
        "provider_message_id": PROVIDER_ID,
    }


def test_resolve_delivered_keeps_a_provider_id_it_was_not_given_and_logs_one_it_replaces(
    backend,
):
    engine = backend.engine
    kept = one_message(engine, "unknown_outcome", provider_message_id="ses-old")
    assert cli(backend, "resolve", str(kept), "--delivered").exit_code == 0
    assert row(engine, kept).provider_message_id == "ses-old"
    replaced = one_message(engine, "failed", provider_message_id="ses-old")
    done = cli(backend, "resolve", str(replaced), "--delivered", "--provider-message-id", "ses-new")
    assert done.exit_code == 0, done.output
    assert done.output == f"resolved message {replaced} as delivered: sent (was failed)\n"
    assert row(engine, replaced).provider_message_id == "ses-new"
    details = [json.loads(r.detail) for r in log_rows(engine)]
    assert details == [
        {"previous_status": "unknown_outcome"},
        {
            "previous_status": "failed",
            "provider_message_id": "ses-new",
            "previous_provider_message_id": "ses-old",
        },
    ]


@pytest.mark.parametrize(
    ("status", "says"),
    [
        ("processing", "a relay holds it"),
        ("sent", "already sent"),
        ("cancelled", "never sent it"),
    ],
)
def test_resolve_delivered_refuses_a_row_it_cannot_close_and_changes_nothing(backend, status, says):
    engine = backend.engine
    mid = one_message(engine, status, claim_token="t-1" if status == "processing" else None)
    before = row(engine, mid)
    refused = cli(backend, "resolve", str(mid), "--delivered", "--reason", "r")
    assert refused.exit_code == 1
    assert f"cannot resolve message {mid} as delivered" in refused.output
    assert says in refused.output
    assert row(engine, mid) == before
    assert attempt_rows(engine, mid) == []
    assert log_rows(engine) == []


@pytest.mark.parametrize("status", ["unknown_outcome", "failed"])
def test_resolve_not_delivered_requeues_as_requeue_does(backend, status):
    engine = backend.engine
    mid = one_message(engine, status, attempt_count=3, send_started_at=datetime.now(UTC))
    twin = one_message(engine, status, attempt_count=3, send_started_at=datetime.now(UTC))
    done = cli(backend, "resolve", str(mid), "--not-delivered", "--reason", "not in SES")
    assert done.exit_code == 0, done.output
    assert done.output == f"resolved message {mid} as not delivered: requeued (was {status})\n"
    assert cli(backend, "requeue", str(twin), "--reason", "not in SES").exit_code == 0
    ignored = {"id", "idempotency_key", "payload", "recipients", "subject", "created_at"}
    resolved, requeued = row(engine, mid)._asdict(), row(engine, twin)._asdict()
    assert resolved["status"] == "pending"
    assert resolved["attempt_count"] == 0
    # the times are each command's own now; a row without a key takes its turn when due
    for name in set(resolved) - ignored - {"updated_at", "next_attempt_at", "fair_at"}:
        assert resolved[name] == requeued[name], name
    for moved in (resolved, requeued):
        assert moved["fair_at"] == moved["next_attempt_at"]
    (attempt,) = attempt_rows(engine, mid)
    assert (attempt.outcome, attempt.error_message) == ("requeued", "not in SES")
    actions = [(r.action, r.message_id, json.loads(r.detail)) for r in log_rows(engine)]
    assert actions == [
        ("resolve_not_delivered", mid, {"previous_status": status}),
        ("requeue", twin, {"previous_status": status}),
    ]


@pytest.mark.parametrize("status", ["pending", "retrying", "processing", "sent", "cancelled"])
def test_resolve_not_delivered_refuses_what_requeue_refuses(backend, status):
    engine = backend.engine
    mid = one_message(engine, status)
    refused = cli(backend, "resolve", str(mid), "--not-delivered")
    assert refused.exit_code == 1
    assert f"cannot resolve message {mid} as not delivered: it is {status}" in refused.output
    assert row(engine, mid).status == status
    assert log_rows(engine) == []


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ((), "exactly one of --delivered or --not-delivered"),
        (("--delivered", "--not-delivered"), "exactly one of --delivered or --not-delivered"),
        (("--not-delivered", "--provider-message-id", "x"), "with --delivered only"),
        (("--delivered", "--provider-message-id", ""), "1 to 255 printable"),
        (("--delivered", "--provider-message-id", "x" * 256), "1 to 255 printable"),
        (("--delivered", "--provider-message-id", "a\nb"), "1 to 255 printable"),
        (("--delivered", "--actor", ""), "--actor"),
        (("--delivered", "--actor", " bob"), "--actor"),
    ],
)
def test_resolve_refuses_bad_usage_and_changes_nothing(backend, args, says):
    engine = backend.engine
    mid = one_message(engine, "unknown_outcome")
    refused = cli(backend, "resolve", str(mid), *args)
    assert refused.exit_code == 2
    assert says in refused.output
    assert row(engine, mid).status == "unknown_outcome"


def test_resolve_of_an_unknown_id_fails_as_show_does(backend):
    shown = cli(backend, "show", "999999")
    refused = cli(backend, "resolve", "999999", "--delivered")
    assert refused.exit_code == shown.exit_code == 1
    assert "no message with id 999999" in refused.output
    assert log_rows(backend.engine) == []


def test_the_actor_is_the_os_user_unless_given(backend):
    engine = backend.engine
    ids = [one_message(engine, "unknown_outcome") for _ in range(4)]
    os_user = {"LOGNAME": "carol", "USER": "carol"}
    assert cli(backend, "resolve", str(ids[0]), "--delivered", **os_user).exit_code == 0
    assert cli(backend, "requeue", str(ids[1]), "--actor", "dave", **os_user).exit_code == 0
    assert cli(backend, "cancel", str(ids[1]), **os_user, OUTBOX_ACTOR="erin").exit_code == 0
    assert cli(backend, "resolve", str(ids[2]), "--not-delivered", **os_user).exit_code == 0
    assert [(r.action, r.actor) for r in log_rows(engine)] == [
        ("resolve_delivered", "carol"),
        ("requeue", "dave"),
        ("cancel", "erin"),
        ("resolve_not_delivered", "carol"),
    ]
    relay_ids = [a.relay_id for a in attempt_rows(engine)]
    assert relay_ids == ["operator:carol", "operator:dave", "operator:erin", "operator:carol"]


def test_bulk_requeue_and_cancel_log_one_row_per_message_changed(backend):
    engine = backend.engine
    failed = [one_message(engine, "failed") for _ in range(3)]
    unknown = one_message(engine, "unknown_outcome")
    pending = [one_message(engine, "pending") for _ in range(2)]
    done = cli(backend, "requeue", "--status", "failed", "--yes", "--reason", "quota raised")
    assert done.exit_code == 0, done.output
    assert cli(backend, "cancel", str(pending[1]), "--actor", "ops").exit_code == 0
    logged = [(r.action, r.message_id, r.reason, json.loads(r.detail)) for r in log_rows(engine)]
    assert logged == [
        *[("requeue", i, "quota raised", {"previous_status": "failed"}) for i in failed],
        ("cancel", pending[1], None, {"previous_status": "pending"}),
    ]
    assert row(engine, unknown).status == "unknown_outcome"  # not matched: not logged


@pytest.mark.parametrize(
    "command",
    [
        ("resolve", "{id}", "--delivered"),
        ("resolve", "{id}", "--not-delivered"),
        ("requeue", "{id}"),
    ],
)
def test_a_log_row_that_cannot_be_written_rolls_its_change_back(backend, command):
    engine = backend.engine
    mid = one_message(engine, "unknown_outcome")
    before = row(engine, mid)
    with refusing_log(engine):
        refused = cli(backend, *(part.format(id=mid) for part in command))
    assert refused.exit_code == 1
    assert "the log refused the row" in refused.output
    assert row(engine, mid) == before  # the change went with the log row
    assert attempt_rows(engine, mid) == []
    assert log_rows(engine) == []
    assert cli(backend, *(part.format(id=mid) for part in command)).exit_code == 0
    assert len(log_rows(engine)) == 1


def test_a_bulk_change_whose_log_fails_in_its_second_batch_keeps_the_first_batch_whole(
    backend, monkeypatch
):
    engine = backend.engine
    monkeypatch.setattr(batches, "CHANGE_BATCH", 3)
    ids = [one_message(engine, "failed") for _ in range(7)]
    with refusing_log(engine, above=ids[2]):
        stopped = cli(backend, "requeue", "--status", "failed", "--yes", "--json")
    assert stopped.exit_code == 1
    report = json.loads(stopped.stdout)
    assert report["requeued_ids"] == ids[:3]
    assert report["unchanged_ids"] == ids[3:]
    with engine.connect() as conn:
        found = dict(conn.execute(sa.select(messages.c.id, messages.c.status)).all())
    assert [found[i] for i in ids] == ["pending"] * 3 + ["failed"] * 4
    assert [r.message_id for r in log_rows(engine)] == ids[:3]
    assert sorted(a.message_id for a in attempt_rows(engine)) == ids[:3]


def test_a_log_row_that_cannot_be_written_rolls_the_suppression_change_back(backend):
    engine = backend.engine
    with refusing_log(engine):
        refused = cli(backend, "suppressions", "add", "h@example.com", "--reason", "r")
    assert refused.exit_code == 1
    assert "the log refused the row" in refused.output
    assert suppressed(engine) == []
    assert cli(backend, "suppressions", "add", "h@example.com", "--reason", "r").exit_code == 0
    with refusing_log(engine):
        assert cli(backend, "suppressions", "remove", "h@example.com").exit_code == 1
    assert suppressed(engine) == ["h@example.com"]
    assert [r.action for r in log_rows(engine)] == ["suppress"]


def test_a_prune_whose_log_row_fails_deletes_nothing(backend):
    engine = backend.engine
    old = datetime.now(UTC) - timedelta(days=40)
    mid = one_message(engine, "sent", created_at=old, updated_at=old)
    with refusing_log(engine):
        refused = cli(backend, "prune", "--older-than", "30d")
    assert refused.exit_code == 1
    assert "the log refused the row" in refused.output
    with engine.connect() as conn:
        assert mid in set(conn.execute(sa.select(messages.c.id)).scalars())


def test_a_resolve_after_a_sweep_wins_over_the_relays_late_finalize(backend):
    """The relay's send outlived its lease, the sweep parked the row, the operator resolved
    it: the relay's finalize, arriving last with its old claim, changes nothing."""
    engine = backend.engine
    (mid,) = enqueue(engine, 1, short=True)
    with engine.begin() as conn:
        (claim,), _ = store.claim_batch(
            conn, relay_id="relay-a", limit=1, now=datetime.now(UTC), lease_seconds=60
        )
    with engine.begin() as conn:
        assert store.hold_unknown(
            conn, message_id=mid, claim_token=claim.claim_token, code="lease", message=None,
            now=datetime.now(UTC),
        )  # fmt: skip
        conn.execute(messages.update().where(messages.c.id == mid).values(claim_token=None))
    done = cli(backend, "resolve", str(mid), "--delivered", "--provider-message-id", "ses-op")
    assert done.exit_code == 0, done.output
    with engine.begin() as conn:
        assert not store.finalize_sent(
            conn, message_id=mid, claim_token=claim.claim_token, provider_message_id="ses-relay",
            now=datetime.now(UTC),
        )  # fmt: skip
    stored = row(engine, mid)
    assert (stored.status, stored.provider_message_id) == ("sent", "ses-op")


def row_lock_waiters(engine: sa.Engine) -> int:
    """Sessions waiting for a row lock now (MariaDB: the resolve's locking read)."""
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            sql = (
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND datname = current_database()"
            )
        else:
            sql = (
                "SELECT count(*) FROM information_schema.processlist "
                "WHERE info LIKE 'SELECT outbox\\_messages.id%FOR UPDATE'"
            )
        return int(conn.execute(sa.text(sql)).scalar_one())


def test_a_relay_claim_that_commits_first_wins_over_a_waiting_resolve(server_backend):
    """The resolve waits on the row a relay is claiming; the claim commits; the resolve finds
    it processing and refuses, and the relay's finalize saves its own send."""
    engine, url = server_backend.engine, server_backend.url
    (mid,) = enqueue(engine, 1, short=True)
    set_row(engine, mid, status="retrying", next_attempt_at=datetime.now(UTC) - timedelta(1))
    relay_engine = make_engine(url)
    try:
        with relay_engine.connect() as relay:
            claiming = relay.begin()
            (claim,), _ = store.claim_batch(
                relay, relay_id="relay-a", limit=1, now=datetime.now(UTC), lease_seconds=60
            )
            operator = subprocess.Popen(
                [RELAY, "resolve", str(mid), "--delivered", "--provider-message-id", "ses-op"],
                env=clean_env(OUTBOX_DATABASE_URL=url),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            try:
                wait_for(
                    lambda: row_lock_waiters(engine) > 0 or operator.poll() is not None,
                    timeout=30,
                    interval=0.05,
                    what="the resolve to wait on the claim",
                )
                assert operator.poll() is None, operator.communicate()
                claiming.commit()
                _, err = operator.communicate(timeout=60)
            finally:
                operator.kill()
                operator.wait()
            with relay.begin():
                assert store.finalize_sent(
                    relay, message_id=mid, claim_token=claim.claim_token,
                    provider_message_id="ses-relay", now=datetime.now(UTC),
                )  # fmt: skip
    finally:
        relay_engine.dispose()
    assert operator.returncode == 1
    assert "a relay holds it" in err
    stored = row(engine, mid)
    assert (stored.status, stored.provider_message_id) == ("sent", "ses-relay")
    assert "resolved" not in {a.outcome for a in attempt_rows(engine, mid)}
    assert log_rows(engine) == []


def test_a_resolve_that_commits_first_wins_over_a_relay_claim(server_backend, monkeypatch):
    """While the resolve holds the row (changed, not yet committed), a relay's claim skips it
    without waiting; once the resolve commits the row is sent and no claim takes it."""
    engine, url = server_backend.engine, server_backend.url
    (mid,) = enqueue(engine, 1, short=True)
    set_row(engine, mid, status="retrying", next_attempt_at=datetime.now(UTC) - timedelta(1))
    holding, release = threading.Event(), threading.Event()
    write_log = ops.log_actions

    def slow_log(conn: sa.Connection, rows: Any) -> None:
        write_log(conn, rows)
        holding.set()
        release.wait(30)

    monkeypatch.setattr(ops, "log_actions", slow_log)
    outcome: list[Any] = []
    worker = threading.Thread(
        target=lambda: outcome.append(
            cli(server_backend, "resolve", str(mid), "--delivered", "--reason", "seen")
        )
    )
    worker.start()
    relay_engine = make_engine(url)
    try:
        assert holding.wait(30)
        with relay_engine.begin() as relay:
            claims, _ = store.claim_batch(
                relay, relay_id="relay-a", limit=10, now=datetime.now(UTC), lease_seconds=60
            )
        assert claims == []  # skipped, not waited for
        release.set()
        worker.join(30)
        with relay_engine.begin() as relay:
            claims, _ = store.claim_batch(
                relay, relay_id="relay-a", limit=10, now=datetime.now(UTC), lease_seconds=60
            )
        assert claims == []
    finally:
        release.set()
        relay_engine.dispose()
    (done,) = outcome
    assert done.exit_code == 0, done.output
    assert row(engine, mid).status == "sent"
    with engine.connect() as conn:
        outcomes = list(
            conn.execute(
                sa.select(attempts.c.outcome).where(attempts.c.message_id == mid)
            ).scalars()
        )
    assert outcomes == ["resolved"]
    assert [r.action for r in log_rows(engine)] == ["resolve_delivered"]
