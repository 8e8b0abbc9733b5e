"""The SES emulator's events: what arrives in SQS for each send, through real boto3 clients.

The relay's own ``SesSender`` sends through the fault server to moto; the fault server
publishes the events SES would to an SNS topic on moto, whose SQS subscription is the
``event_queue``. Each event is checked against AWS's documented example it copies (the keys,
at every level) and against the request it answers (the values), so the intake's tests read
events SES's shape, and the tags this relay really sends.
"""

from __future__ import annotations

import dataclasses
import json
import time
from datetime import UTC, datetime
from typing import Any

import boto3
import pytest

from relay.senders import Accepted, Ambiguous
from relay.senders.ses import SesSender, build_client
from tests.support.ses import AWS_VARIABLES, FaultPlan, FaultServer, aws_env, outgoing
from tests.support.ses_events import (
    DEFAULT_CONFIGURATION_SET,
    QueueMessage,
    template,
)
from tests.support.tls import make_certificate

SEND_TIMEOUT = 2.0  # moto answers within it on a loaded machine
HANG_SECONDS = 6.0  # well past it
SIM = "simulator.amazonses.com"


@pytest.fixture
def ses(moto, event_queue):
    with FaultServer(moto.url, FaultPlan(hang_seconds=HANG_SECONDS), events=event_queue) as server:
        yield server


