"""The edges of what the intake stores, on PostgreSQL and MariaDB (utf8mb4), through its loop
on moto's SQS or its own entry points:

- the caps on an event's stored text, met exactly, passed by one character, and passed with
  4-byte characters (emoji) around the cut: never ``Data too long``, never left on the
  queue, always cut between characters;
- oversized ids (SES message id, SNS MessageId, feedback id) and tags (configuration set,
  custom keys and values, the relay's own tags): stored, cut or ignored, never a crash, and
  only an event that cannot be SES's (a message id over 255 characters) is left for the
  dead-letter queue, as every malformed event is;
- EventBridge events from the topic's account that SES did not publish (another ``source``)
  or whose ``detail-type`` says something else than their detail: never applied as SES's.
"""

from __future__ import annotations

import copy
import json
import uuid
from typing import Any

import pytest
import sqlalchemy as sa

from outbox.schema import Status, events, suppressions
from relay.clock import read_database_time
from relay.events import MAX_BODY_BYTES, parse
from relay.intake import Effect, Intake, apply_events, build_client
from tests.support.db import Backend, row
from tests.support.ses import MotoSes, aws_env
from tests.support.sqs import EventQueue, ses_event, sns_body, stage
from tests.support.waiting import wait_for

OURS = "arn:aws:sns:us-west-2:123456789012:MyTopic"  # sns_body's envelope names this one
ACCOUNT = "123456789012"
UNMATCHED_CAP = 300  # characters of an unmatched or foreign event's recipients and error
MATCHED_CAP = 16_000  # characters of a matched event's recipients
EMOJI = "\U0001f600"  # 4 bytes in UTF-8


@pytest.fixture
def queue(moto: MotoSes, monkeypatch: pytest.MonkeyPatch) -> EventQueue:
    for name, value in {**aws_env(moto.url), "AWS_ENDPOINT_URL_SQS": moto.url}.items():
        monkeypatch.setenv(name, value)
    return EventQueue(moto)


def intake_for(backend: Backend, queue: EventQueue, **kw: Any) -> Intake:
    client = build_client(queue.url, wait_seconds=0)
    return Intake(engine=backend.engine, client=client, queue_url=queue.url, wait_seconds=0, **kw)


def drain(intake: Intake, queue: EventQueue) -> None:
    wait_for(lambda: intake.step() == 0 and queue.depth() == 0, timeout=30.0)


def envelope(event: dict[str, Any], **changed: Any) -> str:
    """``event`` in an SNS envelope, UTF-8 as it is (not ``\\u`` escapes: the body stays under
    SQS's 256 KiB), with ``changed`` envelope fields."""
    outer = {**json.loads(sns_body({})), **changed}
    outer["Message"] = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    body = json.dumps(outer, ensure_ascii=False)
    assert len(body.encode()) < MAX_BODY_BYTES
    return body


def stored(backend: Backend) -> dict[str, sa.Row[Any]]:
    """Every recorded event, by SES message id."""
    with backend.engine.connect() as conn:
        return {e.provider_message_id: e for e in conn.execute(sa.select(events))}


def bytes_of(backend: Backend, column: str, provider_id: str) -> int:
    """How many bytes the database holds in ``column`` of the event ``provider_id``."""
    function = "octet_length" if backend.name == "postgresql" else "LENGTH"
    query = sa.select(sa.func.coalesce(getattr(sa.func, function)(events.c[column]), 0)).where(
        events.c.provider_message_id == provider_id
    )
    with backend.engine.connect() as conn:
        return int(conn.execute(query).scalar_one())


def addresses_of_length(lengths: list[int], *, wide: bool) -> list[str]:
    """One address per length, lower-case and unique (``<n>@x.io`` after a local part of
    emoji when ``wide``, of ``a`` otherwise)."""
    made = []
    for n, length in enumerate(lengths):
        tail = f"{n}@x.io"
        made.append(("\U0001f600" if wide else "a") * (length - len(tail)) + tail)
    assert [len(a) for a in made] == lengths
    return made


