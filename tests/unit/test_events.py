"""The SES event parser against AWS's own example events (``tests/fixtures/ses_events``), each
envelope SES's events arrive in, and bodies nobody would send but anybody could.

What a fixture should parse to is read from the fixture (its message id, its recipients, its
bounce type), not from the parser: the parser is checked against AWS's shapes, not against
itself.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
from datetime import UTC, datetime
from email.utils import parseaddr
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from outbox.schema import DeliveryStatus, EventType
from relay.events import MAX_BODY_BYTES, SesEvent, parse

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "ses_events"
DELIVERED, BOUNCED, SUPPRESSED = (
    DeliveryStatus.DELIVERED,
    DeliveryStatus.BOUNCED,
    DeliveryStatus.SUPPRESSED,
)


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())


def body(obj: object) -> str:
    return json.dumps(obj)


def digest(obj: object) -> str:
    """The key the contract defines: SHA-256 of the object's canonical JSON."""
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def stamp(text: str) -> datetime:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=UTC)


def sns(event: dict[str, Any]) -> dict[str, Any]:
    """AWS's SNS-to-SQS example envelope carrying ``event``."""
    envelope = fixture("sns_envelope.json")
    envelope["Message"] = json.dumps(event)
    return envelope


def eventbridge(event: dict[str, Any]) -> dict[str, Any]:
    envelope = fixture("eventbridge_bounce.json")
    envelope["detail"] = event
    return envelope


def tagged(event: dict[str, Any], **tags: object) -> dict[str, Any]:
    """``event`` with ``mail.tags`` set as given (a value as it should appear in the JSON)."""
    event = copy.deepcopy(event)
    event["mail"]["tags"] = {**event["mail"].get("tags", {}), **tags}
    return event


# fixture -> (type, status, the sub-object whose list names the recipients, the field in it)
PUBLISHED = {
    "event_send.json": (EventType.SEND, None),
    "event_delivery.json": (EventType.DELIVERY, DELIVERED),
    "event_bounce_permanent.json": (EventType.BOUNCE, BOUNCED),
    "event_bounce_transient.json": (EventType.BOUNCE, BOUNCED),
    "event_bounce_undetermined.json": (EventType.BOUNCE, BOUNCED),
    "event_bounce_suppressed.json": (EventType.BOUNCE, SUPPRESSED),
    "event_bounce_on_account_suppression_list.json": (EventType.BOUNCE, SUPPRESSED),
    "event_complaint.json": (EventType.COMPLAINT, DeliveryStatus.COMPLAINED),
    "event_complaint_on_account_suppression_list.json": (EventType.COMPLAINT, SUPPRESSED),
    "event_reject.json": (EventType.REJECT, DeliveryStatus.REJECTED),
    "event_rendering_failure.json": (EventType.RENDERING_FAILURE, DeliveryStatus.REJECTED),
    "event_delivery_delay.json": (EventType.DELIVERY_DELAY, DeliveryStatus.DELAYED),
    "event_open.json": (EventType.OTHER, None),
    "event_click.json": (EventType.OTHER, None),
    "event_subscription.json": (EventType.OTHER, None),
    "notification_bounce.json": (EventType.BOUNCE, BOUNCED),
    "notification_bounce_no_dsn.json": (EventType.BOUNCE, BOUNCED),
    "notification_complaint.json": (EventType.COMPLAINT, DeliveryStatus.COMPLAINED),
    "notification_complaint_no_feedback.json": (EventType.COMPLAINT, DeliveryStatus.COMPLAINED),
    "notification_delivery.json": (EventType.DELIVERY, DELIVERED),
}


def expected_recipients(event: dict[str, Any]) -> tuple[str, ...]:
    kind = event.get("eventType") or event["notificationType"]
    if kind == "Bounce":
        return tuple(r["emailAddress"].lower() for r in event["bounce"]["bouncedRecipients"])
    if kind == "Complaint":
        return tuple(r["emailAddress"].lower() for r in event["complaint"]["complainedRecipients"])
    if kind == "Delivery":
        return tuple(a.lower() for a in event["delivery"]["recipients"])
    if kind == "DeliveryDelay":
        return tuple(r["emailAddress"].lower() for r in event["deliveryDelay"]["delayedRecipients"])
    return tuple(a.lower() for a in event["mail"]["destination"])


