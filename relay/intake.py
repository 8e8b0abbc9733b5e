"""The event intake: SES events from an SQS queue, applied to the outbox in one transaction per
batch, deleted from the queue only once their effect committed.

What one event does (:func:`apply_events`), in the transaction that records it:

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
   returned (:func:`apply_deferred`). A ``sent`` row with another SES message id was sent
   twice (``duplicate_send``).
4. ``delivery_status`` only moves up in rank (:attr:`DeliveryStatus.rank`), so events in any
   order converge; permanent bounces and complaints add their addresses to
   ``outbox_suppressions`` unless they are there, but only the addresses the matched row
   was sent to (To, Cc, Bcc): an event cannot silence anyone its message never had, and an
   unmatched one suppresses nothing.

A malformed queue message is recorded (under the digest of its body) and left on the queue,
so SQS's redrive policy moves it to the dead-letter queue after ``maxReceiveCount`` tries; an
unmatched event is recorded and deleted.

Whoever can send to the queue can make it store text, so what is stored is bounded
(:func:`insert_event`): an event matched to no row keeps a few hundred characters of its
recipients, a matched one what any backend's TEXT column holds; nothing is left on the queue
for being too long. With a topic configured (``--events-topic-arn``, :func:`check_topic_arn`),
an event from anywhere else is :attr:`Effect.FOREIGN`: recorded, bounded, deleted, and applied
to no row (:func:`foreign_origin` says what "from the topic" means for each envelope).

Times: ``received_at`` is the database's clock (the caller passes it in), ``event_at`` and
``mail_at`` are SES's.

:class:`Intake` is the loop around it: receive (long poll) -> parse -> apply -> commit ->
delete what committed. A database error deletes nothing (the messages come back after their
visibility timeout); an SQS error is logged and retried after a jittered backoff.
"""

from __future__ import annotations

import collections
import enum
import hashlib
import logging
import os
import random
import re
import socket
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql, sqlite

from outbox.exceptions import ConfigurationError
from outbox.schema import (
    AttemptOutcome,
    DeliveryStatus,
    EventType,
    RelayState,
    Status,
    SuppressionReason,
    attempts,
    events,
    intakes,
    messages,
    suppressions,
)
from relay import signals
from relay.clock import read_database_time
from relay.db import blames_the_row, retry_delay
from relay.events import SesEvent, parse
from relay.recipients import address_key

__all__ = [
    "ACTOR",
    "COUNT_INTERVAL",
    "COUNT_LAG",
    "DEFERRED_BATCH",
    "DEFERRED_INTERVAL",
    "MAX_MESSAGES",
    "Applied",
    "Effect",
    "Intake",
    "QueueInfo",
    "announce",
    "apply_deferred",
    "apply_events",
    "build_client",
    "check_topic_arn",
    "default_intake_id",
    "find_by_provider_id",
    "find_by_tags",
    "foreign_origin",
    "insert_event",
    "raise_delivery_status",
    "recipients_of",
    "record_intake",
    "record_reconciled_attempt",
    "resolve_sent",
    "set_event_effect",
    "suppress_addresses",
]

_log = logging.getLogger("relay.intake")

ACTOR = "ses-events"  # who the intake's suppressions and attempts name
MAX_MESSAGES = 10  # per ReceiveMessage: SQS's most
_MAX_ID = 2**63 - 1  # a tagged row id beyond this cannot be ours (and would overflow BIGINT)
_MYSQL_DUPLICATE_KEY = 1062
# stored text of an event matched to no row (unmatched, foreign, malformed): enough for an
# operator to see what it was, and a forged one costs no more than that
_UNMATCHED_CHARS = 300
# any event's recipients: MySQL/MariaDB's TEXT holds 65,535 bytes, utf8mb4 takes up to 4 a
# character (50 recipients of 320 characters fit)
_TEXT_CHARS = 16_000
_TOPIC_ARN = re.compile(r"arn:[a-z0-9-]+:sns:[a-z0-9-]+:[0-9]{12}:[A-Za-z0-9_.-]{1,256}")


class Effect(enum.StrEnum):
    """What an event did (``outbox_events.effect``); the last two are never stored."""

    RESOLVED = "resolved"  # it proved SES took a send: the row became sent
    STATUS = "status"  # the row's delivery_status moved up
    RECORDED = "recorded"  # matched; nothing to change
    DEFERRED = "deferred"  # the row was being sent: applied once its relay saved the send
    DUPLICATE_SEND = "duplicate_send"  # the row is sent under another SES message id
    UNMATCHED = "unmatched"  # no row of ours (another app's, a pruned row, a forged tag)
    FOREIGN = "foreign"  # not from the configured topic: applied to no row
    MALFORMED = "malformed"  # not an SES event: left on the queue for its dead-letter queue
    DUPLICATE = "duplicate"  # its key was recorded already: no effect (not stored)
    REFUSED = "refused"  # the database refused its row: left on the queue (not stored)


_RESOLVABLE = (Status.UNKNOWN_OUTCOME.value, Status.PENDING.value, Status.RETRYING.value)
_KEPT = frozenset({Effect.MALFORMED, Effect.REFUSED})  # left on the queue
# no signal: nothing changed, or not yet (a deferred event is announced once it is applied)
_SILENT = frozenset({Effect.DUPLICATE, Effect.REFUSED, Effect.DEFERRED})
COUNT_INTERVAL = 10.0  # seconds: while receives return messages, how often the counts are read
# SQS's message counts are approximate and may lag what the queue holds by a minute; a count
# of none proves the queue empty of everything older than this (seconds, with a margin).
COUNT_LAG = 300.0
DEFERRED_BATCH = 100  # deferred events applied per intake pass, oldest first
DEFERRED_INTERVAL = 5.0  # seconds: while batches keep coming, the deferred pass's least gap
# seconds: a receive starts no later than this after the reading of the last committed
# heartbeat (else the replica beats first), so with one long poll (20 s) and its answer's way
# back a message reaches it within the reconcile sweep's bound on a dead replica
# (relay.store.RECEIVE_AFTER_HEARTBEAT, 120 s) after the heartbeat it last committed
_BEAT_BEFORE_RECEIVE = 60.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Applied:
    """One event's result: its ``effect``, its ``outbox_events`` id (None: not stored), the
    row it was matched to and that row's category, whether it resolved the row to sent, and
    the addresses it newly suppressed."""

    event: SesEvent
    effect: Effect
    event_id: int | None = None
    message_id: int | None = None
    category: str | None = None
    resolved: bool = False
    suppressed: tuple[str, ...] = ()

    @property
    def delete(self) -> bool:
        """Whether its queue message may be deleted: everything but a malformed one (also a
        redelivered one: SQS must count its receives) and one the database refused."""
        if self.effect is Effect.DUPLICATE:
            return self.event.type is not EventType.MALFORMED
        return self.effect not in _KEPT


