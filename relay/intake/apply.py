"""Applying SES events (:func:`apply_events`), in the transaction that records them.

What one event does:

1. Its ``outbox_events`` row is inserted unless its ``event_key`` is there already; a
   duplicate (SQS delivers at least once, SNS may publish twice, an operator may replay a
   dead-letter queue) has no effect at all. The unique key decides between two replicas
   applying the same event at once: the second one's insert waits for the first one's commit
   and then finds the key.
2. It is matched to its row: by its tags (``outbox_message_id`` names the row and
   ``outbox_attempt`` is the claim token of one of its attempts, or its current one), else,
   without the attempt tag (identity notifications carry no tags), by SES message id on the
   rows, then on the attempts. A tag naming a row none of whose attempts carry its token is
   another deployment's (or forged): unmatched, it changes nothing.
3. A matched event proves SES took one of the row's sends: an ``unknown_outcome``,
   ``pending`` or ``retrying`` row becomes ``sent`` (never sent again), with an attempt row
   ``reconciled``. A row being sent (``processing``) is not touched then: the event is
   recorded ``deferred`` and applied by a later pass once the relay saved what its call
   returned (:func:`relay.intake.deferred.apply_deferred`). A ``sent`` row with another SES
   message id was sent twice (``duplicate_send``).
4. ``delivery_status`` only moves up in rank (:attr:`DeliveryStatus.rank`), so events in any
   order converge; permanent bounces and complaints add their addresses to
   ``outbox_suppressions`` unless they are there, but only the addresses the matched row
   was sent to (To, Cc, Bcc): an event cannot silence anyone its message never had, and an
   unmatched one suppresses nothing.

A malformed queue message is recorded (under the digest of its body) and left on the queue,
so SQS's redrive policy moves it to the dead-letter queue after ``maxReceiveCount`` tries; an
unmatched event is recorded and deleted. With a topic configured (``--events-topic-arn``,
:func:`check_topic_arn`), an event from anywhere else is :attr:`Effect.FOREIGN`: recorded,
bounded, deleted, and applied to no row (:func:`foreign_origin`). Why: docs/design.md,
"Decisions" (provider events through SQS; an event is ours only if it names one of our
attempts; any event proves the send reached SES).

Times: ``received_at`` is the database's clock (the caller passes it in), ``event_at`` and
``mail_at`` are SES's.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Sequence
from datetime import datetime

import sqlalchemy as sa

from outbox.exceptions import ConfigurationError
from outbox.schema import EventType, Status, SuppressionReason
from relay.db import blames_the_row
from relay.events import SesEvent
from relay.intake.outcome import Applied, log_applied
from relay.recipients import address_key
from relay.store import events as event_sql
from relay.store.events import Effect, MessageRow

__all__ = [
    "ACTOR",
    "apply_events",
    "check_topic_arn",
    "foreign_origin",
    "recipients_of",
    "settle",
]

_log = logging.getLogger("relay.intake")

ACTOR = "ses-events"  # who the intake's suppressions and attempts name
_MAX_ID = 2**63 - 1  # a tagged row id beyond this cannot be ours (and would overflow BIGINT)
_TOPIC_ARN = re.compile(r"arn:[a-z0-9-]+:sns:[a-z0-9-]+:[0-9]{12}:[A-Za-z0-9_.-]{1,256}")
_RESOLVABLE = (Status.UNKNOWN_OUTCOME.value, Status.PENDING.value, Status.RETRYING.value)
_SUPPRESSION_REASONS = {
    EventType.BOUNCE: SuppressionReason.BOUNCE,
    EventType.COMPLAINT: SuppressionReason.COMPLAINT,
}


def check_topic_arn(value: str) -> str:
    """``value`` if it is an SNS topic's ARN (``arn:aws:sns:<region>:<account>:<name>``);
    else a :class:`ConfigurationError` naming ``--events-topic-arn``."""
    if _TOPIC_ARN.fullmatch(value) is None:
        raise ConfigurationError(
            "--events-topic-arn",
            f"{value!r} is not an SNS topic ARN (arn:aws:sns:<region>:<account id>:<name>)",
        )
    return value


def foreign_origin(event: SesEvent, topic_arn: str | None) -> str | None:
    """Why ``event`` is not from ``topic_arn``, in a few words; None if it is, or if no topic
    is configured (then every event counts as ours, as before the option existed).

    An SNS notification is ours when its ``TopicArn`` is the topic. An EventBridge event has
    no topic: it is ours when its ``account`` is the topic's account (the account whose SES
    published it; a rule on another account's bus forwarding to our queue is foreign). A raw
    body (SNS raw message delivery) names no origin at all: foreign, so a deployment with
    raw delivery leaves the option unset. A malformed body is never foreign (it goes to the
    dead-letter queue as before). Envelopes are not signed here: this keeps other topics'
    and accounts' events out, not a forger who may write to the queue (its queue policy
    does that; :func:`relay.store.events.insert_event` bounds what a forged event costs)."""
    if topic_arn is None or event.type is EventType.MALFORMED:
        return None
    if event.source == "sns":
        if event.origin == topic_arn:
            return None
        return f"from SNS topic {event.origin or '(none)'}, not {topic_arn}"
    if event.source == "eventbridge":
        account = topic_arn.split(":")[4]
        if event.origin == account:
            return None
        return f"from EventBridge account {event.origin or '(none)'}, not {account}"
    return "no SNS envelope (raw delivery): its topic is unknown"


def recipients_of(conn: sa.Connection, message_id: int) -> frozenset[str]:
    """The row's To, Cc and Bcc as lower-cased addr-specs, the form ``outbox_suppressions``
    keys on and the relay screens them in (:func:`relay.store.events.payload_addresses`)."""
    return frozenset(address_key(a) for a in event_sql.payload_addresses(conn, message_id))


def _tagged_id(text: str | None) -> int | None:
    """The row id a tag names, if it can name one (digits, within BIGINT)."""
    if text is None or not text.isascii() or not text.isdecimal():
        return None
    value = int(text)
    return value if 0 < value <= _MAX_ID else None


def _match(conn: sa.Connection, event: SesEvent) -> MessageRow | None:
    if event.type is EventType.MALFORMED:
        return None
    if event.claim_token is not None or event.tagged_message_id is not None:
        tagged = _tagged_id(event.tagged_message_id)
        if event.claim_token is not None:
            if tagged is None:
                return None
            return event_sql.find_by_tags(conn, message_id=tagged, claim_token=event.claim_token)
        if tagged is None:
            return None
    else:
        tagged = None
    if event.provider_message_id is None:
        return None
    found = event_sql.find_by_provider_id(conn, provider_message_id=event.provider_message_id)
    if found is not None and tagged is not None and found.id != tagged:
        return None  # its tag and its SES message id name two rows: trust neither
    return found


def settle(
    conn: sa.Connection, event: SesEvent, row: MessageRow, now: datetime, actor: str
) -> tuple[Effect, bool]:
    """The row's transition for a matched event: (effect, whether it resolved the row)."""
    for _ in range(3):  # each retry follows a row that moved between the read and the UPDATE
        if row.status in _RESOLVABLE:
            if event_sql.resolve_sent(
                conn, message_id=row.id, seen=row.status, event=event, now=now
            ):
                event_sql.record_reconciled_attempt(
                    conn, message_id=row.id, event=event, now=now, actor=actor
                )
                return Effect.RESOLVED, True
        elif row.status == Status.SENT.value:
            held, theirs = row.provider_message_id, event.provider_message_id
            if held is not None and theirs is not None and held != theirs:
                return Effect.DUPLICATE_SEND, False
            if event_sql.raise_delivery_status(conn, message_id=row.id, event=event):
                return Effect.STATUS, False
            return Effect.RECORDED, False
        elif row.status == Status.PROCESSING.value:
            # its relay holds the row and will save what its call returned: the event is
            # applied once it has (apply_deferred), over whatever that was
            return Effect.DEFERRED, False
        else:
            _log.warning(
                "an event shows SES took a send of a %s message: recorded, row left as it is",
                row.status,
                extra={"action": "event_recorded", "message_id": row.id},
            )
            return Effect.RECORDED, False
        moved = event_sql.read_row_locked(conn, row.id)
        if moved is None:
            return Effect.RECORDED, False
        row = moved
    return Effect.RECORDED, False


