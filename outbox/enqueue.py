"""The savepoint-guarded insert of outbox rows on the caller's connection.

Each ``enqueue`` (or ``enqueue_many`` batch) is written at once under one SAVEPOINT on the
connection the caller's transaction already uses. A duplicate idempotency key never aborts
the caller's transaction: it is reported as ``duplicate=True`` with the existing row's id. Any
other error rolls back only the savepoint (none of the batch is written) and propagates as
itself. The savepoint is opened on the Core connection, not through
``Session.begin_nested()``, because it must also work inside flush events (declarative rules),
where a session-level savepoint does not protect the rows.

On PostgreSQL the batch is one statement whatever its size: ``INSERT ... SELECT`` from
``json_to_recordset`` of a single JSON parameter (so the statement text, and the server's plan
for it, is the same for one row or a thousand), ``ON CONFLICT (idempotency_key) DO NOTHING``,
which also calls ``pg_notify`` on :data:`NOTIFY_CHANNEL`; the keys it skipped are read back in
the caller's transaction. PostgreSQL delivers a
notification only when the transaction commits, and folds identical notifications of one
transaction into one: a transaction that enqueues a thousand emails wakes the relay once, and a
rolled-back one never. At REPEATABLE READ and SERIALIZABLE, a key committed by another
transaction after the caller's snapshot was taken is invisible to the caller, and PostgreSQL
answers the conflict with a serialization failure (40001) instead of doing nothing. That failure
is rolled back with the savepoint, and the winners' ids are read on a second, short-lived
connection from the same engine, which sees committed rows; the rest of the batch is inserted
again, and only if none of its keys exists there does the failure propagate.

On MySQL/MariaDB, two inserts waiting on the same key held by a third transaction deadlock when
that transaction rolls back: each waiter inherits a gap lock on the rolled-back key, then each
waits for the other's gap to insert, and InnoDB rolls back one caller's whole transaction.
``INSERT ... ON DUPLICATE KEY UPDATE`` and a locking read first deadlock the same way. So each
row of a batch is inserted by its own statement under a named lock for its key (``GET_LOCK``),
one key at a time, and the batch shares one savepoint (InnoDB rolls back a duplicate-key
statement alone, so a duplicate needs no savepoint of its own): at most one
enqueue waits on a key's row lock at a time, and the others queue on the named lock, outside
InnoDB. A transaction never takes the named lock for a key it inserted itself (its insert does
not wait), so it cannot queue behind a waiter that waits for it. When InnoDB does roll back the
whole transaction (a deadlock elsewhere, a lock wait timeout with
``innodb_rollback_on_timeout``), the savepoint is gone with it and that error propagates, not one
from rolling back the savepoint.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import uuid
import weakref
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import DBAPIError, IntegrityError, SQLAlchemyError

from outbox.category import Category
from outbox.exceptions import InvalidArgument, InvalidKey, MessageTooLarge
from outbox.message import Email
from outbox.schema import Status, messages

__all__ = [
    "MAX_KEY_LENGTH",
    "NOTIFY_CHANNEL",
    "PACKET_CHECK_FROM",
    "EnqueueResult",
    "build_row",
    "check_key",
    "check_packet_size",
    "existing_ids",
    "insert_message",
    "insert_messages",
    "new_key",
]

NOTIFY_CHANNEL = "outbox_wakeup"
MAX_KEY_LENGTH = 255
# Messages this large (rendered) are checked against MySQL's max_allowed_packet.
PACKET_CHECK_FROM = 1_000_000
_PRIORITY_RANGE = range(-32768, 32768)
_T = TypeVar("_T")

_ROW_TYPES: dict[str, Any] = {
    "idempotency_key": sa.Text(),
    "category": sa.Text(),
    "priority": sa.SmallInteger(),
    "status": sa.Text(),
    "payload": postgresql.JSON(),
    "recipients": sa.Text(),
    "recipient_count": sa.SmallInteger(),
    "subject": sa.Text(),
    "attempt_count": sa.Integer(),
    "max_attempts": sa.Integer(),
    "backoff_base": sa.Double(),
    "backoff_cap": sa.Double(),
    "ambiguity_policy": sa.Text(),
    "reconcile_after": sa.Double(),
    "next_attempt_at": postgresql.TIMESTAMP(timezone=True),
    "fairness_key": sa.Text(),
    "fair_at": postgresql.TIMESTAMP(timezone=True),
    "line_at": postgresql.TIMESTAMP(timezone=True),
    "expires_at": postgresql.TIMESTAMP(timezone=True),
    "created_at": postgresql.TIMESTAMP(timezone=True),
    "updated_at": postgresql.TIMESTAMP(timezone=True),
}
_ROW_COLUMNS = tuple(_ROW_TYPES)
_KEY = messages.c.idempotency_key

_values: dict[str, Any] = {name: sa.bindparam(name) for name in _ROW_COLUMNS}
_insert = sa.insert(messages).values(_values)
_insert_returning = (
    sqlite.insert(messages)
    .on_conflict_do_nothing(index_elements=[_KEY])
    .returning(messages.c.id, _KEY)
)
_recordset = (
    sa.func.json_to_recordset(sa.cast(sa.bindparam("rows", type_=sa.Text()), postgresql.JSON()))
    .table_valued(*(sa.column(name, type_) for name, type_ in _ROW_TYPES.items()))
    .render_derived(name="r", with_types=True)
)
_batch_cte = (
    postgresql.insert(messages)
    .from_select(list(_ROW_COLUMNS), sa.select(*(_recordset.c[name] for name in _ROW_COLUMNS)))
    .on_conflict_do_nothing(index_elements=[_KEY])
    .returning(messages.c.id, _KEY)
    .cte("ins")
)
_insert_batch_and_notify = sa.select(
    _batch_cte.c.id, _batch_cte.c.idempotency_key, sa.func.pg_notify(NOTIFY_CHANNEL, "")
)
_existing = sa.select(messages.c.id).where(messages.c.idempotency_key == sa.bindparam("key"))
_existing_locking = _existing.with_for_update(read=True)
_existing_many = sa.select(messages.c.id, _KEY).where(
    messages.c.idempotency_key.in_(sa.bindparam("keys", expanding=True))
)
# Waits at most as long as the holder may wait on the key's row lock; 0 (timed out) or NULL
# (killed) means the insert goes ahead without it.
_get_lock = sa.text("SELECT GET_LOCK(:name, @@innodb_lock_wait_timeout)")
_release_lock = sa.text("SELECT RELEASE_LOCK(:name)")

_SERIALIZATION_FAILURE = "40001"
# Pools that hand out one shared DBAPI connection: a "second" connection would be the caller's.
_SHARED_CONNECTION_POOLS = (sa.pool.StaticPool, sa.pool.SingletonThreadPool, sa.pool.AssertionPool)
_LOOKUP_CHUNK = 500

_engine_log = logging.getLogger("sqlalchemy.engine")


@functools.cache
def _pipeline_supported() -> bool:
    try:
        import psycopg
    except ImportError:
        return False
    return bool(psycopg.Pipeline.is_supported())


_max_packet: weakref.WeakKeyDictionary[sa.Engine, int] = weakref.WeakKeyDictionary()
# Keys each open transaction inserted on MySQL/MariaDB; entries go with their transaction.
_inserted: weakref.WeakKeyDictionary[sa.RootTransaction, set[str]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True, kw_only=True, slots=True)
class EnqueueResult:
    """What ``enqueue`` wrote, for the email with idempotency ``key``: the row's ``id``, and
    ``duplicate`` True when the key existed and nothing was written (``id`` is then the
    existing row's). The row is in the caller's transaction: it commits or rolls back with it.
    """

    key: str
    id: int
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
    fairness_key: str | None = None,
) -> dict[str, Any]:
    """The column values of a new row; raises before anything touches the database. A keyed
    row's turn (``fair_at``) is its due time here; :func:`outbox.fairness.assign_turns` sets
    it from the key's queue."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise InvalidArgument("priority", f"must be an integer, not {type(priority).__name__}")
    if priority not in _PRIORITY_RANGE:
        raise InvalidArgument("priority", "must be between -32768 and 32767 (lower sends first)")
    for field, value in (("not_before", not_before), ("expires_at", expires_at)):
        if value is not None and (not isinstance(value, datetime) or value.utcoffset() is None):
            raise InvalidArgument(field, "must be a timezone-aware datetime")
        if value is not None and not _in_utc_range(value):
            raise InvalidArgument(field, "is out of range: it must be a year 1 to 9999 in UTC")
    due = now if not_before is None else max(now, not_before)
    if expires_at is not None and expires_at <= due:
        raise InvalidArgument("expires_at", "must be later than now and than not_before")
    recipients = email.recipients
    policy, reconcile_after = category.stored_policy
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
        "ambiguity_policy": policy,
        "reconcile_after": reconcile_after,
        "next_attempt_at": due,
        "fairness_key": fairness_key,
        "fair_at": due,
        "line_at": None,
        "expires_at": expires_at,
        "created_at": now,
        "updated_at": now,
    }