# -- the caps, at and around the boundary -------------------------------------------------


@pytest.mark.parametrize("wide", [False, True], ids=["ascii", "emoji"])
@pytest.mark.parametrize("over", [0, 1], ids=["at_cap", "one_over"])
def test_an_unmatched_events_recipients_at_and_over_the_cap(
    server_backend: Backend, queue: EventQueue, wide: bool, over: int
) -> None:
    """Two addresses joined (``a, b``) in exactly the cap, or one character more: kept whole,
    or the first whole and then how many there were; in 4-byte characters too."""
    lengths = [150, UNMATCHED_CAP - 152 + over]  # 150 + len(", ") + the rest
    addresses = addresses_of_length(lengths, wide=wide)
    event = ses_event("send", provider_id=f"cap-{over}")
    event["mail"]["destination"] = addresses
    queue.send(envelope(event))

    intake = intake_for(server_backend, queue)
    drain(intake, queue)

    assert queue.dead_letters() == []
    found = stored(server_backend)[f"cap-{over}"]
    assert found.effect == "unmatched"
    if over:
        assert found.recipients == f"{addresses[0]}, [2 addresses, cut]"
    else:
        assert found.recipients == ", ".join(addresses)
        assert len(found.recipients) == UNMATCHED_CAP
    expected_bytes = len(found.recipients.encode())
    assert bytes_of(server_backend, "recipients", f"cap-{over}") == expected_bytes
    assert intake.counts == {("send", "unmatched"): 1}


@pytest.mark.parametrize("straddle", range(4))
def test_a_foreign_events_error_is_cut_between_emoji(
    server_backend: Backend, queue: EventQueue, straddle: int
) -> None:
    """A topic name of emoji makes the foreign event's error (which names the topic) longer
    than the cap; the cut falls at each offset of the emoji around it, and keeps whole
    characters only."""
    name = "a" * straddle + EMOJI * 250  # an SNS origin is at most 320 printable characters
    theirs = f"arn:aws:sns:us-west-2:210987654321:{name}"
    assert len(theirs) <= 320
    event = ses_event("send", provider_id=f"foreign-{straddle}")
    queue.send(envelope(event, TopicArn=theirs))

    intake = intake_for(server_backend, queue, topic_arn=OURS)
    drain(intake, queue)

    found = stored(server_backend)[f"foreign-{straddle}"]
    assert found.effect == "foreign"
    assert len(found.error) <= UNMATCHED_CAP
    kept, _, marker = found.error.partition(" [cut from ")
    assert marker.endswith(" characters]"), found.error
    assert f"from SNS topic {theirs}, not {OURS}".startswith(kept)  # a prefix, whole emoji
    assert "\ufffd" not in found.error
    assert "?" not in kept
    assert bytes_of(server_backend, "error", f"foreign-{straddle}") == len(found.error.encode())


def test_a_matched_events_recipients_of_emoji_fit_what_a_text_column_holds(
    server_backend: Backend, queue: EventQueue
) -> None:
    """Past the matched cap in 4-byte characters: 16,000 characters are 64,000 bytes, under
    the 65,535 of a MariaDB TEXT; the event is applied and leaves the queue."""
    sent = stage(server_backend.engine, Status.SENT, provider_id="ses-wide")
    addresses = addresses_of_length([320] * 55, wide=True)  # 17,700 characters joined
    event = ses_event("delivery", provider_id="ses-wide")
    event["delivery"]["recipients"] = addresses
    queue.send(envelope(event))

    intake = intake_for(server_backend, queue)
    drain(intake, queue)

    assert queue.dead_letters() == []
    found = stored(server_backend)["ses-wide"]
    assert (found.effect, found.message_id) == ("status", sent)
    assert MATCHED_CAP - 322 < len(found.recipients) <= MATCHED_CAP
    kept = found.recipients.removesuffix(", [55 addresses, cut]").split(", ")
    assert len(kept) == 49  # whole addresses, then how many
    assert kept == addresses[:49]
    assert 60_000 < bytes_of(server_backend, "recipients", "ses-wide") <= 65_535
    assert row(server_backend.engine, sent).delivery_status == "delivered"


