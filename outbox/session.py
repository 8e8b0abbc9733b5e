"""The app-side entry point: :class:`Outbox` enqueues email in the caller's session transaction
and runs declarative rules from SQLAlchemy session events.

``enqueue`` writes at once, in the session's current transaction or savepoint, on the
connection the session itself would use for an INSERT into the outbox table: the session's
``get_bind`` is asked with that table's INSERT as the clause (plus any ``bind_arguments`` the
caller names), so read/write routing and sharding send it where they send the app's own
INSERTs. It leaves nothing in the session's state: no object in ``session.new``, no mapped
class, nothing in ``session.info``, no listener, so the app's listeners, lifecycle events and
generic code over the session never meet it. A transaction integration that commits only a
session it saw change (zope.sqlalchemy) is told that it changed. Rules write their rows in
the ``after_flush`` hook :meth:`Outbox.install` adds where the app's sessions come from.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import sqlalchemy as sa
from blinker import NamedSignal
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncSession, async_scoped_session, async_sessionmaker
from sqlalchemy.ext.horizontal_shard import ShardedSession
from sqlalchemy.orm import Session, UOWTransaction, scoped_session, sessionmaker
from sqlalchemy.util.concurrency import in_greenlet

from outbox import signals, tracing
from outbox.autocommit import in_autocommit
from outbox.category import DEFAULT_CATEGORIES, Category
from outbox.enqueue import EnqueueResult, build_row, check_key, existing_ids, insert_messages
from outbox.exceptions import ConfigurationError, InvalidArgument, UnknownCategory
from outbox.fairness import Weights, assign_turns, check_fairness_key
from outbox.message import Email
from outbox.schema import messages, utcnow

__all__ = ["Outbox", "Rule"]

_T = TypeVar("_T")
_RuleFunction = Callable[[Any], Email | None]
_SessionTarget = sessionmaker[Any] | async_sessionmaker[Any] | type[Session] | type[AsyncSession]

_log = logging.getLogger("outbox")

# The clause the session's get_bind is asked with: an INSERT into the outbox table, as the
# app's own INSERTs are (routing recipes send those to the writer).
_INSERT = sa.insert(messages)


@dataclass(kw_only=True, slots=True)
class _Entry:
    """One enqueued email on its way to the database."""

    outbox: Outbox
    row: dict[str, Any]
    email: Email
    category: Category
    generated: bool  # its key came from new_key(): no other transaction can have it


def _connection(session: Session, bind_arguments: Mapping[str, Any] | None) -> sa.Connection:
    """The connection, in the session's transaction, that the session's own writes use for
    the outbox table; refuse one that cannot hold the email atomically with the app's changes.

    ``get_bind`` is asked as the session's flush asks it (``session._flushing`` is true), with
    an INSERT into the outbox table as the clause: routing recipes send the flush and DML to
    the writer, and some (SQLAlchemy's own example) know a write only by the flush.
    """
    arguments = {"clause": _INSERT, **(bind_arguments or {})}
    bind = arguments.pop("bind", None)
    instance = arguments.get("instance")
    if instance is not None and arguments.get("mapper") is None:
        arguments.update(_object_route(session, instance))
    if bind is None:
        if isinstance(session, ShardedSession) and not (
            arguments.get("shard_id") is not None or instance is not None
        ):
            raise InvalidArgument(
                "bind_arguments",
                "a ShardedSession cannot choose a shard for the outbox table by itself; name "
                "it: bind_arguments={'shard_id': ...} (or {'instance': obj} to follow obj)",
            )
        bind = _writer_bind(session, arguments)
    if bind.dialect.is_async and not in_greenlet():
        raise TypeError(
            "enqueue() got a Session on an async driver outside `run_sync` (an "
            "AsyncSession's sync_session?); use `await ob.enqueue_async(session, email, "
            "...)` with the AsyncSession, or call enqueue() inside `await "
            "session.run_sync(...)`"
        )
    transaction = session.get_nested_transaction() or session.get_transaction()
    if transaction is not None and not transaction.is_active:
        raise sa.exc.InvalidRequestError(
            "enqueue() on a session whose transaction or savepoint is not active (committed, "
            "rolled back by a failed flush, or still beginning): the email would not be part "
            "of it; roll it back, or enqueue in the next transaction"
        )
    conn = session.connection(bind_arguments={"bind": bind})
    _ensure_transaction(conn)
    _mark_changed(session)
    return conn


def _object_route(session: Session, obj: object) -> dict[str, Any]:
    """What ``get_bind`` is asked for an email about ``obj``: as ``obj``'s own INSERT (its
    mapper; on a ShardedSession also the object, for its shard)."""
    route = {"clause": _INSERT, "mapper": sa.inspect(obj).mapper}
    return {**route, "instance": obj} if isinstance(session, ShardedSession) else route


def _writer_bind(session: Session, arguments: dict[str, Any]) -> sa.Engine | sa.Connection:
    flushing = session._flushing
    session._flushing = True
    try:
        return session.get_bind(**arguments)
    except sa.exc.UnboundExecutionError as exc:
        raise sa.exc.UnboundExecutionError(
            f"{str(exc).rstrip('.')}: the outbox table has no bind in this session; give it one "
            "(Session(binds={..., outbox.schema.messages: engine})), or pass "
            "bind_arguments={'bind': engine} to enqueue"
        ) from exc
    finally:
        session._flushing = flushing


def _ensure_transaction(conn: sa.Connection) -> None:
    """Refuse a connection on which the email would commit on its own, without the rest of
    the caller's transaction; begin the transaction sqlite3's legacy mode has not begun."""
    if in_autocommit(conn):
        raise ConfigurationError(
            "isolation_level",
            "the session's connection for the outbox table is in AUTOCOMMIT, so the email "
            "would commit on its own, without the rest of the transaction; enqueue on an "
            "engine or connection with a transactional isolation level",
        )
    if conn.dialect.name != "sqlite":
        return
    # sqlite3's legacy mode begins only before an INSERT, so without a "begin" listener that
    # emits BEGIN (enable_savepoints) a SAVEPOINT may have begun the transaction, and its
    # RELEASE will commit it all
    driver: Any = conn.connection.driver_connection
    legacy = getattr(driver, "autocommit", -1) == -1 and driver.isolation_level is not None
    if legacy and not conn.dispatch.begin and conn.in_nested_transaction():
        raise ConfigurationError(
            "enable_savepoints",
            "this SQLite engine lets sqlite3 begin transactions, so a savepoint's RELEASE "
            "may commit the email on its own; call outbox.sqlite.enable_savepoints(engine)",
        )
    if not driver.in_transaction:
        conn.exec_driver_sql("BEGIN")  # as enable_savepoints would have; COMMIT ends it


def _mark_changed(session: Session) -> None:
    """Tell zope.sqlalchemy, if it manages ``session``, that the session wrote: its transaction
    manager commits only sessions it saw change, and our Core INSERT is not an ORM write it
    sees. The session's own ``ZopeTransactionEvents`` is used, so its settings hold."""
    datamanager = sys.modules.get("zope.sqlalchemy.datamanager")
    if datamanager is None:
        return
    for listener in session.dispatch.after_begin:
        events = getattr(listener, "__self__", None)
        if isinstance(events, datamanager.ZopeTransactionEvents):
            try:
                events.mark_changed(session)
            except AssertionError as exc:  # registered read only: it would roll back
                raise ConfigurationError(
                    "zope.sqlalchemy",
                    "the session is registered read-only, so its transaction is rolled "
                    "back and the email would be lost; enqueue in a read-write session",
                ) from exc
            return