def expected_event_at(event: dict[str, Any]) -> datetime:
    kind = event.get("eventType") or event["notificationType"]
    own = {
        "Bounce": "bounce",
        "Complaint": "complaint",
        "Delivery": "delivery",
        "DeliveryDelay": "deliveryDelay",
        "Open": "open",
        "Click": "click",
        "Subscription": "subscription",
    }.get(kind)
    return stamp(event[own]["timestamp"] if own else event["mail"]["timestamp"])


def expected_detail(event: dict[str, Any]) -> str | None:
    kind = event.get("eventType") or event["notificationType"]
    if kind == "Bounce":
        return f"{event['bounce']['bounceType']}/{event['bounce']['bounceSubType']}"
    if kind == "Complaint":
        complaint = event["complaint"]
        return complaint.get("complaintSubType") or complaint.get("complaintFeedbackType")
    if kind == "DeliveryDelay":
        return event["deliveryDelay"]["delayType"]
    if kind == "Reject":
        return event["reject"]["reason"]
    if kind == "Rendering Failure":
        return event["failure"]["errorMessage"]
    if kind in ("Open", "Click", "Subscription"):
        return kind
    return None


def test_every_fixture_file_is_checked():
    checked = {
        *PUBLISHED,
        "sns_envelope.json",
        "sns_envelope_bounce.json",
        "sns_subscription_confirmation.json",
        "sns_unsubscribe_confirmation.json",
        "eventbridge_bounce.json",
    }
    assert {p.name for p in FIXTURES.glob("*.json")} == checked


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_aws_example_event_parses_to_what_it_says(name):
    event = fixture(name)
    parsed = parse((FIXTURES / name).read_text())
    event_type, status = PUBLISHED[name]
    recipients = expected_recipients(event)
    assert parsed.error is None
    assert parsed.source == "raw"
    assert parsed.type is event_type
    assert parsed.delivery_status is status
    assert parsed.provider_message_id == event["mail"]["messageId"]
    assert parsed.mail_at == stamp(event["mail"]["timestamp"])
    assert parsed.event_at == expected_event_at(event)
    assert parsed.detail == expected_detail(event)
    assert parsed.recipients == recipients
    permanent = event.get("bounce", {}).get("bounceType") == "Permanent"
    assert parsed.suppress == (recipients if permanent or "complaint" in event else ())
    assert parsed.key == digest(event)
    # AWS's examples carry only SES's own tags (or none): no row of ours is named
    assert parsed.tagged_message_id is None
    assert parsed.claim_token is None


def test_permanent_bounces_suppress_and_transient_ones_do_not():
    permanent = parse(body(fixture("event_bounce_permanent.json")))
    transient = parse(body(fixture("event_bounce_transient.json")))
    assert permanent.suppress == ("recipient@example.com",)
    assert (transient.detail, transient.delivery_status, transient.suppress) == (
        "Transient/MailboxFull",
        BOUNCED,
        (),
    )


def test_bounce_notification_names_only_the_bounced_recipients():
    event = fixture("notification_bounce_no_dsn.json")
    parsed = parse(body(event))
    assert len(event["mail"]["destination"]) == 3
    assert parsed.recipients == ("jane@example.com", "richard@example.com")
    assert parsed.suppress == parsed.recipients


