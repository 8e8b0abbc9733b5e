"""What an SES event says, read from one queue message: a pure function from text to value.

SES reports what became of a send it accepted (Send, Delivery, Bounce, Complaint, Reject,
DeliveryDelay, Rendering Failure, and Open, Click, Subscription that change nothing here)
through a configuration set's event destination (``eventType``) or an identity's feedback
notifications (``notificationType``, which carry no tags). The queue message holding it comes in
one of three envelopes, all accepted:

- an SNS notification (``Type`` ``Notification``; ``Message`` is the event as a JSON string),
- an EventBridge event (``source`` ``aws.ses``; ``detail`` is the event object),
- the event itself (SNS raw message delivery).

:func:`parse` never raises and never touches the database, the network or the clock: the
intake decides what an event does to a row, this module only says what the event is. A queue
is open to whoever may send to it, so every body is treated as hostile: anything that is not an
SES event comes back as :attr:`EventType.MALFORMED` with a short reason (never the body's
text), and a field of the wrong type is ignored rather than trusted. Where an event says it came
from (:attr:`SesEvent.origin`: the SNS topic, the EventBridge account) is only read here; the
intake decides whether that is ours (``--events-topic-arn``). The key of an event is the
digest of the SES event object itself, not of its envelope: SQS delivers at least once and an
event re-published through another envelope is still the same event, recorded once.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import parseaddr
from typing import Any

from outbox.schema import ADDRESS_CHARS, DeliveryStatus, EventType

__all__ = ["MAX_BODY_BYTES", "SesEvent", "parse", "recorded_status"]

# SQS's largest message: a longer body was not put there by SNS, EventBridge or SES.
MAX_BODY_BYTES = 256 * 1024

_DETAIL_CHARS = 255  # outbox_events.detail
_PROVIDER_ID_CHARS = 255  # outbox_events.provider_message_id
_ADDRESS_CHARS = ADDRESS_CHARS
_TAG_CHARS = 64  # outbox_events.tagged_message_id
_CLAIM_TOKEN_CHARS = 36  # outbox_events.claim_token (a UUID)
_TIMESTAMP_CHARS = 64
_ORIGIN_CHARS = 320  # an SNS topic ARN: arn:<partition>:sns:<region>:<account>:<name of 256>
_ACCOUNT = re.compile(r"[0-9]{12}")
_TAG_VALUE = re.compile(r"[A-Za-z0-9_-]+")
# A bare addr-spec, as SES writes recipients: read without parseaddr, which costs more than
# the rest of an event together
_PLAIN_ADDRESS = re.compile(r"[^\s<>\"(),;:\\\[\]@]+@[^\s<>\"(),;:\\\[\]@]+")
_SUPPRESSION_SUBTYPES = frozenset({"Suppressed", "OnAccountSuppressionList"})
_SNS_CONFIRMATIONS = frozenset({"SubscriptionConfirmation", "UnsubscribeConfirmation"})
# What SES itself publishes once when a topic is set up, before any event: the plain-text test
# message of a configuration set's new SNS destination, and the notification type of an
# identity's new feedback topic (it carries no mail object). Both change nothing.
_SES_TOPIC_VALIDATION = "Successfully validated SNS topic for Amazon SES event publishing."
_SES_SUBSCRIPTION_SUCCEEDED = "AmazonSnsSubscriptionSucceeded"

# SES's name for each kind -> ours; a name not here is OTHER (Open, Click, Subscription, and
# whatever SES adds later: it proves the send was accepted, and changes no status).
_TYPES = {
    "Send": EventType.SEND,
    "Delivery": EventType.DELIVERY,
    "Bounce": EventType.BOUNCE,
    "Complaint": EventType.COMPLAINT,
    "Reject": EventType.REJECT,
    "DeliveryDelay": EventType.DELIVERY_DELAY,
    "Rendering Failure": EventType.RENDERING_FAILURE,
    "RenderingFailure": EventType.RENDERING_FAILURE,  # the spelling of SES's event-type lists
}

# An EventBridge event names its kind in ``detail-type``; used only where ``detail`` lacks one.
_DETAIL_TYPES = {
    "Email Sent": "Send",
    "Email Delivered": "Delivery",
    "Email Bounced": "Bounce",
    "Email Complaint Received": "Complaint",
    "Email Rejected": "Reject",
    "Email Delivery Delayed": "DeliveryDelay",
    "Email Rendering Failed": "Rendering Failure",
    "Email Opened": "Open",
    "Email Clicked": "Click",
    "Email Subscribed": "Subscription",
}

# The object holding each kind's own facts, and where its timestamp is; the kinds absent here
# are stamped with mail.timestamp (Send, Reject, Rendering Failure: SES decided at the call).
_SUBOBJECT = {
    "Bounce": "bounce",
    "Complaint": "complaint",
    "Delivery": "delivery",
    "DeliveryDelay": "deliveryDelay",
    "Reject": "reject",
    "Rendering Failure": "failure",
    "RenderingFailure": "failure",
    "Open": "open",
    "Click": "click",
    "Subscription": "subscription",
}
_STAMPED_BY_MAIL = frozenset({"Send", "Reject", "Rendering Failure", "RenderingFailure"})


@dataclass(frozen=True, slots=True, kw_only=True)
class SesEvent:
    """One queue message, read.

    ``key`` is the SHA-256 (hex) of the SES event object's canonical JSON
    (``json.dumps(obj, sort_keys=True, separators=(",", ":"))``), whatever envelope carried it;
    of an SNS confirmation, the envelope's; of a malformed body, the body's UTF-8 bytes. Every
    text field fits the ``outbox_events`` column it is stored in and holds no NUL or lone
    surrogate (which PostgreSQL refuses), so the intake can store it as it is.
    """

    key: str
    source: str  # "sns" | "eventbridge" | "raw": the envelope it came in
    type: EventType
    event_at: datetime | None  # the event's own timestamp (SES's clock), UTC
    mail_at: datetime | None  # mail.timestamp: when SES took the send call (SES's clock), UTC
    provider_message_id: str | None  # mail.messageId
    tagged_message_id: str | None  # mail.tags["outbox_message_id"][0], as sent
    claim_token: str | None  # mail.tags["outbox_attempt"][0]
    detail: str | None  # "Permanent/General", the complaint feedback type, the delay type, ...
    recipients: tuple[str, ...]  # the addresses the event concerns, lower-cased addr-specs
    suppress: tuple[str, ...]  # the addresses never to mail again (permanent bounce, complaint)
    delivery_status: DeliveryStatus | None  # what the event means for the row; None: nothing
    error: str | None  # MALFORMED only: why, in a few words (never the body's text)
    # where it says it came from: the SNS envelope's TopicArn, the EventBridge event's account
    # (12 digits); None in a raw body, or when the value is not one
    origin: str | None = None


def parse(body: str) -> SesEvent:
    """Read one queue message body; never raises.

    Anything that is not an SES event in one of the accepted envelopes is MALFORMED: a body
    over :data:`MAX_BODY_BYTES` (not even decoded), text that is not JSON or nests too deeply
    for the decoder, JSON that is not an object, an event without a ``mail`` object or a
    ``mail.messageId``. A well-formed event of a kind that changes nothing (Open, Click,
    Subscription, a kind SES adds later), an SNS subscription or unsubscribe confirmation and
    SES's own message that a topic was set up are OTHER. A timestamp that is missing or
    unreadable is None, not a reason to refuse the event.
    """
    if not isinstance(body, str) or not body:
        return _malformed(body if isinstance(body, str) else "", "raw", "empty body")
    if len(body) > MAX_BODY_BYTES or (
        len(body) * 4 > MAX_BODY_BYTES and len(_utf8(body)) > MAX_BODY_BYTES
    ):
        return _malformed(body, "raw", "body over 256 KiB")
    try:
        return _parse(body)
    except RecursionError:
        return _malformed(body, "raw", "JSON nested too deeply")
    except (ValueError, TypeError, AttributeError, KeyError, OverflowError):
        # Not expected from any body (each field is type-checked before use); kept so that a
        # body nobody foresaw is recorded as malformed instead of stopping the intake.
        return _malformed(body, "raw", "unreadable event")


def _parse(body: str) -> SesEvent:
    try:
        outer = json.loads(body)
    except ValueError:
        return _malformed(body, "raw", "not JSON")
    if not isinstance(outer, dict):
        return _malformed(body, "raw", "not a JSON object")

    if "Type" in outer:
        return _from_sns(body, outer)
    if "detail-type" in outer or ("source" in outer and "detail" in outer):
        return _from_eventbridge(body, outer)
    return _from_event(body, outer, "raw", None, None)


def _from_sns(body: str, envelope: dict[str, Any]) -> SesEvent:
    kind = envelope.get("Type")
    topic = envelope.get("TopicArn")
    origin = (
        topic
        if isinstance(topic, str) and 0 < len(topic) <= _ORIGIN_CHARS and topic.isprintable()
        else None
    )
    if kind in _SNS_CONFIRMATIONS:
        # Not an event: SNS telling a subscriber about its subscription (a queue subscribed
        # with raw delivery off still receives them). Recorded, changes nothing.
        return _other(_digest_of(envelope), "sns", str(kind), origin)
    if kind != "Notification":
        return _malformed(body, "sns", "unknown SNS message type")
    message = envelope.get("Message")
    if not isinstance(message, str):
        return _malformed(body, "sns", "SNS Message is not text")
    if message.strip() == _SES_TOPIC_VALIDATION:
        return _other(_digest_of(envelope), "sns", _SES_TOPIC_VALIDATION, origin)
    try:
        event = json.loads(message)
    except ValueError:
        return _malformed(body, "sns", "SNS Message is not JSON")
    if not isinstance(event, dict):
        return _malformed(body, "sns", "SNS Message is not a JSON object")
    return _from_event(body, event, "sns", None, origin)


def _from_eventbridge(body: str, envelope: dict[str, Any]) -> SesEvent:
    if envelope.get("source") != "aws.ses":
        return _malformed(body, "eventbridge", "EventBridge event not from aws.ses")
    detail = envelope.get("detail")
    if not isinstance(detail, dict):
        return _malformed(body, "eventbridge", "EventBridge detail is not a JSON object")
    detail_type = envelope.get("detail-type")
    fallback = _DETAIL_TYPES.get(detail_type) if isinstance(detail_type, str) else None
    account = envelope.get("account")
    origin = account if isinstance(account, str) and _ACCOUNT.fullmatch(account) else None
    return _from_event(body, detail, "eventbridge", fallback, origin)


def _from_event(
    body: str, event: dict[str, Any], source: str, fallback_kind: str | None, origin: str | None
) -> SesEvent:
    kind = event.get("eventType", event.get("notificationType", fallback_kind))
    if not isinstance(kind, str) or not kind:
        return _malformed(body, source, "no eventType or notificationType")
    if kind == _SES_SUBSCRIPTION_SUCCEEDED:
        return _other(_digest_of(event), source, kind, origin)
    mail = event.get("mail")
    if not isinstance(mail, dict):
        return _malformed(body, source, "no mail object")
    provider_id = mail.get("messageId")
    if (
        not isinstance(provider_id, str)
        or not provider_id
        or len(provider_id) > _PROVIDER_ID_CHARS
        or not provider_id.isprintable()
    ):
        return _malformed(body, source, "no mail.messageId")

    event_type = _TYPES.get(kind, EventType.OTHER)
    own = _mapping(event.get(_SUBOBJECT.get(kind, "")))
    mail_at = _timestamp(mail.get("timestamp"))
    event_at = mail_at if kind in _STAMPED_BY_MAIL else _timestamp(own.get("timestamp"))
    tags = _mapping(mail.get("tags"))

    recipients: tuple[str, ...]
    suppress: tuple[str, ...] = ()
    status: DeliveryStatus | None = None
    detail: str | None = None
    if event_type is EventType.BOUNCE:
        recipients = _addresses(own.get("bouncedRecipients"), "emailAddress")
        bounce_type, subtype = _text(own.get("bounceType")), _text(own.get("bounceSubType"))
        detail = "/".join(p for p in (bounce_type, subtype) if p) or None
        if bounce_type == "Permanent":
            # every permanent bounce, the suppression-list ones included: SES will drop the
            # next send to that address too, and counts it against the account
            suppress = recipients
        if bounce_type == "Permanent" and subtype in _SUPPRESSION_SUBTYPES:
            status = DeliveryStatus.SUPPRESSED
        else:
            status = DeliveryStatus.BOUNCED
    elif event_type is EventType.COMPLAINT:
        recipients = _addresses(own.get("complainedRecipients"), "emailAddress")
        suppress = recipients
        subtype = _text(own.get("complaintSubType"))
        if subtype == "OnAccountSuppressionList":
            # SES's own words: it accepted the message but did not send it, the address being
            # on the account's suppression list. Not a recipient's complaint: it must not count
            # in the complaint rate.
            status = DeliveryStatus.SUPPRESSED
            detail = subtype
        else:
            status = DeliveryStatus.COMPLAINED
            detail = _text(own.get("complaintFeedbackType"))
    elif event_type is EventType.DELIVERY:
        recipients = _addresses(own.get("recipients"), None)
        status = DeliveryStatus.DELIVERED
    elif event_type is EventType.DELIVERY_DELAY:
        recipients = _addresses(own.get("delayedRecipients"), "emailAddress")
        status = DeliveryStatus.DELAYED
        detail = _text(own.get("delayType"))
    else:
        recipients = _addresses(mail.get("destination"), None)
        if event_type is EventType.REJECT:
            status = DeliveryStatus.REJECTED
            detail = _text(own.get("reason"))
        elif event_type is EventType.RENDERING_FAILURE:
            status = DeliveryStatus.REJECTED
            detail = _text(own.get("errorMessage"))
        elif event_type is EventType.OTHER:
            detail = kind

    return SesEvent(
        key=_digest_of(event),
        source=source,
        type=event_type,
        event_at=event_at,
        mail_at=mail_at,
        provider_message_id=provider_id,
        tagged_message_id=_tag(tags, "outbox_message_id", _TAG_CHARS),
        claim_token=_tag(tags, "outbox_attempt", _CLAIM_TOKEN_CHARS),
        detail=_clean(detail),
        recipients=recipients,
        suppress=suppress,
        delivery_status=status,
        error=None,
        origin=origin,
    )


def _malformed(body: str, source: str, error: str) -> SesEvent:
    return SesEvent(
        key=hashlib.sha256(_utf8(body)).hexdigest(),
        source=source,
        type=EventType.MALFORMED,
        event_at=None,
        mail_at=None,
        provider_message_id=None,
        tagged_message_id=None,
        claim_token=None,
        detail=None,
        recipients=(),
        suppress=(),
        delivery_status=None,
        error=error,
    )


def _other(key: str, source: str, detail: str, origin: str | None) -> SesEvent:
    return SesEvent(
        key=key,
        source=source,
        type=EventType.OTHER,
        event_at=None,
        mail_at=None,
        provider_message_id=None,
        tagged_message_id=None,
        claim_token=None,
        detail=_clean(detail),
        recipients=(),
        suppress=(),
        delivery_status=None,
        error=None,
        origin=origin,
    )


def _utf8(text: str) -> bytes:
    # surrogatepass: a str may hold a lone surrogate (a JSON "\ud800" decodes to one); its
    # digest must still be computed, not raise
    return text.encode("utf-8", "surrogatepass")


def _digest_of(obj: dict[str, Any]) -> str:
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("ascii")).hexdigest()


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, dict) else {}


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def _clean(text: str | None) -> str | None:
    """``text`` as the detail column takes it: at most 255 characters, none a control
    character or a lone surrogate (replaced by a space)."""
    if text is None:
        return None
    text = text[:_DETAIL_CHARS]
    if not text.isprintable():
        text = "".join(c if c.isprintable() else " " for c in text)
    return text.strip() or None


def _timestamp(value: object) -> datetime | None:
    """An ISO 8601 time with its offset (SES writes ``2017-08-05T00:41:02.669Z``), in UTC; None
    for anything else, a time without an offset included (its zone would be a guess)."""
    if not isinstance(value, str) or len(value) > _TIMESTAMP_CHARS:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    if parsed.tzinfo is None:
        return None
    return parsed.astimezone(UTC)


def _tag(tags: Mapping[str, Any], name: str, limit: int) -> str | None:
    """The first value of tag ``name``; None unless it is one the relay could have set (our tag
    charset, at most ``limit`` characters): a forged or foreign value names no row."""
    values = tags.get(name)
    if not isinstance(values, list) or not values:
        return None
    value = values[0]
    if not isinstance(value, str) or len(value) > limit or not _TAG_VALUE.fullmatch(value):
        return None
    return value


def _addresses(items: object, field: str | None) -> tuple[str, ...]:
    """The lower-cased addr-specs in ``items`` (a list of strings, or of objects whose
    ``field`` is one), display names stripped, duplicates and unreadable entries dropped."""
    if not isinstance(items, list):
        return ()
    found: dict[str, None] = {}
    for item in items:
        if field is not None:
            item = item.get(field) if isinstance(item, dict) else None
        address = _address(item)
        if address is not None:
            found[address] = None
    return tuple(found)


def _address(raw: object) -> str | None:
    if not isinstance(raw, str) or len(raw) > 2 * _ADDRESS_CHARS:
        return None
    address = (raw if _PLAIN_ADDRESS.fullmatch(raw) else parseaddr(raw)[1]).lower()
    if (
        not address
        or len(address) > _ADDRESS_CHARS
        or address.count("@") != 1
        or not address.isprintable()
        or any(c.isspace() for c in address)
    ):
        return None
    return address


_STATUS_OF_TYPE = {
    EventType.DELIVERY: DeliveryStatus.DELIVERED,
    EventType.DELIVERY_DELAY: DeliveryStatus.DELAYED,
    EventType.REJECT: DeliveryStatus.REJECTED,
    EventType.RENDERING_FAILURE: DeliveryStatus.REJECTED,
}


def recorded_status(kind: EventType, detail: str | None) -> DeliveryStatus | None:
    """What an event recorded as ``kind`` with ``detail`` means for its row's delivery status:
    :func:`parse`'s reading, again, from what it stored (a deferred event is applied later)."""
    if kind is EventType.BOUNCE:
        suppressed = detail in ("Permanent/Suppressed", "Permanent/OnAccountSuppressionList")
        return DeliveryStatus.SUPPRESSED if suppressed else DeliveryStatus.BOUNCED
    if kind is EventType.COMPLAINT:
        if detail == "OnAccountSuppressionList":
            return DeliveryStatus.SUPPRESSED
        return DeliveryStatus.COMPLAINED
    return _STATUS_OF_TYPE.get(kind)
