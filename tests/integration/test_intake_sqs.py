"""relay.intake's loop against moto's SQS server: a message leaves the queue only once its
effect committed, a malformed one ends in the dead-letter queue after its redrive policy's
receives and is recorded once, a database outage mid-batch deletes nothing and the next pass
applies everything exactly once, SQS errors are retried and never crash it.

The client is the intake's own (:func:`relay.intake.build_client`), pointed at moto through
``AWS_ENDPOINT_URL_SQS`` as a deployment would point it at a VPC endpoint.
"""

from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from outbox.exceptions import ConfigurationError
from outbox.schema import Status, attempts, events
from relay.clock import read_database_time
from relay.db import make_engine
from relay.intake import Intake, build_client
from tests.support.db import Backend, attempt_rows, row
from tests.support.ses import MotoSes, aws_env
from tests.support.sqs import MAX_RECEIVES, EventQueue, ses_event, sns_body, stage
from tests.support.waiting import wait_for


@pytest.fixture
def queue(moto: MotoSes, monkeypatch: pytest.MonkeyPatch) -> EventQueue:
    """An events queue with its dead-letter queue, and the environment that reaches it."""
    for name, value in {**aws_env(moto.url), "AWS_ENDPOINT_URL_SQS": moto.url}.items():
        monkeypatch.setenv(name, value)
    return EventQueue(moto)


def intake_for(engine: sa.Engine, queue: EventQueue, **kw: Any) -> Intake:
    client = build_client(queue.url, wait_seconds=0)
    return Intake(engine=engine, client=client, queue_url=queue.url, wait_seconds=0, **kw)


def drain(intake: Intake, queue: EventQueue, *, until: float = 10.0) -> None:
    """Passes until the queue holds nothing (each pass a short poll)."""
    deadline = time.monotonic() + until
    while queue.depth():
        assert time.monotonic() < deadline, "the queue never emptied"
        if not intake.step():
            time.sleep(0.2)


def tagged(engine: sa.Engine, n: int) -> list[tuple[int, str]]:
    """``n`` ambiguous rows and the claim tokens of their attempts."""
    staged = []
    for _ in range(n):
        token = str(uuid.uuid4())
        staged.append((stage(engine, Status.UNKNOWN_OUTCOME, tokens=(token,)), token))
    return staged


def test_applied_events_leave_the_queue_stamped_with_the_databases_clock(
    backend: Backend, queue: EventQueue
):
    engine = backend.engine
    staged = tagged(engine, 3)
    queue.send(
        *[
            sns_body(ses_event(kind, provider_id=f"ses-{mid}", message_id=mid, claim_token=t))
            for mid, t in staged
            for kind in ("send", "delivery")
        ]
    )
    intake = intake_for(engine, queue)
    with engine.connect() as conn:
        before = read_database_time(conn)
    drain(intake, queue)
    with engine.connect() as conn:
        after = read_database_time(conn)
        received = list(conn.execute(sa.select(events.c.received_at)).scalars())
    for mid, _ in staged:
        assert (row(engine, mid).status, row(engine, mid).delivery_status) == ("sent", "delivered")
    assert len(received) == 6
    assert all(before - timedelta(seconds=1) <= r <= after + timedelta(seconds=1) for r in received)
    assert sum(n for (_, effect), n in intake.counts.items() if effect == "resolved") == 3


def test_a_malformed_message_lands_in_the_dead_letter_queue_recorded_once(
    backend: Backend, queue: EventQueue
):
    engine = backend.engine
    queue.send("{not json")
    intake = intake_for(engine, queue)
    receives = 0
    deadline = time.monotonic() + 20
    while not queue.dead_letters():
        assert time.monotonic() < deadline, "the malformed message never reached the DLQ"
        receives += intake.step()
        time.sleep(0.3)  # past the 1 s visibility timeout within a few passes
    assert receives == MAX_RECEIVES
    with engine.connect() as conn:
        recorded = list(conn.execute(sa.select(events.c.effect, events.c.event_type)))
    assert recorded == [("malformed", "malformed")]
    assert queue.depth() == 0
    assert queue.dead_letters() == ["{not json"]
    assert intake.counts[("malformed", "malformed")] == 1
    assert intake.counts[("malformed", "duplicate")] == MAX_RECEIVES - 1


def test_an_unmatched_event_is_recorded_and_deleted(backend: Backend, queue: EventQueue):
    queue.send(sns_body(ses_event("notification_delivery", provider_id="not-ours")))
    intake = intake_for(backend.engine, queue)
    assert intake.step() == 1
    assert queue.depth() == 0
    assert intake.counts == {("delivery", "unmatched"): 1}


def _kill_on_third_event_insert(engine: sa.Engine) -> Any:
    """A real outage mid-batch: the third event insert of the next pass finds its server
    connection killed from another session (``pg_terminate_backend``, ``KILL``)."""
    seen = {"inserts": 0, "armed": True}
    other = sa.create_engine(engine.url)

    def before(conn, cursor, statement, parameters, context, executemany):
        if not seen["armed"] or not statement.lstrip().upper().startswith(
            "INSERT INTO OUTBOX_EVENTS"
        ):
            return
        seen["inserts"] += 1
        if seen["inserts"] != 3:
            return
        seen["armed"] = False
        if engine.dialect.name == "postgresql":
            pid = conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()
            with other.begin() as killer:
                killer.exec_driver_sql(f"SELECT pg_terminate_backend({int(pid)})")
        else:
            pid = conn.exec_driver_sql("SELECT CONNECTION_ID()").scalar_one()
            with other.begin() as killer:
                killer.exec_driver_sql(f"KILL CONNECTION {int(pid)}")

    sa.event.listen(engine, "before_cursor_execute", before)
    return seen, other