def _in_utc_range(value: datetime) -> bool:
    try:
        value.astimezone(UTC)
    except OverflowError:
        return False
    return True


def insert_messages(
    conn: sa.Connection,
    rows: Sequence[dict[str, Any]],
    emails: Sequence[Email],
    *,
    fresh: AbstractSet[str] = frozenset(),
) -> list[tuple[int, bool]]:
    """Insert ``rows`` (distinct keys) under one savepoint on ``conn``; return (id, duplicate)
    for each, in order. ``fresh`` are the keys :func:`new_key` generated for this batch.

    Must be called with ``conn`` inside the caller's transaction. Only a duplicate key is
    swallowed; any other error rolls back the savepoint, so none of ``rows`` is written, and
    propagates.
    """
    if not rows:
        return []
    dialect = conn.dialect.name
    if dialect == "postgresql":
        return _insert_postgresql(conn, rows)
    if dialect in ("mysql", "mariadb"):
        for row, email in zip(rows, emails, strict=True):
            check_packet_size(conn, email, row)
        return _insert_mysql_batch(conn, rows, emails, fresh)
    if dialect == "sqlite" and conn.dialect.insert_returning:
        if len(rows) <= _ROWS_PER_STATEMENT:
            return _insert_sqlite(conn, rows)  # one statement, all or nothing: no savepoint
        return _under_savepoint(conn, lambda: _insert_sqlite(conn, rows))
    return _under_savepoint(conn, lambda: [_insert_plain(conn, row, _existing) for row in rows])