def test_the_outbox_tags_name_the_row_and_the_attempt():
    token = "0b0f5a4e-52cb-4c8e-9d6e-3a3c1f2b4d5e"
    event = tagged(
        fixture("event_delivery.json"), outbox_message_id=["1234"], outbox_attempt=[token]
    )
    parsed = parse(body(event))
    assert (parsed.tagged_message_id, parsed.claim_token) == ("1234", token)


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("1234", "a string, not a list"),
        ([], "an empty list"),
        ([1234], "a number"),
        ([None], "a null"),
        ([["1234"]], "a nested list"),
        (["a" * 65], "longer than 64"),
        (["12.34"], "outside the tag charset"),
        (["1234; DROP"], "outside the tag charset"),
        (["\uff11\uff12\uff13\uff14"], "digits of another script"),
        ([""], "empty"),
    ],
)
def test_a_tag_value_the_relay_could_not_have_set_names_nothing(value, reason):
    parsed = parse(body(tagged(fixture("event_send.json"), outbox_message_id=value)))
    assert parsed.type is EventType.SEND, reason
    assert parsed.tagged_message_id is None, reason


def test_the_first_of_several_tag_values_counts_and_a_claim_token_fits_its_column():
    event = tagged(
        fixture("event_send.json"),
        outbox_message_id=["7", "8"],
        outbox_attempt=["a" * 37],
    )
    parsed = parse(body(event))
    assert parsed.tagged_message_id == "7"
    assert parsed.claim_token is None  # outbox_events.claim_token holds 36


@pytest.mark.parametrize("tags", ["outbox_message_id=7", ["outbox_message_id", "7"], 7, None])
def test_tags_that_are_not_an_object_are_ignored(tags):
    event = fixture("event_send.json")
    event["mail"]["tags"] = tags
    parsed = parse(body(event))
    assert (parsed.type, parsed.tagged_message_id) == (EventType.SEND, None)


def test_aws_sns_envelope_carrying_an_event():
    envelope = fixture("sns_envelope_bounce.json")
    event = json.loads(envelope["Message"])
    parsed = parse(body(envelope))
    assert (parsed.source, parsed.type, parsed.delivery_status) == (
        "sns",
        EventType.BOUNCE,
        BOUNCED,
    )
    assert parsed.provider_message_id == event["mail"]["messageId"]
    assert parsed.key == digest(event)


def test_aws_eventbridge_envelope_carrying_an_event():
    envelope = fixture("eventbridge_bounce.json")
    parsed = parse(body(envelope))
    assert (parsed.source, parsed.type, parsed.delivery_status) == (
        "eventbridge",
        EventType.BOUNCE,
        BOUNCED,
    )
    assert parsed.provider_message_id == envelope["detail"]["mail"]["messageId"]
    assert parsed.key == digest(envelope["detail"])


def test_each_envelope_says_where_it_came_from_and_a_raw_body_does_not():
    event = fixture("event_delivery.json")
    envelope = fixture("sns_envelope.json")
    assert parse(body(sns(event))).origin == envelope["TopicArn"]
    confirmation = {**envelope, "Type": "SubscriptionConfirmation"}
    assert parse(body(confirmation)).origin == envelope["TopicArn"]
    assert parse(body(eventbridge(event))).origin == "123456789012"
    assert parse(body(event)).origin is None
    # a value that cannot be a topic's or an account's names no origin
    assert parse(body({**sns(event), "TopicArn": ["x"]})).origin is None
    assert parse(body({**sns(event), "TopicArn": "a" * 400})).origin is None
    assert parse(body({**eventbridge(event), "account": "12345"})).origin is None


def test_eventbridge_detail_without_an_event_type_takes_it_from_the_detail_type():
    envelope = fixture("eventbridge_bounce.json")
    del envelope["detail"]["eventType"]
    parsed = parse(body(envelope))
    assert (parsed.type, parsed.detail) == (EventType.BOUNCE, "Permanent/General")


@pytest.mark.parametrize(
    "name", ["sns_subscription_confirmation.json", "sns_unsubscribe_confirmation.json"]
)
def test_sns_confirmations_are_other_and_change_nothing(name):
    envelope = fixture(name)
    parsed = parse(body(envelope))
    assert (parsed.source, parsed.type, parsed.detail) == ("sns", EventType.OTHER, envelope["Type"])
    assert (parsed.provider_message_id, parsed.delivery_status, parsed.suppress) == (None, None, ())
    assert parsed.key == digest(envelope)


