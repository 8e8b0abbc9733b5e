"""The events SES publishes for a message it accepted, and their way into SQS, for the emulator.

SES event publishing (a configuration set with an SNS event destination) sends one ``Send``
event for every message it accepts, then one event per recipient as the mail goes out. The
mailbox simulator decides the recipient's fate: ``bounce@simulator.amazonses.com`` bounces
(``Permanent``/``General``), ``complaint@`` is delivered and then complained about,
``suppressionlist@`` bounces ``Permanent``/``OnAccountSuppressionList``; any other address
(``success@``, ``ooto@``, a real-looking one) is delivered. A ``+label`` in the local part is
ignored, as SES ignores it.

The events are not written by us: each is a copy of AWS's documentation example in
``tests/fixtures/ses_events/`` (see its README) with only the per-message fields replaced:
``mail.timestamp``, ``source``, ``sourceArn``, ``messageId``, ``destination``, the From, To
and Subject headers, ``commonHeaders``, ``tags`` (the request's ``EmailTags`` plus the
example's ``ses:`` tags, ``ses:configuration-set`` and ``ses:from-domain`` set from the
request), and the recipient, timestamp and feedback id of the per-recipient object. Keys the
example has are kept in its order; no key is added.

:class:`EventPublisher` is what the :class:`~tests.support.ses.FaultServer` hands every send
moto accepted to: a worker thread builds the events and publishes them to the SNS topic an
:class:`EventQueue` subscribes (so the queue holds SNS's own envelope), or, as the plan says,
puts them on the queue in an EventBridge envelope or raw (the body SNS raw message delivery
would write). The plan's ``events_*`` settings delay, drop or duplicate events; nothing the
publisher does can slow or break the answer to ``SendEmail``.
"""

from __future__ import annotations

import copy
import heapq
import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from email.utils import parseaddr
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import boto3

if TYPE_CHECKING:
    from tests.support.ses import FaultPlan

__all__ = [
    "ACCOUNT",
    "DEFAULT_CONFIGURATION_SET",
    "DETAIL_TYPES",
    "ENVELOPES",
    "FIXTURES",
    "EventPublisher",
    "EventQueue",
    "PublishedEvent",
    "QueueMessage",
    "build_events",
    "eventbridge_envelope",
    "fates",
    "template",
    "unwrap",
]

ACCOUNT = "123456789012"  # moto's default account, the one its ARNs name
# SES publishes events only for a send with a configuration set; a request without one is
# treated as sent with the identity's default configuration set of this name
DEFAULT_CONFIGURATION_SET = "outbox-events"
SIMULATOR = "simulator.amazonses.com"
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "ses_events"
ENVELOPES = ("sns", "eventbridge", "raw")

# what happens to a recipient -> the fixture each of its events copies, in publishing order
_TEMPLATES = {
    "send": "event_send.json",
    "delivery": "event_delivery.json",
    "bounce": "event_bounce_permanent.json",
    "complaint": "event_complaint.json",
    "suppressed": "event_bounce_on_account_suppression_list.json",
    "delivery_delay": "event_delivery_delay.json",
    "eventbridge": "eventbridge_bounce.json",
}
# the simulator's local part -> the recipient's events after the Send
_SIMULATED = {
    "bounce": ("bounce",),
    "complaint": ("delivery", "complaint"),
    "suppressionlist": ("suppressed",),
}
# how long after SES took the message each event happens (SES's clock)
_OFFSETS = {
    "delivery_delay": timedelta(milliseconds=300),
    "bounce": timedelta(milliseconds=500),
    "suppressed": timedelta(milliseconds=20),
    "delivery": timedelta(milliseconds=800),
    "complaint": timedelta(milliseconds=1500),
}
# eventType -> EventBridge detail-type (Amazon Simple Email Service events reference)
DETAIL_TYPES = {
    "Send": "Email Sent",
    "Delivery": "Email Delivered",
    "Bounce": "Email Bounced",
    "Complaint": "Email Complaint Received",
    "DeliveryDelay": "Email Delivery Delayed",
    "Reject": "Email Rejected",
    "Rendering Failure": "Email Rendering Failed",
    "Open": "Email Opened",
    "Click": "Email Clicked",
    "Subscription": "Email Subscribed",
}


