"""The savepoint-guarded insert of one outbox row on the caller's connection.

The insert runs inside a SAVEPOINT on the connection the caller's transaction already uses. A
duplicate idempotency key rolls back only that savepoint, so the caller's transaction goes on as
if nothing happened; the existing row's id is returned instead. The savepoint is opened on the
Core connection, not through ``Session.begin_nested()``, because it must also work inside flush
events (declarative rules), where a session-level savepoint does not protect the rows.

On PostgreSQL the insert also calls ``pg_notify`` on :data:`NOTIFY_CHANNEL` in the same
statement. PostgreSQL delivers a notification only when the transaction commits, and folds
identical notifications of one transaction into one: a transaction that enqueues a thousand
emails wakes the relay once, and a rolled-back one never.
"""

from __future__ import annotations

import json
import uuid
import weakref
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError

from outbox.category import Category
from outbox.exceptions import InvalidArgument, InvalidKey, MessageTooLarge
from outbox.message import Email
from outbox.schema import Status, messages

__all__ = ["MAX_KEY_LENGTH", "NOTIFY_CHANNEL", "EnqueueResult", "insert_message", "new_key"]

NOTIFY_CHANNEL = "outbox_wakeup"
MAX_KEY_LENGTH = 255
_PRIORITY_RANGE = range(-32768, 32768)

_ROW_COLUMNS = (
    "idempotency_key", "category", "priority", "status", "payload", "recipients",
    "recipient_count", "subject", "attempt_count", "max_attempts", "backoff_base",
    "backoff_cap", "ambiguity_policy", "next_attempt_at", "expires_at", "created_at",
    "updated_at",
)  # fmt: skip
_insert = sa.insert(messages).values({name: sa.bindparam(name) for name in _ROW_COLUMNS})
_ins_cte = _insert.returning(messages.c.id).cte("ins")
_insert_and_notify = sa.select(_ins_cte.c.id, sa.func.pg_notify(NOTIFY_CHANNEL, ""))
_existing = sa.select(messages.c.id).where(messages.c.idempotency_key == sa.bindparam("key"))
_existing_locking = _existing.with_for_update(read=True)

_max_packet: weakref.WeakKeyDictionary[sa.Engine, int] = weakref.WeakKeyDictionary()


@dataclass(frozen=True, kw_only=True, slots=True)
class EnqueueResult:
    """What ``enqueue`` did: ``duplicate`` is True when the key existed and nothing was written
    (``id`` is then the existing row's)."""

    id: int
    key: str
    duplicate: bool


def new_key() -> str:
    """A fresh idempotency key, for callers that do not give one."""
    return f"auto:{uuid.uuid4()}"


def check_key(key: str | None) -> str:
    if key is None:
        return new_key()
    if not isinstance(key, str):
        raise InvalidKey("key", f"must be a string, not {type(key).__name__}")
    if not key.strip():
        raise InvalidKey("key", "must not be empty")
    if len(key) > MAX_KEY_LENGTH:
        raise InvalidKey("key", f"is {len(key)} characters long; the limit is {MAX_KEY_LENGTH}")
    return key


def build_row(
    email: Email,
    *,
    key: str,
    category: Category,
    priority: int,
    not_before: datetime | None,
    expires_at: datetime | None,
    now: datetime,
) -> dict[str, Any]:
    """The column values of a new row; raises before anything touches the database."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidArgument("priority", f"must be an integer, not {type(priority).__name__}")
    if priority not in _PRIORITY_RANGE:
        raise InvalidArgument("priority", "must be between -32768 and 32767 (lower sends first)")
    for field, value in (("not_before", not_before), ("expires_at", expires_at)):
        if value is not None and (not isinstance(value, datetime) or value.utcoffset() is None):
            raise InvalidArgument(field, "must be a timezone-aware datetime")
    due = now if not_before is None else max(now, not_before)
    if expires_at is not None and expires_at <= due:
        raise InvalidArgument("expires_at", "must be later than now and than not_before")
    recipients = email.recipients
    return {
        "idempotency_key": key,
        "category": category.name,
        "priority": priority,
        "status": Status.PENDING.value,
        "payload": email.to_payload(),
        "recipients": ", ".join(recipients),
        "recipient_count": len(recipients),
        "subject": email.subject,
        "attempt_count": 0,
        "max_attempts": category.max_attempts,
        "backoff_base": float(category.backoff_base),
        "backoff_cap": float(category.backoff_cap),
        "ambiguity_policy": category.ambiguity.value,
        "next_attempt_at": due,
        "expires_at": expires_at,
        "created_at": now,
        "updated_at": now,
    }


def insert_message(conn: sa.Connection, row: dict[str, Any], email: Email) -> tuple[int, bool]:
    """Insert ``row`` under a savepoint on ``conn``; return (id, duplicate).

    Must be called with ``conn`` inside the caller's transaction. Only a duplicate key is
    swallowed; any other error rolls back the savepoint and propagates.
    """
    dialect = conn.dialect
    if dialect.name in ("mysql", "mariadb"):
        _check_packet_size(conn, email, row)
    savepoint = conn.begin_nested()
    try:
        if dialect.name == "postgresql":
            new_id = conn.execute(_insert_and_notify, row).scalar_one()
        else:
            inserted = conn.execute(_insert, row).inserted_primary_key
            assert inserted is not None
            new_id = inserted[0]
    except IntegrityError:
        savepoint.rollback()
        existing = conn.execute(
            _existing_locking if dialect.name in ("mysql", "mariadb") else _existing,
            {"key": row["idempotency_key"]},
        ).scalar()
        if existing is None:
            raise
        return int(existing), True
    except BaseException:
        if savepoint.is_active:
            savepoint.rollback()
        raise
    savepoint.commit()
    return int(new_id), False


def _check_packet_size(conn: sa.Connection, email: Email, row: dict[str, Any]) -> None:
    """MySQL/MariaDB refuse (and drop the connection on) a statement larger than
    ``max_allowed_packet``; refuse such a message up front instead."""
    if email.rendered_size() < 1_000_000:
        return
    engine = conn.engine
    limit = _max_packet.get(engine)
    if limit is None:
        limit = int(conn.exec_driver_sql("SELECT @@max_allowed_packet").scalar_one())
        _max_packet[engine] = limit
    size = len(json.dumps(row["payload"])) + 4096
    if size > limit:
        raise MessageTooLarge(
            "attachments" if email.attachments else "html",
            f"the stored message is {size} bytes, over the database's max_allowed_packet "
            f"({limit} bytes); raise max_allowed_packet on the server to enqueue it",
        )