def test_the_message_ses_publishes_when_an_event_destination_is_set_up_is_other():
    # not in AWS's examples: the plain-text test message SES publishes to a configuration
    # set's new SNS destination, as subscribers receive it
    envelope = fixture("sns_envelope.json")
    envelope["Message"] = "Successfully validated SNS topic for Amazon SES event publishing."
    parsed = parse(body(envelope))
    assert (parsed.type, parsed.detail, parsed.error) == (
        EventType.OTHER,
        envelope["Message"],
        None,
    )
    assert parsed.key == digest(envelope)


def test_the_notification_ses_publishes_when_a_feedback_topic_is_set_up_is_other():
    # not in AWS's examples either: an identity's new feedback topic gets this, with no mail
    event = {
        "notificationType": "AmazonSnsSubscriptionSucceeded",
        "message": "You have successfully subscribed your Amazon SNS topic "
        "'arn:aws:sns:us-east-1:123456789012:MyTopic' to receive 'Bounce' notifications from "
        "Amazon SES for identity 'example.com'.",
    }
    parsed = parse(body(sns(event)))
    assert (parsed.source, parsed.type, parsed.detail) == (
        "sns",
        EventType.OTHER,
        "AmazonSnsSubscriptionSucceeded",
    )
    assert (parsed.provider_message_id, parsed.delivery_status) == (None, None)
    assert parsed.key == digest(event)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_one_event_is_one_key_whatever_envelope_carries_it(name):
    event = fixture(name)
    keys = {
        parse(json.dumps(event)).key,
        parse(json.dumps(event, indent=4, sort_keys=True)).key,  # re-serialised: same event
        parse(body(sns(event))).key,
        parse(body(eventbridge(event))).key,
    }
    assert keys == {digest(event)}


def test_the_aws_envelope_fixtures_of_one_event_share_its_key():
    keys = {
        parse((FIXTURES / name).read_text()).key
        for name in (
            "event_bounce_permanent.json",
            "sns_envelope_bounce.json",
            "eventbridge_bounce.json",
        )
    }
    assert len(keys) == 1


@pytest.mark.parametrize(
    "change",
    [
        lambda e: e["bounce"].update(timestamp="2017-08-05T00:41:02.670Z"),
        lambda e: e["bounce"].update(bounceSubType="Suppressed"),
        lambda e: e["bounce"]["bouncedRecipients"][0].update(emailAddress="other@example.com"),
        lambda e: e["mail"].update(messageId=e["mail"]["messageId"] + "1"),
        lambda e: e["mail"]["tags"].update(outbox_attempt=["b"]),
        lambda e: e["mail"]["headers"].pop(),
    ],
)
def test_events_differing_in_one_field_have_different_keys(change):
    event = fixture("event_bounce_permanent.json")
    other = copy.deepcopy(event)
    change(other)
    assert parse(body(other)).key != parse(body(event)).key


def test_a_malformed_body_is_keyed_by_its_bytes():
    text = '{"eventType": "Bounce"}'
    parsed = parse(text)
    assert parsed.key == hashlib.sha256(text.encode()).hexdigest()
    assert parse(text + " ").key != parsed.key