@cache
def _load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / name).read_text())
    return data


def template(name: str) -> dict[str, Any]:
    """A fresh copy of AWS's example ``name`` (a file of ``tests/fixtures/ses_events``, or one
    of this module's kinds: ``send``, ``delivery``, ``bounce``, ``complaint``, ``suppressed``,
    ``delivery_delay``, ``eventbridge``)."""
    return copy.deepcopy(_load(_TEMPLATES.get(name, name)))


def fates(address: str) -> tuple[str, ...]:
    """What the recipient ``address`` (as in the request, display name or not) goes through
    after the Send: the mailbox simulator's outcome for its addresses, delivery for any other."""
    local, _, domain = parseaddr(address)[1].lower().rpartition("@")
    if domain != SIMULATOR:
        return ("delivery",)
    return _SIMULATED.get(local.split("+", 1)[0], ("delivery",))


def _stamp(at: datetime) -> str:
    """SES's timestamp format: UTC, milliseconds, ``Z``."""
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.") + f"{at.microsecond // 1000:03d}Z"


def _recipients(request: Mapping[str, Any]) -> list[str]:
    destination = request.get("Destination", {})
    return [
        address
        for key in ("ToAddresses", "CcAddresses", "BccAddresses")
        for address in destination.get(key, [])
    ]


def _subject(request: Mapping[str, Any]) -> str:
    simple = request.get("Content", {}).get("Simple", {})
    return str(simple.get("Subject", {}).get("Data", ""))


def _mail(
    template_mail: dict[str, Any], request: Mapping[str, Any], message_id: str, at: datetime
) -> dict[str, Any]:
    """``template_mail`` (the example's ``mail``) with this message's fields."""
    sender = str(request.get("FromEmailAddress", ""))
    sender_address = parseaddr(sender)[1]
    to = list(request.get("Destination", {}).get("ToAddresses", []))
    tags = {str(t["Name"]): str(t["Value"]) for t in request.get("EmailTags", [])}
    values = {
        "timestamp": _stamp(at),
        "source": sender,
        "sourceArn": f"arn:aws:ses:{_region(template_mail)}:{ACCOUNT}:identity/{sender_address}",
        "sendingAccountId": ACCOUNT,
        "messageId": message_id,
        "destination": _recipients(request),
    }
    mail = {key: values.get(key, value) for key, value in template_mail.items()}
    headers = {
        "From": sender,
        "To": ", ".join(to),
        "Subject": _subject(request),
        "X-SES-MESSAGE-TAGS": ", ".join(f"{k}={v}" for k, v in tags.items()),
    }
    if "headers" in mail:
        mail["headers"] = [
            {**header, "value": headers.get(header["name"], header["value"])}
            for header in mail["headers"]
            if headers.get(header["name"], True)  # an empty To or tag header is left out
        ]
    if "commonHeaders" in mail:
        common = {
            "from": [sender],
            "to": to,
            "messageId": message_id,
            "subject": _subject(request),
        }
        mail["commonHeaders"] = {
            key: common.get(key, value)
            for key, value in mail["commonHeaders"].items()
            if key != "to" or to
        }
    if "tags" in mail:
        known = {
            "ses:configuration-set": [
                str(request.get("ConfigurationSetName") or DEFAULT_CONFIGURATION_SET)
            ],
            "ses:from-domain": [sender_address.rpartition("@")[2]],
        }
        mail["tags"] = {
            **{
                key: known.get(key, value)
                for key, value in mail["tags"].items()
                if key.startswith("ses:")
            },
            **{name: [value] for name, value in tags.items()},
        }
    return mail


def _region(mail: Mapping[str, Any]) -> str:
    return str(mail.get("sourceArn", "arn:aws:ses:us-east-1")).split(":")[3]


def _recipient_event(kind: str, address: str, at: datetime) -> dict[str, Any]:
    """The example of ``kind`` with its per-recipient object filled for ``address``."""
    event = template(kind)
    happened = at + _OFFSETS[kind]
    recipient = parseaddr(address)[1]
    feedback = f"{uuid.uuid4().hex}-000000"
    if kind == "delivery":
        part = event["delivery"]
        part["timestamp"] = _stamp(happened)
        part["processingTimeMillis"] = int(_OFFSETS[kind] / timedelta(milliseconds=1))
        part["recipients"] = [recipient]
    elif kind in ("bounce", "suppressed"):
        part = event["bounce"]
        part["timestamp"] = _stamp(happened)
        part["feedbackId"] = feedback
        part["bouncedRecipients"] = [{**part["bouncedRecipients"][0], "emailAddress": recipient}]
    elif kind == "complaint":
        part = event["complaint"]
        part["timestamp"] = part["arrivalDate"] = _stamp(happened)
        part["feedbackId"] = feedback
        part["complainedRecipients"] = [
            {**part["complainedRecipients"][0], "emailAddress": recipient}
        ]
    elif kind == "delivery_delay":
        part = event["deliveryDelay"]
        part["timestamp"] = _stamp(happened)
        part["expirationTime"] = _stamp(at + timedelta(hours=12))
        part["delayedRecipients"] = [{**part["delayedRecipients"][0], "emailAddress": recipient}]
    else:
        raise ValueError(f"no per-recipient event {kind!r}")
    return event


def build_events(
    request: Mapping[str, Any],
    message_id: str,
    at: datetime,
    *,
    delayed: Iterable[str] = (),
) -> list[tuple[str, str | None, dict[str, Any]]]:
    """The events SES publishes for the accepted ``request`` (SendEmail's JSON) that it gave
    ``message_id`` at ``at``: ``(kind, recipient or None, event)``, the Send first, then each
    recipient's in the order they happen. A recipient in ``delayed`` (as in the request) gets
    a DeliveryDelay before its other events."""
    delayed = set(delayed)
    at = at.astimezone(UTC)
    steps: list[tuple[str, str | None]] = [("send", None)]
    for address in _recipients(request):
        steps.extend(
            (kind, address)
            for kind in (("delivery_delay",) if address in delayed else ()) + fates(address)
        )
    out: list[tuple[str, str | None, dict[str, Any]]] = []
    for kind, recipient in steps:
        event = template(kind) if recipient is None else _recipient_event(kind, recipient, at)
        event["mail"] = _mail(event["mail"], request, message_id, at)
        out.append((kind, None if recipient is None else parseaddr(recipient)[1], event))
    return out


def eventbridge_envelope(event: Mapping[str, Any], *, region: str) -> dict[str, Any]:
    """``event`` as EventBridge delivers it to an SQS target (the event is ``detail``)."""
    envelope = template("eventbridge")
    mail_at = datetime.strptime(event["mail"]["timestamp"], "%Y-%m-%dT%H:%M:%S.%fZ")
    values = {
        "id": str(uuid.uuid4()),
        "detail-type": DETAIL_TYPES[event["eventType"]],
        "account": ACCOUNT,
        "time": mail_at.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "region": region,
        "detail": dict(event),
    }
    return {key: values.get(key, value) for key, value in envelope.items()}


# -- the queue ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class QueueMessage:
    """One SQS message as a consumer receives it, its envelope taken apart."""

    body: str
    sqs_message_id: str
    receive_count: int
    envelope: str  # "sns", "eventbridge" or "raw"
    notification: dict[str, Any] | None  # the SNS or EventBridge envelope, None for raw
    event: dict[str, Any]  # the SES event object

    @property
    def event_type(self) -> str:
        return str(self.event.get("eventType"))


def unwrap(body: str) -> tuple[str, dict[str, Any] | None, dict[str, Any]]:
    """``(envelope, envelope object, SES event)`` of an SQS body the emulator could write."""
    data = json.loads(body)
    if data.get("Type") == "Notification" and "TopicArn" in data:
        return "sns", data, json.loads(data["Message"])
    if data.get("source") == "aws.ses" and "detail" in data:
        return "eventbridge", data, data["detail"]
    return "raw", None, data


@dataclass(frozen=True, kw_only=True)
class EventQueue:
    """An SQS queue with a dead-letter queue, subscribed (SNS envelope, not raw) to the topic
    the emulator publishes SES events to: a configuration set's SNS event destination."""

    endpoint_url: str
    region: str
    topic_arn: str
    subscription_arn: str
    url: str
    arn: str
    dlq_url: str
    dlq_arn: str
    visibility_timeout: int
    max_receive_count: int
    _sqs: Any = field(repr=False, compare=False)

    @classmethod
    def create(
        cls,
        endpoint_url: str,
        *,
        name: str | None = None,
        region: str = "us-east-1",
        visibility_timeout: int = 2,
        max_receive_count: int = 3,
    ) -> EventQueue:
        """A fresh topic, queue and DLQ named after ``name`` (random by default) on the moto
        server at ``endpoint_url``."""
        name = name or f"ses-events-{uuid.uuid4().hex[:8]}"
        sqs = _client("sqs", endpoint_url, region)
        sns = _client("sns", endpoint_url, region)
        dlq_url = sqs.create_queue(QueueName=f"{name}-dlq")["QueueUrl"]
        dlq_arn = _queue_arn(sqs, dlq_url)
        redrive = {"deadLetterTargetArn": dlq_arn, "maxReceiveCount": str(max_receive_count)}
        url = sqs.create_queue(
            QueueName=name,
            Attributes={
                "VisibilityTimeout": str(visibility_timeout),
                "RedrivePolicy": json.dumps(redrive),
            },
        )["QueueUrl"]
        arn = _queue_arn(sqs, url)
        topic_arn = sns.create_topic(Name=name)["TopicArn"]
        subscription_arn = sns.subscribe(
            TopicArn=topic_arn,
            Protocol="sqs",
            Endpoint=arn,
            Attributes={"RawMessageDelivery": "false"},
            ReturnSubscriptionArn=True,
        )["SubscriptionArn"]
        return cls(
            endpoint_url=endpoint_url,
            region=region,
            topic_arn=topic_arn,
            subscription_arn=subscription_arn,
            url=url,
            arn=arn,
            dlq_url=dlq_url,
            dlq_arn=dlq_arn,
            visibility_timeout=visibility_timeout,
            max_receive_count=max_receive_count,
            _sqs=sqs,
        )

    def receive(self, *, dlq: bool = False, delete: bool = True) -> list[QueueMessage]:
        """Every message visible now on the queue (or its DLQ), received and, unless told
        otherwise, deleted: a test reads what arrived and leaves an empty queue. Each receive
        counts toward the redrive policy, so reading without deleting moves messages to the
        DLQ after ``max_receive_count`` reads."""
        url = self.dlq_url if dlq else self.url
        out: list[QueueMessage] = []
        while True:
            batch = self._sqs.receive_message(
                QueueUrl=url,
                MaxNumberOfMessages=10,
                WaitTimeSeconds=0,
                AttributeNames=["ApproximateReceiveCount"],
            ).get("Messages", [])
            if not batch:
                return out
            for message in batch:
                envelope, notification, event = unwrap(message["Body"])
                out.append(
                    QueueMessage(
                        body=message["Body"],
                        sqs_message_id=message["MessageId"],
                        receive_count=int(message["Attributes"]["ApproximateReceiveCount"]),
                        envelope=envelope,
                        notification=notification,
                        event=event,
                    )
                )
            if delete:
                self._sqs.delete_message_batch(
                    QueueUrl=url,
                    Entries=[
                        {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]}
                        for i, m in enumerate(batch)
                    ],
                )

    def wait_for(
        self, count: int, *, timeout: float = 10.0, dlq: bool = False
    ) -> list[QueueMessage]:
        """Receive (and delete) until ``count`` messages arrived; an ``AssertionError`` names
        what did arrive if they do not within ``timeout`` seconds."""
        got: list[QueueMessage] = []
        deadline = time.monotonic() + timeout
        while len(got) < count:
            got.extend(self.receive(dlq=dlq))
            if len(got) >= count:
                break
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{len(got)} of {count} messages within {timeout} s: "
                    f"{[m.event_type for m in got]}"
                )
            time.sleep(0.05)
        return got

    def counts(self) -> dict[str, int]:
        """What SQS says it holds: ``visible``, ``in_flight`` (received, not deleted, not yet
        visible again) and ``dead`` (on the DLQ), without receiving anything."""
        names = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
        main = self._sqs.get_queue_attributes(QueueUrl=self.url, AttributeNames=names)
        dead = self._sqs.get_queue_attributes(QueueUrl=self.dlq_url, AttributeNames=names)
        return {
            "visible": int(main["Attributes"]["ApproximateNumberOfMessages"]),
            "in_flight": int(main["Attributes"]["ApproximateNumberOfMessagesNotVisible"]),
            "dead": int(dead["Attributes"]["ApproximateNumberOfMessages"])
            + int(dead["Attributes"]["ApproximateNumberOfMessagesNotVisible"]),
        }