# -- oversized ids and tags ----------------------------------------------------------------


def test_oversized_ids_and_tags_are_stored_cut_or_ignored_never_refused(
    server_backend: Backend, queue: EventQueue
) -> None:
    big = "x" * 100_000
    token = str(uuid.uuid4())
    held = stage(server_backend.engine, Status.UNKNOWN_OUTCOME, tokens=(token,))
    sent = stage(server_backend.engine, Status.SENT, provider_id=EMOJI * 255)
    bodies = []

    # the longest SES message id stored, in 4-byte characters, matched to its row
    complaint = ses_event("complaint", provider_id=EMOJI * 255, to="customer0@example.com")
    complaint["complaint"]["feedbackId"] = big  # an oversized feedback id: not stored
    bodies.append(envelope(complaint, MessageId=big))  # and an oversized SNS MessageId

    # a send with every tag oversized: the configuration set, a custom key and value, and the
    # relay's own tags one character past what the relay writes (so they name no row)
    tagged = ses_event("send", provider_id="ses-tagged", message_id=held, claim_token=token)
    tags = tagged["mail"]["tags"]
    tags["ses:configuration-set"] = [big]
    tags["k" * 10_000] = ["v" * 10_000]
    tags["outbox_message_id"] = ["1" * 65]
    tags["outbox_attempt"] = [token + "0"]
    bodies.append(envelope(tagged))

    # the longest id, plain, matched by its own tags
    plain = ses_event("send", provider_id="i" * 255, message_id=held, claim_token=token)
    bodies.append(envelope(plain))

    # one character past it: no SES message id can be that long, the body is not SES's
    too_long = ses_event("send", provider_id="j" * 256)
    bodies.append(envelope(too_long))
    queue.send(*bodies)

    intake = intake_for(server_backend, queue)
    wait_for(
        lambda: intake.step() == 0 and queue.depth() == 0 and len(queue.dead_letters()) == 1,
        timeout=30.0,
    )

    assert all(effect != "refused" for _, effect in intake.counts)
    by_id = stored(server_backend)
    assert (by_id[EMOJI * 255].effect, by_id[EMOJI * 255].message_id) == ("status", sent)
    assert by_id[EMOJI * 255].detail == "abuse"
    assert (by_id["ses-tagged"].effect, by_id["ses-tagged"].message_id) == ("unmatched", None)
    assert by_id["ses-tagged"].tagged_message_id is None
    assert by_id["ses-tagged"].claim_token is None
    assert (by_id["i" * 255].effect, by_id["i" * 255].message_id) == ("resolved", held)
    [malformed] = [e for e in by_id.values() if e.effect == "malformed"]
    assert malformed.provider_message_id is None
    assert malformed.error == "no mail.messageId"
    assert len(by_id) == 4
    assert row(server_backend.engine, held).provider_message_id == "i" * 255
    assert row(server_backend.engine, sent).delivery_status == "complained"
    with server_backend.engine.connect() as conn:
        assert conn.execute(sa.select(suppressions.c.address)).scalars().all() == [
            "customer0@example.com"
        ]
    # the malformed one only: left for the dead-letter queue, as every malformed event is
    assert [json.loads(b)["Message"] for b in queue.dead_letters()] == [
        json.loads(bodies[3])["Message"]
    ]


# -- EventBridge: the topic's account, but not SES's event -------------------------------


