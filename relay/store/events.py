"""The event intake's statements: ``outbox_events``, the suppressions events add, the rows
events match and resolve, and the intakes' heartbeats (``outbox_intakes``). Each a function
named by intent, taking the caller's connection; :mod:`relay.intake` orders them.

Whoever can send to the events queue can make it store text, so every text written here
fits its column on every backend (:func:`insert_event`): no event is refused for its length.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql, sqlite

from outbox.schema import (
    ADDRESS_CHARS,
    AttemptOutcome,
    DeliveryStatus,
    Status,
    SuppressionReason,
    attempts,
    events,
    intakes,
    messages,
    suppressions,
)
from relay.events import SesEvent

__all__ = [
    "DeferredEvent",
    "Effect",
    "MessageRow",
    "find_by_provider_id",
    "find_by_tags",
    "find_deferred",
    "insert_event",
    "payload_addresses",
    "raise_delivery_status",
    "read_row_locked",
    "record_intake",
    "record_reconciled_attempt",
    "resolve_sent",
    "set_event_effect",
    "suppress_addresses",
    "take_deferred",
]

_MYSQL_DUPLICATE_KEY = 1062
# stored text of an event matched to no row (unmatched, foreign, malformed): enough for an
# operator to see what it was, and a forged one costs no more than that
_UNMATCHED_CHARS = 300
# any event's recipients: MySQL/MariaDB's TEXT holds 65,535 bytes, utf8mb4 takes up to 4 a
# character (50 recipients of 320 characters fit)
_TEXT_CHARS = 16_000
_ADDRESS_CHARS = ADDRESS_CHARS


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


@dataclass(frozen=True, slots=True)
class MessageRow:
    """What the intake reads of the ``outbox_messages`` row an event matched."""

    id: int
    status: str
    category: str
    provider_message_id: str | None


@dataclass(frozen=True, kw_only=True, slots=True)
class DeferredEvent:
    """A ``deferred`` event as recorded (its own SES message id as ``provider_message_id``,
    its ``recipients`` as stored), with its row as it is now."""

    event_id: int
    event_key: str
    source: str
    event_type: str
    event_at: datetime | None
    mail_at: datetime | None
    provider_message_id: str | None
    tagged_message_id: str | None
    claim_token: str | None
    detail: str | None
    recipients: str | None
    row: MessageRow


_m = messages
_e = events
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


def _as_row(row: Any) -> MessageRow | None:
    if row is None:
        return None
    return MessageRow(int(row.id), str(row.status), str(row.category), row.provider_message_id)


# -- the row an event names -------------------------------------------------------------------


def find_by_tags(conn: sa.Connection, *, message_id: int, claim_token: str) -> MessageRow | None:
    """The row ``message_id`` if ``claim_token`` is its current claim token or one of its
    attempts'; else None (another deployment's event, or a forged one)."""
    a = attempts
    ours = sa.or_(
        _m.c.claim_token == claim_token,
        sa.exists().where(a.c.message_id == _m.c.id, a.c.claim_token == claim_token),
    )
    stmt = sa.select(*_ROW_COLUMNS).where(_m.c.id == message_id, ours)
    return _as_row(conn.execute(stmt).first())


def find_by_provider_id(conn: sa.Connection, *, provider_message_id: str) -> MessageRow | None:
    """The row SES message id ``provider_message_id`` belongs to: the row that holds it, else
    the row of an attempt that recorded it (a stale finalize's, a send that was later
    resent)."""
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


def read_row_locked(conn: sa.Connection, message_id: int) -> MessageRow | None:
    """The row as it is now, locked: a locking read sees the last committed version even in a
    transaction whose snapshot predates it (MySQL/MariaDB at REPEATABLE READ re-read a row
    from the snapshot otherwise, and an UPDATE guarded on what it said never matches)."""
    stmt = sa.select(*_ROW_COLUMNS).where(_m.c.id == message_id).with_for_update()
    return _as_row(conn.execute(stmt).first())


def payload_addresses(conn: sa.Connection, message_id: int) -> list[str]:
    """The row's To, Cc and Bcc as its payload holds them, read from its address lists alone
    (never its bodies or attachments); an entry that is not text is skipped. A body prune
    dropped keeps these lists (:func:`relay.store.operator.dropped_payload`): a complaint
    can come weeks after the send."""
    payload = _m.c.payload
    stmt = sa.select(payload["to"], payload["cc"], payload["bcc"]).where(_m.c.id == message_id)
    found = conn.execute(stmt).first()
    addresses: list[str] = []
    for field in found or ():
        if isinstance(field, str):  # a stored scalar where a list belongs
            field = [field]
        if not isinstance(field, list):
            continue
        addresses.extend(a for a in field if isinstance(a, str))
    return addresses


# -- outbox_events --------------------------------------------------------------------------


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
    """Record ``event`` unless its key (``key``, by default the event's) is recorded; its id,
    or None for a duplicate. On the servers the insert waits for a concurrent uncommitted
    insert of the same key, then finds it: of two replicas applying one event, one records
    it. ``intake_id`` names the replica that took it from its queue: the reconcile sweep asks
    that replica's queue, and only that one, whether it was drained after it (an event
    recorded without one proves nothing there).

    Every text fits its column on every backend, so no event is refused for its length: an
    event matched to no row keeps a few hundred characters of its recipients and error
    (a whole address at a time, then how many there were), a matched one what a MySQL TEXT
    holds."""
    e = _e.c
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
    inserted = _insert_unless_present(conn, _e, values)
    return None if inserted is None else int(inserted[0])


def set_event_effect(conn: sa.Connection, *, event_id: int, effect: Effect) -> None:
    """What the event turned out to do, once its effects ran."""
    conn.execute(sa.update(_e).where(_e.c.id == event_id).values(effect=effect.value))


def find_deferred(conn: sa.Connection, *, limit: int) -> list[DeferredEvent]:
    """Up to ``limit`` events recorded ``deferred`` whose row is no longer being sent, oldest
    first."""
    stmt = (
        sa.select(
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
        .join(_m, _m.c.id == _e.c.message_id)
        .where(_e.c.effect == Effect.DEFERRED.value, _m.c.status != Status.PROCESSING.value)
        .order_by(_e.c.received_at, _e.c.id)
        .limit(limit)
    )
    return [
        DeferredEvent(
            event_id=int(found.event_id),
            event_key=str(found.event_key),
            source=str(found.source),
            event_type=found.event_type,
            event_at=found.event_at,
            mail_at=found.mail_at,
            provider_message_id=found.event_provider_id,
            tagged_message_id=found.tagged_message_id,
            claim_token=found.claim_token,
            detail=found.detail,
            recipients=found.recipients,
            row=MessageRow(
                int(found.id), str(found.status), str(found.category), found.provider_message_id
            ),
        )
        for found in conn.execute(stmt).all()
    ]


def take_deferred(conn: sa.Connection, *, event_id: int) -> bool:
    """Take a deferred event for this transaction: of two replicas applying it at once, the
    second one's UPDATE waits for the first one's commit and then matches nothing."""
    stmt = (
        sa.update(_e)
        .where(_e.c.id == event_id, _e.c.effect == Effect.DEFERRED.value)
        .values(effect=Effect.RECORDED.value)
    )
    return bool(conn.execute(stmt).rowcount == 1)


# -- what an event changes ------------------------------------------------------------------


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
    """unknown_outcome/pending/retrying -> sent, because an event proved SES took one of the
    row's sends: its SES message id, sent at ``mail_at`` (else ``now``), claim cleared, and
    its delivery status raised. Guarded on the status read (``seen``): a row claimed
    meanwhile is left to its relay."""
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
    """The attempt row saying the event settled the row."""
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
    """A sent row's delivery status set to the event's where that is higher in rank; guarded
    on the SES message id too, so an event of another send of the row never speaks for the
    one it holds."""
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
    """Add each address to ``outbox_suppressions`` unless it is there (an operator's or an
    earlier event's entry is kept as it is); the ones added."""
    added = []
    for address in sorted(set(addresses)):
        if not address or len(address) > _ADDRESS_CHARS:
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


# -- outbox_intakes -------------------------------------------------------------------------


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
    """This replica's ``outbox_intakes`` row: alive at ``now`` (the database's clock), and
    with ``caught_up`` its queue found empty then (or, given ``empty_since``, empty of
    everything older than that). One upsert per dialect (``ON CONFLICT DO UPDATE``, MariaDB's
    ``ON DUPLICATE KEY UPDATE``), each column conditional: the process that started last owns
    the row (a write of an older one with the same id changes nothing), a new process starts
    with its own proof (none until its first empty receive), and ``caught_up_at`` only moves
    forward.

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