def insert_message(conn: sa.Connection, row: dict[str, Any], email: Email) -> tuple[int, bool]:
    """:func:`insert_messages` for one row."""
    return insert_messages(conn, [row], [email])[0]


def _under_savepoint(conn: sa.Connection, work: Callable[[], _T]) -> _T:
    savepoint = conn.begin_nested()
    try:
        result = work()
    except BaseException:
        _rolled_back(savepoint)
        raise
    savepoint.commit()
    return result


def _insert_plain(
    conn: sa.Connection, row: dict[str, Any], lookup: sa.Select[Any]
) -> tuple[int, bool]:
    """A plain INSERT of one row inside the batch's savepoint. A duplicate key fails this
    statement alone (SQLite and InnoDB roll back only the statement); ``lookup`` then finds
    the existing row's id."""
    try:
        inserted = conn.execute(_insert, row).inserted_primary_key
    except IntegrityError:
        existing = conn.execute(lookup, {"key": row["idempotency_key"]}).scalar()
        if existing is None:
            raise
        return int(existing), True
    assert inserted is not None
    return int(inserted[0]), False


def _insert_sqlite(conn: sa.Connection, rows: Sequence[dict[str, Any]]) -> list[tuple[int, bool]]:
    """One multi-row INSERT ... ON CONFLICT DO NOTHING RETURNING; the keys it skipped are read
    back (SQLite has one writer: nothing removes them in between). A failed statement is rolled
    back alone, the transaction goes on, so it needs no savepoint."""
    found = {key: (int(id_), False) for id_, key in conn.execute(_insert_returning, list(rows))}
    skipped = [row["idempotency_key"] for row in rows if row["idempotency_key"] not in found]
    found.update((key, (id_, True)) for key, id_ in existing_ids(conn, skipped).items())
    return [found[row["idempotency_key"]] for row in rows]