MALFORMED_BODIES = {
    "empty": ("", "empty body"),
    "null": ("null", "not a JSON object"),
    "list": ("[]", "not a JSON object"),
    "string": ('"x"', "not a JSON object"),
    "number": ("1e999", "not a JSON object"),
    "truncated": ('{"eventType": "Bounce", "mail": {', "not JSON"),
    "not json": ("Hello world!", "not JSON"),
    "no type": (body({"mail": {"messageId": "x"}}), "no eventType or notificationType"),
    "type a number": (
        body({"eventType": 3, "mail": {"messageId": "x"}}),
        "no eventType or notificationType",
    ),
    "type null": (
        body({"eventType": None, "mail": {"messageId": "x"}}),
        "no eventType or notificationType",
    ),
    "no mail": (body({"eventType": "Delivery"}), "no mail object"),
    "mail a list": (body({"eventType": "Delivery", "mail": ["x"]}), "no mail object"),
    "no message id": (body({"eventType": "Delivery", "mail": {}}), "no mail.messageId"),
    "message id a number": (
        body({"eventType": "Delivery", "mail": {"messageId": 1234}}),
        "no mail.messageId",
    ),
    "message id a list": (
        body({"eventType": "Delivery", "mail": {"messageId": ["x"]}}),
        "no mail.messageId",
    ),
    "message id empty": (
        body({"eventType": "Delivery", "mail": {"messageId": ""}}),
        "no mail.messageId",
    ),
    "message id surrogate": (
        '{"eventType": "Send", "mail": {"messageId": "\\ud800"}}',
        "no mail.messageId",
    ),
    "message id NUL": (
        '{"eventType": "Send", "mail": {"messageId": "a\\u0000"}}',
        "no mail.messageId",
    ),
    "message id too long": (
        body({"eventType": "Send", "mail": {"messageId": "a" * 256}}),
        "no mail.messageId",
    ),
    "deep list": ("[" * 10_000 + "]" * 10_000, "JSON nested too deeply"),
    "deep object": ('{"a":' * 10_000 + "1" + "}" * 10_000, "JSON nested too deeply"),
    "foreign EventBridge": (
        body({**fixture("eventbridge_bounce.json"), "source": "aws.ec2"}),
        "EventBridge event not from aws.ses",
    ),
    "EventBridge detail text": (
        body({**fixture("eventbridge_bounce.json"), "detail": "{}"}),
        "EventBridge detail is not a JSON object",
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED_BODIES))
def test_what_is_not_an_ses_event_is_malformed(case):
    text, error = MALFORMED_BODIES[case]
    parsed = parse(text)
    assert (parsed.type, parsed.error) == (EventType.MALFORMED, error)
    assert parsed.key == hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    assert (
        parsed.provider_message_id,
        parsed.delivery_status,
        parsed.recipients,
        parsed.suppress,
    ) == (
        None,
        None,
        (),
        (),
    )


@pytest.mark.parametrize(
    ("message", "error"),
    [
        ("Hello world!", "SNS Message is not JSON"),
        (json.dumps(["x"]), "SNS Message is not a JSON object"),
        (1234, "SNS Message is not text"),
        (None, "SNS Message is not text"),
        ("[" * 10_000 + "]" * 10_000, "JSON nested too deeply"),
        (json.dumps({"Type": "Notification", "Message": "{}"}), "no eventType or notificationType"),
    ],
)
def test_an_sns_envelope_whose_message_is_not_an_event_is_malformed(message, error):
    envelope = fixture("sns_envelope.json")
    envelope["Message"] = message
    parsed = parse(body(envelope))
    assert (parsed.type, parsed.error) == (EventType.MALFORMED, error)


def test_aws_sns_envelope_example_is_malformed_its_message_being_plain_text():
    parsed = parse((FIXTURES / "sns_envelope.json").read_text())
    assert (parsed.source, parsed.type, parsed.error) == (
        "sns",
        EventType.MALFORMED,
        "SNS Message is not JSON",
    )


def test_an_unknown_sns_message_type_is_malformed():
    envelope = fixture("sns_subscription_confirmation.json")
    envelope["Type"] = "Advertisement"
    assert parse(body(envelope)).error == "unknown SNS message type"


def test_a_body_over_the_sqs_limit_is_malformed_without_being_read():
    event = fixture("event_send.json")
    event["mail"]["headers"].append({"name": "X-Pad", "value": "x" * (300 * 1024)})
    parsed = parse(body(event))
    assert (parsed.type, parsed.error) == (EventType.MALFORMED, "body over 256 KiB")