def _write(
    session: Session, entries: list[_Entry], bind_arguments: Mapping[str, Any] | None
) -> list[EnqueueResult]:
    """Write ``entries`` in one batch in ``session``'s transaction and return their results;
    on any error none is written and the error propagates. A key given twice in the batch is
    written once; the later ones are its duplicates."""
    conn = _connection(session, bind_arguments)
    first: dict[str, int] = {}
    fresh: list[_Entry] = []
    for index, entry in enumerate(entries):
        if first.setdefault(entry.row["idempotency_key"], index) == index:
            fresh.append(entry)
    rows = [e.row for e in fresh]
    if fresh:
        assign_turns(
            conn, rows, fresh[0].outbox.weights, existing=lambda keys: existing_ids(conn, keys)
        )
    with tracing.creating(rows) as created:
        written = insert_messages(
            conn,
            rows,
            [e.email for e in fresh],
            fresh={e.row["idempotency_key"] for e in fresh if e.generated},
        )
        created(written)
    by_key = {
        entry.row["idempotency_key"]: outcome for entry, outcome in zip(fresh, written, strict=True)
    }
    results = []
    for index, entry in enumerate(entries):
        key = entry.row["idempotency_key"]
        new_id, duplicate = by_key[key]
        result = EnqueueResult(key=key, id=new_id, duplicate=duplicate or first[key] != index)
        results.append(result)
        signal = signals.duplicate_skipped if result.duplicate else signals.enqueued
        _notify(signal, entry.outbox, result, entry.category.name)
    return results


