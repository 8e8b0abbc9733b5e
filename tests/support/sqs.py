"""SES events as they reach the intake's queue, the queue itself on moto's server, and rows
staged as the relay leaves them for the events to find.

``ses_event(kind, ...)`` is one of AWS's documented event examples
(``tests/fixtures/ses_events``) with the ids, tags, recipients and times of a test's message
substituted; ``sns_body`` wraps it in the SNS envelope an SNS -> SQS subscription delivers,
``raw_body`` is SQS raw message delivery. :class:`EventQueue` is an SQS queue on moto with a
dead-letter queue (``RedrivePolicy`` ``maxReceiveCount`` 3) and a short visibility timeout,
so a message the intake leaves on the queue comes back within a second.
"""

from __future__ import annotations

import copy
import json
import uuid
from datetime import UTC, datetime, timedelta
from functools import cache
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from outbox.schema import Status, attempts, messages
from tests.support.factories import enqueue
from tests.support.ses import REGION, MotoSes

__all__ = [
    "KINDS",
    "MAIL_AT",
    "MAX_RECEIVES",
    "EventQueue",
    "raw_body",
    "ses_event",
    "sns_body",
    "stage",
    "stamp",
]

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "ses_events"
MAIL_AT = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)  # when SES took a test's send (SES's clock)
MAX_RECEIVES = 3  # the queue's maxReceiveCount
VISIBILITY_SECONDS = 1

# kind: (fixture file, the event's own object, its recipients' field)
KINDS: dict[str, tuple[str, str | None, str | None]] = {
    "send": ("event_send.json", None, None),
    "delivery": ("event_delivery.json", "delivery", "recipients"),
    "bounce": ("event_bounce_permanent.json", "bounce", "bouncedRecipients"),
    "bounce_transient": ("event_bounce_transient.json", "bounce", "bouncedRecipients"),
    "bounce_suppressed": ("event_bounce_suppressed.json", "bounce", "bouncedRecipients"),
    "complaint": ("event_complaint.json", "complaint", "complainedRecipients"),
    "delivery_delay": ("event_delivery_delay.json", "deliveryDelay", "delayedRecipients"),
    "reject": ("event_reject.json", None, None),
    "open": ("event_open.json", "open", None),
    "notification_delivery": ("notification_delivery.json", "delivery", "recipients"),
    "notification_bounce": ("notification_bounce.json", "bounce", "bouncedRecipients"),
    "notification_complaint": ("notification_complaint.json", "complaint", "complainedRecipients"),
}


