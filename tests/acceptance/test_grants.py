"""The least-privilege grant scripts of examples/deploy, applied as a user applies them: psql
with ``-v`` variables on PostgreSQL, the MariaDB script with its ``${NAME}`` placeholders filled
in (what envsubst does) and piped into the mariadb client.

Under those roles the app enqueues (new and duplicate keys), a real ``outbox-relay run`` process
delivers a backlog, sweeps expired leases and expires stale rows, and neither role can change
the schema or delete a message. The roles are dropped when each test ends.
"""

from __future__ import annotations

import shutil
import signal
import socket
import string
import subprocess
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

from outbox import Outbox
from outbox.schema import attempts, messages, relays
from tests.support.db import attempt_rows
from tests.support.factories import email
from tests.support.relays import (
    FAKE_SENDER,
    RELAY,
    clean_env,
    message_rows,
    read_records,
    relay_rows,
)
from tests.support.waiting import wait_for

DEPLOY = Path(__file__).resolve().parents[2] / "examples" / "deploy"
RELAY_ROLE, APP_ROLE = "outbox_relay_test_h8", "outbox_app_test_h8"
PASSWORD = {RELAY_ROLE: "relay-pw-h8", APP_ROLE: "app-pw-h8"}
VIEWS = (
    "outbox_status_summary",
    "outbox_lag",
    "outbox_unknown_outcomes",
    "outbox_failures",
    "outbox_relay_health",
)
MARIADB_PLACEHOLDERS = {
    "RELAY_USER",
    "RELAY_PASSWORD",
    "APP_USER",
    "APP_PASSWORD",
    "DB_NAME",
    "CLIENT_HOST",
}


def run_client(command: list[str], script: str | None = None, **env: str) -> None:
    done = subprocess.run(
        command,
        input=script,
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(**env),
        check=False,
    )
    assert done.returncode == 0, f"{command[0]} failed:\n{done.stdout}\n{done.stderr}"


def apply_postgresql(admin: sa.URL) -> None:
    """``psql -v ... -f grants-postgresql.sql``, as the README says."""
    conninfo = admin.set(drivername="postgresql").render_as_string(hide_password=False)
    run_client(
        [
            "psql",
            conninfo,
            "-X",
            "-q",
            "-v",
            "ON_ERROR_STOP=1",
            "-v",
            f"relay_role={RELAY_ROLE}",
            "-v",
            f"relay_password={PASSWORD[RELAY_ROLE]}",
            "-v",
            f"app_role={APP_ROLE}",
            "-v",
            f"app_password={PASSWORD[APP_ROLE]}",
            "-f",
            str(DEPLOY / "grants-postgresql.sql"),
        ]
    )


def render_mariadb(database: str) -> str:
    """The MariaDB script with its placeholders filled in, as envsubst fills them."""
    text = (DEPLOY / "grants-mariadb.sql").read_text()
    template = string.Template(text)
    assert template.is_valid()
    # every "$" in the file is one of the documented placeholders, so envsubst (which also
    # replaces $NAME) touches nothing else
    assert text.count("$") == sum(text.count("${" + name + "}") for name in MARIADB_PLACEHOLDERS)
    assert set(template.get_identifiers()) == MARIADB_PLACEHOLDERS
    return template.substitute(
        RELAY_USER=RELAY_ROLE,
        RELAY_PASSWORD=PASSWORD[RELAY_ROLE],
        APP_USER=APP_ROLE,
        APP_PASSWORD=PASSWORD[APP_ROLE],
        DB_NAME=database,
        CLIENT_HOST="%",
    )


def apply_mariadb(admin: sa.URL) -> None:
    """``envsubst < grants-mariadb.sql | mariadb -h ... -u root``."""
    client = shutil.which("mariadb") or "mysql"
    command = [client, "--protocol=TCP", "-h", admin.host or "127.0.0.1"]
    command += ["-P", str(admin.port or 3306), "-u", admin.username or "root"]
    password = {"MYSQL_PWD": admin.password} if admin.password else {}
    run_client(command, render_mariadb(admin.database or ""), **password)


def drop_roles(admin: sa.Engine) -> None:
    with admin.begin() as conn:
        if admin.dialect.name == "postgresql":
            for role in (RELAY_ROLE, APP_ROLE):
                found = conn.execute(
                    sa.text("SELECT 1 FROM pg_roles WHERE rolname = :role"), {"role": role}
                ).scalar()
                if found:
                    conn.exec_driver_sql(f'DROP OWNED BY "{role}"')
                    conn.exec_driver_sql(f'DROP ROLE "{role}"')
        else:
            for role in (RELAY_ROLE, APP_ROLE):
                conn.exec_driver_sql(f"DROP USER IF EXISTS '{role}'@'%%'")  # %% for pymysql