@dataclass(frozen=True, slots=True)
class _Row:
    id: int
    status: str
    category: str
    provider_message_id: str | None


# -- statements ----------------------------------------------------------------------------

_m = messages
_ROW_COLUMNS = (_m.c.id, _m.c.status, _m.c.category, _m.c.provider_message_id)
_RANK = sa.case({s.value: s.rank for s in DeliveryStatus}, value=_m.c.delivery_status, else_=0)


def _fit(value: str | None, column: sa.Column[Any]) -> str | None:
    """``value`` cut to its column's length: a hostile event's long field must not make the
    batch's transaction fail (it would block every event received with it)."""
    length = getattr(column.type, "length", None)
    if value is None or length is None:
        return value
    return value[:length]


def _cut(text: str | None, limit: int) -> str | None:
    """``text`` in at most ``limit`` characters; a cut one ends saying how long it was."""
    if text is None or len(text) <= limit:
        return text
    marker = f" [cut from {len(text)} characters]"
    return text[: limit - len(marker)] + marker


def _joined(addresses: Sequence[str], limit: int) -> str | None:
    """``addresses`` as ``outbox_events.recipients`` holds them (``a@x, b@y``), in at most
    ``limit`` characters: whole addresses, then a last entry (no ``@`` in it) saying how many
    there were."""
    text = ", ".join(addresses)
    if len(text) <= limit:
        return text or None
    marker = f"[{len(addresses)} addresses, cut]"
    kept: list[str] = []
    size = len(marker)
    for address in addresses:
        size += len(address) + 2
        if size > limit:
            break
        kept.append(address)
    return ", ".join([*kept, marker])


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
    does that; :func:`insert_event` bounds what a forged event costs)."""
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


def _as_row(row: Any) -> _Row | None:
    if row is None:
        return None
    return _Row(int(row.id), str(row.status), str(row.category), row.provider_message_id)


def _tagged_id(text: str | None) -> int | None:
    """The row id a tag names, if it can name one (digits, within BIGINT)."""
    if text is None or not text.isascii() or not text.isdecimal():
        return None
    value = int(text)
    return value if 0 < value <= _MAX_ID else None


def find_by_tags(conn: sa.Connection, *, message_id: int, claim_token: str) -> _Row | None:
    """find_by_tags -- The row ``message_id`` if ``claim_token`` is its current claim token or
    one of its attempts'; else None (another deployment's event, or a forged one)."""
    a = attempts
    ours = sa.or_(
        _m.c.claim_token == claim_token,
        sa.exists().where(a.c.message_id == _m.c.id, a.c.claim_token == claim_token),
    )
    stmt = sa.select(*_ROW_COLUMNS).where(_m.c.id == message_id, ours)
    return _as_row(conn.execute(stmt).first())


def find_by_provider_id(conn: sa.Connection, *, provider_message_id: str) -> _Row | None:
    """find_by_provider_id -- The row SES message id ``provider_message_id`` belongs to: the
    row that holds it, else the row of an attempt that recorded it (a stale finalize's, a
    send that was later resent)."""
    stmt = (
        sa.select(*_ROW_COLUMNS)
        .where(_m.c.provider_message_id == provider_message_id)
        .order_by(_m.c.id)
        .limit(1)
    )
    found = _as_row(conn.execute(stmt).first())
    if found is not None:
        return found
    by_attempt = (
        sa.select(*_ROW_COLUMNS)
        .join(attempts, attempts.c.message_id == _m.c.id)
        .where(attempts.c.provider_message_id == provider_message_id)
        .order_by(attempts.c.id)
        .limit(1)
    )
    return _as_row(conn.execute(by_attempt).first())


def _read_row(conn: sa.Connection, message_id: int) -> _Row | None:
    """The row as it is now, locked: a locking read sees the last committed version even in a
    transaction whose snapshot predates it (MySQL/MariaDB at REPEATABLE READ re-read a row
    from the snapshot otherwise, and an UPDATE guarded on what it said never matches)."""
    stmt = sa.select(*_ROW_COLUMNS).where(_m.c.id == message_id).with_for_update()
    return _as_row(conn.execute(stmt).first())


def recipients_of(conn: sa.Connection, message_id: int) -> frozenset[str]:
    """recipients_of -- The row's To, Cc and Bcc as lower-cased addr-specs, the form
    ``outbox_suppressions`` keys on and the relay screens them in. Read from the payload's
    address lists alone (never its bodies or attachments); an entry that is not text is
    skipped."""
    payload = _m.c.payload
    stmt = sa.select(payload["to"], payload["cc"], payload["bcc"]).where(_m.c.id == message_id)
    found = conn.execute(stmt).first()
    addresses: set[str] = set()
    for field in found or ():
        if isinstance(field, str):  # a stored scalar where a list belongs
            field = [field]
        if not isinstance(field, list):
            continue
        addresses.update(address_key(a) for a in field if isinstance(a, str))
    return frozenset(addresses)


def _insert_unless_present(
    conn: sa.Connection, table: sa.Table, values: dict[str, Any]
) -> tuple[Any, ...] | None:
    """INSERT unless the row's unique key is there: its primary key, or None if it was.
    PostgreSQL and SQLite: ``ON CONFLICT DO NOTHING``; MySQL/MariaDB: the insert in a
    savepoint, rolled back on a duplicate key (error 1062) only, so every other error still
    raises (``INSERT IGNORE`` would turn truncations and bad values into warnings)."""
    name = conn.dialect.name
    if name in ("postgresql", "sqlite"):
        insert = postgresql.insert if name == "postgresql" else sqlite.insert
        stmt = (
            insert(table)
            .values(values)
            .on_conflict_do_nothing()
            .returning(*table.primary_key.columns)
        )
        row = conn.execute(stmt).first()
        return None if row is None else tuple(row)
    try:
        with conn.begin_nested():
            result = conn.execute(sa.insert(table).values(values))
    except sa.exc.IntegrityError as exc:
        if _mysql_code(exc) == _MYSQL_DUPLICATE_KEY:
            return None
        raise
    key = result.inserted_primary_key
    return None if key is None else tuple(key)


def _mysql_code(exc: sa.exc.DBAPIError) -> int | None:
    args = getattr(exc.orig, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


def insert_event(
    conn: sa.Connection,
    event: SesEvent,
    *,
    now: datetime,
    message_id: int | None,
    effect: Effect,
    intake_id: str | None = None,
    key: str | None = None,
    error: str | None = None,
) -> int | None:
    """insert_event -- Record ``event`` unless its key (``key``, by default the event's) is
    recorded; its id, or None for a duplicate. On the servers the insert waits for a
    concurrent uncommitted insert of the same key, then finds it: of two replicas applying
    one event, one records it. ``intake_id`` names the replica that took it from its queue:
    the reconcile sweep asks that replica's queue, and only that one, whether it was drained
    after it (an event recorded without one proves nothing there).

    Every text fits its column on every backend, so no event is refused for its length: an
    event matched to no row keeps a few hundred characters of its recipients and error
    (a whole address at a time, then how many there were), a matched one what a MySQL TEXT
    holds."""
    e = events.c
    limit = _UNMATCHED_CHARS if message_id is None else _TEXT_CHARS
    values = {
        "event_key": key or event.key,
        "received_at": now,
        "event_type": event.type.value,
        "event_at": event.event_at,
        "mail_at": event.mail_at,
        "provider_message_id": _fit(event.provider_message_id, e.provider_message_id),
        "message_id": message_id,
        "tagged_message_id": _fit(event.tagged_message_id, e.tagged_message_id),
        "claim_token": _fit(event.claim_token, e.claim_token),
        "detail": _fit(event.detail, e.detail),
        "recipients": _joined(event.recipients, limit),
        "effect": effect.value,
        "error": _cut(error or event.error, _UNMATCHED_CHARS),
        "source": _fit(event.source, e.source),
        "intake_id": _fit(intake_id, e.intake_id),
    }
    inserted = _insert_unless_present(conn, events, values)
    return None if inserted is None else int(inserted[0])


def set_event_effect(conn: sa.Connection, *, event_id: int, effect: Effect) -> None:
    """set_event_effect -- What the event turned out to do, once its effects ran."""
    conn.execute(sa.update(events).where(events.c.id == event_id).values(effect=effect.value))


def _raised(status: DeliveryStatus | None, at: datetime | None) -> dict[str, Any]:
    """``delivery_status`` (and its time) set to ``status`` only where that is a rise."""
    if status is None:
        return {}
    rises = status.rank > _RANK
    return {
        "delivery_status": sa.case((rises, status.value), else_=_m.c.delivery_status),
        "delivery_status_at": sa.case((rises, at), else_=_m.c.delivery_status_at),
    }


def resolve_sent(
    conn: sa.Connection, *, message_id: int, seen: str, event: SesEvent, now: datetime
) -> bool:
    """resolve_sent -- unknown_outcome/pending/retrying -> sent, because an event proved SES
    took one of the row's sends: its SES message id, sent at ``mail_at`` (else ``now``), claim
    cleared, and its delivery status raised. Guarded on the status read (``seen``): a row
    claimed meanwhile is left to its relay."""
    sent_at = event.mail_at if event.mail_at is not None else now
    provider_id = _fit(event.provider_message_id, _m.c.provider_message_id)
    values = {
        "status": Status.SENT.value,
        "provider_message_id": sa.func.coalesce(
            sa.literal(provider_id, sa.String()), _m.c.provider_message_id
        ),
        "sent_at": sent_at,
        "claim_token": None,
        "lease_expires_at": None,
        "last_error_code": None,
        "last_error_message": None,
        "updated_at": now,
        **_raised(event.delivery_status, event.event_at),
    }
    stmt = sa.update(_m).where(_m.c.id == message_id, _m.c.status == seen).values(**values)
    return bool(conn.execute(stmt).rowcount == 1)


def record_reconciled_attempt(
    conn: sa.Connection, *, message_id: int, event: SesEvent, now: datetime, actor: str
) -> None:
    """record_reconciled_attempt -- The attempt row saying the event settled the row."""
    conn.execute(
        sa.insert(attempts).values(
            message_id=message_id,
            claim_token=_fit(event.claim_token, attempts.c.claim_token),
            relay_id=actor,
            started_at=None,
            finished_at=now,
            outcome=AttemptOutcome.RECONCILED.value,
            provider_message_id=_fit(event.provider_message_id, attempts.c.provider_message_id),
        )
    )


def raise_delivery_status(conn: sa.Connection, *, message_id: int, event: SesEvent) -> bool:
    """raise_delivery_status -- A sent row's delivery status set to the event's where that is
    higher in rank; guarded on the SES message id too, so an event of another send of the row
    never speaks for the one it holds."""
    status = event.delivery_status
    if status is None:
        return False
    guard = [_m.c.id == message_id, _m.c.status == Status.SENT.value, status.rank > _RANK]
    if event.provider_message_id is not None:
        guard.append(
            sa.or_(
                _m.c.provider_message_id.is_(None),
                _m.c.provider_message_id == event.provider_message_id,
            )
        )
    stmt = (
        sa.update(_m)
        .where(*guard)
        .values(delivery_status=status.value, delivery_status_at=event.event_at)
    )
    return bool(conn.execute(stmt).rowcount == 1)


def suppress_addresses(
    conn: sa.Connection,
    *,
    addresses: Iterable[str],
    reason: SuppressionReason,
    event_id: int,
    detail: str | None,
    now: datetime,
    actor: str,
) -> tuple[str, ...]:
    """suppress_addresses -- Add each address to ``outbox_suppressions`` unless it is there
    (an operator's or an earlier event's entry is kept as it is); the ones added."""
    added = []
    limit = 320  # outbox_suppressions.address: the longest address RFC 5321 allows
    for address in sorted(set(addresses)):
        if not address or len(address) > limit:
            continue  # not an address any message of ours can hold
        values = {
            "address": address,
            "reason": reason.value,
            "detail": _fit(detail, suppressions.c.detail),
            "event_id": event_id,
            "created_at": now,
            "actor": actor,
        }
        if _insert_unless_present(conn, suppressions, values) is not None:
            added.append(address)
    return tuple(added)


# -- one event, one batch ----------------------------------------------------------------


def _match(conn: sa.Connection, event: SesEvent) -> _Row | None:
    if event.type is EventType.MALFORMED:
        return None
    if event.claim_token is not None or event.tagged_message_id is not None:
        tagged = _tagged_id(event.tagged_message_id)
        if event.claim_token is not None:
            if tagged is None:
                return None
            return find_by_tags(conn, message_id=tagged, claim_token=event.claim_token)
        if tagged is None:
            return None
    else:
        tagged = None
    if event.provider_message_id is None:
        return None
    found = find_by_provider_id(conn, provider_message_id=event.provider_message_id)
    if found is not None and tagged is not None and found.id != tagged:
        return None  # its tag and its SES message id name two rows: trust neither
    return found


def _settle(
    conn: sa.Connection, event: SesEvent, row: _Row, now: datetime, actor: str
) -> tuple[Effect, bool]:
    """The row's transition for a matched event: (effect, whether it resolved the row)."""
    for _ in range(3):  # each retry follows a row that moved between the read and the UPDATE
        if row.status in _RESOLVABLE:
            if resolve_sent(conn, message_id=row.id, seen=row.status, event=event, now=now):
                record_reconciled_attempt(
                    conn, message_id=row.id, event=event, now=now, actor=actor
                )
                return Effect.RESOLVED, True
        elif row.status == Status.SENT.value:
            held, theirs = row.provider_message_id, event.provider_message_id
            if held is not None and theirs is not None and held != theirs:
                return Effect.DUPLICATE_SEND, False
            if raise_delivery_status(conn, message_id=row.id, event=event):
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
        moved = _read_row(conn, row.id)
        if moved is None:
            return Effect.RECORDED, False
        row = moved
    return Effect.RECORDED, False


_SUPPRESSION_REASONS = {
    EventType.BOUNCE: SuppressionReason.BOUNCE,
    EventType.COMPLAINT: SuppressionReason.COMPLAINT,
}


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
        event_id = insert_event(
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
    event_id = insert_event(
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
    effect, resolved = _settle(conn, event, row, now, actor)
    reason = _SUPPRESSION_REASONS.get(event.type)
    suppressed: tuple[str, ...] = ()
    if reason is not None and event.suppress:
        # only addresses this message was sent to: whoever can publish to the topic (or knows
        # a message's SES id, which its Message-ID header shows every recipient) must not be
        # able to silence anyone else
        own = recipients_of(conn, row.id)
        suppressed = suppress_addresses(
            conn,
            addresses=[a for a in event.suppress if a in own],
            reason=reason,
            event_id=event_id,
            detail=event.detail,
            now=now,
            actor=actor,
        )
    if effect is not first:
        set_event_effect(conn, event_id=event_id, effect=effect)
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
    ``intake_id`` the replica that took the batch from its queue (:func:`insert_event`);
    with ``topic_arn``, events from elsewhere are only recorded (:func:`foreign_origin`).

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
        _log_applied(applied)
    return [results[i] for i in range(len(batch))]


# -- deferred events ----------------------------------------------------------------------

_e = events
_DEFERRED_COLUMNS = (  # the event's own id and SES message id under names of their own
    _e.c.id.label("event_id"),
    _e.c.event_key,
    _e.c.source,
    _e.c.event_type,
    _e.c.event_at,
    _e.c.mail_at,
    _e.c.provider_message_id.label("event_provider_id"),
    _e.c.tagged_message_id,
    _e.c.claim_token,
    _e.c.detail,
    _e.c.recipients,
    *_ROW_COLUMNS,
)


def _status_of(kind: EventType, detail: str | None) -> DeliveryStatus | None:
    """What a recorded event means for its row's delivery status: the parser's reading
    (:mod:`relay.events`), from the type and detail it stored."""
    if kind is EventType.BOUNCE:
        suppressed = detail in ("Permanent/Suppressed", "Permanent/OnAccountSuppressionList")
        return DeliveryStatus.SUPPRESSED if suppressed else DeliveryStatus.BOUNCED
    if kind is EventType.COMPLAINT:
        if detail == "OnAccountSuppressionList":
            return DeliveryStatus.SUPPRESSED
        return DeliveryStatus.COMPLAINED
    return _STATUS_OF_TYPE.get(kind)


_STATUS_OF_TYPE = {
    EventType.DELIVERY: DeliveryStatus.DELIVERED,
    EventType.DELIVERY_DELAY: DeliveryStatus.DELAYED,
    EventType.REJECT: DeliveryStatus.REJECTED,
    EventType.RENDERING_FAILURE: DeliveryStatus.REJECTED,
}


def _recorded_event(found: Any) -> SesEvent | None:
    """The event as the intake parsed it, from its ``outbox_events`` row (its suppressions
    were made when it arrived: none again)."""
    try:
        kind = EventType(found.event_type)
    except ValueError:
        return None
    return SesEvent(
        key=str(found.event_key),
        source=str(found.source),
        type=kind,
        event_at=found.event_at,
        mail_at=found.mail_at,
        provider_message_id=found.event_provider_id,
        tagged_message_id=found.tagged_message_id,
        claim_token=found.claim_token,
        detail=found.detail,
        recipients=tuple(a for a in (found.recipients or "").split(", ") if "@" in a),
        suppress=(),
        delivery_status=_status_of(kind, found.detail),
        error=None,
    )


def _take_deferred(conn: sa.Connection, event_id: int) -> bool:
    """Take a deferred event for this transaction: of two replicas applying it at once, the
    second one's UPDATE waits for the first one's commit and then matches nothing."""
    stmt = (
        sa.update(_e)
        .where(_e.c.id == event_id, _e.c.effect == Effect.DEFERRED.value)
        .values(effect=Effect.RECORDED.value)
    )
    return bool(conn.execute(stmt).rowcount == 1)


def _apply_deferred_one(
    conn: sa.Connection, found: Any, now: datetime, actor: str
) -> Applied | None:
    event = _recorded_event(found)
    row = _as_row(found)
    event_id = int(found.event_id)
    if event is None or row is None or not _take_deferred(conn, event_id):
        return None
    effect, resolved = _settle(conn, event, row, now, actor)
    if effect is not Effect.RECORDED:
        set_event_effect(conn, event_id=event_id, effect=effect)
    return Applied(
        event=event,
        effect=effect,
        event_id=event_id,
        message_id=row.id,
        category=row.category,
        resolved=resolved,
    )


def apply_deferred(
    conn: sa.Connection, *, now: datetime, actor: str = ACTOR, limit: int = DEFERRED_BATCH
) -> list[Applied]:
    """apply_deferred -- Apply, in the caller's transaction, up to ``limit`` events recorded
    ``deferred`` (they came while their row was being sent) whose row is no longer being
    sent, oldest first: the same effects as on arrival, once the relay saved what its call
    returned. A Send or Delivery that came while the call was still waiting resolves the
    row the call left unknown_outcome (or retrying); a bounce that beat the relay's save sets
    the sent row's delivery status; the first attempt's event that came during a requeued
    send shows the row sent twice (``duplicate_send``). Each event's effect replaces
    ``deferred`` once, whichever replica applies it; one whose row is taken again before its
    UPDATE stays deferred for the next pass."""
    stmt = (
        sa.select(*_DEFERRED_COLUMNS)
        .join(_m, _m.c.id == _e.c.message_id)
        .where(_e.c.effect == Effect.DEFERRED.value, _m.c.status != Status.PROCESSING.value)
        .order_by(_e.c.received_at, _e.c.id)
        .limit(limit)
    )
    done: list[Applied] = []
    isolate = conn.dialect.name != "sqlite"
    for found in conn.execute(stmt).all():
        if not isolate:
            applied = _apply_deferred_one(conn, found, now, actor)
        else:
            try:
                with conn.begin_nested():
                    applied = _apply_deferred_one(conn, found, now, actor)
            except sa.exc.DBAPIError as exc:
                if not blames_the_row(exc):
                    raise
                _log.error(
                    "the database refused a deferred event's effect; left deferred: %s",
                    getattr(exc, "orig", None) or exc,
                    extra={"action": "event_refused", "event_id": found.event_id},
                )
                continue
        if applied is not None:
            done.append(applied)
            _log_applied(applied)
    return done


def _log_applied(applied: Applied) -> None:
    event = applied.event
    extra = {
        "action": f"event_{applied.effect.value}",
        "message_id": applied.message_id,
        "event_type": event.type.value,
        "provider_message_id": event.provider_message_id,
    }
    if applied.effect is Effect.DUPLICATE_SEND:
        _log.warning("two sends of this message reached SES", extra=extra)
    elif applied.effect is Effect.MALFORMED:
        _log.warning(
            "not an SES event (%s); left on the queue for its dead-letter queue",
            event.error,
            extra={**extra, "event_key": event.key},
        )
    elif applied.effect is Effect.RESOLVED:
        _log.info("an event proved SES took the send: sent", extra=extra)
    elif applied.effect is Effect.UNMATCHED:
        _log.info("no message of ours: recorded", extra=extra)
    elif applied.effect is Effect.FOREIGN:
        _log.warning(
            "not from the configured topic (%s %s): recorded, applied to no message",
            event.source,
            event.origin or "without an origin",
            extra={**extra, "origin": event.origin},
        )
    elif applied.effect is Effect.DEFERRED:
        _log.info(
            "the message is being sent: event deferred until its relay saved the send",
            extra=extra,
        )
    elif applied.effect is Effect.RECORDED and applied.message_id is not None:
        _log.debug("recorded", extra=extra)
    for address in applied.suppressed:
        _log.info(
            "address suppressed",
            extra={"action": "suppressed", "message_id": applied.message_id, "to": address},
        )


def announce(sender: object, batch: Iterable[Applied]) -> None:
    """Send the intake's signals for ``batch`` (after it committed), from ``sender``: a
    receiver that raises is logged, the others still hear."""
    for applied in batch:
        if applied.message_id is None or applied.effect in _SILENT:
            continue
        event = applied.event
        common = {
            "message_id": applied.message_id,
            "category": applied.category,
            "provider_message_id": event.provider_message_id,
        }
        if applied.resolved:
            _send(signals.reconciled, sender, result="sent", **common)
        detail = {**common, "recipients": event.recipients, "event_at": event.event_at}
        if event.type is EventType.DELIVERY:
            _send(signals.delivered, sender, **detail)
        elif event.type is EventType.BOUNCE:
            kind, _, sub = (event.detail or "").partition("/")
            _send(
                signals.bounced,
                sender,
                bounce_type=kind or None,
                bounce_subtype=sub or None,
                **detail,
            )
        elif event.type is EventType.COMPLAINT:
            _send(signals.complained, sender, feedback_type=event.detail, **detail)


def _send(signal: Any, sender: object, **kw: Any) -> None:
    try:
        signal.send(sender, **kw)
    except Exception:
        _log.exception("a receiver of %s failed", signal.name, extra={"action": "signal_error"})


# -- the replicas' view of the queue ---------------------------------------------------------


def record_intake(
    conn: sa.Connection,
    *,
    intake_id: str,
    queue_url: str,
    visibility_timeout: float,
    started_at: datetime,
    now: datetime,
    caught_up: bool,
    empty_since: datetime | None = None,
) -> None:
    """record_intake -- This replica's ``outbox_intakes`` row: alive at ``now`` (the
    database's clock), and with ``caught_up`` its queue found empty then (or, given
    ``empty_since``, empty of everything older than that). One upsert per
    dialect (``ON CONFLICT DO UPDATE``, MariaDB's ``ON DUPLICATE KEY UPDATE``), each column
    conditional: the process that started last owns the row (a write of an older one with
    the same id changes nothing), a new process starts with its own proof (none until its
    first empty receive), and ``caught_up_at`` only moves forward.

    No stored time stays later than the ``now`` being written: such a value was written
    before the database's clock was stepped back, and a ``caught_up_at`` from then would
    claim an emptiness seen later than it was. The owner's ``heartbeat_at`` follows the
    clock, a ``caught_up_at`` ahead of it is replaced by the owner's (NULL by an older
    process's write), and a row whose process started after ``now`` is taken by the writer
    as a newer process's."""
    t = intakes.c
    values = {
        "intake_id": intake_id,
        "queue_url": queue_url,
        "visibility_timeout": float(visibility_timeout),
        "started_at": started_at,
        "heartbeat_at": now,
        "caught_up_at": (empty_since or now) if caught_up else None,
    }
    name = conn.dialect.name
    stmt: Any
    if name in ("mysql", "mariadb"):
        stmt = mysql.insert(intakes).values(values)
        new = stmt.inserted
    else:
        stmt = (postgresql.insert if name == "postgresql" else sqlite.insert)(intakes).values(
            values
        )
        new = stmt.excluded
    # a row started after this write's clock was written before the clock went back
    ahead = t.started_at > new.heartbeat_at
    newer = sa.or_(new.started_at > t.started_at, ahead)
    same = sa.and_(new.started_at == t.started_at, ~ahead)
    older = sa.and_(new.started_at < t.started_at, ~ahead)
    stale = t.caught_up_at > new.heartbeat_at  # found empty "later" than now: not so
    caught_up_at = sa.case(
        (newer, new.caught_up_at),
        (sa.and_(older, stale), sa.null()),
        (older, t.caught_up_at),
        (stale, new.caught_up_at),
        (new.caught_up_at.is_(None), t.caught_up_at),
        (t.caught_up_at.is_(None), new.caught_up_at),
        (new.caught_up_at > t.caught_up_at, new.caught_up_at),
        else_=t.caught_up_at,
    )
    owned = sa.or_(newer, same)
    # an older process's reading never moves the owner's heartbeat (it would make the owner
    # look silent longer than it is, and the reconcile sweep count it dead sooner)
    heartbeat_at = sa.case((owned, new.heartbeat_at), else_=t.heartbeat_at)
    # in this order: MariaDB assigns left to right, each later expression reading the row as
    # the earlier ones left it, so started_at (which the others compare with) is set last
    updates = [
        ("caught_up_at", caught_up_at),
        ("heartbeat_at", heartbeat_at),
        ("queue_url", sa.case((owned, new.queue_url), else_=t.queue_url)),
        (
            "visibility_timeout",
            sa.case((owned, new.visibility_timeout), else_=t.visibility_timeout),
        ),
        ("started_at", sa.case((newer, new.started_at), else_=t.started_at)),
    ]
    if name in ("mysql", "mariadb"):
        stmt = stmt.on_duplicate_key_update(updates)
    else:
        stmt = stmt.on_conflict_do_update(index_elements=[t.intake_id], set_=dict(updates))
    conn.execute(stmt)


def default_intake_id() -> str:
    """An ``outbox-relay events`` process's id in ``outbox_intakes``: its host and pid."""
    return f"{socket.gethostname()}-{os.getpid()}"


# -- the SQS loop --------------------------------------------------------------------------


def build_client(
    queue_url: str, *, wait_seconds: int, connect_timeout: float = 5.0, region: str | None = None
) -> Any:
    """The intake's SQS client, from boto3's standard configuration chain (region,
    credentials, ``AWS_ENDPOINT_URL_SQS``), with botocore's retries off (the loop retries,
    with its own backoff) and a read timeout longer than the long poll. Without a configured
    region the queue URL's (``sqs.<region>.amazonaws.com``) is used."""
    import boto3
    from botocore.config import Config

    session = boto3.session.Session(region_name=region)
    if not session.region_name:
        fallback = os.environ.get("AWS_REGION") or _region_of(queue_url)
        if fallback:
            session = boto3.session.Session(region_name=fallback)
    if not session.region_name:
        raise ConfigurationError(
            "AWS_REGION",
            "no AWS region configured for SQS (AWS_REGION, AWS_DEFAULT_REGION, the profile's "
            "region, or a queue URL of the form https://sqs.<region>.amazonaws.com/...)",
        )
    if session.get_credentials() is None:
        raise ConfigurationError(
            "AWS credentials", "none found in the standard chain (env, profile, role)"
        )
    config = Config(
        retries={"total_max_attempts": 1, "mode": "standard"},
        connect_timeout=connect_timeout,
        read_timeout=wait_seconds + 10.0,
        tcp_keepalive=True,
    )
    return session.client("sqs", config=config)


def _region_of(queue_url: str) -> str | None:
    host = (urlsplit(queue_url).hostname or "").split(".")
    if len(host) >= 3 and host[0] == "sqs" and host[-2:] == ["amazonaws", "com"]:
        return host[1]
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class QueueInfo:
    """What the intake read of its queue at start: its dead-letter queue's ARN and
    ``maxReceiveCount`` (None without a redrive policy), and its visibility timeout."""

    dead_letter_arn: str | None
    max_receive_count: int | None
    visibility_timeout: int | None


_MISSING_QUEUE = frozenset(
    {"AWS.SimpleQueueService.NonExistentQueue", "QueueDoesNotExist", "InvalidAddress"}
)


class Intake:
    """The loop of one intake replica: ``run()`` until :meth:`request_stop` (or, with
    ``exit_when_idle``, until a receive comes back empty). Any number of replicas may share a
    queue and a database.

    ``client`` is a boto3 SQS client (:func:`build_client`). ``intake_id`` names the
    replica's ``outbox_intakes`` row (the relay's id when it runs in a relay; by default the
    host and pid): each pass writes its heartbeat there, and ``caught_up_at`` when a long
    poll found the queue empty (see :meth:`step`); nothing is written before the queue's
    visibility timeout is known (:meth:`check_queue`). Counters for the metrics:
    :attr:`counts` (``(type, effect)``: events, a deferred one counted again with the effect
    it had once applied), :attr:`errors` (``sqs``, ``database``). With ``topic_arn``, only
    that SNS topic's events (or its account's, through EventBridge) are applied
    (:func:`foreign_origin`); without, every event is."""

    def __init__(
        self,
        *,
        engine: sa.Engine,
        client: Any,
        queue_url: str,
        wait_seconds: int = 20,
        exit_when_idle: bool = False,
        actor: str = ACTOR,
        rng: random.Random | None = None,
        intake_id: str | None = None,
        topic_arn: str | None = None,
    ) -> None:
        self.engine = engine
        self.topic_arn = None if topic_arn is None else check_topic_arn(topic_arn)
        self.intake_id = intake_id if intake_id is not None else default_intake_id()
        self.client = client
        self.queue_url = queue_url
        self.wait_seconds = wait_seconds
        self.exit_when_idle = exit_when_idle
        self.actor = actor
        self._rng = rng if rng is not None else random.Random()
        self._stopping = threading.Event()
        self._failures = 0  # consecutive failed passes
        self.queue: QueueInfo | None = None  # read by check_queue
        self.counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self.errors: collections.Counter[str] = collections.Counter()
        self.loop_at: float | None = None  # monotonic time of the loop's last pass
        self.waiting_at: float | None = None
        self.started_at: datetime | None = None  # the database's clock at the first heartbeat
        # monotonic time since which every message SQS handed this process was applied (or
        # left on the queue as not an event); until a visibility timeout after it, messages
        # this process (or the one before it under this id) took may still be hidden in SQS
        self._settled_since = time.monotonic()
        self._deferred_at = -float("inf")  # monotonic time of the last deferred pass
        self._counted_at = -float("inf")  # monotonic time the queue's counts were last read
        # monotonic time just before the database's clock was read for the last committed
        # heartbeat (None before the first)
        self._beat_at: float | None = None

    def request_stop(self) -> None:
        """Stop after the batch in hand (a long poll in progress ends within
        ``wait_seconds``). Thread/signal-safe."""
        self._stopping.set()

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    # what /healthz and /readyz read (the relay's names): the intake is never paused
    paused = False
    pause_code = None

    @property
    def state(self) -> RelayState:
        return RelayState.DRAINING if self._stopping.is_set() else RelayState.RUNNING

    def check_queue(self) -> QueueInfo:
        """Read the queue's redrive policy and visibility timeout. A queue that does not
        exist (or cannot be read with these credentials) is a :class:`ConfigurationError`
        naming its URL; without a redrive policy, a warning: malformed messages then come
        back forever. Other SQS errors (endpoint unreachable) raise as botocore's."""
        from botocore.exceptions import ClientError

        try:
            answer = self.client.get_queue_attributes(
                QueueUrl=self.queue_url, AttributeNames=["RedrivePolicy", "VisibilityTimeout"]
            )
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in _MISSING_QUEUE:
                raise ConfigurationError(
                    "--events-queue-url", f"no SQS queue at {self.queue_url} ({code})"
                ) from None
            if code in ("AccessDenied", "AccessDeniedException", "InvalidClientTokenId"):
                raise ConfigurationError(
                    "--events-queue-url",
                    f"cannot read the SQS queue at {self.queue_url} ({code}): the relay needs "
                    "sqs:GetQueueAttributes, sqs:ReceiveMessage and sqs:DeleteMessage on it",
                ) from None
            raise
        attributes = answer.get("Attributes", {})
        info = _queue_info(attributes)
        self.queue = info
        if info.dead_letter_arn is None:
            _log.warning(
                "the events queue has no redrive policy: a malformed message will be "
                "received again forever; give it a dead-letter queue (RedrivePolicy)",
                extra={"action": "no_dead_letter_queue", "queue": self.queue_url},
            )
        return info

    def run(self) -> None:
        """Receive and apply until stopped; never raises for SQS or database errors (they are
        logged and retried after a jittered backoff)."""
        from botocore.exceptions import BotoCoreError, ClientError

        _log.info(
            "event intake started", extra={"action": "intake_started", "queue": self.queue_url}
        )
        try:
            while not self._stopping.is_set():
                self.loop_at = time.monotonic()
                try:
                    if self.queue is None:
                        self.check_queue()
                    received = self.step()
                except (BotoCoreError, ClientError) as exc:
                    self._failed("sqs", exc)
                    continue
                except sa.exc.DBAPIError as exc:
                    self._failed("database", getattr(exc, "orig", None) or exc)
                    continue
                except ConfigurationError as exc:  # the queue was deleted while running
                    self._failed("sqs", exc)
                    continue
                self._failures = 0
                if received == 0 and self.exit_when_idle:
                    _log.info("queue empty, exiting", extra={"action": "idle_exit"})
                    break
        finally:
            self.loop_at = None
            _log.info("event intake stopped", extra={"action": "intake_stopped"})

    def _failed(self, kind: str, exc: BaseException) -> None:
        self._failures += 1
        self.errors[kind] += 1
        delay = self.backoff()
        _log.warning(
            "%s error: %s; retrying in %.1fs",
            "SQS" if kind == "sqs" else kind,
            exc,
            delay,
            extra={"action": f"intake_{kind}_error", "failures": self._failures},
        )
        self._stopping.wait(delay)

    def backoff(self) -> float:
        """Jittered exponential, 0.5 s to 30 s: replicas failing together do not retry in
        step."""
        return retry_delay(self._failures, self._rng)

    def step(self) -> int:
        """One pass: receive up to :data:`MAX_MESSAGES` (long poll), apply them in one
        transaction, commit, delete the ones whose effect committed, send the signals; then
        apply the deferred events whose row is no longer being sent (:func:`apply_deferred`,
        its own transaction). The number received. An SQS error on the receive or a database
        error raises, and nothing is deleted; a failed delete only means those messages come
        again (and are then duplicates).

        The replica's ``outbox_intakes`` row gets its heartbeat each pass and, after a long
        poll (``wait_seconds`` >= 1: a short poll samples only some of SQS's servers) that
        returned nothing, ``caught_up_at``: the database's clock right after it, so no event
        was visible in the queue until then. Not while messages this process was handed may
        still be hidden unapplied (a failed batch, an event the database refused, a receive
        whose answer was lost, the process's start): until the queue's visibility timeout
        has passed since.

        Each receive names the visibility timeout read at start (:meth:`check_queue`): a
        setting raised on the queue since cannot hide a message this replica took longer
        than its row says. And the reconcile sweep asks every replica of the queue, and
        bounds when a dead one may last have taken a message by its heartbeat: so a replica
        beats before its first receive, and before any that would start more than
        :data:`_BEAT_BEFORE_RECEIVE` seconds after its last heartbeat's reading."""
        visibility = None if self.queue is None else self.queue.visibility_timeout
        if visibility is not None and (
            self._beat_at is None or time.monotonic() - self._beat_at >= _BEAT_BEFORE_RECEIVE
        ):
            self._beat(caught_up=False)
        request: dict[str, Any] = {
            "QueueUrl": self.queue_url,
            "MaxNumberOfMessages": MAX_MESSAGES,
            "WaitTimeSeconds": self.wait_seconds,
        }
        if visibility is not None:
            request["VisibilityTimeout"] = visibility
        try:
            answer = self.client.receive_message(**request)
        except BaseException:
            self._unsettled()  # SQS may have handed out messages on the lost answer
            raise
        received = answer.get("Messages") or []
        if received:
            self._apply_received(received)
            self._check_emptied()
        else:
            self._beat(caught_up=self._caught_up())
        if received and time.monotonic() - self._deferred_at < DEFERRED_INTERVAL:
            return len(received)  # busy: the deferred events wait a few seconds more
        self._deferred_at = time.monotonic()
        with self.engine.begin() as conn:
            deferred = apply_deferred(conn, now=read_database_time(conn), actor=self.actor)
        for result in deferred:
            self.counts[(result.event.type.value, result.effect.value)] += 1
        announce(self, deferred)
        return len(received)

    def _apply_received(self, received: list[dict[str, Any]]) -> None:
        parsed = [parse(str(m.get("Body", ""))) for m in received]
        try:
            with self.engine.begin() as conn:
                read_at = time.monotonic()
                now = read_database_time(conn)
                applied = apply_events(
                    conn,
                    parsed,
                    now=now,
                    actor=self.actor,
                    intake_id=self.intake_id,
                    topic_arn=self.topic_arn,
                )
                self._record(conn, now, caught_up=False)
        except BaseException:
            self._unsettled()
            raise
        self._beat_at = read_at
        if any(result.effect is Effect.REFUSED for result in applied):
            self._unsettled()
        for result in applied:
            self.counts[(result.event.type.value, result.effect.value)] += 1
        self._delete(
            [
                m["ReceiptHandle"]
                for m, result in zip(received, applied, strict=True)
                if result.delete
            ]
        )
        announce(self, applied)

    def _unsettled(self) -> None:
        self._settled_since = time.monotonic()

    def _caught_up(self) -> bool:
        """Whether an empty receive just now proves the queue held no event this replica
        could see: a long poll, and nothing handed to this process may still be hidden (each
        receive names this replica's visibility timeout, so the queue's setting, changed
        since, does not decide how long)."""
        visibility = None if self.queue is None else self.queue.visibility_timeout
        return (
            self.wait_seconds >= 1
            and visibility is not None
            and time.monotonic() - self._settled_since >= visibility
        )

    def _check_emptied(self) -> None:
        """Under steady traffic a long poll never comes back empty, and the reconcile sweep
        would never see a proof. So while receives keep returning messages, every
        :data:`COUNT_INTERVAL` seconds the queue's own counts are read: none visible and
        none delayed means no event older than SQS's counting lag was still waiting, and
        ``caught_up_at`` is set :data:`COUNT_LAG` seconds before the reading. A count that
        cannot be read proves nothing."""
        if time.monotonic() - self._counted_at < COUNT_INTERVAL or not self._caught_up():
            return
        self._counted_at = time.monotonic()
        try:
            answer = self.client.get_queue_attributes(
                QueueUrl=self.queue_url,
                AttributeNames=[
                    "ApproximateNumberOfMessages",
                    "ApproximateNumberOfMessagesDelayed",
                ],
            )
            counts = answer.get("Attributes") or {}
            waiting = int(counts["ApproximateNumberOfMessages"])
            waiting += int(counts["ApproximateNumberOfMessagesDelayed"])
        except Exception as exc:  # an unreadable count is no proof, never a failed pass
            _log.debug("queue counts not read: %s", exc, extra={"action": "queue_count"})
            return
        if waiting:
            return
        with self.engine.begin() as conn:
            read_at = time.monotonic()
            now = read_database_time(conn)
            lag = timedelta(seconds=COUNT_LAG)
            self._record(conn, now, caught_up=True, empty_since=now - lag)
        self._beat_at = read_at

    def _beat(self, *, caught_up: bool) -> None:
        with self.engine.begin() as conn:
            read_at = time.monotonic()
            self._record(conn, read_database_time(conn), caught_up=caught_up)
        self._beat_at = read_at

    def _record(
        self,
        conn: sa.Connection,
        now: datetime,
        *,
        caught_up: bool,
        empty_since: datetime | None = None,
    ) -> None:
        visibility = None if self.queue is None else self.queue.visibility_timeout
        if visibility is None:
            return  # check_queue has not read it: the row would prove nothing
        if self.started_at is None:
            self.started_at = now
        record_intake(
            conn,
            intake_id=self.intake_id,
            queue_url=self.queue_url,
            visibility_timeout=visibility,
            started_at=self.started_at,
            now=now,
            caught_up=caught_up,
            empty_since=empty_since,
        )

    def _delete(self, handles: list[str]) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        if not handles:
            return
        entries = [{"Id": str(i), "ReceiptHandle": h} for i, h in enumerate(handles)]
        try:
            answer = self.client.delete_message_batch(QueueUrl=self.queue_url, Entries=entries)
        except (BotoCoreError, ClientError) as exc:
            self.errors["sqs"] += 1
            _log.warning(
                "cannot delete %d applied messages (%s): they will be received again, as "
                "duplicates",
                len(entries),
                exc,
                extra={"action": "delete_failed"},
            )
            return
        failed = answer.get("Failed") or []
        if failed:
            self.errors["sqs"] += 1
            _log.warning(
                "SQS did not delete %d applied messages (%s): they will be received again, "
                "as duplicates",
                len(failed),
                ", ".join(sorted({str(f.get("Code")) for f in failed})),
                extra={"action": "delete_failed"},
            )


def _queue_info(attributes: dict[str, Any]) -> QueueInfo:
    import json

    policy: dict[str, Any] = {}
    raw = attributes.get("RedrivePolicy")
    if raw:
        try:
            loaded = json.loads(raw)
        except ValueError:
            loaded = {}
        policy = loaded if isinstance(loaded, dict) else {}
    count = policy.get("maxReceiveCount")
    visibility = attributes.get("VisibilityTimeout")
    return QueueInfo(
        dead_letter_arn=policy.get("deadLetterTargetArn") or None,
        max_receive_count=_whole(count),
        visibility_timeout=_whole(visibility),
    )


def _whole(value: object) -> int | None:
    text = str(value) if isinstance(value, int | str) else ""
    return int(text) if text.isascii() and text.isdecimal() else None