def eventbridge(
    detail: dict[str, Any], *, source: str = "aws.ses", detail_type: str = "Email Sent"
) -> str:
    return json.dumps(
        {
            "version": "0",
            "id": str(uuid.uuid4()),
            "detail-type": detail_type,
            "source": source,
            "account": ACCOUNT,
            "time": "2026-12-01T12:00:01Z",
            "region": "us-west-2",
            "resources": [],
            "detail": detail,
        }
    )


@pytest.mark.parametrize("source", ["aws.sesv2", "custom.ses", "", "AWS.SES"])
@pytest.mark.parametrize("topic", [OURS, None], ids=["with_topic", "without_topic"])
def test_an_eventbridge_event_of_another_source_is_never_applied(
    server_backend: Backend, source: str, topic: str | None
) -> None:
    token = str(uuid.uuid4())
    held = stage(server_backend.engine, Status.UNKNOWN_OUTCOME, tokens=(token,))
    send = ses_event("send", provider_id="ses-held", message_id=held, claim_token=token)
    with server_backend.engine.begin() as conn:
        [done] = apply_events(
            conn,
            [parse(eventbridge(send, source=source))],
            now=read_database_time(conn),
            topic_arn=topic,
        )
    assert done.effect is Effect.MALFORMED
    assert done.message_id is None
    assert row(server_backend.engine, held).status == "unknown_outcome"
    with server_backend.engine.connect() as conn:
        [recorded] = conn.execute(sa.select(events)).all()
    assert (recorded.effect, recorded.message_id) == ("malformed", None)


def test_an_eventbridge_event_whose_detail_type_is_not_an_email_event_is_never_applied(
    server_backend: Backend,
) -> None:
    """SES's own CloudTrail record of the send call comes as source ``aws.ses`` from the
    account too (``AWS API Call via CloudTrail``): it is not an event about the message."""
    token = str(uuid.uuid4())
    held = stage(server_backend.engine, Status.UNKNOWN_OUTCOME, tokens=(token,))
    trail = {
        "eventVersion": "1.08",
        "eventSource": "ses.amazonaws.com",
        "eventName": "SendEmail",
        "eventType": "AwsApiCall",
        "requestParameters": {"emailTags": [{"name": "outbox_message_id", "value": str(held)}]},
        "responseElements": {"messageId": "ses-held"},
    }
    plain = copy.deepcopy(ses_event("send", provider_id="ses-held"))
    del plain["eventType"]  # a detail with no kind of its own, under another detail-type
    with server_backend.engine.begin() as conn:
        done = apply_events(
            conn,
            [
                parse(eventbridge(trail, detail_type="AWS API Call via CloudTrail")),
                parse(eventbridge(plain, detail_type="AWS API Call via CloudTrail")),
            ],
            now=read_database_time(conn),
            topic_arn=OURS,
        )
    assert [a.effect for a in done] == [Effect.MALFORMED, Effect.MALFORMED]
    assert row(server_backend.engine, held).status == "unknown_outcome"


def test_a_detail_type_that_contradicts_its_detail_cannot_make_an_event_a_bounce(
    server_backend: Backend,
) -> None:
    """``Email Bounced`` around a Delivery: what the detail says is applied (its row is
    delivered), not what the envelope says (nobody is suppressed, nothing bounced)."""
    sent = stage(server_backend.engine, Status.SENT, provider_id="ses-sent")
    delivery = ses_event("delivery", provider_id="ses-sent")
    delivery["bounce"] = {
        "bounceType": "Permanent",
        "bouncedRecipients": [{"emailAddress": "customer0@example.com"}],
    }
    with server_backend.engine.begin() as conn:
        [done] = apply_events(
            conn,
            [parse(eventbridge(delivery, detail_type="Email Bounced"))],
            now=read_database_time(conn),
            topic_arn=OURS,
        )
    assert (done.effect, done.suppressed) == (Effect.STATUS, ())
    assert row(server_backend.engine, sent).delivery_status == "delivered"
    with server_backend.engine.connect() as conn:
        assert conn.execute(sa.select(suppressions)).all() == []