def role_names(admin: sa.Engine) -> set[str]:
    """Which of the two roles exist."""
    if admin.dialect.name == "postgresql":
        query = sa.text("SELECT rolname FROM pg_roles WHERE rolname IN :names")
    else:
        query = sa.text("SELECT user FROM mysql.user WHERE user IN :names")
    query = query.bindparams(sa.bindparam("names", expanding=True))
    with admin.connect() as conn:
        return set(conn.execute(query, {"names": [RELAY_ROLE, APP_ROLE]}).scalars())


@dataclass
class Roles:
    admin: sa.Engine
    relay_url: str
    app_url: str
    engines: list[sa.Engine] = field(default_factory=list)

    def engine(self, url: str) -> sa.Engine:
        engine = sa.create_engine(url, pool_pre_ping=True)
        self.engines.append(engine)
        return engine


@pytest.fixture
def roles(server_backend) -> Iterator[Roles]:
    """The relay and app roles created by the grant script (run twice: it must be re-runnable),
    dropped again when the test ends."""
    admin = server_backend.engine
    url = sa.make_url(server_backend.url)
    drop_roles(admin)  # left over from an interrupted run
    apply = apply_postgresql if admin.dialect.name == "postgresql" else apply_mariadb
    created = Roles(
        admin=admin,
        relay_url=url.set(username=RELAY_ROLE, password=PASSWORD[RELAY_ROLE]).render_as_string(
            hide_password=False
        ),
        app_url=url.set(username=APP_ROLE, password=PASSWORD[APP_ROLE]).render_as_string(
            hide_password=False
        ),
    )
    try:
        apply(url)
        apply(url)
        assert role_names(admin) == {RELAY_ROLE, APP_ROLE}
        yield created
    finally:
        for engine in created.engines:
            engine.dispose()
        drop_roles(admin)
    assert role_names(admin) == set()


def permission_denied(engine: sa.Engine, statement: str) -> None:
    """``statement`` is refused for lack of a privilege (not for any other reason)."""
    with pytest.raises(sa.exc.DBAPIError) as caught, engine.begin() as conn:
        conn.exec_driver_sql(statement)
    error = caught.value.orig
    if engine.dialect.name == "postgresql":
        assert getattr(error, "sqlstate", None) == "42501", (statement, error)
    else:
        # 1142: command denied for table; 1044: access denied to the database
        assert error.args[0] in (1142, 1044), (statement, error)


def enqueue_as(engine: sa.Engine, keys: list[str]) -> list[tuple[int, bool]]:
    """Enqueue one email per key in one transaction; (id, duplicate) for each."""
    ob, Sessions = Outbox(), sessionmaker(engine)
    with Sessions.begin() as session:
        return [
            (r.id, r.duplicate)
            for r in (ob.enqueue(session, email(n), key=key) for n, key in enumerate(keys))
        ]


