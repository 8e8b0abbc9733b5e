"""The reconcile proof of a drained queue against replicas that do not share one view of it.

A reconcile row's ambiguous send is requeued once the intake committed one of our Send
events past its window and every live replica of the queue that recorded it found that queue
empty more than a visibility timeout after the event. These attacks once broke it: a replica
of another queue, one whose peer holds the held send's own event in flight, a visibility
timeout raised on the queue after start, a caught_up_at written while the database's clock
ran ahead; each proved a drained queue that was not, and the requeue would send the message
a second time. Against moto's SQS, on SQLite, PostgreSQL and MariaDB.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa

from outbox.schema import Status, intakes, messages
from relay import store
from relay.clock import read_database_time
from relay.intake import Intake, build_client
from tests.support.db import Backend, row
from tests.support.ses import MotoSes, aws_env
from tests.support.sqs import ses_event, sns_body, stage

VISIBILITY = 3  # seconds: the events queue's visibility timeout here
WINDOW = 60.0


def now_of(engine: sa.Engine) -> Any:
    with engine.connect() as conn:
        return read_database_time(conn)


def queue(moto: MotoSes, name: str, visibility: int) -> str:
    client = moto.client("sqs")
    url: str = client.create_queue(
        QueueName=name, Attributes={"VisibilityTimeout": str(visibility)}
    )["QueueUrl"]
    return url


def intake(engine: sa.Engine, url: str, intake_id: str) -> Intake:
    found = Intake(
        engine=engine,
        client=build_client(url, wait_seconds=1),
        queue_url=url,
        wait_seconds=1,
        intake_id=intake_id,
    )
    found.check_queue()
    return found


def held_and_proof(engine: sa.Engine) -> tuple[int, str, str]:
    """A reconcile row held unknown_outcome an hour ago (claim ``tok-held``), its Send event
    (not yet applied), and another row's Send event (the proof), SES's time now."""
    held = stage(engine, Status.UNKNOWN_OUTCOME, tokens=("tok-held",))
    other = stage(engine, Status.SENT, tokens=("tok-proof",), provider_id="ses-proof")
    now = now_of(engine)
    with engine.begin() as conn:
        conn.execute(
            sa.update(messages)
            .where(messages.c.id == held)
            .values(reconcile_after=WINDOW, send_started_at=now - timedelta(hours=1))
        )
    own = sns_body(
        ses_event(
            "send",
            provider_id="ses-held",
            message_id=held,
            claim_token="tok-held",
            mail_at=now - timedelta(hours=1),
        )
    )
    proof = sns_body(
        ses_event(
            "send", provider_id="ses-proof", message_id=other, claim_token="tok-proof", mail_at=now
        )
    )
    return held, own, proof


def reconcile(engine: sa.Engine) -> list[int]:
    with engine.begin() as conn:
        now = read_database_time(conn)
        return [r.id for r in store.reconcile_unknown(conn, now=now, relay_id="r1")]


@pytest.fixture
def sqs_env(moto: MotoSes, monkeypatch: pytest.MonkeyPatch) -> MotoSes:
    for name, value in {**aws_env(moto.url), "AWS_ENDPOINT_URL_SQS": moto.url}.items():
        monkeypatch.setenv(name, value)
    return moto


def test_a_replica_of_another_queue_proves_nothing_about_this_one(
    backend: Backend, sqs_env: MotoSes
) -> None:
    engine = backend.engine
    events_a = queue(sqs_env, "events-a", VISIBILITY)
    events_b = queue(sqs_env, "events-b", 1)  # another configuration set's queue, empty
    held, own, proof = held_and_proof(engine)
    client = sqs_env.client("sqs")
    client.send_message(QueueUrl=events_a, MessageBody=proof)
    a = intake(engine, events_a, "intake-a")
    assert a.step() == 1  # the proof is committed
    client.send_message(QueueUrl=events_a, MessageBody=own)  # a backlog replica a has not read
    b = intake(engine, events_b, "intake-b")
    time.sleep(1.2)  # queue b's visibility timeout since b started
    assert b.step() == 0
    with engine.connect() as conn:
        caught = conn.execute(
            sa.select(intakes.c.caught_up_at).where(intakes.c.intake_id == "intake-b")
        ).scalar()
    assert caught is not None
    assert reconcile(engine) == []  # the row's own Send event is still on queue a
    assert row(engine, held).status == "unknown_outcome"


def test_an_event_in_flight_at_another_replica_keeps_the_row_held(
    backend: Backend, sqs_env: MotoSes
) -> None:
    engine = backend.engine
    url = queue(sqs_env, "events", VISIBILITY)
    held, own, proof = held_and_proof(engine)
    client = sqs_env.client("sqs")
    client.send_message(QueueUrl=url, MessageBody=proof)
    y = intake(engine, url, "intake-y")
    assert y.step() == 1  # the proof is committed
    time.sleep(VISIBILITY + 0.2)  # past the visibility timeout since y started and the proof
    client.send_message(QueueUrl=url, MessageBody=own)
    from relay.intake import record_intake

    with engine.begin() as conn:  # replica x's heartbeat: every replica beats before it receives
        now = read_database_time(conn)
        record_intake(
            conn,
            intake_id="intake-x",
            queue_url=url,
            visibility_timeout=VISIBILITY,
            started_at=now,
            now=now,
            caught_up=False,
        )
    taken = client.receive_message(QueueUrl=url, MaxNumberOfMessages=10)
    assert len(taken.get("Messages", [])) == 1  # replica x took it, and dies (or is slow)
    assert y.step() == 0  # found empty: the event is hidden, in flight at x
    assert reconcile(engine) == []  # x's event comes back within the visibility timeout
    assert row(engine, held).status == "unknown_outcome"


def test_a_visibility_timeout_raised_after_start_keeps_a_failed_batch_unproven(
    backend: Backend, sqs_env: MotoSes, monkeypatch: pytest.MonkeyPatch
) -> None:
    import relay.intake.loop as module

    engine = backend.engine
    url = queue(sqs_env, "events", 1)
    held, own, proof = held_and_proof(engine)
    client = sqs_env.client("sqs")
    client.send_message(QueueUrl=url, MessageBody=proof)
    x = intake(engine, url, "intake-x")
    assert x.step() == 1  # the proof is committed
    client.set_queue_attributes(QueueUrl=url, Attributes={"VisibilityTimeout": "6"})
    client.send_message(QueueUrl=url, MessageBody=own)

    def refuse(*_a: Any, **_kw: Any) -> Any:
        raise sa.exc.OperationalError("apply", {}, Exception("server closed the connection"))

    monkeypatch.setattr(module, "apply_events", refuse)
    with pytest.raises(sa.exc.OperationalError):
        x.step()  # the row's own event, taken and not applied: hidden for 6 s now
    monkeypatch.undo()
    time.sleep(1.2)  # the visibility timeout x read at its start
    assert reconcile(engine) == []  # x has not found the queue empty since its failed batch
    assert x.step() == 1  # x took it for its own timeout, not the queue's: back already
    assert reconcile(engine) == []
    assert row(engine, held).status == "sent"  # resolved by its own Send event


def test_a_caught_up_at_ahead_of_the_databases_clock_proves_nothing(backend: Backend) -> None:
    from relay.events import parse
    from relay.intake import apply_events, record_intake

    engine = backend.engine
    held, _own, proof = held_and_proof(engine)
    now = now_of(engine)
    with engine.begin() as conn:  # a replica's reading while the database's clock ran an hour fast
        record_intake(
            conn,
            intake_id="intake-z",
            queue_url="https://sqs.eu-west-1.amazonaws.com/123456789012/ses-events",
            visibility_timeout=30.0,
            started_at=now - timedelta(hours=1),
            now=now + timedelta(hours=1),
            caught_up=True,
        )
    with engine.begin() as conn:  # the clock stepped back since: the proof commits now
        apply_events(conn, [parse(proof)], now=read_database_time(conn), intake_id="intake-z")
    assert reconcile(engine) == []  # no replica found the queue empty after the proof
    assert row(engine, held).status == "unknown_outcome"
