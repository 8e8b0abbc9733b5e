"""``outbox-relay events`` and ``outbox-relay run --events-queue-url`` as a deployment runs them:
real processes, moto's SQS server as the queue, events put on it with boto3 the way SNS
delivers them.

Bad settings are refused before anything starts, naming the flag (or the queue URL); a run
with ``--exit-when-idle`` applies the queue and exits 0; the relay's own process applies
events in a thread beside its sends and stops it with its drain.
"""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import urllib.request
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox.schema import Status, events
from relay.testing import read_deliveries
from tests.support.db import Backend, row
from tests.support.factories import enqueue
from tests.support.relays import FAKE_SENDER, RELAY, clean_env, spawn
from tests.support.ses import MotoSes, aws_env
from tests.support.sqs import EventQueue, ses_event, sns_body, stage
from tests.support.waiting import wait_for


@pytest.fixture
def queue(moto: MotoSes) -> EventQueue:
    return EventQueue(moto)


def env_for(queue: EventQueue, **extra: str) -> dict[str, str]:
    return clean_env(**{**aws_env(queue.endpoint), **extra})


def outbox_relay(
    *args: str, env: dict[str, str], timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [RELAY, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def refusal(done: subprocess.CompletedProcess[str]) -> str:
    """The one ``Error:`` line of a refused start."""
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, done.stderr
    return errors[0]


def resolvable(engine: sa.Engine, queue: EventQueue, n: int) -> list[int]:
    """``n`` ambiguous rows, and a Send and a Delivery for each on the queue."""
    ids = []
    for _ in range(n):
        token = str(uuid.uuid4())
        mid = stage(engine, Status.UNKNOWN_OUTCOME, tokens=(token,))
        queue.send(
            *[
                sns_body(
                    ses_event(kind, provider_id=f"ses-{mid}", message_id=mid, claim_token=token)
                )
                for kind in ("send", "delivery")
            ]
        )
        ids.append(mid)
    return ids


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- refused before anything starts ----------------------------------------------------------

BAD = {
    "queue-url-not-a-url": (["--events-queue-url", "not a url"], "--events-queue-url"),
    "queue-url-ftp": (["--events-queue-url", "ftp://sqs.example.com/1/q"], "--events-queue-url"),
    "queue-url-no-path": (
        ["--events-queue-url", "https://sqs.us-east-1.amazonaws.com"],
        "--events-queue-url",
    ),
    "wait-over-20": (["--wait-seconds", "21"], "--wait-seconds"),
    "wait-negative": (["--wait-seconds", "-1"], "--wait-seconds"),
    "wait-not-a-number": (["--wait-seconds", "soon"], "--wait-seconds"),
}


@pytest.mark.parametrize(("args", "flag"), list(BAD.values()), ids=list(BAD))
def test_bad_settings_are_refused_naming_the_flag(tmp_path: Path, args, flag):
    db = tmp_path / "never-created.db"
    base = [
        "--database-url",
        f"sqlite:///{db}",
        "--events-queue-url",
        "https://sqs.us-east-1.amazonaws.com/1/q",
    ]
    done = outbox_relay("events", *base, *args, env=clean_env())
    assert flag in refusal(done)
    assert not db.exists()


def test_bad_settings_from_the_environment_are_refused_too(tmp_path: Path):
    db = tmp_path / "never-created.db"
    env = clean_env(
        OUTBOX_DATABASE_URL=f"sqlite:///{db}",
        OUTBOX_EVENTS_QUEUE_URL="https://sqs.us-east-1.amazonaws.com/1/q",
        OUTBOX_EVENTS_WAIT_SECONDS="30",
    )
    assert "--wait-seconds" in refusal(outbox_relay("events", env=env))
    assert "--events-wait-seconds" in refusal(
        outbox_relay(
            "run", "--events-queue-url", "https://sqs.us-east-1.amazonaws.com/1/q", env=env
        )
    )
    env["OUTBOX_EVENTS_WAIT_SECONDS"] = "5"
    env["OUTBOX_EVENTS_QUEUE_URL"] = "sqs-queue"
    assert "--events-queue-url" in refusal(outbox_relay("run", env=env))
    assert not db.exists()


def test_a_queue_that_does_not_exist_is_refused_naming_its_url(backend: Backend, queue: EventQueue):
    missing = queue.url.rsplit("/", 1)[0] + "/no-such-queue"
    for command in ("events", "run"):
        done = outbox_relay(
            command,
            "--database-url",
            backend.url,
            "--events-queue-url",
            missing,
            *(["--sender", "console"] if command == "run" else []),
            env=env_for(queue),
        )
        line = refusal(done)
        assert missing in line
        assert "--events-queue-url" in line


# -- running -----------------------------------------------------------------------------------


def test_events_exit_when_idle_applies_the_queue_and_exits(backend: Backend, queue: EventQueue):
    engine = backend.engine
    ids = resolvable(engine, queue, 3)
    queue.send("{not json", sns_body(ses_event("notification_delivery", provider_id="not-ours")))
    done = outbox_relay(
        "events",
        "--exit-when-idle",
        env=env_for(
            queue,
            OUTBOX_DATABASE_URL=backend.url,
            OUTBOX_EVENTS_QUEUE_URL=queue.url,
            OUTBOX_EVENTS_WAIT_SECONDS="0",
        ),
    )
    assert done.returncode == 0, done.stderr
    for mid in ids:
        assert (row(engine, mid).status, row(engine, mid).delivery_status) == ("sent", "delivered")
    with engine.connect() as conn:
        effects = sorted(conn.execute(sa.select(events.c.effect)).scalars())
    assert effects.count("resolved") == 3
    assert effects.count("malformed") == 1
    assert effects.count("unmatched") == 1
    assert "action=event_resolved" in done.stderr
    assert "action=idle_exit" in done.stderr
    # only the malformed message is left, for its dead-letter queue
    assert queue.depth() == 1


def test_events_serves_its_metrics_and_stops_on_sigterm(
    server_backend: Backend, queue: EventQueue, tmp_path: Path
):
    engine = server_backend.engine
    port = free_port()
    log = tmp_path / "events.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                RELAY,
                "events",
                "--database-url",
                server_backend.url,
                "--events-queue-url",
                queue.url,
                "--wait-seconds",
                "1",
                "--http-port",
                str(port),
                "--http-host",
                "127.0.0.1",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env_for(queue),
        )
    try:
        ids = resolvable(engine, queue, 2)
        wait_for(
            lambda: all(row(engine, mid).status == "sent" for mid in ids),
            timeout=30,
            what="the events to be applied",
        )

        def metrics() -> str:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as page:
                return page.read().decode()

        def resolved_page() -> str | None:
            page = metrics()
            return page if 'outbox_reconciled_total{result="sent"} 2.0' in page else None

        page = wait_for(resolved_page, timeout=10, what="the resolved events on /metrics")
        resolved = re.findall(r'outbox_events_total\{effect="resolved",type="\w+"\} (\S+)', page)
        assert sum(float(n) for n in resolved) == 2.0  # one of each row's Send and Delivery
        assert "outbox_event_intake_lag_seconds " in page
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as health:
            assert health.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    assert "action=intake_stopped" in log.read_text()


def test_run_with_an_events_queue_sends_and_applies_events_in_one_process(
    server_backend: Backend, queue: EventQueue, tmp_path: Path
):
    """The relay sends its pending mail through the fake sender while its intake thread
    resolves the ambiguous rows from the queue; SIGTERM drains both and exits 0."""
    engine = server_backend.engine
    record = tmp_path / "sent.log"
    pending = enqueue(engine, 3)
    ids = resolvable(engine, queue, 2)
    proc = spawn(
        server_backend.url,
        FAKE_SENDER,
        "with-intake",
        tmp_path / "relay.log",
        env_for(queue, OUTBOX_FAKE_RECORD_FILE=str(record)),
        "--events-queue-url",
        queue.url,
        "--events-wait-seconds",
        "1",
    )
    try:
        try:
            wait_for(
                lambda: all(row(engine, m).status == "sent" for m in [*pending, *ids]),
                timeout=30,
                what="the sends and the events",
            )
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the relay's log:\n{proc.output()[-4000:]}") from None
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.popen.poll() is None:
            proc.popen.kill()
            proc.popen.wait(5)
    assert read_deliveries(record) == {m: 1 for m in pending}  # the resolved rows: never sent
    output = proc.output()
    assert "action=intake_started" in output
    assert "action=intake_stopped" in output
    assert "action=drained" in output
    assert queue.depth() == 0