def start_relay(url: str, tmp_path: Path, *args: str, **env: str) -> subprocess.Popen[bytes]:
    """``outbox-relay run`` with the fake sender, connected with ``url``; output to relay.log."""
    with (tmp_path / "relay.log").open("wb") as out:
        return subprocess.Popen(
            [RELAY, "run", "--sender", FAKE_SENDER, "--relay-id", "grants-relay", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=clean_env(
                OUTBOX_DATABASE_URL=url,
                OUTBOX_FAKE_RECORD_FILE=str(tmp_path / "sent.log"),
                **env,
            ),
        )


def finish(proc: subprocess.Popen[bytes], tmp_path: Path, timeout: float) -> str:
    """Wait for the relay to exit 0 with no database or permission error; its output."""
    try:
        returncode = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        returncode = None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    output = (tmp_path / "relay.log").read_text(errors="replace")
    assert returncode == 0, f"exit {returncode}; the relay's log:\n{output[-4000:]}"
    for trouble in ("db_error", "listen_error", "metrics_lag_error", "denied", "Traceback"):
        assert trouble not in output, output[-4000:]
    return output


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def http_get(url: str) -> tuple[int, str] | None:
    """(status, body), or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return None


def test_the_app_role_enqueues_new_and_duplicate_keys_and_nothing_more(server_backend, roles):
    app = roles.engine(roles.app_url)
    (first, again, other) = enqueue_as(app, ["grants:1", "grants:1", "grants:2"])
    assert not first[1]
    assert again == (first[0], True)  # same transaction: the savepoint hid the duplicate
    assert not other[1]
    assert enqueue_as(app, ["grants:2"]) == [(other[0], True)]  # committed row, new transaction

    rows = message_rows(server_backend.engine)
    assert sorted(rows) == sorted([first[0], other[0]])
    assert {row.status for row in rows.values()} == {"pending"}

    # the app cannot deliver, edit, delete, or read what the relay records
    permission_denied(app, "UPDATE outbox_messages SET status = 'sent'")
    permission_denied(app, "DELETE FROM outbox_messages")
    permission_denied(app, "SELECT COUNT(*) FROM outbox_attempts")
    permission_denied(app, "SELECT COUNT(*) FROM outbox_relays")
    permission_denied(app, "SELECT * FROM outbox_status_summary")
    permission_denied(app, "CREATE TABLE outbox_h8_probe (id INTEGER)")
    assert set(message_rows(server_backend.engine)) == {first[0], other[0]}


def test_a_relay_process_under_the_relay_role_delivers_sweeps_and_expires(
    server_backend, roles, tmp_path
):
    admin = server_backend.engine
    app = roles.engine(roles.app_url)
    keys = [f"grants:{n}" for n in range(20)]
    ids = [id_ for id_, duplicate in enqueue_as(app, keys) if not duplicate]
    assert len(ids) == 20
    hung_sent, hung_unsent, stale = ids[0], ids[1], ids[2]
    now = datetime.now(UTC)
    with admin.begin() as conn:
        # a relay died mid-send (lease expired, send started): must end unknown_outcome
        # a relay died before sending (lease expired, never started): must be sent now
        for message_id, started in ((hung_sent, now - timedelta(minutes=6)), (hung_unsent, None)):
            conn.execute(
                sa.update(messages)
                .where(messages.c.id == message_id)
                .values(
                    status="processing",
                    claim_token=str(uuid.uuid4()),
                    claimed_by="dead-relay",
                    claimed_at=now - timedelta(minutes=6),
                    lease_expires_at=now - timedelta(minutes=1),
                    send_started_at=started,
                )
            )
        # not due for an hour, and already past its expiry: the expire scan moves it
        conn.execute(
            sa.update(messages)
            .where(messages.c.id == stale)
            .values(next_attempt_at=now + timedelta(hours=1), expires_at=now - timedelta(minutes=1))
        )
        # the relay's own row from a previous life, long dead: register takes it over (UPDATE)
        conn.execute(
            sa.insert(relays).values(
                relay_id="grants-relay",
                host="old-host",
                pid=1,
                started_at=now - timedelta(days=1),
                heartbeat_at=now - timedelta(days=1),
                state="running",
            )
        )

    proc = start_relay(
        roles.relay_url,
        tmp_path,
        "--exit-when-idle",
        # short lease: heartbeats run every second; a rate of 10/s books every send in the
        # shared budget and makes the run last long enough to see them
        "--send-timeout",
        "1",
        "--lease-seconds",
        "4",
        "--drain-seconds",
        "2",
        "--max-send-rate",
        "10",
        "--poll-interval",
        "0.2",
    )
    finish(proc, tmp_path, 60)

    expected = set(ids) - {hung_sent, stale}
    sends = Counter(r.message_id for r in read_records(tmp_path / "sent.log"))
    assert set(sends) == expected
    assert set(sends.values()) == {1}

    rows = message_rows(admin)
    assert rows[hung_sent].status == "unknown_outcome"
    assert rows[hung_sent].claimed_by == "dead-relay"
    assert rows[stale].status == "expired"
    assert {rows[i].status for i in expected} == {"sent"}
    assert all(rows[i].claimed_by == "grants-relay" for i in expected)

    tries = attempt_rows(admin)
    swept = [a for a in tries if a.outcome == "lease_expired"]
    assert [(a.message_id, a.relay_id) for a in swept] == [(hung_sent, "dead-relay")]
    assert Counter(a.message_id for a in tries if a.outcome == "accepted") == Counter(expected)

    me = relay_rows(admin)["grants-relay"]
    assert me.state == "stopped"
    assert me.host != "old-host"
    assert me.started_at > now - timedelta(minutes=5)
    assert me.heartbeat_at > me.started_at  # heartbeats and the final stop were written


def test_the_relay_role_cannot_change_the_schema_or_delete_messages(server_backend, roles):
    enqueue_as(roles.engine(roles.app_url), ["grants:1"])
    relay = roles.engine(roles.relay_url)
    with relay.connect() as conn:  # what it may read: its tables and the operator views
        for view in VIEWS:
            conn.execute(sa.select(sa.text("*")).select_from(sa.table(view))).all()
        assert conn.execute(sa.select(sa.func.count()).select_from(messages)).scalar_one() == 1
        conn.execute(sa.select(sa.func.count()).select_from(attempts)).scalar_one()

    for statement in (
        "CREATE TABLE outbox_h8_probe (id INTEGER)",
        "CREATE INDEX ix_h8_probe ON outbox_messages (category)",
        "ALTER TABLE outbox_messages ADD COLUMN h8_probe INTEGER",
        "DROP TABLE outbox_attempts",
        "DROP VIEW outbox_lag",
        "TRUNCATE TABLE outbox_attempts",
        "DELETE FROM outbox_messages",
        "DELETE FROM outbox_attempts",
        "UPDATE outbox_attempts SET outcome = 'accepted'",
        "INSERT INTO outbox_messages (idempotency_key) VALUES ('forged')",
    ):
        permission_denied(relay, statement)

    assert len(message_rows(server_backend.engine)) == 1
    assert sa.inspect(server_backend.engine).get_table_names().count("outbox_h8_probe") == 0


def test_health_readiness_and_metrics_work_under_the_relay_role(server_backend, roles, tmp_path):
    """/readyz reads the database and /metrics the outbox_lag view, as the relay role.

    Needs ``outbox-relay run --http-port`` (OUTBOX_HTTP_PORT)."""
    enqueue_as(roles.engine(roles.app_url), ["grants:1"])
    base = f"http://127.0.0.1:{free_port()}"
    proc = start_relay(
        roles.relay_url, tmp_path, "--poll-interval", "0.2", OUTBOX_HTTP_PORT=base.rsplit(":", 1)[1]
    )
    try:
        ready = wait_for(
            lambda: (http_get(f"{base}/readyz") or (0, ""))[0] == 200 or proc.poll() is not None,
            timeout=30,
            what="/readyz to answer 200",
        )
        assert ready
        assert proc.poll() is None, (tmp_path / "relay.log").read_text()[-4000:]
        wait_for(lambda: read_records(tmp_path / "sent.log"), timeout=30, what="the delivery")
        assert (http_get(f"{base}/healthz") or (0, ""))[0] == 200
        metrics = http_get(f"{base}/metrics")
        assert metrics is not None
        assert metrics[0] == 200
        assert "outbox_lag_refresh_errors_total 0.0" in metrics[1], metrics[1]
        proc.send_signal(signal.SIGTERM)
        finish(proc, tmp_path, 30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert relay_rows(server_backend.engine)["grants-relay"].state == "stopped"
    assert [r.key for r in read_records(tmp_path / "sent.log")] == ["grants:1"]


def operator(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [RELAY, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(OUTBOX_DATABASE_URL=url),
        stdin=subprocess.DEVNULL,
        check=False,
    )


def test_operators_use_the_relay_role_except_for_prune_which_needs_the_owner(server_backend, roles):
    admin = server_backend.engine
    done, unknown, waiting = (
        i for i, _ in enqueue_as(roles.engine(roles.app_url), ["a", "b", "c"])
    )
    long_ago = datetime.now(UTC) - timedelta(days=2)
    with admin.begin() as conn:
        for message_id, status in ((done, "sent"), (unknown, "unknown_outcome")):
            conn.execute(
                sa.update(messages)
                .where(messages.c.id == message_id)
                .values(status=status, attempt_count=1, created_at=long_ago, updated_at=long_ago)
            )
        conn.execute(
            sa.insert(attempts).values(
                message_id=done, finished_at=long_ago, outcome="accepted", relay_id="old"
            )
        )

    for args in (("status",), ("list",), ("show", str(done))):
        answer = operator(roles.relay_url, *args)
        assert answer.returncode == 0, (args, answer.stdout, answer.stderr)
    requeued = operator(roles.relay_url, "requeue", str(unknown), "--reason", "checked in SES")
    assert requeued.returncode == 0, requeued.stderr
    cancelled = operator(roles.relay_url, "cancel", str(waiting))
    assert cancelled.returncode == 0, cancelled.stderr
    rows = message_rows(admin)
    assert (rows[unknown].status, rows[waiting].status) == ("pending", "cancelled")

    prune = ("prune", "--older-than", "1h", "--dedup-window", "1h")
    refused = operator(roles.relay_url, *prune)
    assert refused.returncode != 0
    assert "denied" in refused.stdout + refused.stderr, refused.stderr[-2000:]
    assert done in message_rows(admin)

    pruned = operator(server_backend.url, *prune)  # the owner: what `migrate` runs as
    assert pruned.returncode == 0, pruned.stderr
    assert set(message_rows(admin)) == {unknown, waiting}
    assert done not in {a.message_id for a in attempt_rows(admin)}
