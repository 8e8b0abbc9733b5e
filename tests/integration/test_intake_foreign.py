"""What an event nobody of ours published may cost, on SQLite, PostgreSQL and MariaDB, through
the intake's loop on moto's SQS: a forged event of ~240 KB of recipients is stored in a few
hundred characters (matched: in what any backend's TEXT holds) and leaves the queue, MariaDB
included; with ``--events-topic-arn`` an event from another topic, another account's
EventBridge bus or a raw body is recorded ``foreign`` and changes no message, and a copy of
one of ours that came that way does not make ours a duplicate.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from click.testing import CliRunner

from outbox.exceptions import ConfigurationError
from outbox.schema import Status, events
from relay.cli import main
from relay.clock import read_database_time
from relay.events import MAX_BODY_BYTES, parse
from relay.intake import Effect, Intake, apply_events, build_client, check_topic_arn
from tests.support.db import Backend, row
from tests.support.ses import MotoSes, aws_env
from tests.support.sqs import EventQueue, raw_body, ses_event, sns_body, stage
from tests.support.waiting import wait_for

OURS = "arn:aws:sns:us-west-2:123456789012:MyTopic"  # sns_body's envelope names this one
THEIRS = "arn:aws:sns:us-west-2:210987654321:TheirTopic"
FLOOD = 780  # addresses of 307 characters: a body just under SQS's 256 KiB


@pytest.fixture
def queue(moto: MotoSes, monkeypatch: pytest.MonkeyPatch) -> EventQueue:
    for name, value in {**aws_env(moto.url), "AWS_ENDPOINT_URL_SQS": moto.url}.items():
        monkeypatch.setenv(name, value)
    return EventQueue(moto)


@pytest.fixture
def relay_logger() -> Iterator[None]:
    """The ``relay`` logger as it was: the ``events`` command points it at its stderr."""
    root = logging.getLogger("relay")
    saved = (root.handlers[:], root.level, root.propagate)
    yield
    root.handlers[:], root.level, root.propagate = saved


def intake_for(backend: Backend, queue: EventQueue, **kw: Any) -> Intake:
    client = build_client(queue.url, wait_seconds=0)
    return Intake(engine=backend.engine, client=client, queue_url=queue.url, wait_seconds=0, **kw)


def drain(intake: Intake, queue: EventQueue) -> None:
    wait_for(lambda: intake.step() == 0 and queue.depth() == 0, timeout=20.0)


def from_topic(event: dict[str, Any], topic: str) -> str:
    envelope = json.loads(sns_body(event))
    envelope["TopicArn"] = topic
    return json.dumps(envelope)


def from_eventbridge(event: dict[str, Any], account: str) -> str:
    return json.dumps(
        {
            "version": "0",
            "id": str(uuid.uuid4()),
            "detail-type": "Email Sent",
            "source": "aws.ses",
            "account": account,
            "time": "2026-12-01T12:00:01Z",
            "region": "us-west-2",
            "resources": [],
            "detail": event,
        }
    )


def flooded(event: dict[str, Any], where: tuple[str, str]) -> dict[str, Any]:
    """``event`` with :data:`FLOOD` addresses in its recipients' list ``where``, all but the
    first as long as an address may be."""
    addresses = ["first@example.com"]
    addresses += [f"{'x' * 290}{n:05d}@example.com" for n in range(1, FLOOD)]
    event[where[0]][where[1]] = addresses
    return event


def stored(backend: Backend) -> list[sa.Row[Any]]:
    with backend.engine.connect() as conn:
        return list(conn.execute(sa.select(events).order_by(events.c.id)))


def test_a_forged_event_of_240_kb_is_stored_capped_and_leaves_the_queue(
    backend: Backend, queue: EventQueue
) -> None:
    sent = stage(backend.engine, Status.SENT, provider_id="ses-known")
    unmatched = flooded(ses_event("send", provider_id="forged-1"), ("mail", "destination"))
    # one naming a real SES message id (every recipient sees it in the Message-ID header)
    matched = flooded(ses_event("delivery", provider_id="ses-known"), ("delivery", "recipients"))
    bodies = [sns_body(unmatched), sns_body(matched)]
    assert all(240_000 < len(b) < MAX_BODY_BYTES for b in bodies)
    queue.send(*bodies)

    intake = intake_for(backend, queue)
    drain(intake, queue)

    assert queue.dead_letters() == []
    by_id = {e.provider_message_id: e for e in stored(backend)}
    forged, known = by_id["forged-1"], by_id["ses-known"]
    assert (forged.effect, forged.message_id) == ("unmatched", None)
    assert len(forged.recipients) <= 300
    assert forged.recipients.endswith(f"[{FLOOD} addresses, cut]")
    assert forged.recipients.startswith("first@example.com, ")  # whole addresses, then how many
    assert (known.effect, known.message_id) == ("status", sent)
    assert 240_000 > len(known.recipients) > 15_000  # what a MySQL TEXT holds, not more
    assert known.recipients.endswith(f"[{FLOOD} addresses, cut]")
    assert row(backend.engine, sent).delivery_status == "delivered"
    assert intake.counts == {("send", "unmatched"): 1, ("delivery", "status"): 1}


def test_an_event_from_another_topic_is_recorded_foreign_and_changes_nothing(
    backend: Backend, queue: EventQueue
) -> None:
    token = str(uuid.uuid4())
    held = stage(backend.engine, Status.UNKNOWN_OUTCOME, tokens=(token,))
    event = ses_event("send", provider_id="ses-held", message_id=held, claim_token=token)
    queue.send(from_topic(event, THEIRS))

    intake = intake_for(backend, queue, topic_arn=OURS)
    drain(intake, queue)

    assert row(backend.engine, held).status == "unknown_outcome"
    [foreign] = stored(backend)
    assert (foreign.effect, foreign.message_id, foreign.event_type) == ("foreign", None, "send")
    assert THEIRS in foreign.error
    assert intake.counts == {("send", "foreign"): 1}

    # the same SES event from our topic is ours: the foreign copy did not take its key
    queue.send(from_topic(event, OURS))
    drain(intake, queue)
    assert row(backend.engine, held).status == "sent"
    assert [e.effect for e in stored(backend)] == ["foreign", "resolved"]


def test_with_a_topic_eventbridge_counts_its_account_and_a_raw_body_is_foreign(
    backend: Backend,
) -> None:
    tokens = [str(uuid.uuid4()) for _ in range(3)]
    rows = [stage(backend.engine, Status.UNKNOWN_OUTCOME, tokens=(t,)) for t in tokens]
    sends = [
        ses_event("send", provider_id=f"ses-{mid}", message_id=mid, claim_token=t)
        for mid, t in zip(rows, tokens, strict=True)
    ]
    bodies = [
        from_eventbridge(sends[0], "123456789012"),  # the topic's account: ours
        from_eventbridge(sends[1], "210987654321"),
        raw_body(sends[2]),
    ]
    with backend.engine.begin() as conn:
        done = apply_events(
            conn, [parse(b) for b in bodies], now=read_database_time(conn), topic_arn=OURS
        )
    assert [a.effect for a in done] == [Effect.RESOLVED, Effect.FOREIGN, Effect.FOREIGN]
    assert [row(backend.engine, mid).status for mid in rows] == [
        "sent",
        "unknown_outcome",
        "unknown_outcome",
    ]
    errors = {e.source: e.error for e in stored(backend) if e.effect == "foreign"}
    assert "210987654321" in errors["eventbridge"]
    assert "raw delivery" in errors["raw"]


def test_without_a_topic_every_topic_is_applied_as_before(backend: Backend) -> None:
    token = str(uuid.uuid4())
    held = stage(backend.engine, Status.UNKNOWN_OUTCOME, tokens=(token,))
    event = ses_event("send", provider_id="ses-held", message_id=held, claim_token=token)
    with backend.engine.begin() as conn:
        [done] = apply_events(
            conn, [parse(from_topic(event, THEIRS))], now=read_database_time(conn)
        )
    assert done.effect is Effect.RESOLVED


def test_the_events_command_takes_the_topic(
    backend: Backend, queue: EventQueue, relay_logger: None
) -> None:
    token = str(uuid.uuid4())
    held = stage(backend.engine, Status.UNKNOWN_OUTCOME, tokens=(token,))
    event = ses_event("send", provider_id="ses-held", message_id=held, claim_token=token)
    queue.send(from_topic(event, THEIRS))
    args = ["events", "--events-queue-url", queue.url, "--wait-seconds", "1", "--exit-when-idle"]
    env = {"OUTBOX_DATABASE_URL": backend.url, "OUTBOX_EVENTS_TOPIC_ARN": OURS}
    done = CliRunner().invoke(main, args, env=env, catch_exceptions=False)
    assert done.exit_code == 0, done.output
    assert [(e.effect, e.message_id) for e in stored(backend)] == [("foreign", None)]
    assert row(backend.engine, held).status == "unknown_outcome"


@pytest.mark.parametrize(
    "value",
    ["MyTopic", "arn:aws:sqs:us-west-2:123456789012:MyTopic", "arn:aws:sns:us-west-2:1234:T"],
)
def test_a_value_that_is_no_topic_arn_is_refused_naming_the_flag(
    value: str, relay_logger: None
) -> None:
    with pytest.raises(ConfigurationError, match="--events-topic-arn"):
        check_topic_arn(value)
    args = ["events", "--database-url", "sqlite://", "--events-queue-url", "https://q"]
    done = CliRunner().invoke(main, [*args, "--events-topic-arn", value])
    assert done.exit_code == 2
    assert "--events-topic-arn" in done.output
