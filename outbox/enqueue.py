"""The savepoint-guarded insert of one outbox row on the caller's connection.

The insert runs inside a SAVEPOINT on the connection the caller's transaction already uses. A
duplicate idempotency key never aborts the caller's transaction: it is reported as
``duplicate=True`` with the existing row's id. Any other error rolls back only the savepoint and
propagates as itself. The savepoint is opened on the Core connection, not through
``Session.begin_nested()``, because it must also work inside flush events (declarative rules),
where a session-level savepoint does not protect the rows.

On PostgreSQL the insert is ``INSERT ... ON CONFLICT (idempotency_key) DO NOTHING`` and also
calls ``pg_notify`` on :data:`NOTIFY_CHANNEL` in the same statement. PostgreSQL delivers a
notification only when the transaction commits, and folds identical notifications of one
transaction into one: a transaction that enqueues a thousand emails wakes the relay once, and a
rolled-back one never. At REPEATABLE READ and SERIALIZABLE, a key committed by another
transaction after the caller's snapshot was taken is invisible to the caller, and PostgreSQL
answers the conflict with a serialization failure (40001) instead of doing nothing. That failure
is rolled back with the savepoint, and the winner's id is read on a second, short-lived
connection from the same engine, which sees committed rows; only if no such row exists there
does the failure propagate.

On MySQL/MariaDB, two inserts waiting on the same key held by a third transaction deadlock when
that transaction rolls back: each waiter inherits a gap lock on the rolled-back key, then each
waits for the other's gap to insert, and InnoDB rolls back one caller's whole transaction.
``INSERT ... ON DUPLICATE KEY UPDATE`` and a locking read first deadlock the same way. So an
enqueue takes a named lock for its key (``GET_LOCK``) around the insert statement: at most one
enqueue waits on a key's row lock at a time, and the others queue on the named lock, outside
InnoDB. A transaction never takes the named lock for a key it inserted itself (its insert does
not wait), so it cannot queue behind a waiter that waits for it. When InnoDB does roll back the
whole transaction (a deadlock elsewhere, a lock wait timeout with
``innodb_rollback_on_timeout``), the savepoint is gone with it and that error propagates, not one
from rolling back the savepoint.
"""

from __future__ import annotations

import hashlib
import json
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.exc import DBAPIError, IntegrityError, SQLAlchemyError

from outbox.category import Category
from outbox.exceptions import InvalidArgument, InvalidKey, MessageTooLarge
from outbox.message import Email
from outbox.schema import Status, messages

__all__ = [
    "MAX_KEY_LENGTH",
    "NOTIFY_CHANNEL",
    "EnqueueResult",
    "build_row",
    "check_key",
    "insert_message",
    "new_key",
]

NOTIFY_CHANNEL = "outbox_wakeup"
MAX_KEY_LENGTH = 255
_PRIORITY_RANGE = range(-32768, 32768)

_ROW_COLUMNS = (
    "idempotency_key", "category", "priority", "status", "payload", "recipients",
    "recipient_count", "subject", "attempt_count", "max_attempts", "backoff_base",
    "backoff_cap", "ambiguity_policy", "next_attempt_at", "expires_at", "created_at",
    "updated_at",
)  # fmt: skip
_values: dict[str, Any] = {name: sa.bindparam(name) for name in _ROW_COLUMNS}
_insert = sa.insert(messages).values(_values)
_ins_cte = (
    postgresql.insert(messages)
    .values(_values)
    .on_conflict_do_nothing(index_elements=[messages.c.idempotency_key])
    .returning(messages.c.id)
    .cte("ins")
)
_insert_and_notify = sa.select(_ins_cte.c.id, sa.func.pg_notify(NOTIFY_CHANNEL, ""))
_existing = sa.select(messages.c.id).where(messages.c.idempotency_key == sa.bindparam("key"))
_existing_locking = _existing.with_for_update(read=True)
# Waits at most as long as the holder may wait on the key's row lock; 0 (timed out) or NULL
# (killed) means the insert goes ahead without it.
_get_lock = sa.text("SELECT GET_LOCK(:name, @@innodb_lock_wait_timeout)")
_release_lock = sa.text("SELECT RELEASE_LOCK(:name)")

_SERIALIZATION_FAILURE = "40001"
# Pools that hand out one shared DBAPI connection: a "second" connection would be the caller's.
_SHARED_CONNECTION_POOLS = (sa.pool.StaticPool, sa.pool.SingletonThreadPool, sa.pool.AssertionPool)

_max_packet: weakref.WeakKeyDictionary[sa.Engine, int] = weakref.WeakKeyDictionary()
# Keys each open transaction inserted on MySQL/MariaDB; entries go with their transaction.
_inserted: weakref.WeakKeyDictionary[sa.RootTransaction, set[str]] = weakref.WeakKeyDictionary()


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
    dialect = conn.dialect.name
    if dialect == "postgresql":
        return _insert_postgresql(conn, row)
    if dialect in ("mysql", "mariadb"):
        _check_packet_size(conn, email, row)
        return _insert_mysql(conn, row)
    return _insert_plain(conn, row, _existing)