def _client(service: str, endpoint_url: str, region: str) -> Any:
    return boto3.client(
        service,
        endpoint_url=endpoint_url,
        region_name=region,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )


def _queue_arn(sqs: Any, url: str) -> str:
    attributes = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])
    return str(attributes["Attributes"]["QueueArn"])


# -- the publisher -----------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class PublishedEvent:
    """One event the publisher built for an accepted send, and what became of it."""

    message_id: str  # mail.messageId: moto's MessageId
    outbox_id: int | None
    event_type: str  # eventType: Send, Delivery, Bounce, Complaint, DeliveryDelay
    kind: str  # send, delivery, bounce, complaint, suppressed, delivery_delay
    recipient: str | None  # the addr-spec a per-recipient event concerns
    envelope: str
    copies: int  # 0 dropped, 1 published, 2 published twice
    event: dict[str, Any]
    published_at: float | None = None  # time.time() when it was handed to SNS / SQS


@dataclass(frozen=True, kw_only=True, slots=True)
class _Settings:
    """The plan's ``events_*`` settings as they were when SES took a send."""

    envelope: str
    drop: float
    drop_sends: float
    duplicate: float
    delivery_delay: float
    reorder: float


class EventPublisher:
    """Builds and publishes the events of accepted sends on its own thread, as ``plan`` says:

    * ``events_envelope``: ``"sns"`` (publish to the topic), ``"eventbridge"`` or ``"raw"``
      (straight onto the queue, as an EventBridge rule or SNS raw delivery would);
    * ``events_delay``: seconds between SES taking the send and its events being published
      (the events keep their own timestamps);
    * ``events_drop``: share of events never published; ``events_drop_sends``: share of sends
      none of whose events is published;
    * ``events_duplicate``: share of events published twice (two SNS notifications of the same
      event, as SNS and SQS's at-least-once delivery may hand over);
    * ``events_delivery_delay``: share of delivered recipients that get a DeliveryDelay first;
    * ``events_reorder``: share of sends whose recipients' events are published before the Send.

    The settings in force when SES took a send apply to its events, whenever they are
    published. An error is passed to ``on_error`` and the event is lost, never raised to the
    sender."""

    def __init__(
        self, destination: EventQueue, plan: FaultPlan, on_error: Callable[[str], None]
    ) -> None:
        self.destination = destination
        self.plan = plan
        self._on_error = on_error
        self._sns = _client("sns", destination.endpoint_url, destination.region)
        self._sqs = _client("sqs", destination.endpoint_url, destination.region)
        self._heap: list[tuple[float, int, Any]] = []
        self._order = itertools.count()
        self._busy = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._records: list[PublishedEvent] = []
        self._thread = threading.Thread(target=self._run, name="ses-events", daemon=True)
        self._thread.start()

    @property
    def records(self) -> list[PublishedEvent]:
        """Every event built so far, published or dropped, in publishing order."""
        with self._cond:
            return list(self._records)

    @property
    def published(self) -> list[PublishedEvent]:
        return [r for r in self.records if r.copies]

    def submit(
        self, *, request: dict[str, Any], message_id: str, outbox_id: int | None, wall: float
    ) -> None:
        """Publish the events of a send SES accepted at ``wall`` (epoch seconds): returns at
        once, the building and publishing happen on the publisher's thread."""
        plan = self.plan
        settings = _Settings(
            envelope=plan.events_envelope,
            drop=plan.events_drop,
            drop_sends=plan.events_drop_sends,
            duplicate=plan.events_duplicate,
            delivery_delay=plan.events_delivery_delay,
            reorder=plan.events_reorder,
        )
        with self._cond:
            due = time.monotonic() + plan.events_delay
            send = (request, message_id, outbox_id, wall, settings)
            heapq.heappush(self._heap, (due, next(self._order), send))
            self._cond.notify()

    def flush(self, timeout: float = 10.0) -> None:
        """Wait until everything submitted so far (delays included) was published."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._heap or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(self._heap)} sends' events still unpublished")
                self._cond.wait(min(left, 0.05))

    def stop(self) -> None:
        """Stop; events still waiting for their delay are not published."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(10)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and (
                    not self._heap or self._heap[0][0] > time.monotonic()
                ):
                    wait = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cond.wait(wait)
                if self._stopping:
                    return
                _, _, send = heapq.heappop(self._heap)
                self._busy += 1
            try:
                self._publish_send(*send)
            except Exception as exc:
                self._on_error(f"ses events for {send[1]}: {type(exc).__name__}: {exc}")
            finally:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()

    def _publish_send(
        self,
        request: dict[str, Any],
        message_id: str,
        outbox_id: int | None,
        wall: float,
        settings: _Settings,
    ) -> None:
        roll = self.plan.events_roll
        delayed = [
            address
            for address in _recipients(request)
            if fates(address)[0] == "delivery" and roll() < settings.delivery_delay
        ]
        built = build_events(
            request, message_id, datetime.fromtimestamp(wall, UTC), delayed=delayed
        )
        if roll() < settings.reorder:
            built = [*built[1:], built[0]]
        drop_all = roll() < settings.drop_sends
        envelope = settings.envelope
        for kind, recipient, event in built:
            copies = 0 if drop_all or roll() < settings.drop else 1
            if copies and roll() < settings.duplicate:
                copies = 2
            for _ in range(copies):
                self._publish(event, envelope)
            with self._cond:
                self._records.append(
                    PublishedEvent(
                        message_id=message_id,
                        outbox_id=outbox_id,
                        event_type=event["eventType"],
                        kind=kind,
                        recipient=recipient,
                        envelope=envelope,
                        copies=copies,
                        event=event,
                        published_at=time.time() if copies else None,
                    )
                )

    def _publish(self, event: dict[str, Any], envelope: str) -> None:
        if envelope == "sns":
            self._sns.publish(TopicArn=self.destination.topic_arn, Message=json.dumps(event))
        elif envelope == "eventbridge":
            body = eventbridge_envelope(event, region=self.destination.region)
            self._sqs.send_message(QueueUrl=self.destination.url, MessageBody=json.dumps(body))
        elif envelope == "raw":
            self._sqs.send_message(QueueUrl=self.destination.url, MessageBody=json.dumps(event))
        else:
            raise ValueError(f"unknown events envelope {envelope!r}")