def _fairness_key(given: str | None, category: Category, email: Email) -> str | None:
    """The message's fairness key: the one given, else its category's (a key, or one made
    from the email); checked here, before anything is written."""
    if given is not None:
        return check_fairness_key(given)
    default = category.fairness_key
    if default is None or isinstance(default, str):
        return default
    field = f"categories[{category.name!r}].fairness_key"
    try:
        made = default(email)
    except Exception as exc:
        raise InvalidArgument(field, f"raised {type(exc).__name__}: {exc}") from exc
    return check_fairness_key(made, field)


def _notify(signal: NamedSignal, sender: Outbox, result: EnqueueResult, category: str) -> None:
    """Send ``signal`` to each receiver; one that raises is logged, not raised: the row is
    written by now, and an error here would tell the app it was not."""
    for receiver in signal.receivers_for(sender):
        try:
            receiver(sender, result=result, category=category)
        except Exception:
            _log.exception(
                "action=signal_failed signal=%s key=%s receiver=%r",
                signal.name,
                result.key,
                receiver,
            )


def _plain(session: Session | scoped_session[Any]) -> Session:
    if isinstance(session, scoped_session):
        plain: Session = session()
        return plain
    return session


def _plain_async(session: AsyncSession | async_scoped_session[Any]) -> AsyncSession:
    plain: AsyncSession = session() if isinstance(session, async_scoped_session) else session
    return plain


def _check_sync_session(session: object) -> None:
    """Refuse what is not a sync session before anything runs: calling an AsyncSession's
    methods here would create coroutines nobody awaits, and an Engine or a Connection is not
    the caller's transaction."""
    if isinstance(session, Session | scoped_session):
        return
    if isinstance(session, AsyncSession | async_scoped_session):
        raise TypeError(
            "enqueue() needs a sync Session; with an AsyncSession use "
            "`await ob.enqueue_async(session, email, ...)`"
        )
    raise TypeError(_not_a_session("enqueue", session, "Session"))


def _check_async_session(session: object) -> None:
    if isinstance(session, AsyncSession | async_scoped_session):
        return
    if isinstance(session, Session | scoped_session):
        raise TypeError(
            "enqueue_async() needs an AsyncSession; with a sync Session use "
            "`ob.enqueue(session, email, ...)`"
        )
    raise TypeError(_not_a_session("enqueue_async", session, "AsyncSession"))


