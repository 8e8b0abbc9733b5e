"""``outbox-relay doctor`` and ``outbox-relay send-test`` as an operator runs them: real
processes against moto's server (SES v1 and v2, SNS, SQS) and the test databases.

moto answers neither SES v2 ``GetAccount`` nor ``GetConfigurationSetEventDestinations``: the
account line is then "could not check", and the event destinations are read through SES v1
(``DescribeConfigurationSet``), which the line says. moto also reports every configuration
set's sending as disabled (it stores the ``SendingOptions`` dict where a bool belongs), so
:func:`configuration_set` sets moto's own flag the way SES keeps it.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests.support.factories import enqueue
from tests.support.relays import RELAY, clean_env, kill_all, relay_rows, spawn
from tests.support.ses import IDENTITY, REGION, FaultPlan, FaultServer, MotoSes, aws_env
from tests.support.ses_events import EventQueue
from tests.support.waiting import wait_for

CONFIG_SET = "outbox-events"
SIMULATOR = "success@simulator.amazonses.com"


def env_for(moto_url: str, *, region: str = REGION, ses_url: str | None = None) -> dict[str, str]:
    """The environment of a process that reaches moto (SES v2 through ``ses_url`` when given)
    as its AWS, in ``region``, and nothing of the test's own."""
    env = {k: v for k, v in clean_env().items() if not k.startswith("AWS_")}
    env.update(aws_env(ses_url or moto_url, region=region, events_url=moto_url))
    env["AWS_ENDPOINT_URL_SES"] = moto_url  # SES v1, where moto lacks the v2 call
    return env