def existing_ids(conn: sa.Connection, keys: Iterable[str]) -> dict[str, int]:
    """The ids of the rows with ``keys`` that ``conn`` can see."""
    keys = list(keys)
    ids: dict[str, int] = {}
    for start in range(0, len(keys), _LOOKUP_CHUNK):
        chunk = keys[start : start + _LOOKUP_CHUNK]
        ids.update((key, int(id_)) for id_, key in conn.execute(_existing_many, {"keys": chunk}))
    return ids


_insert_many_returning = sa.insert(messages).values(_values).returning(messages.c.id, _KEY)
_MULTI_ROW_BYTES = 1_000_000  # a multi-row INSERT stays under any likely max_allowed_packet
# SQLAlchemy sends an executemany of more rows as several INSERTs (insertmanyvalues pages)
_ROWS_PER_STATEMENT = 1000


def _insert_mysql_batch(
    conn: sa.Connection,
    rows: Sequence[dict[str, Any]],
    emails: Sequence[Email],
    fresh: AbstractSet[str],
) -> list[tuple[int, bool]]:
    """MySQL/MariaDB. Rows whose keys :func:`new_key` generated (random: no other transaction
    can hold, wait on or commit them) need no named lock: they go as one multi-row INSERT where
    the server returns ids (MariaDB 10.5+), else one plain INSERT each. Every other row goes on
    its own under its key's named lock. One statement alone needs no savepoint (InnoDB rolls
    back a failed statement by itself); more share one."""
    generated = [row for row in rows if row["idempotency_key"] in fresh]
    multi = (
        getattr(conn.dialect, "is_mariadb", False)
        and conn.dialect.insert_returning
        and 1 < len(generated) <= _ROWS_PER_STATEMENT
        and sum(_size(e) for e in emails) <= _MULTI_ROW_BYTES
    )
    statements = (1 if multi else len(generated)) + 3 * (len(rows) - len(generated))

    def work() -> list[tuple[int, bool]]:
        found: dict[str, tuple[int, bool]] = {}
        try:
            if multi:
                inserted = conn.execute(_insert_many_returning, generated).all()
                found.update((key, (int(id_), False)) for id_, key in inserted)
            else:
                for row in generated:
                    new_id = conn.execute(_insert, row).inserted_primary_key
                    assert new_id is not None
                    found[row["idempotency_key"]] = (int(new_id[0]), False)
        except IntegrityError:
            # A generated key someone else wrote (it was shown in an EnqueueResult before the
            # flush): InnoDB rolled back that statement alone; those rows go the careful way.
            found = {key: value for key, value in found.items() if not multi}
        transaction = conn.get_transaction()
        if found and transaction is not None:
            _inserted.setdefault(transaction, set()).update(found)
        for row in rows:
            if row["idempotency_key"] not in found:
                found[row["idempotency_key"]] = _insert_mysql(conn, row)
        return [found[row["idempotency_key"]] for row in rows]

    return work() if statements == 1 else _under_savepoint(conn, work)


def _size(email: Email) -> int:
    """A cheap upper bound of the bytes ``email`` adds to an INSERT statement."""
    return email.rendered_size() + 4096


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