def test_a_database_outage_mid_batch_deletes_nothing_and_a_later_pass_applies_it_once(
    server_backend: Backend, queue: EventQueue
):
    engine = make_engine(server_backend.url)
    try:
        staged = tagged(engine, 5)
        queue.send(
            *[
                sns_body(ses_event("send", provider_id=f"ses-{mid}", message_id=mid, claim_token=t))
                for mid, t in staged
            ]
        )
        seen, other = _kill_on_third_event_insert(engine)
        intake = intake_for(engine, queue)
        with pytest.raises(sa.exc.DBAPIError):
            intake.step()
        assert seen["inserts"] == 3
        other.dispose()
        assert queue.depth() == 5  # nothing deleted: all come back after the visibility timeout
        with engine.connect() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(events)).scalar() == 0
        assert all(row(engine, mid).status == "unknown_outcome" for mid, _ in staged)
        drain(intake, queue)
        for mid, _ in staged:
            assert row(engine, mid).status == "sent"
            assert [a.outcome for a in attempt_rows(engine, mid)] == ["ambiguous", "reconciled"]
        with engine.connect() as conn:
            assert conn.execute(sa.select(sa.func.count()).select_from(events)).scalar() == 5
            reconciled = conn.execute(
                sa.select(sa.func.count())
                .select_from(attempts)
                .where(attempts.c.outcome == "reconciled")
            ).scalar()
        assert reconciled == 5
    finally:
        engine.dispose()


def test_the_loop_survives_sqs_errors_and_stops_on_request(
    backend: Backend, queue: EventQueue, monkeypatch: pytest.MonkeyPatch, caplog
):
    """SQS unreachable (a closed port): every pass fails, is logged and backed off; the loop
    never raises, and a stop request ends it within one backoff."""
    monkeypatch.setenv("AWS_ENDPOINT_URL_SQS", "http://127.0.0.1:9")
    intake = intake_for(backend.engine, queue)
    intake.backoff = lambda: 0.05  # type: ignore[method-assign]
    thread = threading.Thread(target=intake.run, daemon=True)
    thread.start()
    wait_for(lambda: intake.errors["sqs"] >= 3, what="three failed passes")
    assert thread.is_alive()
    intake.request_stop()
    thread.join(5)
    assert not thread.is_alive()
    assert "SQS error" in caplog.text


def test_a_failed_delete_only_means_a_harmless_redelivery(backend: Backend, queue: EventQueue):
    engine = backend.engine
    ((mid, token),) = tagged(engine, 1)
    queue.send(sns_body(ses_event("send", provider_id="ses-x", message_id=mid, claim_token=token)))
    intake = intake_for(engine, queue)
    real = intake.client

    class DropsDeletes:
        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def delete_message_batch(self, **kw: Any) -> dict[str, Any]:
            return {
                "Successful": [],
                "Failed": [
                    {"Id": e["Id"], "Code": "InternalError", "SenderFault": False}
                    for e in kw["Entries"]
                ],
            }

    intake.client = DropsDeletes()
    assert intake.step() == 1
    assert intake.errors["sqs"] == 1
    intake.client = real
    time.sleep(1.1)  # the visibility timeout
    drain(intake, queue)
    assert intake.counts == {("send", "resolved"): 1, ("send", "duplicate"): 1}
    assert [a.outcome for a in attempt_rows(engine, mid)] == ["ambiguous", "reconciled"]


def test_a_queue_that_does_not_exist_is_refused_naming_its_url(backend: Backend, queue):
    missing = queue.url.rsplit("/", 1)[0] + "/no-such-queue"
    intake = Intake(
        engine=backend.engine,
        client=build_client(missing, wait_seconds=0),
        queue_url=missing,
        wait_seconds=0,
    )
    with pytest.raises(ConfigurationError, match="no-such-queue"):
        intake.check_queue()


def test_a_queue_without_a_redrive_policy_is_warned_about(backend: Backend, queue, caplog):
    bare = queue.client.create_queue(QueueName="bare")["QueueUrl"]
    intake = Intake(
        engine=backend.engine,
        client=build_client(bare, wait_seconds=0),
        queue_url=bare,
        wait_seconds=0,
    )
    info = intake.check_queue()
    assert info.dead_letter_arn is None
    assert "no redrive policy" in caplog.text
    assert "forever" in caplog.text
    assert intake_for(backend.engine, queue).check_queue().max_receive_count == MAX_RECEIVES


def test_the_client_takes_the_region_from_the_queue_url(monkeypatch: pytest.MonkeyPatch):
    for name in ("AWS_REGION", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/aws-config")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    client = build_client("https://sqs.eu-west-3.amazonaws.com/1/q", wait_seconds=20)
    assert client.meta.region_name == "eu-west-3"
    assert client.meta.config.retries["total_max_attempts"] == 1
    assert client.meta.config.read_timeout > 20