@pytest.fixture
def sender_for(monkeypatch, tmp_path):
    """``sender_for(url, ca=None)``: the relay's SesSender from the standard chain (env only)."""
    for name in (*AWS_VARIABLES, "AWS_CA_BUNDLE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))

    def make(url, *, ca=None):
        for name, value in aws_env(url).items():
            monkeypatch.setenv(name, value)
        if ca is not None:
            monkeypatch.setenv("AWS_CA_BUNDLE", str(ca))
        return SesSender(build_client(send_timeout=SEND_TIMEOUT, concurrency=1))

    return make


@pytest.fixture
def sender(ses, sender_for):
    return sender_for(ses.url)


def message(n, **fields):
    """Message ``n`` as the relay hands it over, claimed under ``claim-{n}``."""
    return dataclasses.replace(outgoing(n, **fields), claim_token=f"claim-{n}")


def keys(value: Any) -> set[str]:
    """Every key path of a JSON value (list items share one path): its shape, not its values.
    Custom tags are values here (the example's ``myCustomTag1``, our ``outbox_message_id``);
    the ``ses:`` tags SES adds are shape."""
    return {
        path
        for path in _paths(value, "")
        if ".tags." not in path or path.partition(".tags.")[2].startswith("ses:")
    }


def _paths(value: Any, path: str) -> set[str]:
    if isinstance(value, dict):
        return {
            p
            for key, item in value.items()
            for p in {f"{path}.{key}", *_paths(item, f"{path}.{key}")}
        }
    if isinstance(value, list):
        return {p for item in value for p in _paths(item, f"{path}[]")}
    return set()


def events_of(messages: list[QueueMessage]) -> list[tuple[str, str | None]]:
    """``(eventType, recipient)`` of each message, sorted (SQS keeps no order)."""
    out = []
    for m in messages:
        part = m.event.get(m.event_type[0].lower() + m.event_type[1:], {})
        recipients = (
            part.get("recipients")
            or [r["emailAddress"] for r in part.get("bouncedRecipients", [])]
            or [r["emailAddress"] for r in part.get("complainedRecipients", [])]
            or [r["emailAddress"] for r in part.get("delayedRecipients", [])]
            or [None]
        )
        out.extend((m.event_type, r) for r in recipients)
    return sorted(out, key=lambda e: (e[0], e[1] or ""))


def ses_time(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC).timestamp()


SIMULATED = [
    pytest.param(f"success@{SIM}", [("Delivery", None)], "event_delivery", id="success"),
    pytest.param("customer@example.com", [("Delivery", None)], "event_delivery", id="any"),
    pytest.param(
        f"bounce@{SIM}", [("Bounce", "Permanent/General")], "event_bounce_permanent", id="bounce"
    ),
    pytest.param(
        f"complaint@{SIM}",
        [("Complaint", "abuse"), ("Delivery", None)],
        "event_complaint",
        id="complaint",
    ),
    pytest.param(
        f"suppressionlist@{SIM}",
        [("Bounce", "Permanent/OnAccountSuppressionList")],
        "event_bounce_on_account_suppression_list",
        id="suppressionlist",
    ),
    pytest.param(
        f"bounce+order-7@{SIM}",
        [("Bounce", "Permanent/General")],
        "event_bounce_permanent",
        id="labelled-bounce",
    ),
]


def detail(m: QueueMessage) -> str | None:
    if m.event_type == "Bounce":
        return f"{m.event['bounce']['bounceType']}/{m.event['bounce']['bounceSubType']}"
    if m.event_type == "Complaint":
        return str(m.event["complaint"]["complaintFeedbackType"])
    return None


@pytest.mark.parametrize(("address", "after_send", "fixture"), SIMULATED)
def test_each_simulator_address_gets_the_events_ses_publishes_in_a_real_sns_envelope(
    ses, sender, event_queue, address, after_send, fixture
):
    outcome = sender.send(message(1, to=[address]))
    ses.events.flush()
    got = event_queue.wait_for(1 + len(after_send))

    [request] = ses.sends
    assert outcome == Accepted(provider_message_id=request.message_id)
    assert sorted((m.event_type, detail(m)) for m in got) == sorted([("Send", None), *after_send])
    sns_shape = keys(template("sns_envelope.json")) - {".Subject"}  # SES publishes none
    for m in got:
        assert m.envelope == "sns"
        assert keys(m.notification) == sns_shape
        assert m.notification["Type"] == "Notification"
        assert m.notification["TopicArn"] == event_queue.topic_arn
        shape = fixture if m.event_type != "Send" else "event_send"
        if m.event_type == "Delivery":
            shape = "event_delivery"
        assert keys(m.event) == keys(template(f"{shape}.json")), m.event_type
        mail = m.event["mail"]
        assert mail["messageId"] == request.message_id
        assert mail["destination"] == [address]
        assert mail["source"] == "Shop <shop@example.com>"
        assert mail["commonHeaders"]["subject"] == "msg key-1"
        assert mail["tags"]["outbox_message_id"] == ["1"]
        assert mail["tags"]["outbox_attempt"] == ["claim-1"]
        assert mail["tags"]["outbox_category"] == ["default"]
        assert mail["tags"]["ses:configuration-set"] == [DEFAULT_CONFIGURATION_SET]
        assert mail["tags"]["ses:from-domain"] == ["example.com"]
        assert abs(ses_time(mail["timestamp"]) - request.wall) < 0.002
    for m in got:
        if m.event_type != "Send":
            [(_, recipient)] = events_of([m])
            assert recipient == address
            stamp = m.event[m.event_type.lower()]["timestamp"]
            assert ses_time(stamp) > ses_time(m.event["mail"]["timestamp"])
    assert ses.errors == []


def test_each_recipient_of_one_message_gets_its_own_events(ses, sender, event_queue):
    to = ["a@example.com", f"bounce@{SIM}"]
    cc = [f"complaint@{SIM}"]
    bcc = [f"suppressionlist@{SIM}"]
    sender.send(message(2, to=to, cc=cc, bcc=bcc, configuration_set="shop-events"))
    ses.events.flush()
    got = event_queue.wait_for(6)

    assert events_of(got) == [
        ("Bounce", f"bounce@{SIM}"),
        ("Bounce", f"suppressionlist@{SIM}"),
        ("Complaint", f"complaint@{SIM}"),
        ("Delivery", "a@example.com"),
        ("Delivery", f"complaint@{SIM}"),
        ("Send", None),
    ]
    for m in got:
        mail = m.event["mail"]
        assert mail["destination"] == [*to, *cc, *bcc]
        assert mail["commonHeaders"]["to"] == to  # the To header only: Bcc is in no header
        assert mail["tags"]["ses:configuration-set"] == ["shop-events"]
    assert event_queue.receive() == []  # nothing more


@pytest.mark.parametrize("kind", ["hang", "reset"])
def test_a_send_ses_took_without_answering_still_gets_its_events(ses, sender, event_queue, kind):
    ses.plan.script(kind)
    outcome = sender.send(message(3))
    ses.events.flush()
    got = event_queue.wait_for(2)

    [request] = ses.sends
    assert isinstance(outcome, Ambiguous)
    assert request.accepted
    assert sorted(m.event_type for m in got) == ["Delivery", "Send"]
    assert {m.event["mail"]["messageId"] for m in got} == {request.message_id}
    assert ses.errors == []


def test_a_tls_corrupted_answer_still_gets_its_events(moto, event_queue, sender_for, tmp_path):
    cert = make_certificate(tmp_path, "trusted")
    plan = FaultPlan()
    plan.script("tls_corrupt")
    with FaultServer(moto.url, plan, tls=cert.server_context(), events=event_queue) as server:
        outcome = sender_for(server.url, ca=cert.cert_file).send(message(4))
        server.events.flush()
        got = event_queue.wait_for(2)

    [request] = server.sends
    assert isinstance(outcome, Ambiguous), outcome
    assert outcome.code == "SSLError"
    assert sorted(m.event_type for m in got) == ["Delivery", "Send"]
    assert {m.event["mail"]["messageId"] for m in got} == {request.message_id}


@pytest.mark.parametrize("kind", ["reset_before", "throttle", "rejected", "server_error"])
def test_a_send_ses_did_not_take_publishes_nothing(ses, sender, event_queue, kind):
    ses.plan.script(kind)
    sender.send(message(5))
    sender.send(message(6))  # a pass after it: the events of message 6 are all that arrive
    ses.events.flush()
    got = event_queue.wait_for(2)
    time.sleep(0.2)
    got += event_queue.receive()

    first, second = ses.sends
    assert (first.kind, first.accepted, second.kind) == (kind, False, "pass")
    assert {m.event["mail"]["tags"]["outbox_message_id"][0] for m in got} == {"6"}
    assert len(got) == 2
    assert [r.outbox_id for r in ses.events.records] == [6, 6]


def test_delayed_events_keep_the_time_ses_took_the_send(ses, sender, event_queue):
    ses.plan.events_delay = 1.0
    sender.send(message(7))
    sent = time.time()
    time.sleep(0.5)
    assert event_queue.counts() == {"visible": 0, "in_flight": 0, "dead": 0}
    got = event_queue.wait_for(2, timeout=5)
    arrived = time.time()

    assert arrived - sent >= 1.0
    [request] = ses.sends
    for m in got:
        assert abs(ses_time(m.event["mail"]["timestamp"]) - request.wall) < 0.002
    assert all(r.published_at - request.wall >= 1.0 for r in ses.events.records)


def test_dropped_events_never_arrive_and_the_records_say_which(ses, sender, event_queue):
    ses.plan.events_drop = 1.0
    sender.send(message(8))
    ses.plan.events_drop = 0.0
    sender.send(message(9))
    ses.events.flush()
    got = event_queue.wait_for(2)
    time.sleep(0.2)
    got += event_queue.receive()

    assert {m.event["mail"]["tags"]["outbox_message_id"][0] for m in got} == {"9"}
    assert [(r.outbox_id, r.copies) for r in ses.events.records] == [(8, 0), (8, 0), (9, 1), (9, 1)]


def test_a_share_of_sends_loses_all_its_events_and_the_rest_none(ses, sender, event_queue):
    ses.plan.events_drop_sends = 0.5
    for n in range(20):
        sender.send(message(100 + n))
    ses.events.flush()
    records = ses.events.records
    got = event_queue.wait_for(sum(r.copies for r in records))

    per_send: dict[int | None, set[int]] = {}
    for r in records:
        per_send.setdefault(r.outbox_id, set()).add(r.copies)
    assert len(per_send) == 20
    assert all(copies in ({0}, {1}) for copies in per_send.values())
    lost = {n for n, copies in per_send.items() if copies == {0}}
    assert 3 <= len(lost) <= 17  # seeded: a share, neither none nor all
    arrived = {int(m.event["mail"]["tags"]["outbox_message_id"][0]) for m in got}
    assert arrived == set(per_send) - lost
    assert len(got) == 2 * (20 - len(lost))


def test_a_duplicated_event_arrives_twice_as_the_same_event(ses, sender, event_queue):
    ses.plan.events_duplicate = 1.0
    sender.send(message(10))
    ses.events.flush()
    got = event_queue.wait_for(4)

    bodies = sorted(m.notification["Message"] for m in got)
    assert bodies[0] == bodies[1]
    assert bodies[2] == bodies[3]
    assert bodies[1] != bodies[2]
    assert len({m.notification["MessageId"] for m in got}) == 4  # two SNS notifications each
    assert [r.copies for r in ses.events.records] == [2, 2]


def test_delivery_delay_and_reorder_shares(ses, sender, event_queue):
    ses.plan.events_delivery_delay = 1.0
    ses.plan.events_reorder = 1.0
    sender.send(message(11, to=["a@example.com", f"bounce@{SIM}"]))
    ses.events.flush()
    got = event_queue.wait_for(4)

    assert [r.kind for r in ses.events.records] == ["delivery_delay", "delivery", "bounce", "send"]
    assert events_of(got) == [
        ("Bounce", f"bounce@{SIM}"),
        ("Delivery", "a@example.com"),
        ("DeliveryDelay", "a@example.com"),
        ("Send", None),
    ]
    [delay] = [m for m in got if m.event_type == "DeliveryDelay"]
    assert keys(delay.event) == keys(template("event_delivery_delay.json"))


@pytest.mark.parametrize("envelope", ["eventbridge", "raw"])
def test_other_envelopes_reach_the_same_queue(ses, sender, event_queue, envelope):
    ses.plan.events_envelope = envelope
    sender.send(message(12, to=[f"bounce@{SIM}"]))
    ses.events.flush()
    got = event_queue.wait_for(2)

    assert {m.envelope for m in got} == {envelope}
    [bounce] = [m for m in got if m.event_type == "Bounce"]
    if envelope == "eventbridge":
        assert keys(bounce.notification) == keys(template("eventbridge_bounce.json"))
        assert bounce.notification["detail-type"] == "Email Bounced"
        assert bounce.notification["source"] == "aws.ses"
        assert {m.notification["detail-type"] for m in got} == {"Email Sent", "Email Bounced"}
    else:
        assert json.loads(bounce.body) == bounce.event
    assert keys(bounce.event) == keys(template("event_bounce_permanent.json"))


def test_a_publishing_failure_is_recorded_and_never_reaches_the_sender(
    ses, sender, event_queue, moto
):
    moto.client("sns").delete_topic(TopicArn=event_queue.topic_arn)
    outcome = sender.send(message(13))
    ses.events.flush()

    [request] = ses.sends
    assert outcome == Accepted(provider_message_id=request.message_id)
    assert len(ses.errors) == 1
    assert ses.errors[0].startswith(f"ses events for {request.message_id}: NotFoundException")
    assert event_queue.counts() == {"visible": 0, "in_flight": 0, "dead": 0}


def test_a_message_received_three_times_moves_to_the_dead_letter_queue(ses, sender, event_queue):
    """moto applies the queue's RedrivePolicy: what the intake's DLQ promise rests on."""
    sender.send(message(14))
    ses.events.flush()
    sqs = boto3.client(
        "sqs",
        endpoint_url=event_queue.endpoint_url,
        region_name=event_queue.region,
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    for receive in range(1, 4):
        messages: list[dict[str, Any]] = []
        deadline = time.monotonic() + 10  # on a loaded machine one receive may bring only one
        while len(messages) < 2 and time.monotonic() < deadline:
            batch = sqs.receive_message(
                QueueUrl=event_queue.url, MaxNumberOfMessages=10, WaitTimeSeconds=1
            )
            messages += batch.get("Messages", [])
        assert len(messages) == 2, receive
        for m in messages:  # give up on it at once instead of waiting out the timeout
            sqs.change_message_visibility(
                QueueUrl=event_queue.url, ReceiptHandle=m["ReceiptHandle"], VisibilityTimeout=0
            )
    assert sqs.receive_message(QueueUrl=event_queue.url).get("Messages", []) == []
    dead = event_queue.receive(dlq=True)
    assert sorted(m.event_type for m in dead) == ["Delivery", "Send"]
    assert all(m.receive_count == 4 for m in dead)


def test_the_relays_environment_points_sqs_and_sns_at_moto(moto, ses):
    env = aws_env(ses.url, events_url=moto.url)
    assert env["AWS_ENDPOINT_URL_SESV2"] == ses.url
    assert env["AWS_ENDPOINT_URL_SQS"] == env["AWS_ENDPOINT_URL_SNS"] == moto.url
    assert aws_env(moto.url)["AWS_ENDPOINT_URL_SQS"] == moto.url
