"""The least-privilege grant scripts of examples/deploy, applied as a user applies them: psql
with ``-v`` variables on PostgreSQL, the MariaDB script with its ``${NAME}`` placeholders filled
in (what envsubst does) and piped into the mariadb client.

Under those roles the app enqueues (new and duplicate keys), a real ``outbox-relay run`` process
delivers a backlog, sweeps expired leases and expires stale rows, and neither role can change
the schema or delete a message. The roles are dropped when each test ends.
"""

from __future__ import annotations

import base64
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
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

from outbox import Outbox
from outbox.schema import (
    DeliveryStatus,
    EventType,
    attempts,
    events,
    intakes,
    messages,
    operator_actions,
    relays,
    suppressions,
)
from relay.events import SesEvent
from relay.intake import Effect, apply_deferred, apply_events, record_intake
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
# Unique per run: roles are cluster-wide on PostgreSQL and server-wide on MariaDB, and another
# run of this module may be using the same server.
_RUN = uuid.uuid4().hex[:8]
RELAY_ROLE, APP_ROLE = f"outbox_relay_t{_RUN}", f"outbox_app_t{_RUN}"
OPERATOR_ROLE = f"outbox_operator_t{_RUN}"
INJECTED = f"outbox_injected_t{_RUN}"  # what a password spliced into SQL would create
ROLES = (RELAY_ROLE, APP_ROLE, OPERATOR_ROLE)
# a quote, a backslash and a semicolon in each, and SQL after the quote: a script that pastes
# a password into a string literal creates the user INJECTED and sets another password
PASSWORD = {
    role: f"{role[7:10]}\\pw'; CREATE USER IF NOT EXISTS '{INJECTED}'@'%' IDENTIFIED BY 'x'; -- "
    for role in ROLES
}
VIEWS = (
    "outbox_status_summary",
    "outbox_lag",
    "outbox_unknown_outcomes",
    "outbox_failures",
    "outbox_relay_health",
)
MARIADB_PLACEHOLDERS = {
    "RELAY_USER",
    "APP_USER",
    "OPERATOR_USER",
    "DB_NAME",
    "CLIENT_HOST",
    "RELAY_PASSWORD_B64",
    "APP_PASSWORD_B64",
    "OPERATOR_PASSWORD_B64",
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
    variables = {
        "relay_role": RELAY_ROLE,
        "relay_password": PASSWORD[RELAY_ROLE],
        "app_role": APP_ROLE,
        "app_password": PASSWORD[APP_ROLE],
        "operator_role": OPERATOR_ROLE,
        "operator_password": PASSWORD[OPERATOR_ROLE],
    }
    command = ["psql", conninfo, "-X", "-q", "-v", "ON_ERROR_STOP=1"]
    for name, value in variables.items():
        command += ["-v", f"{name}={value}"]
    run_client([*command, "-f", str(DEPLOY / "grants-postgresql.sql")])


def base64_of(text: str) -> str:
    """What ``printf %s "$PASSWORD" | base64 -w0`` prints."""
    return base64.b64encode(text.encode()).decode()


def render_mariadb(database: str) -> str:
    """The MariaDB script with its placeholders filled in, as envsubst fills them."""
    text = (DEPLOY / "grants-mariadb.sql").read_text()
    template = string.Template(text)
    assert template.is_valid()
    values = {
        "RELAY_USER": RELAY_ROLE,
        "APP_USER": APP_ROLE,
        "OPERATOR_USER": OPERATOR_ROLE,
        "DB_NAME": database,
        "CLIENT_HOST": "%",
        **{f"{name}_PASSWORD_B64": base64_of(PASSWORD[role]) for name, role in _NAMED},
        # an older script's placeholders: the password pasted as it is
        **{f"{name}_PASSWORD": PASSWORD[role] for name, role in _NAMED},
    }
    names = set(template.get_identifiers())
    assert names <= set(values), names - set(values)
    # every "$" in the file is one of its placeholders, so envsubst (which also replaces $NAME)
    # touches nothing else
    assert text.count("$") == sum(text.count("${" + name + "}") for name in names)
    return template.substitute(values)


_NAMED = (("RELAY", RELAY_ROLE), ("APP", APP_ROLE), ("OPERATOR", OPERATOR_ROLE))


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
            for role in (*ROLES, INJECTED):
                found = conn.execute(
                    sa.text("SELECT 1 FROM pg_roles WHERE rolname = :role"), {"role": role}
                ).scalar()
                if found:
                    conn.exec_driver_sql(f'DROP OWNED BY "{role}"')
                    conn.exec_driver_sql(f'DROP ROLE "{role}"')
        else:
            for role in (*ROLES, INJECTED):
                conn.exec_driver_sql(f"DROP USER IF EXISTS '{role}'@'%%'")  # %% for pymysql


def role_names(admin: sa.Engine) -> set[str]:
    """Which of the roles (and the injected one) exist."""
    if admin.dialect.name == "postgresql":
        query = sa.text("SELECT rolname FROM pg_roles WHERE rolname IN :names")
    else:
        query = sa.text("SELECT user FROM mysql.user WHERE user IN :names")
    query = query.bindparams(sa.bindparam("names", expanding=True))
    with admin.connect() as conn:
        return set(conn.execute(query, {"names": [*ROLES, INJECTED]}).scalars())


@dataclass
class Roles:
    admin: sa.Engine
    relay_url: str
    app_url: str
    operator_url: str
    engines: list[sa.Engine] = field(default_factory=list)

    def engine(self, url: str) -> sa.Engine:
        engine = sa.create_engine(url, pool_pre_ping=True)
        self.engines.append(engine)
        return engine


def apply(server_url: str) -> None:
    """The backend's grant script, run as its README says."""
    url = sa.make_url(server_url)
    (apply_postgresql if url.get_backend_name() == "postgresql" else apply_mariadb)(url)


@pytest.fixture
def roles(server_backend) -> Iterator[Roles]:
    """The relay, app and operator roles created by the grant script (run twice: it must be
    re-runnable), dropped again when the test ends."""
    admin = server_backend.engine
    url = sa.make_url(server_backend.url)
    drop_roles(admin)  # left over from an interrupted run

    def url_of(role: str) -> str:
        return url.set(username=role, password=PASSWORD[role]).render_as_string(hide_password=False)

    created = Roles(
        admin=admin,
        relay_url=url_of(RELAY_ROLE),
        app_url=url_of(APP_ROLE),
        operator_url=url_of(OPERATOR_ROLE),
    )
    try:
        apply(server_backend.url)
        apply(server_backend.url)
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
        # 1142: command denied for table; 1143: for a column; 1044: to the database
        assert error.args[0] in (1142, 1143, 1044), (statement, error)


def enqueue_as(
    engine: sa.Engine, keys: list[str], *, fairness_key: str | None = None
) -> list[tuple[int, bool]]:
    """Enqueue one email per key in one transaction; (id, duplicate) for each."""
    ob, Sessions = Outbox(), sessionmaker(engine)
    with Sessions.begin() as session:
        return [
            (r.id, r.duplicate)
            for r in (
                ob.enqueue(session, email(n), key=key, fairness_key=fairness_key)
                for n, key in enumerate(keys)
            )
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
    # nor read what it enqueued (bodies, recipients), nor write a claim or a result; it reads
    # the status, key and turn of queued rows only to place a keyed row's turn
    for column in ("payload", "recipients", "subject", "provider_message_id"):
        permission_denied(app, f"SELECT {column} FROM outbox_messages")
    permission_denied(app, "SELECT COUNT(*) FROM outbox_suppressions")
    permission_denied(app, "INSERT INTO outbox_messages (claim_token) VALUES ('forged')")
    permission_denied(app, "INSERT INTO outbox_messages (sent_at) VALUES (NULL)")
    assert set(message_rows(server_backend.engine)) == {first[0], other[0]}


def test_a_relay_process_under_the_relay_role_delivers_sweeps_and_expires(
    server_backend, roles, tmp_path
):
    admin = server_backend.engine
    app = roles.engine(roles.app_url)
    keys = [f"grants:{n}" for n in range(20)]
    ids = [id_ for id_, duplicate in enqueue_as(app, keys) if not duplicate]
    # keyed mail: the app reads its key's turns; the relay books and counts the key's limits
    ids += [id_ for id_, _ in enqueue_as(app, ["grants:t1", "grants:t2"], fairness_key="t")]
    assert len(ids) == 22
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
        "--key-limit",
        "t=1/s,inflight:1",
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
        # what a message says, who gets it and how it is retried are the app's
        "UPDATE outbox_messages SET recipients = 'someone@example.org'",
        "UPDATE outbox_messages SET payload = '{}'",
        "UPDATE outbox_messages SET subject = 'forged'",
        "UPDATE outbox_messages SET idempotency_key = 'forged'",
        "UPDATE outbox_messages SET category = 'forged'",
        "UPDATE outbox_messages SET max_attempts = 1000",
        "UPDATE outbox_messages SET expires_at = NULL",
        # suppressions are only added by the relay; operators remove them
        "DELETE FROM outbox_suppressions",
        "UPDATE outbox_suppressions SET reason = 'manual'",
        # the operators' log and the events' record are not the relay's to rewrite
        "INSERT INTO outbox_operator_actions (at, actor, action) VALUES "
        "('2020-01-01', 'relay', 'requeue')",
        "UPDATE outbox_events SET event_type = 'send'",
        "DELETE FROM outbox_events",
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


def test_operators_have_a_role_of_their_own_and_prune_needs_the_owner(server_backend, roles):
    admin = server_backend.engine
    done, unknown, waiting, held = (
        i for i, _ in enqueue_as(roles.engine(roles.app_url), ["a", "b", "c", "d"])
    )
    long_ago = datetime.now(UTC) - timedelta(days=2)
    with admin.begin() as conn:
        for message_id, status in ((done, "sent"), (unknown, "unknown_outcome"), (held, "failed")):
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

    # the relay role no longer runs operators' changes
    for args in (
        ("requeue", str(unknown), "--reason", "checked in SES"),
        ("suppressions", "add", "bounced@example.com", "--reason", "asked"),
    ):
        refused = operator(roles.relay_url, *args)
        assert refused.returncode != 0, (args, refused.stdout)
        assert "denied" in refused.stdout + refused.stderr, refused.stderr[-2000:]

    url = roles.operator_url
    for args in (("status",), ("list",), ("show", str(done)), ("suppressions", "list")):
        answer = operator(url, *args)
        assert answer.returncode == 0, (args, answer.stdout, answer.stderr)
    for args in (
        ("requeue", str(unknown), "--reason", "checked in SES"),
        ("cancel", str(waiting)),
        ("resolve", str(held), "--delivered", "--reason", "the customer has it"),
        ("suppressions", "add", "bounced@example.com", "--reason", "asked"),
        ("suppressions", "remove", "bounced@example.com", "--reason", "asked again"),
        ("suppressions", "add", "gone@example.com", "--reason", "asked"),
    ):
        answer = operator(url, *args)
        assert answer.returncode == 0, (args, answer.stdout, answer.stderr)
    rows = message_rows(admin)
    assert (rows[unknown].status, rows[waiting].status, rows[held].status) == (
        "pending",
        "cancelled",
        "sent",
    )
    with admin.connect() as conn:
        listed = conn.execute(sa.select(suppressions.c.address)).scalars().all()
        logged = conn.execute(sa.select(operator_actions.c.action)).scalars().all()
    assert listed == ["gone@example.com"]
    assert len(logged) == 6

    # operators cannot rewrite a message, the log, or the record of attempts and events
    operator_engine = roles.engine(url)
    for statement in (
        "UPDATE outbox_messages SET recipients = 'someone@example.org'",
        "UPDATE outbox_messages SET payload = '{}'",
        "UPDATE outbox_messages SET claimed_by = 'forged'",
        "UPDATE outbox_operator_actions SET actor = 'someone else'",
        "DELETE FROM outbox_operator_actions",
        "UPDATE outbox_attempts SET outcome = 'accepted'",
        "DELETE FROM outbox_attempts",
        "DELETE FROM outbox_events",
        "DELETE FROM outbox_messages",
        "DROP TABLE outbox_attempts",
    ):
        permission_denied(operator_engine, statement)

    prune = ("prune", "--older-than", "1h", "--dedup-window", "1h")
    for role_url in (roles.relay_url, url):
        refused = operator(role_url, *prune)
        assert refused.returncode != 0
        assert "denied" in refused.stdout + refused.stderr, refused.stderr[-2000:]
    assert done in message_rows(admin)

    pruned = operator(server_backend.url, *prune)  # the owner: what `migrate` runs as
    assert pruned.returncode == 0, pruned.stderr
    assert done not in message_rows(admin)
    assert done not in {a.message_id for a in attempt_rows(admin)}


def ses_event(n: int, kind: EventType, provider_id: str, **fields: Any) -> SesEvent:
    """An SES event of ``kind`` about the send SES called ``provider_id``."""
    at = datetime.now(UTC) - timedelta(seconds=5)
    values: dict[str, Any] = {
        "key": f"{_RUN}-{n}",
        "source": "raw",
        "type": kind,
        "event_at": at,
        "mail_at": at,
        "provider_message_id": provider_id,
        "tagged_message_id": None,
        "claim_token": None,
        "detail": None,
        "recipients": (),
        "suppress": (),
        "delivery_status": None,
        "error": None,
    }
    return SesEvent(**{**values, **fields})


def test_the_event_intake_records_and_applies_events_under_the_relay_role(server_backend, roles):
    """What ``outbox-relay events`` writes, on a connection as the relay role: its intake
    row, events (new, duplicate, deferred and applied later), a resolved row and its attempt,
    a raised delivery status, and the suppression of a bounced recipient."""
    admin = server_backend.engine
    ids = [i for i, _ in enqueue_as(roles.engine(roles.app_url), ["e:1", "e:2", "e:3"])]
    unknown, sent, sending = ids
    now = datetime.now(UTC)
    with admin.begin() as conn:
        for message_id, status in (
            (unknown, "unknown_outcome"),
            (sent, "sent"),
            (sending, "processing"),
        ):
            conn.execute(
                sa.update(messages)
                .where(messages.c.id == message_id)
                .values(
                    status=status,
                    provider_message_id=f"ses-{message_id}",
                    send_started_at=now - timedelta(minutes=1),
                    claim_token=str(uuid.uuid4()) if status == "processing" else None,
                    lease_expires_at=now + timedelta(minutes=5) if status == "processing" else None,
                )
            )
    delivered = ses_event(
        1, EventType.DELIVERY, f"ses-{unknown}", delivery_status=DeliveryStatus.DELIVERED
    )
    bounced = ses_event(
        2,
        EventType.BOUNCE,
        f"ses-{sent}",
        detail="Permanent/General",
        recipients=(f"customer{1}@example.com",),
        suppress=("customer1@example.com",),
        delivery_status=DeliveryStatus.BOUNCED,
    )
    early = ses_event(
        3, EventType.DELIVERY, f"ses-{sending}", delivery_status=DeliveryStatus.DELIVERED
    )

    relay = roles.engine(roles.relay_url)
    with relay.begin() as conn:
        for caught_up in (False, True):  # the row inserted, then updated
            record_intake(
                conn,
                intake_id=f"intake-{_RUN}",
                queue_url="https://sqs.example/q",
                visibility_timeout=30.0,
                started_at=now,
                now=now,
                caught_up=caught_up,
            )
    with relay.begin() as conn:
        applied = apply_events(conn, [delivered, bounced, early, delivered], now=now)
    assert [a.effect for a in applied] == [
        Effect.RESOLVED,
        Effect.STATUS,
        Effect.DEFERRED,
        Effect.DUPLICATE,
    ]
    assert applied[1].suppressed == ("customer1@example.com",)
    with admin.begin() as conn:  # its relay saved the send: the deferred event applies now
        conn.execute(
            sa.update(messages)
            .where(messages.c.id == sending)
            .values(status="sent", claim_token=None, lease_expires_at=None)
        )
    with relay.begin() as conn:
        later = apply_deferred(conn, now=now)
    assert [(a.message_id, a.effect) for a in later] == [(sending, Effect.STATUS)]

    rows = message_rows(admin)
    assert rows[unknown].status == "sent"
    assert (rows[sent].delivery_status, rows[sending].delivery_status) == ("bounced", "delivered")
    assert [a.outcome for a in attempt_rows(admin)] == ["reconciled"]
    with admin.connect() as conn:
        assert conn.execute(sa.select(suppressions.c.address)).scalars().all() == [
            "customer1@example.com"
        ]
        assert conn.execute(sa.select(intakes.c.caught_up_at)).scalar_one() is not None
        effects = conn.execute(sa.select(events.c.effect).order_by(events.c.id)).scalars().all()
    assert effects == ["resolved", "status", "status"]


def test_a_password_with_a_quote_a_backslash_and_a_semicolon_is_a_value_not_sql(
    server_backend, roles
):
    """Each role logs in with its password, which holds a quote, a backslash, a semicolon
    and SQL after the quote; nothing that SQL says was run."""
    assert all(("'" in p and "\\" in p and ";" in p) for p in PASSWORD.values())
    for url in (roles.relay_url, roles.app_url, roles.operator_url):
        with roles.engine(url).connect() as conn:
            assert conn.exec_driver_sql("SELECT 1").scalar_one() == 1
    assert role_names(server_backend.engine) == set(ROLES)  # and not INJECTED


# PostgreSQL only: on MariaDB the script says to revoke first (its REVOKE has no IF EXISTS)
@pytest.mark.parametrize("server_backend", ["postgresql"], indirect=True)
def test_running_the_script_again_takes_back_what_an_older_grant_gave(server_backend, roles):
    """A relay role with every privilege on the outbox tables (as an older script, or a hand,
    gave it) has exactly the script's grants once the script ran again."""
    admin = server_backend.engine
    with admin.begin() as conn:
        conn.exec_driver_sql(f'GRANT ALL ON outbox_messages, outbox_suppressions TO "{RELAY_ROLE}"')
    relay = roles.engine(roles.relay_url)
    with relay.begin() as conn:
        conn.exec_driver_sql("UPDATE outbox_messages SET subject = 'before'")
    apply(server_backend.url)
    permission_denied(relay, "UPDATE outbox_messages SET subject = 'after'")
    permission_denied(relay, "DELETE FROM outbox_suppressions")
    with relay.begin() as conn:
        conn.exec_driver_sql("UPDATE outbox_messages SET updated_at = updated_at")