def _insert_plain(
    conn: sa.Connection, row: dict[str, Any], lookup: sa.Select[Any]
) -> tuple[int, bool]:
    """A plain INSERT; on an integrity error, ``lookup`` finds the existing row's id."""
    savepoint = conn.begin_nested()
    try:
        inserted = conn.execute(_insert, row).inserted_primary_key
    except IntegrityError:
        if not _rolled_back(savepoint):
            raise
        existing = conn.execute(lookup, {"key": row["idempotency_key"]}).scalar()
        if existing is None:
            raise
        return int(existing), True
    except BaseException:
        _rolled_back(savepoint)
        raise
    savepoint.commit()
    assert inserted is not None
    return int(inserted[0]), False


def _insert_mysql(conn: sa.Connection, row: dict[str, Any]) -> tuple[int, bool]:
    """The plain insert under the key's named lock, held only for the insert statement.

    A transaction that inserted the key itself skips the lock while its row is there: it
    reads its own row instead of inserting, since a waiter holding the lock may be waiting for
    this very transaction. A row its own savepoint rolled back is gone: then it locks.
    The lookup after a duplicate is a locking read, which reads the latest committed row that a
    REPEATABLE READ snapshot may not show.
    """
    key = row["idempotency_key"]
    transaction = conn.get_transaction()
    mine = _inserted.get(transaction, set()) if transaction is not None else set()
    if key in mine:
        # This transaction inserted the key: if its row is still there (a plain read sees
        # one's own rows) that is the duplicate, with no lock and no wait. If a savepoint
        # rolled it back, the key is free again and takes the lock like any other.
        own = conn.execute(_existing, {"key": key}).scalar()
        if own is not None:
            return int(own), True
        mine.discard(key)
    lock = {"name": "outbox:" + hashlib.sha1(key.encode(), usedforsecurity=False).hexdigest()}
    locked = conn.execute(_get_lock, lock).scalar() == 1
    try:
        new_id, duplicate = _insert_plain(conn, row, _existing_locking)
    except BaseException:
        if locked:
            _quietly(lambda: conn.execute(_release_lock, lock))
        raise
    if locked:
        conn.execute(_release_lock, lock)
    if not duplicate and transaction is not None:
        _inserted.setdefault(transaction, set()).add(key)
    return new_id, duplicate


def _insert_postgresql(conn: sa.Connection, row: dict[str, Any]) -> tuple[int, bool]:
    """ON CONFLICT DO NOTHING and notify; a conflict is looked up in the caller's transaction,
    or, when its snapshot cannot see the winner, on a second connection."""
    key = row["idempotency_key"]
    for _ in range(2):
        savepoint = conn.begin_nested()
        try:
            new_id = conn.execute(_insert_and_notify, row).scalar()
        except DBAPIError as error:
            if not _rolled_back(savepoint) or _sqlstate(error) != _SERIALIZATION_FAILURE:
                raise
            committed = _committed_id(conn, key)
            if committed is None:
                raise
            return committed, True
        except BaseException:
            _rolled_back(savepoint)
            raise
        savepoint.commit()
        if new_id is not None:
            return int(new_id), False
        existing = conn.execute(_existing, {"key": key}).scalar()
        if existing is not None:
            return int(existing), True
        # The conflicting row was deleted (pruned) between the two statements: insert again.
    raise RuntimeError(f"idempotency key {key!r} conflicted twice with a row that was not found")


def _committed_id(conn: sa.Connection, key: str) -> int | None:
    """The id of the committed row with ``key``, read outside the caller's snapshot on a
    short-lived connection of the same engine; None if it cannot be read there."""
    engine = conn.engine
    if isinstance(engine.pool, _SHARED_CONNECTION_POOLS):
        return None
    schema_map = conn.get_execution_options().get("schema_translate_map")
    try:
        with _side_engine(engine).connect() as other:
            try:
                if schema_map is not None:
                    other = other.execution_options(schema_translate_map=schema_map)
                existing = other.execute(_existing, {"key": key}).scalar()
            finally:
                other.invalidate()  # closed for good: no idle connection outlives the lookup
    except SQLAlchemyError:
        return None
    return None if existing is None else int(existing)


_side_engines: weakref.WeakKeyDictionary[sa.Engine, sa.Engine] = weakref.WeakKeyDictionary()


def _side_engine(engine: sa.Engine) -> sa.Engine:
    """An engine on a pool of its own with ``engine``'s settings (``Pool.recreate``), for the
    lookup outside the caller's snapshot: borrowing from the caller's pool would wait for a
    connection, or fail, exactly when every connection is held by callers racing on keys."""
    side = _side_engines.get(engine)
    if side is None:
        side = sa.Engine(engine.pool.recreate(), engine.dialect, engine.url)
        _side_engines[engine] = side
    return side


def _rolled_back(savepoint: sa.NestedTransaction) -> bool:
    """Roll back to ``savepoint``; False if that is no longer possible, typically because the
    server already rolled back the whole transaction (InnoDB after a deadlock): the error that
    ended it is then the one to raise, and nothing more may run in the caller's name."""
    return savepoint.is_active and _quietly(savepoint.rollback)


def _quietly(cleanup: Callable[[], object]) -> bool:
    try:
        cleanup()
    except SQLAlchemyError:
        return False
    return True


def _sqlstate(error: DBAPIError) -> str | None:
    orig = error.orig
    return getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)


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