def test_the_limit_counts_bytes_not_characters():
    event = fixture("event_send.json")
    pad = MAX_BODY_BYTES // 2 + 100  # 'é' is two bytes: over the limit in bytes only
    event["mail"]["headers"].append({"name": "X-Pad", "value": "é" * pad})
    text = json.dumps(event, ensure_ascii=False)
    assert len(text) < MAX_BODY_BYTES < len(text.encode())
    assert parse(text).error == "body over 256 KiB"
    event["mail"]["headers"][-1]["value"] = "é" * (pad // 2)
    assert parse(json.dumps(event, ensure_ascii=False)).type is EventType.SEND


def test_an_unknown_event_type_with_a_mail_object_is_other():
    event = fixture("event_send.json")
    event["eventType"] = "Teleported"
    del event["send"]
    parsed = parse(body(event))
    assert (parsed.type, parsed.detail, parsed.delivery_status, parsed.error) == (
        EventType.OTHER,
        "Teleported",
        None,
        None,
    )
    assert parsed.provider_message_id == event["mail"]["messageId"]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("2017-08-05T00:41:02.669Z", datetime(2017, 8, 5, 0, 41, 2, 669000, tzinfo=UTC)),
        ("2017-08-05T02:41:02+02:00", datetime(2017, 8, 5, 0, 41, 2, tzinfo=UTC)),
        ("2017-08-05T00:41:02.669", None),  # no offset: its zone would be a guess
        ("yesterday", None),
        ("2017-13-45T00:00:00Z", None),
        ("", None),
        (1501893662, None),
        (None, None),
        (["2017-08-05T00:41:02.669Z"], None),
        ("2017-08-05T00:41:02Z" + " " * 100, None),
    ],
)
def test_a_timestamp_is_utc_or_none_and_never_refuses_the_event(value, expected):
    event = fixture("event_bounce_permanent.json")
    event["bounce"]["timestamp"] = value
    event["mail"]["timestamp"] = value
    parsed = parse(body(event))
    assert (parsed.type, parsed.event_at, parsed.mail_at) == (EventType.BOUNCE, expected, expected)
    assert expected is None or parsed.event_at.tzinfo is UTC


def test_a_missing_timestamp_is_none():
    event = fixture("event_delivery.json")
    del event["delivery"]["timestamp"]
    del event["mail"]["timestamp"]
    parsed = parse(body(event))
    assert (parsed.type, parsed.event_at, parsed.mail_at) == (EventType.DELIVERY, None, None)


def test_addresses_are_lower_cased_addr_specs_once_each():
    event = fixture("event_bounce_permanent.json")
    event["bounce"]["bouncedRecipients"] = [
        {"emailAddress": '"Jane Doe" <Jane@Example.COM>'},
        {"emailAddress": "jane@example.com"},
        {"emailAddress": "Mary Doe <mary@example.com>"},
        {"emailAddress": "not an address"},
        {"emailAddress": "\ud800@example.com"},
        {"emailAddress": "nul\x00@example.com"},
        {"emailAddress": "a@b@example.com"},
        {"emailAddress": "x" * 400 + "@example.com"},
        {"emailAddress": 42},
        {"emailAddress": None},
        {"emailAddress": ["richard@example.com"]},
        "richard@example.com",  # not an object
        None,
    ]
    parsed = parse(body(event))
    assert parsed.recipients == ("jane@example.com", "mary@example.com")
    assert parsed.suppress == parsed.recipients


@settings(max_examples=300, deadline=None)
@given(
    st.text(max_size=40)
    | st.from_regex(r"[A-Za-z0-9.+_-]{1,12}@[A-Za-z0-9.-]{1,12}", fullmatch=True)
)
@example("Jane.Doe+tag@Example.com")
@example("a.@example.com")
def test_an_address_is_the_addr_spec_email_utils_reads_in_it(raw):
    event = fixture("event_bounce_permanent.json")
    event["bounce"]["bouncedRecipients"] = [{"emailAddress": raw}]
    address = parseaddr(raw)[1].lower()
    usable = (
        address.count("@") == 1 and address.isprintable() and not any(c.isspace() for c in address)
    )
    assert parse(body(event)).recipients == ((address,) if usable else ())