def _apply_one(
    conn: sa.Connection,
    event: SesEvent,
    now: datetime,
    actor: str,
    intake_id: str | None,
    topic_arn: str | None,
) -> Applied:
    foreign = foreign_origin(event, topic_arn)
    if foreign is not None:
        # under a key of its own: a copy of one of our events that came another way must
        # not make ours a duplicate when it arrives
        key = hashlib.sha256(f"foreign:{event.origin}:{event.key}".encode()).hexdigest()
        event_id = event_sql.insert_event(
            conn,
            event,
            now=now,
            message_id=None,
            effect=Effect.FOREIGN,
            intake_id=intake_id,
            key=key,
            error=foreign,
        )
        if event_id is None:
            return Applied(event=event, effect=Effect.DUPLICATE)
        return Applied(event=event, effect=Effect.FOREIGN, event_id=event_id)
    row = _match(conn, event)
    if event.type is EventType.MALFORMED:
        first = Effect.MALFORMED
    else:
        first = Effect.UNMATCHED if row is None else Effect.RECORDED
    event_id = event_sql.insert_event(
        conn,
        event,
        now=now,
        message_id=None if row is None else row.id,
        effect=first,
        intake_id=intake_id,
    )
    if event_id is None:
        return Applied(event=event, effect=Effect.DUPLICATE)
    if row is None:
        return Applied(event=event, effect=first, event_id=event_id)
    effect, resolved = settle(conn, event, row, now, actor)
    reason = _SUPPRESSION_REASONS.get(event.type)
    suppressed: tuple[str, ...] = ()
    if reason is not None and event.suppress:
        # only addresses this message was sent to: whoever can publish to the topic (or knows
        # a message's SES id, which its Message-ID header shows every recipient) must not be
        # able to silence anyone else
        own = recipients_of(conn, row.id)
        suppressed = event_sql.suppress_addresses(
            conn,
            addresses=[a for a in event.suppress if a in own],
            reason=reason,
            event_id=event_id,
            detail=event.detail,
            now=now,
            actor=actor,
        )
    if effect is not first:
        event_sql.set_event_effect(conn, event_id=event_id, effect=effect)
    return Applied(
        event=event,
        effect=effect,
        event_id=event_id,
        message_id=row.id,
        category=row.category,
        resolved=resolved,
        suppressed=suppressed,
    )