def _insert_postgresql(
    conn: sa.Connection, rows: Sequence[dict[str, Any]]
) -> list[tuple[int, bool]]:
    """The whole batch in one INSERT ... ON CONFLICT DO NOTHING that notifies; the keys it
    skipped are read in the caller's transaction, or, when its snapshot cannot see the
    winners, on a second connection.

    The first attempt's savepoint stays open until the batch is done, so an error in a later
    attempt (after a conflicting row was pruned between the insert and the lookup) rolls back
    the whole batch, not only that attempt.
    """
    found: dict[str, tuple[int, bool]] = {}
    todo = list(rows)
    if _pipelined(conn):
        done = _insert_pipelined(conn, todo)
        if done is not None:
            todo = _after_insert(conn, todo, done, found)
            if not todo:
                return [found[row["idempotency_key"]] for row in rows]
            # a key skipped whose row is gone (pruned in between): the general path below
    outer: sa.NestedTransaction | None = None
    for _ in range(len(rows) + 2):
        if not todo:
            break
        savepoint = conn.begin_nested()
        try:
            inserted = conn.execute(_insert_batch_and_notify, {"rows": _as_json(todo)}).all()
        except DBAPIError as error:
            if not _rolled_back(savepoint) or _sqlstate(error) != _SERIALIZATION_FAILURE:
                _roll_back_outer(outer)
                raise
            committed = _committed_ids(conn, [row["idempotency_key"] for row in todo])
            if not committed:
                _roll_back_outer(outer)
                raise
            found.update((key, (id_, True)) for key, id_ in committed.items())
            todo = [row for row in todo if row["idempotency_key"] not in found]
            continue
        except BaseException:
            _rolled_back(savepoint)
            _roll_back_outer(outer)
            raise
        if outer is None:
            outer = savepoint
        else:
            savepoint.commit()
        todo = _after_insert(conn, todo, [(id_, key) for id_, key, _ in inserted], found)
    if todo:
        _roll_back_outer(outer)
        raise RuntimeError(
            f"idempotency key {todo[0]['idempotency_key']!r} conflicted again and again "
            "with a row that was not found"
        )
    if outer is not None:
        outer.commit()
    return [found[row["idempotency_key"]] for row in rows]


def _after_insert(
    conn: sa.Connection,
    todo: list[dict[str, Any]],
    inserted: Iterable[tuple[int, str]],
    found: dict[str, tuple[int, bool]],
) -> list[dict[str, Any]]:
    """Record the (id, key) rows the insert returned and the existing rows of the keys it
    skipped; return the rows still missing: a key that conflicted with a row deleted (pruned)
    between the two statements, to be inserted again."""
    found.update((key, (int(id_), False)) for id_, key in inserted)
    skipped = [row["idempotency_key"] for row in todo if row["idempotency_key"] not in found]
    found.update((key, (id_, True)) for key, id_ in existing_ids(conn, skipped).items())
    return [row for row in todo if row["idempotency_key"] not in found]


_SAVEPOINT = "outbox_batch"
_pipeline_sql: weakref.WeakKeyDictionary[sa.Dialect, dict[Any, tuple[str, dict[str, Any]]]] = (
    weakref.WeakKeyDictionary()
)


def _pipelined(conn: sa.Connection) -> bool:
    """Whether the batch may go as one pipeline of SAVEPOINT, INSERT and RELEASE (one round trip
    instead of three): psycopg 3 in sync mode with a libpq that pipelines, and nobody watching
    the connection's statements (cursor-execute listeners, such as tracing, or echo) that
    would miss statements sent past SQLAlchemy."""
    dialect = conn.dialect
    if dialect.driver != "psycopg" or dialect.is_async or not _pipeline_supported():
        return False
    dispatch = conn.dispatch
    if dispatch.before_cursor_execute or dispatch.after_cursor_execute:
        return False
    return not (conn.engine.echo or _engine_log.isEnabledFor(logging.INFO))


def _insert_pipelined(conn: sa.Connection, rows: Sequence[dict[str, Any]]) -> list[Any] | None:
    """Send SAVEPOINT, the batch INSERT and RELEASE in one pipeline on the psycopg connection
    under ``conn``; return the (id, key) of the inserted rows.

    On a database error, roll back to the savepoint and raise it as SQLAlchemy would (the
    same exception classes); a serialization failure returns None instead, for the caller's
    ordinary path to resolve on a second connection. If the savepoint cannot be rolled back
    (the connection is gone, or the transaction was already aborted), return None too: the
    ordinary path, through SQLAlchemy, then meets the same state and raises (and handles:
    disconnects invalidate the connection) it as for any statement.
    """
    sql, params = _pipeline_statement(conn)
    raw: Any = conn.connection.driver_connection
    params = {**params, "rows": _as_json(rows)}
    failure: Exception | None = None
    try:
        with raw.pipeline():
            try:
                raw.execute(f"SAVEPOINT {_SAVEPOINT}")
                cursor = raw.execute(sql, params)
                raw.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
            except Exception as inside:
                failure = inside
        if failure is None:
            return [(int(row[0]), row[1]) for row in cursor.fetchall()]
    except Exception as at_end:
        failure = failure or at_end
    assert failure is not None
    try:
        raw.execute(f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}")
        raw.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
    except Exception:
        return None
    dbapi_error = conn.dialect.loaded_dbapi.Error
    if not isinstance(failure, dbapi_error) or getattr(failure, "sqlstate", None) == (
        _SERIALIZATION_FAILURE
    ):
        return None
    raise DBAPIError.instance(
        sql, params, failure, dbapi_error, hide_parameters=True, dialect=conn.dialect
    ) from failure