@cache
def _fixture(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((FIXTURES / name).read_text())
    return loaded


def stamp(when: datetime) -> str:
    """SES's timestamp form: ``2016-10-19T23:21:04.133Z``."""
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z"


def ses_event(
    kind: str,
    *,
    provider_id: str,
    message_id: int | str | None = None,
    claim_token: str | None = None,
    to: str = "customer0@example.com",
    mail_at: datetime | None = None,
    at: datetime | None = None,
) -> dict[str, Any]:
    """AWS's example of ``kind`` (see :data:`KINDS`) for SES message ``provider_id``, tagged
    ``outbox_message_id`` / ``outbox_attempt`` when given (identity notifications carry no
    tags, whatever is given), to ``to``; SES took it at ``mail_at`` and the event happened at
    ``at`` (default a second later)."""
    name, inner, field = KINDS[kind]
    event = copy.deepcopy(_fixture(name))
    mail_at = mail_at or MAIL_AT
    at = at or mail_at + timedelta(seconds=1)
    mail = event["mail"]
    mail["messageId"] = provider_id
    mail["timestamp"] = stamp(mail_at)
    mail["destination"] = [to]
    if "commonHeaders" in mail:
        mail["commonHeaders"]["to"] = [to]
    if "notificationType" not in event:
        tags = mail.setdefault("tags", {})
        if message_id is not None:
            tags["outbox_message_id"] = [str(message_id)]
        if claim_token is not None:
            tags["outbox_attempt"] = [claim_token]
    if inner is not None:
        body = event[inner]
        if "timestamp" in body:
            body["timestamp"] = stamp(at)
        if field == "recipients":
            body[field] = [to]
        elif field is not None:
            body[field] = [{**body[field][0], "emailAddress": to}]
    return event


def sns_body(event: dict[str, Any]) -> str:
    """``event`` as SNS delivers it to an SQS queue (its envelope, ``Message`` a JSON
    string), with a fresh SNS MessageId: two publications of one event differ here only."""
    envelope = copy.deepcopy(_fixture("sns_envelope.json"))
    envelope.pop("Subject", None)
    envelope["MessageId"] = str(uuid.uuid4())
    envelope["Message"] = json.dumps(event, separators=(",", ":"))
    return json.dumps(envelope)


def raw_body(event: dict[str, Any]) -> str:
    """``event`` as SQS raw message delivery passes it on."""
    return json.dumps(event)


class EventQueue:
    """An events queue and its dead-letter queue on ``moto`` (reset by the ``moto`` fixture
    for every test): ``VisibilityTimeout`` 1 s, ``maxReceiveCount`` :data:`MAX_RECEIVES`."""

    def __init__(self, moto: MotoSes, name: str = "outbox-events") -> None:
        self.client = moto.client("sqs")
        self.endpoint = moto.url
        dead = self.client.create_queue(QueueName=f"{name}-dlq")["QueueUrl"]
        arn = self.client.get_queue_attributes(QueueUrl=dead, AttributeNames=["QueueArn"])[
            "Attributes"
        ]["QueueArn"]
        self.dead_letter_url = dead
        self.url = self.client.create_queue(
            QueueName=name,
            Attributes={
                "VisibilityTimeout": str(VISIBILITY_SECONDS),
                "RedrivePolicy": json.dumps(
                    {"deadLetterTargetArn": arn, "maxReceiveCount": str(MAX_RECEIVES)}
                ),
            },
        )["QueueUrl"]

    def send(self, *bodies: str) -> None:
        for body in bodies:
            self.client.send_message(QueueUrl=self.url, MessageBody=body)

    def depth(self, url: str | None = None) -> int:
        """Messages on the queue (or ``url``), visible or in flight."""
        attributes = self.client.get_queue_attributes(
            QueueUrl=url or self.url,
            AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
        )["Attributes"]
        return int(attributes["ApproximateNumberOfMessages"]) + int(
            attributes["ApproximateNumberOfMessagesNotVisible"]
        )

    def dead_letters(self) -> list[str]:
        """The bodies on the dead-letter queue (received, and left there to be seen again)."""
        answer = self.client.receive_message(
            QueueUrl=self.dead_letter_url, MaxNumberOfMessages=10, VisibilityTimeout=0
        )
        return [m["Body"] for m in answer.get("Messages", [])]

    def env(self) -> dict[str, str]:
        """What a relay process needs to reach this queue (with :func:`aws_env`'s rest)."""
        return {"AWS_ENDPOINT_URL_SQS": self.endpoint, "AWS_REGION": REGION}


def stage(
    engine: sa.Engine,
    status: Status,
    *,
    tokens: tuple[str, ...] = (),
    current: str | None = None,
    provider_id: str | None = None,
    attempt_ids: tuple[str | None, ...] = (),
    to: str | tuple[str, ...] = "customer0@example.com",
) -> int:
    """One message left in ``status``: an ambiguous attempt row per claim token in
    ``tokens`` (with the SES message id of the same place in ``attempt_ids``), ``current``
    its claim token now, ``provider_id`` on the row, sent to ``to`` (one address or
    several)."""
    (message_id,) = enqueue(engine, 1, to=[to] if isinstance(to, str) else list(to))
    with engine.begin() as conn:
        for n, token in enumerate(tokens):
            conn.execute(
                sa.insert(attempts).values(
                    message_id=message_id,
                    claim_token=token,
                    relay_id="relay-a",
                    started_at=MAIL_AT - timedelta(seconds=1),
                    finished_at=MAIL_AT,
                    outcome="ambiguous",
                    provider_message_id=attempt_ids[n] if n < len(attempt_ids) else None,
                )
            )
        conn.execute(
            sa.update(messages)
            .where(messages.c.id == message_id)
            .values(
                status=status.value,
                claim_token=current,
                provider_message_id=provider_id,
                attempt_count=len(tokens),
                last_error_code="ReadTimeoutError" if status is Status.UNKNOWN_OUTCOME else None,
                sent_at=MAIL_AT if status is Status.SENT else None,
            )
        )
    return message_id