def _not_a_session(method: str, session: object, expected: str) -> str:
    return (
        f"{method}() writes in a session's transaction: pass the {expected} your change is "
        f"made in, not a {type(session).__module__}.{type(session).__qualname__} (the row "
        "must commit or roll back with the caller's own changes)"
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Rule:
    """A declarative rule: ``function(obj)`` returns the Email to send for ``obj``, or None."""

    name: str
    model: type
    on: str  # "insert" or "update"
    function: _RuleFunction
    category: str | None
    priority: int
    key: Callable[[Any], str] | None

    def key_for(self, obj: Any) -> str:
        if self.key is not None:
            return f"{self.name}:{self.key(obj)}"
        primary_key = sa.inspect(obj).mapper.primary_key_from_instance(obj)
        return f"{self.name}:{','.join(str(part) for part in primary_key)}"


class Outbox:
    """Writes outbox rows in the caller's own transaction.

    ``categories`` add to (or replace, by name) the built-in ``default`` and ``transactional``
    categories; ``default_category`` is used when ``enqueue`` is given none.
    ``fairness_weights`` (``{key pattern: weight}``) give the keys they match more turns (a
    weight of 2: two sends for a weight-1 key's one) or fewer; see ``enqueue``'s
    ``fairness_key``.
    """

    def __init__(
        self,
        *,
        categories: Iterable[Category] = (),
        default_category: str = "default",
        fairness_weights: Mapping[str, float] | None = None,
    ) -> None:
        self.categories: dict[str, Category] = {c.name: c for c in DEFAULT_CATEGORIES}
        for category in categories:
            if not isinstance(category, Category):
                raise ConfigurationError("categories", f"{category!r} is not a Category")
            self.categories[category.name] = category
        if default_category not in self.categories:
            raise ConfigurationError(
                "default_category", f"{default_category!r} is not a configured category"
            )
        self.default_category = default_category
        self.weights = Weights(fairness_weights)
        self.rules: list[Rule] = []

    # -- enqueue ---------------------------------------------------------------------------

    def enqueue(
        self,
        session: Session | scoped_session[Any],
        email: Email,
        *,
        key: str | None = None,
        category: str | None = None,
        priority: int = 0,
        not_before: datetime | None = None,
        expires_at: datetime | None = None,
        fairness_key: str | None = None,
        bind_arguments: Mapping[str, Any] | None = None,
    ) -> EnqueueResult:
        """Write ``email`` as an outbox row in ``session``'s current transaction, now.

        The row commits or rolls back with the caller's changes (and with the savepoint it is
        written in). Repeating a ``key`` is harmless: nothing is written, ``duplicate`` is True
        and ``id`` is the existing row's, and the caller's transaction stays usable. Lower
        ``priority`` sends first. Bad input raises an
        :class:`~outbox.exceptions.EnqueueError` before anything touches the database.

        ``fairness_key`` (a tenant, say; default: the category's) shares sending fairly: among
        due messages of one priority, keys are served in turn, so one key's backlog does not
        hold back another's mail. Messages without a key are served when due, in order.

        The row goes on the connection the session would use for an INSERT into the outbox
        table; ``bind_arguments`` are added to what its ``get_bind`` is asked with (a
        ``ShardedSession`` needs ``{"shard_id": ...}``; ``{"bind": engine}`` names the bind).
        """
        _check_sync_session(session)
        entry = self._entry(email, key, category, priority, not_before, expires_at, fairness_key)
        entries = [entry]
        return _write(_plain(session), entries, bind_arguments)[0]

    def enqueue_many(
        self,
        session: Session | scoped_session[Any],
        emails: Sequence[Email],
        *,
        keys: Sequence[str | None] | None = None,
        category: str | None = None,
        priority: int = 0,
        not_before: datetime | None = None,
        expires_at: datetime | None = None,
        fairness_key: str | None = None,
        bind_arguments: Mapping[str, Any] | None = None,
    ) -> list[EnqueueResult]:
        """:meth:`enqueue` for each of ``emails`` in one batch (one statement on PostgreSQL and
        SQLite); ``keys[i]`` is the key of ``emails[i]`` (None, or no ``keys``, generates one).
        Every email is checked before any is written: one bad email raises and none is
        enqueued."""
        _check_sync_session(session)
        entries = self._entries(
            emails, keys, category, priority, not_before, expires_at, fairness_key
        )
        return _write(_plain(session), entries, bind_arguments)

    async def enqueue_async(
        self,
        session: AsyncSession | async_scoped_session[Any],
        email: Email,
        *,
        key: str | None = None,
        category: str | None = None,
        priority: int = 0,
        not_before: datetime | None = None,
        expires_at: datetime | None = None,
        fairness_key: str | None = None,
        bind_arguments: Mapping[str, Any] | None = None,
    ) -> EnqueueResult:
        """:meth:`enqueue` for an ``AsyncSession``: the row is written when this returns."""
        _check_async_session(session)
        entry = self._entry(email, key, category, priority, not_before, expires_at, fairness_key)
        entries = [entry]
        target = _plain_async(session)
        results = await target.run_sync(_write, entries, bind_arguments)
        return results[0]

    async def enqueue_many_async(
        self,
        session: AsyncSession | async_scoped_session[Any],
        emails: Sequence[Email],
        *,
        keys: Sequence[str | None] | None = None,
        category: str | None = None,
        priority: int = 0,
        not_before: datetime | None = None,
        expires_at: datetime | None = None,
        fairness_key: str | None = None,
        bind_arguments: Mapping[str, Any] | None = None,
    ) -> list[EnqueueResult]:
        """:meth:`enqueue_many` for an ``AsyncSession``."""
        _check_async_session(session)
        entries = self._entries(
            emails, keys, category, priority, not_before, expires_at, fairness_key
        )
        return await _plain_async(session).run_sync(_write, entries, bind_arguments)

    def _entries(
        self,
        emails: Sequence[Email],
        keys: Sequence[str | None] | None,
        category: str | None,
        priority: int,
        not_before: datetime | None,
        expires_at: datetime | None,
        fairness_key: str | None = None,
    ) -> list[_Entry]:
        if isinstance(emails, Email) or not isinstance(emails, Sequence):
            raise TypeError(f"emails must be a list of outbox.Email, not {type(emails).__name__}")
        if keys is None:
            keys = [None] * len(emails)
        elif isinstance(keys, str) or not isinstance(keys, Sequence):
            raise InvalidArgument("keys", f"must be a list of keys, not {type(keys).__name__}")
        elif len(keys) != len(emails):
            raise InvalidArgument(
                "keys", f"has {len(keys)} keys for {len(emails)} emails; give one per email"
            )
        return [
            self._entry(email, key, category, priority, not_before, expires_at, fairness_key)
            for email, key in zip(emails, keys, strict=True)
        ]

    def _entry(
        self,
        email: Email,
        key: str | None,
        category: str | None,
        priority: int,
        not_before: datetime | None,
        expires_at: datetime | None,
        fairness_key: str | None = None,
    ) -> _Entry:
        row, cat = self._row(email, key, category, priority, not_before, expires_at, fairness_key)
        return _Entry(outbox=self, row=row, email=email, category=cat, generated=key is None)

    def _row(
        self,
        email: Email,
        key: str | None,
        category: str | None,
        priority: int,
        not_before: datetime | None,
        expires_at: datetime | None,
        fairness_key: str | None = None,
    ) -> tuple[dict[str, Any], Category]:
        if not isinstance(email, Email):
            raise TypeError(f"email must be an outbox.Email, not {type(email).__name__}")
        name = self.default_category if category is None else category
        cat = self.categories.get(name)
        if cat is None:
            raise UnknownCategory(name, list(self.categories))
        row = build_row(
            email,
            key=check_key(key),
            category=cat,
            priority=priority,
            not_before=not_before,
            expires_at=expires_at,
            now=utcnow(),
            fairness_key=_fairness_key(fairness_key, cat, email),
        )
        return row, cat

    # -- declarative rules -----------------------------------------------------------------

    def on_insert(
        self,
        model: type,
        *,
        name: str | None = None,
        category: str | None = None,
        priority: int = 0,
        key: Callable[[Any], str] | None = None,
    ) -> Callable[[Callable[[_T], Email | None]], Callable[[_T], Email | None]]:
        """Register ``function(obj) -> Email | None``, run for each new ``model`` row flushed.

        The email is written in the same transaction, keyed ``"<name>:<primary key>"`` (or
        ``"<name>:<key(obj)>"``), so a row never gets the same rule's email twice. The function
        runs after the flush, so database-generated ids are set. An exception in it (an invalid
        Email, say) fails the flush like any other flush error.
        """
        return self._rule("insert", model, name, category, priority, key)

    def on_update(
        self,
        model: type,
        *,
        name: str | None = None,
        category: str | None = None,
        priority: int = 0,
        key: Callable[[Any], str] | None = None,
    ) -> Callable[[Callable[[_T], Email | None]], Callable[[_T], Email | None]]:
        """Like :meth:`on_insert`, for ``model`` rows with changed columns in a flush.

        The default key is per row, so each row gets the email at most once; pass ``key`` (for
        example ``lambda order: f"{order.id}:{order.status}"``) to send once per state instead.
        """
        return self._rule("update", model, name, category, priority, key)

    def _rule(
        self,
        on: str,
        model: type,
        name: str | None,
        category: str | None,
        priority: int,
        key: Callable[[Any], str] | None,
    ) -> Callable[[Callable[[_T], Email | None]], Callable[[_T], Email | None]]:
        if category is not None and category not in self.categories:
            raise UnknownCategory(category, list(self.categories))

        def register(function: Callable[[_T], Email | None]) -> Callable[[_T], Email | None]:
            rule_name = name or f"{function.__module__}.{function.__qualname__}"
            if any(r.name == rule_name for r in self.rules):
                raise ConfigurationError("rule name", f"{rule_name!r} is already registered")
            self.rules.append(
                Rule(
                    name=rule_name,
                    model=model,
                    on=on,
                    function=function,
                    category=category,
                    priority=priority,
                    key=key,
                )
            )
            return function

        return register

    def install(self, target: _SessionTarget) -> None:
        """Hook the declarative rules into sessions made by ``target``: a ``sessionmaker``, an
        ``async_sessionmaker``, or a ``Session``/``AsyncSession`` subclass. Idempotent."""
        listen_on: Any
        if isinstance(target, sessionmaker):
            listen_on = target
        elif isinstance(target, async_sessionmaker):
            # the app's own sync class (class_.sync_session_class, or the maker's), listened
            # on as it is; only the shared base Session gets a subclass of this maker's own
            sync_class = target.kw.get("sync_session_class") or target.class_.sync_session_class
            if sync_class is Session:
                sync_class = type("OutboxSession", (Session,), {})
                target.configure(sync_session_class=sync_class)
            listen_on = sync_class
        elif isinstance(target, type) and issubclass(target, AsyncSession):
            listen_on = target.sync_session_class
        elif isinstance(target, type) and issubclass(target, Session):
            listen_on = target
        else:
            raise ConfigurationError(
                "install",
                f"expected a sessionmaker, async_sessionmaker or Session class, not {target!r}",
            )
        if not event.contains(listen_on, "after_flush", self._after_flush):
            event.listen(listen_on, "after_flush", self._after_flush)

    def _after_flush(self, session: Session, flush_context: UOWTransaction) -> None:
        if not self.rules:
            return
        batches = (("insert", session.new), ("update", session.dirty))
        # Each email goes on the bind its object was written on (as the object's own INSERT
        # is routed: its mapper, its shard), one batch per bind.
        by_bind: dict[int, tuple[sa.Engine | sa.Connection, list[_Entry]]] = {}
        for on, objects in batches:
            for obj in objects:
                for rule in self.rules:
                    if rule.on != on or not isinstance(obj, rule.model):
                        continue
                    if on == "update" and not session.is_modified(obj):
                        continue
                    email = rule.function(obj)
                    if email is None:
                        continue
                    bind = _writer_bind(session, _object_route(session, obj))
                    _, entries = by_bind.setdefault(id(bind), (bind, []))
                    entries.append(
                        self._entry(
                            email, rule.key_for(obj), rule.category, rule.priority, None, None
                        )
                    )
        for bind, entries in by_bind.values():
            _write(session, entries, {"bind": bind})