@pytest.mark.parametrize("recipients", [None, "recipient@example.com", {"a": 1}, 7])
def test_a_recipient_list_that_is_not_a_list_names_nobody(recipients):
    event = fixture("event_bounce_permanent.json")
    event["bounce"]["bouncedRecipients"] = recipients
    parsed = parse(body(event))
    assert (parsed.type, parsed.recipients, parsed.suppress) == (EventType.BOUNCE, (), ())


@pytest.mark.parametrize("bounce", [None, "Permanent", [], 7])
def test_a_bounce_without_its_object_is_a_bounce_that_suppresses_nobody(bounce):
    event = fixture("event_bounce_permanent.json")
    event["bounce"] = bounce
    parsed = parse(body(event))
    assert (parsed.type, parsed.delivery_status, parsed.detail, parsed.suppress) == (
        EventType.BOUNCE,
        BOUNCED,
        None,
        (),
    )


def test_detail_fits_its_column_and_holds_no_control_character():
    event = fixture("event_reject.json")
    event["reject"]["reason"] = "bad\x00content\ud800\n" + "x" * 400
    parsed = parse(body(event))
    assert parsed.detail.startswith("bad content  ")
    assert len(parsed.detail) == 255
    assert parsed.detail.isprintable()


def test_a_lone_surrogate_in_the_body_itself_is_no_crash():
    parsed = parse('{"eventType": "Send", "mail": {"messageId": "\ud800"}}')
    assert (parsed.type, parsed.error) == (EventType.MALFORMED, "no mail.messageId")


def test_the_parsed_event_is_a_frozen_value():
    parsed = parse(body(fixture("event_send.json")))
    with pytest.raises(dataclasses.FrozenInstanceError):
        parsed.type = EventType.BOUNCE  # type: ignore[misc]
    assert parsed == parse(body(fixture("event_send.json")))


# Hostile bodies: any JSON value anywhere, and any text at all.
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4)
    ),
    max_leaves=20,
)


def paths(obj: object, prefix: tuple = ()) -> list[tuple]:
    """Every path to a value inside ``obj``."""
    found = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            found += paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            found += paths(v, (*prefix, i))
    return found


def replaced(obj: Any, path: tuple, value: object) -> Any:
    if not path:
        return value
    obj = copy.deepcopy(obj)
    target = obj
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    return obj


def well_formed(parsed: SesEvent) -> None:
    """What the intake relies on, whatever the body was."""
    assert isinstance(parsed, SesEvent)
    assert len(parsed.key) == 64
    assert int(parsed.key, 16) >= 0
    assert parsed.source in ("sns", "eventbridge", "raw")
    assert (parsed.error is not None) == (parsed.type is EventType.MALFORMED)
    for text in (parsed.detail, parsed.provider_message_id):
        assert text is None or (0 < len(text) <= 255 and text.isprintable())
    for address in (*parsed.recipients, *parsed.suppress):
        assert address == address.lower()
        assert address.isprintable()
        assert len(address) <= 320
    assert set(parsed.suppress) <= set(parsed.recipients)
    for time in (parsed.event_at, parsed.mail_at):
        assert time is None or time.tzinfo is UTC


BASES = [fixture(n) for n in ("event_bounce_permanent.json", "notification_complaint.json")]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), base=st.sampled_from([*BASES, fixture("sns_envelope_bounce.json")]))
def test_any_value_anywhere_in_an_event_never_raises(data, base):
    path = data.draw(st.sampled_from(paths(base)))
    value = data.draw(JSON)
    well_formed(parse(json.dumps(replaced(base, path, value))))


@settings(max_examples=300, deadline=None)
@given(st.text())
@example("\ud800")
@example('{"Type": "Notification", "Message": "\\ud800"}')
@example('{"source": "aws.ses", "detail": {"eventType": "Bounce", "mail": {"messageId": "m"}}}')
def test_any_text_never_raises(text):
    well_formed(parse(text))


@settings(max_examples=200, deadline=None)
@given(JSON)
def test_any_json_never_raises(value):
    well_formed(parse(json.dumps(value)))