def _pipeline_statement(conn: sa.Connection) -> tuple[str, dict[str, Any]]:
    """The batch statement as psycopg SQL for ``conn``'s dialect and schema translation."""
    schema_map = conn.get_execution_options().get("schema_translate_map")
    cache_key = None if not schema_map else tuple(sorted(schema_map.items(), key=repr))
    by_map = _pipeline_sql.setdefault(conn.dialect, {})
    statement = by_map.get(cache_key)
    if statement is None:
        compiled = _insert_batch_and_notify.compile(
            dialect=conn.dialect,
            schema_translate_map=schema_map or None,
            render_schema_translate=bool(schema_map),
        )
        params = dict(compiled.construct_params({"rows": ""}))
        statement = by_map[cache_key] = (str(compiled), params)
    return statement


def _roll_back_outer(outer: sa.NestedTransaction | None) -> None:
    if outer is not None:
        _rolled_back(outer)


def _as_json(rows: Sequence[dict[str, Any]]) -> str:
    """The batch as the JSON array ``json_to_recordset`` reads: timestamps in ISO 8601 with
    their UTC offset."""
    return json.dumps(rows, separators=(",", ":"), default=_iso)


def _iso(value: object) -> str:
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat()
    raise TypeError(f"{type(value).__name__} is not a column value")


def _committed_ids(conn: sa.Connection, keys: list[str]) -> dict[str, int] | None:
    """The ids of the committed rows with ``keys``, read outside the caller's snapshot on a
    short-lived connection of the same engine; None if they cannot be read there."""
    engine = conn.engine
    if isinstance(engine.pool, _SHARED_CONNECTION_POOLS):
        return None
    schema_map = conn.get_execution_options().get("schema_translate_map")
    try:
        # the caller's search_path (a tenant's schema set with SET LOCAL) names its table
        search_path = conn.scalar(sa.text("SELECT current_setting('search_path')"))
        with _side_engine(engine).connect() as other:
            try:
                other.execute(
                    sa.text("SELECT set_config('search_path', :p, false)"), {"p": search_path}
                )
                if schema_map is not None:
                    other = other.execution_options(schema_translate_map=schema_map)
                return existing_ids(other, keys)
            finally:
                other.invalidate()  # closed for good: no idle connection outlives the lookup
    except SQLAlchemyError:
        return None


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


def check_packet_size(conn: sa.Connection, email: Email, row: dict[str, Any]) -> None:
    """MySQL/MariaDB refuse (and drop the connection on) a statement larger than
    ``max_allowed_packet``; refuse such a message up front instead."""
    if email.rendered_size() < PACKET_CHECK_FROM:
        return
    engine = conn.engine
    limit = _max_packet.get(engine)
    if limit is None:
        limit = int(conn.exec_driver_sql("SELECT @@max_allowed_packet").scalar_one())
        _max_packet[engine] = limit
    # The driver escapes the JSON text again inside the statement (a quote or backslash becomes
    # two bytes): twice its length bounds what reaches the server.
    size = 2 * len(json.dumps(row["payload"])) + 4096
    if size > limit:
        raise MessageTooLarge(
            "attachments" if email.attachments else "html",
            f"the stored message is {size} bytes, over the database's max_allowed_packet "
            f"({limit} bytes); raise max_allowed_packet on the server to enqueue it",
        )