def outbox_relay(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [RELAY, *args],
        capture_output=True,
        text=True,
        timeout=90,
        env=env,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def lines(done: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """``{check: status}`` of doctor's report."""
    found = {}
    for line in done.stdout.splitlines():
        status, rest = line.split(None, 1)
        found[rest.split(":", 1)[0]] = status
    return found


def line_of(done: subprocess.CompletedProcess[str], check: str) -> str:
    [line] = [x for x in done.stdout.splitlines() if x.split(None, 1)[-1].startswith(check)]
    return line


def configuration_set(moto: MotoSes, topic_arn: str | None) -> None:
    """``CONFIG_SET`` in moto, sending enabled, with an SNS event destination to
    ``topic_arn`` (none when None)."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.ses.models import ses_backends

    moto.client("sesv2").create_configuration_set(ConfigurationSetName=CONFIG_SET)
    ses_backends[DEFAULT_ACCOUNT_ID][REGION].config_sets[CONFIG_SET].enabled = True
    if topic_arn is not None:
        moto.client("ses").create_configuration_set_event_destination(
            ConfigurationSetName=CONFIG_SET,
            EventDestination={
                "Name": "to-the-relay",
                "Enabled": True,
                "MatchingEventTypes": ["send", "delivery", "bounce", "complaint", "reject"],
                "SNSDestination": {"TopicARN": topic_arn},
            },
        )


def doctor(url: str, queue: EventQueue, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return outbox_relay(
        "doctor",
        "--database-url",
        url,
        "--ses-configuration-set",
        CONFIG_SET,
        "--events-queue-url",
        queue.url,
        *args,
        env={**env_for(queue.endpoint_url), **env},
    )


def test_everything_right_is_no_failure_and_exit_0(server_backend, moto, event_queue):
    configuration_set(moto, event_queue.topic_arn)
    enqueue(server_backend.engine, 1)  # from Shop <shop@example.com>: found in the outbox
    done = doctor(server_backend.url, event_queue, "--events-topic-arn", event_queue.topic_arn)
    assert done.returncode == 0, done.stdout + done.stderr
    found = lines(done)
    for check in (
        "database",
        "grants",
        "ses region",
        f"ses configuration set {CONFIG_SET}",
        "ses event destination",
        "events queue",
    ):
        assert found[check] == "ok", line_of(done, check)
    # moto verifies without DKIM, and does not answer GetAccount: said, not faked
    assert found[f"ses identity {IDENTITY}"] == "warn"
    assert "verified in us-east-1" in line_of(done, f"ses identity {IDENTITY}")
    assert "DKIM NOT_STARTED" in line_of(done, f"ses identity {IDENTITY}")
    assert "could not check" in line_of(done, "ses account")
    assert "read through SES v1" in line_of(done, "ses event destination")
    assert "fail" not in found.values()


def test_a_wrong_region_fails_each_identity_naming_the_region_and_the_fix(
    postgres_backend, moto, event_queue
):
    configuration_set(moto, event_queue.topic_arn)
    done = outbox_relay(
        "doctor",
        "--database-url",
        postgres_backend.url,
        "--from",
        IDENTITY,
        env=env_for(moto.url, region="eu-west-1"),
    )
    assert done.returncode == 1, done.stdout + done.stderr
    line = line_of(done, f"ses identity {IDENTITY}")
    assert line.startswith("fail"), line
    assert "not verified for sending in eu-west-1" in line
    assert "region from AWS_DEFAULT_REGION" in line
    assert "set AWS_REGION and AWS_DEFAULT_REGION to the region where it is verified" in line


def test_an_unverified_identity_in_the_outbox_fails_naming_it(postgres_backend, moto, event_queue):
    configuration_set(moto, event_queue.topic_arn)
    enqueue(postgres_backend.engine, 1, sender="Billing <billing@unverified.example>")
    done = doctor(postgres_backend.url, event_queue)
    assert done.returncode == 1, done.stdout + done.stderr
    line = line_of(done, "ses identity billing@unverified.example")
    assert line.startswith("fail"), line
    assert "neither it nor its domain is an identity" in line
    assert "create-email-identity --email-identity unverified.example" in line
    assert lines(done)[f"ses configuration set {CONFIG_SET}"] == "ok"


def test_a_configuration_set_without_an_event_destination_fails(
    postgres_backend, moto, event_queue
):
    configuration_set(moto, None)
    done = doctor(postgres_backend.url, event_queue, "--from", IDENTITY)
    assert done.returncode == 1, done.stdout + done.stderr
    line = line_of(done, "ses event destination")
    assert line.startswith("fail"), line
    assert f"{CONFIG_SET} has no enabled event destination" in line
    assert "add an SNS event destination" in line


def test_a_queue_not_subscribed_to_the_destinations_topic_fails(
    postgres_backend, moto, event_queue
):
    other = moto.client("sns").create_topic(Name="somebody-elses-topic")["TopicArn"]
    configuration_set(moto, other)
    done = doctor(postgres_backend.url, event_queue, "--from", IDENTITY)
    assert done.returncode == 1, done.stdout + done.stderr
    line = line_of(done, "ses event destination")
    assert line.startswith("fail"), line
    assert f"{other}: the queue is not subscribed to it" in line
    assert f"--notification-endpoint {event_queue.arn}" in line


def test_a_missing_configuration_set_and_queue_fail(postgres_backend, moto):
    done = outbox_relay(
        "doctor",
        "--database-url",
        postgres_backend.url,
        "--from",
        IDENTITY,
        "--ses-configuration-set",
        "no-such-set",
        "--events-queue-url",
        f"{moto.url}/123456789012/no-such-queue",
        env=env_for(moto.url),
    )
    assert done.returncode == 1
    found = lines(done)
    assert found["ses configuration set no-such-set"] == "fail"
    assert found["events queue"] == "fail"
    assert "does not exist in us-east-1" in line_of(done, "ses configuration set")


def test_json_is_a_list_of_check_status_found_fix(postgres_backend, moto, event_queue):
    configuration_set(moto, event_queue.topic_arn)
    done = doctor(postgres_backend.url, event_queue, "--from", IDENTITY, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert isinstance(report, list)
    assert all(set(item) == {"check", "status", "found", "fix"} for item in report)
    assert {item["status"] for item in report} <= {"ok", "warn"}
    assert all(item["fix"] is None for item in report if item["status"] == "ok")
    assert [item["check"] for item in report][:3] == ["database", "grants", "ses region"]


def test_an_unreachable_database_and_smtp_server_fail_without_a_traceback(tmp_path: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    done = outbox_relay(
        "doctor",
        "--database-url",
        f"postgresql+psycopg://nobody@127.0.0.1:{port}/nothing",
        "--sender",
        "smtp",
        "--smtp-host",
        "127.0.0.1",
        "--smtp-port",
        str(port),
        "--smtp-timeout",
        "2",
        env=clean_env(),
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert line_of(done, "database").startswith("fail  database: cannot connect to")
    assert line_of(done, "smtp server").startswith("fail  smtp server: 127.0.0.1:")


def test_grants_are_na_on_sqlite(tmp_path: Path, moto):
    url = f"sqlite:///{tmp_path / 'outbox.db'}"
    assert outbox_relay("migrate", "--database-url", url, env=clean_env()).returncode == 0
    done = outbox_relay("doctor", "--database-url", url, "--from", IDENTITY, env=env_for(moto.url))
    assert line_of(done, "grants") == "ok    grants: n/a: SQLite has no roles"


def test_a_role_that_can_read_but_not_write_fails_the_grants_naming_what_it_lacks(
    server_backend, moto
):
    admin = server_backend.engine
    url = sa.make_url(server_backend.url)
    pg = admin.dialect.name == "postgresql"
    drop = 'DROP ROLE IF EXISTS "doctor_probe"' if pg else "DROP USER IF EXISTS 'doctor_probe'@'%%'"
    with admin.begin() as conn:
        if pg:
            if conn.execute(
                sa.text("SELECT 1 FROM pg_roles WHERE rolname = 'doctor_probe'")
            ).first():
                conn.exec_driver_sql("DROP OWNED BY doctor_probe")
            conn.exec_driver_sql(drop)
            conn.exec_driver_sql("CREATE ROLE doctor_probe LOGIN PASSWORD 'probe-pw'")
            conn.exec_driver_sql("GRANT USAGE ON SCHEMA public TO doctor_probe")
            conn.exec_driver_sql("GRANT SELECT ON ALL TABLES IN SCHEMA public TO doctor_probe")
        else:
            conn.exec_driver_sql(drop)
            conn.exec_driver_sql("CREATE USER 'doctor_probe'@'%%' IDENTIFIED BY 'probe-pw'")
            conn.exec_driver_sql(f"GRANT SELECT ON `{url.database}`.* TO 'doctor_probe'@'%%'")
    probe = url.set(username="doctor_probe", password="probe-pw")
    try:
        done = outbox_relay(
            "doctor",
            "--database-url",
            probe.render_as_string(hide_password=False),
            "--from",
            IDENTITY,
            env=env_for(moto.url),
        )
    finally:
        with admin.begin() as conn:
            if pg:
                conn.exec_driver_sql("DROP OWNED BY doctor_probe")
            conn.exec_driver_sql(drop)
    assert done.returncode == 1, done.stdout + done.stderr
    line = line_of(done, "grants")
    assert line.startswith("fail  grants: the role lacks UPDATE (status, claim_token"), line
    assert "INSERT ON outbox_attempts" in line
    assert "SELECT ON" not in line
    assert "grant them as examples/deploy/grants-" in line
    assert lines(done)["database"] == "ok"


# -- send-test -----------------------------------------------------------------------------


def test_send_test_with_a_relay_and_its_intake_ends_delivered(
    server_backend, moto, event_queue, tmp_path
):
    with FaultServer(moto.url, FaultPlan(), events=event_queue) as ses:
        env = env_for(moto.url, ses_url=ses.url)
        args = ("--events-queue-url", event_queue.url, "--events-wait-seconds", "1")
        proc = spawn(
            server_backend.url,
            "ses",
            "send-test",
            tmp_path / "relay.log",
            env,
            *args,
            "--poll-interval",
            "0.1",
        )
        try:
            wait_for(lambda: relay_rows(server_backend.engine), timeout=30, what="relay up")
            done = outbox_relay(
                "send-test",
                "--database-url",
                server_backend.url,
                "--to",
                SIMULATOR,
                "--from",
                IDENTITY,
                "--wait",
                "30",
                env=env,
            )
        finally:
            kill_all([proc])
    assert done.returncode == 0, done.stdout + done.stderr + proc.output()[-3000:]
    out = done.stdout
    assert "enqueued (key outbox-test:" in out
    assert re.search(r": sent(, delivered)? \(provider id ", out), out
    assert out.rstrip().endswith("delivered")
    with server_backend.engine.connect() as conn:
        category = conn.execute(sa.text("SELECT category FROM outbox_messages")).scalar_one()
    assert category == "outbox-test"


def test_send_test_without_a_relay_times_out_naming_the_state(postgres_backend):
    done = outbox_relay(
        "send-test",
        "--database-url",
        postgres_backend.url,
        "--to",
        SIMULATOR,
        "--from",
        IDENTITY,
        "--wait",
        "1",
        env=clean_env(),
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "no relay has a heartbeat" in done.stdout
    assert ": pending" in done.stdout
    [error] = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert "timed out after 1 s waiting for a relay to send it (none is running)" in error
    assert "it stays queued" in error  # a retrying script queues one test message a try


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--to", "not an address", "--from", IDENTITY], "--to"),
        (["--to", SIMULATOR, "--from", "nobody"], "--from"),
        (["--to", SIMULATOR, "--from", IDENTITY, "--wait", "nan"], "--wait"),  # for ever
        (["--to", SIMULATOR, "--from", IDENTITY, "--wait", "inf"], "--wait"),
    ],
)
def test_send_test_refuses_a_bad_address_naming_the_flag(postgres_backend, args, flag):
    done = outbox_relay("send-test", "--database-url", postgres_backend.url, *args, env=clean_env())
    assert done.returncode == 2, done.stdout + done.stderr
    [error] = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert flag in error