def apply_events(
    conn: sa.Connection,
    batch: Sequence[SesEvent],
    *,
    now: datetime,
    actor: str = ACTOR,
    intake_id: str | None = None,
    topic_arn: str | None = None,
) -> list[Applied]:
    """Apply ``batch`` in the caller's transaction (which it then commits); one
    :class:`Applied` per event, in the batch's order. ``now`` is the database's clock;
    ``intake_id`` the replica that took the batch from its queue
    (:func:`relay.store.events.insert_event`); with ``topic_arn``, events from elsewhere are
    only recorded (:func:`foreign_origin`).

    Events are applied in key order, so two replicas holding overlapping batches take the
    keys' locks in the same order and wait for each other instead of deadlocking. On
    PostgreSQL and MySQL/MariaDB each event runs in a savepoint: one the database refuses
    (a value it will not store) is rolled back alone, :attr:`Effect.REFUSED`, left on the
    queue for its dead-letter queue, and the rest of the batch still commits. An outage
    (lost connection, deadlock, lock wait timeout) raises: the caller rolls the batch back
    and deletes nothing."""
    results: dict[int, Applied] = {}
    isolate = conn.dialect.name != "sqlite"  # pysqlite's SAVEPOINT needs the engine's fix
    for index, event in sorted(enumerate(batch), key=lambda item: item[1].key):
        if not isolate:
            results[index] = _apply_one(conn, event, now, actor, intake_id, topic_arn)
            continue
        try:
            with conn.begin_nested():
                applied = _apply_one(conn, event, now, actor, intake_id, topic_arn)
        except sa.exc.DBAPIError as exc:
            if not blames_the_row(exc):
                raise
            _log.error(
                "the database refused an event; left on the queue: %s",
                getattr(exc, "orig", None) or exc,
                extra={"action": "event_refused", "event_key": event.key},
            )
            results[index] = Applied(event=event, effect=Effect.REFUSED)
            continue
        results[index] = applied
    for applied in results.values():
        log_applied(applied)
    return [results[i] for i in range(len(batch))]
