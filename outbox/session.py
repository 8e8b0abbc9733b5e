"""The app-side entry point: :class:`Outbox` enqueues email in the caller's session transaction
and runs declarative rules from SQLAlchemy session events.

``enqueue`` touches no database: it validates the email, builds its row and buffers it in the
session, noting the transaction or savepoint it was enqueued in. The session's next flush
writes every buffered row in one batch (one statement on PostgreSQL and SQLite) under one
savepoint. While rows are buffered, a placeholder object sits among the session's new objects,
so the session is never "clean" and every flush runs: an explicit ``flush()``, an autoflush
before a query, the flush ``begin_nested()`` does before its SAVEPOINT, and the commit's.
Listeners on every ``Session`` (installed when this module is imported, ahead of the app's
own) write the buffer before each flush and commit, taking the placeholder out before the ORM
or the app sees it; after a rollback they drop the rows buffered in the rolled-back
transaction or savepoint and unclaim the results of rows written there. Rules write their rows
at the end of the flush that made them. A session bound to a Connection writes at once: its
app may commit that connection's transaction without ever committing the session.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncSession, async_scoped_session, async_sessionmaker
from sqlalchemy.orm import (
    Session,
    SessionTransaction,
    UOWTransaction,
    registry,
    scoped_session,
    sessionmaker,
)
from sqlalchemy.util.concurrency import in_greenlet

from outbox import signals
from outbox.category import DEFAULT_CATEGORIES, Category
from outbox.enqueue import (
    PACKET_CHECK_FROM,
    EnqueueResult,
    build_row,
    check_key,
    check_packet_size,
    insert_messages,
)
from outbox.exceptions import (
    ConfigurationError,
    EnqueueNotWritten,
    InvalidArgument,
    UnknownCategory,
)
from outbox.message import Email
from outbox.schema import messages, utcnow

__all__ = ["Outbox", "Rule"]

_T = TypeVar("_T")
_RuleFunction = Callable[[Any], Email | None]
_SessionTarget = sessionmaker[Any] | async_sessionmaker[Any] | type[Session] | type[AsyncSession]

_BIND_ARGS = {"clause": messages}
_BUFFER = "outbox.buffer"  # session.info: the entries buffered for the next flush
_MARKER = "outbox.marker"  # session.info: the session's placeholder object
_WRITTEN = "outbox.written"  # session.info: (transaction, entry) written, not yet committed


@dataclass(kw_only=True, slots=True)
class _Entry:
    """One enqueued email on its way to the database."""

    outbox: Outbox
    row: dict[str, Any]
    email: Email
    category: Category
    result: EnqueueResult
    generated: bool = False  # its key came from new_key(): no other transaction can have it
    transaction: SessionTransaction | None = None  # innermost at enqueue: root or savepoint
    same_as: EnqueueResult | None = None  # an earlier entry of the same batch with this key


class _Marker:
    """The placeholder that keeps a session with buffered rows from looking clean (see the
    module's docstring). It is mapped to a table that does not exist, so if it ever reached
    the ORM's own flush, that flush would fail loudly instead of writing anything."""


_placeholders = registry()
_placeholders.map_imperatively(
    _Marker,
    sa.Table(
        "outbox_pending_placeholder",
        _placeholders.metadata,
        sa.Column("id", sa.Integer, primary_key=True),
    ),
)


def _innermost(session: Session) -> SessionTransaction | None:
    return session.get_nested_transaction() or session.get_transaction()


def _within(transaction: SessionTransaction | None, ended: SessionTransaction) -> bool:
    """Whether ``transaction`` is ``ended`` or was begun inside it."""
    while transaction is not None:
        if transaction is ended:
            return True
        transaction = transaction.parent
    return False


def _mark(session: Session) -> None:
    """Put the placeholder among the session's new objects (again, if it was expunged)."""
    marker = session.info.get(_MARKER)
    if marker is None:
        marker = session.info[_MARKER] = _Marker()
    state = sa.inspect(marker)
    if not (state.pending and state.session is session):
        session.add(marker)  # also begins the session's transaction if it had none


def _unmark(session: Session) -> None:
    marker = session.info.get(_MARKER)
    if marker is not None:
        state = sa.inspect(marker)
        if state.pending and state.session is session:
            session.expunge(marker)


def _write_buffered(session: Session) -> None:
    """Write the session's buffered rows now, and take the placeholder out of the session."""
    entries = session.info.pop(_BUFFER, None)
    _unmark(session)
    if entries:
        _write(session, entries)


def _before_flush(session: Session, flush_context: UOWTransaction, instances: object) -> None:
    _write_buffered(session)


def _before_commit(session: Session) -> None:
    """Also at the commit (and a savepoint's release): the placeholder may be gone (an
    ``expunge_all()``) while the rows are still the transaction's to write."""
    _write_buffered(session)


def _after_soft_rollback(session: Session, previous_transaction: SessionTransaction) -> None:
    """Drop what a rollback undid: rows buffered in the rolled-back transaction or savepoint
    are never written, rows written there stop being claimed by their results. A row enqueued
    outside the savepoint but written inside it (its placeholder had been expunged) goes back
    to the buffer, to be written again in the transaction it belongs to."""
    boundary: SessionTransaction | None = previous_transaction
    while boundary is not None and not (boundary.parent is None or boundary.nested):
        boundary = boundary.parent  # a flush's subtransaction rolls back its savepoint or root
    if boundary is None:
        return
    kept = []
    for entry in session.info.get(_BUFFER, []):
        if _within(entry.transaction, boundary):
            entry.result._fail("the transaction or savepoint it was enqueued in was rolled back")
        else:
            kept.append(entry)
    written: list[tuple[SessionTransaction | None, _Entry]] = session.info.get(_WRITTEN, [])
    still = []
    for write_transaction, entry in written:
        if not _within(write_transaction, boundary):
            still.append((write_transaction, entry))
        elif _within(entry.transaction, boundary):
            entry.result._undo("it was written, then its transaction or savepoint was rolled back")
        else:
            entry.result._undo("its write was rolled back with a savepoint; it is buffered again")
            entry.result._pend(_resolver(session))
            kept.append(entry)
    written[:] = still
    if kept:
        session.info[_BUFFER] = kept
        if session.is_active:
            _mark(session)
    else:
        session.info.pop(_BUFFER, None)
        _unmark(session)


def _after_commit(session: Session) -> None:
    if session.get_nested_transaction() is None:  # the root committed: its rows are for good
        session.info.pop(_WRITTEN, None)


def _after_transaction_end(session: Session, transaction: SessionTransaction) -> None:
    """The root transaction is over (committed, rolled back or closed): nothing buffered or
    written in it can be written or kept any more."""
    if transaction.parent is not None:
        return
    _unmark(session)
    for entry in session.info.pop(_BUFFER, []):
        entry.result._fail("its transaction was rolled back or closed before it was written")
    for _, entry in session.info.pop(_WRITTEN, []):
        entry.result._undo("its transaction was rolled back or closed without a commit")


for _name, _listener in (
    ("before_flush", _before_flush),
    ("before_commit", _before_commit),
    ("after_soft_rollback", _after_soft_rollback),
    ("after_commit", _after_commit),
    ("after_transaction_end", _after_transaction_end),
):
    # insert=True: ahead of the app's own listeners, which then never see the placeholder
    event.listen(Session, _name, _listener, insert=True)


def _write(session: Session, entries: list[_Entry]) -> None:
    """Write ``entries`` in one batch on the session's connection and settle their results;
    on any error none is written, each result says why, and the error propagates."""
    entries = _deduplicated(entries)
    fresh = [entry for entry in entries if entry.same_as is None]
    try:
        conn = session.connection(bind_arguments=_BIND_ARGS)
        transaction = _innermost(session)
        for entry in entries:  # written at once: enqueued where they are written
            entry.transaction = entry.transaction or transaction
        written = insert_messages(
            conn,
            [e.row for e in fresh],
            [e.email for e in fresh],
            fresh={e.result.key for e in fresh if e.generated},
        )
    except BaseException as exc:
        for entry in entries:
            entry.result._fail(f"its write failed: {type(exc).__name__}: {exc}")
        raise
    for entry, (new_id, duplicate) in zip(fresh, written, strict=True):
        entry.result._settle(new_id, duplicate)
    record = session.info.setdefault(_WRITTEN, [])
    for entry in entries:
        if entry.same_as is not None:
            entry.result._settle(entry.same_as.id, True)
        result = entry.result
        record.append((transaction, entry))
        signal = signals.duplicate_skipped if result.duplicate else signals.enqueued
        signal.send(entry.outbox, result=result, category=entry.category.name)


def _resolver(session: Session) -> Callable[[EnqueueResult], None]:
    owner = weakref.ref(session)
    return lambda result: _resolve(result, owner)


def _resolve(result: EnqueueResult, owner: weakref.ref[Session]) -> None:
    """Reading a result that is still buffered: write the session's buffered rows now."""
    session = owner()
    if session is None:
        result._fail("its session was discarded before the row was written")
        return
    if session._flushing:
        raise EnqueueNotWritten(
            result.key, "a flush of its session is writing it; read the result after the flush"
        )
    if _on_async_driver(session) and not in_greenlet():
        raise EnqueueNotWritten(
            result.key,
            "the AsyncSession has not flushed yet; `await session.flush()` (or the commit) "
            "writes it",
        )
    _write_buffered(session)
    if not result.written:
        result._fail("it was never written")


def _plain(session: Session | scoped_session[Any]) -> Session:
    if isinstance(session, scoped_session):
        plain: Session = session()
        return plain
    return session


def _plain_async(session: AsyncSession | async_scoped_session[Any]) -> Session:
    plain: AsyncSession = session() if isinstance(session, async_scoped_session) else session
    return plain.sync_session


def _buffer(session: Session, entries: list[_Entry]) -> None:
    """Buffer ``entries`` in ``session`` until its next flush. Inside a flush (a flush event,
    a rule), or with a session bound to a Connection (whose transaction the app may commit
    without the session), write them at once."""
    bind = session.get_bind(clause=messages)  # no bind for the table raises here, not later
    transaction = _innermost(session)
    if transaction is not None and not transaction.is_active:
        raise sa.exc.InvalidRequestError(
            "enqueue() on a session whose transaction or savepoint is no longer active "
            "(committed, or rolled back by a failed flush): the email would not be part of "
            "it; roll it back, or enqueue in the next transaction"
        )
    dialect = bind.dialect
    mysql = dialect.name in ("mysql", "mariadb") and not dialect.is_async
    if mysql and any(e.email.rendered_size() >= PACKET_CHECK_FROM for e in entries):
        conn = session.connection(bind_arguments=_BIND_ARGS)
        for entry in entries:
            check_packet_size(conn, entry.email, entry.row)
    if session._flushing or isinstance(bind, sa.Connection):
        _write(session, entries)
        return
    _mark(session)  # begins the session's transaction if it had none: tag with it
    transaction = _innermost(session)
    for entry in entries:
        entry.transaction = transaction
    session.info.setdefault(_BUFFER, []).extend(entries)


def _deduplicated(entries: list[_Entry]) -> list[_Entry]:
    """Mark each entry whose key an earlier entry of the same batch has: it is that one's
    duplicate, and is not written itself."""
    by_key: dict[str, EnqueueResult] = {}
    for entry in entries:
        first = by_key.setdefault(entry.result.key, entry.result)
        entry.same_as = None if first is entry.result else first
    return entries


def _check_sync_session(session: object) -> None:
    """Refuse what is not a sync session before anything runs: calling an AsyncSession's
    methods here would create coroutines nobody awaits, and an Engine or a Connection is not
    the caller's transaction."""
    if isinstance(session, Session | scoped_session):
        if _on_async_driver(session) and not in_greenlet():
            raise TypeError(
                "enqueue() got a Session on an async driver outside `run_sync` (an "
                "AsyncSession's sync_session?); use `await ob.enqueue_async(session, email, "
                "...)` with the AsyncSession, or call enqueue() inside `await "
                "session.run_sync(...)`"
            )
        return
    if isinstance(session, AsyncSession | async_scoped_session):
        raise TypeError(
            "enqueue() needs a sync Session; with an AsyncSession use "
            "`await ob.enqueue_async(session, email, ...)`"
        )
    raise TypeError(_not_a_session("enqueue", session, "Session"))


def _on_async_driver(session: Session | scoped_session[Any]) -> bool:
    """Whether the outbox table's bind talks through an async driver: its sync Session can
    only run inside SQLAlchemy's greenlet (``run_sync``); anywhere else its first statement
    leaves a coroutine unawaited and fails with ``MissingGreenlet``."""
    try:
        bind = session.get_bind(clause=messages)
    except sa.exc.UnboundExecutionError:
        return False  # enqueue's own connection() names the missing bind
    return bool(bind.dialect.is_async)


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
    """

    def __init__(
        self,
        *,
        categories: Iterable[Category] = (),
        default_category: str = "default",
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
    ) -> EnqueueResult:
        """Write ``email`` as an outbox row in ``session``'s current transaction.

        The row is buffered in the session and written at its next flush (at the latest, the
        commit), with every other row buffered there, in one batch; it commits or rolls back
        with the caller's changes. Repeating a ``key`` is harmless: nothing is written,
        ``duplicate`` is True and ``id`` is the existing row's, and the caller's transaction
        stays usable. Lower ``priority`` sends first. Bad input raises an
        :class:`~outbox.exceptions.EnqueueError` here, before anything touches the database.
        """
        _check_sync_session(session)
        target = _plain(session)
        entry = self._entry(target, email, key, category, priority, not_before, expires_at)
        _buffer(target, [entry])
        return entry.result

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
    ) -> list[EnqueueResult]:
        """:meth:`enqueue` for each of ``emails`` (``keys[i]`` is the key of ``emails[i]``;
        None, or no ``keys``, generates one). Every email is checked before any is buffered:
        one bad email raises and none is enqueued."""
        _check_sync_session(session)
        target = _plain(session)
        entries = self._entries(target, emails, keys, category, priority, not_before, expires_at)
        _buffer(target, entries)
        return [entry.result for entry in entries]

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
    ) -> EnqueueResult:
        """:meth:`enqueue` for an ``AsyncSession``: the row is written when the session
        flushes (``await session.flush()``, or the commit)."""
        _check_async_session(session)
        target = _plain_async(session)
        entry = self._entry(target, email, key, category, priority, not_before, expires_at)
        _buffer(target, [entry])
        return entry.result

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
    ) -> list[EnqueueResult]:
        """:meth:`enqueue_many` for an ``AsyncSession``."""
        _check_async_session(session)
        target = _plain_async(session)
        entries = self._entries(target, emails, keys, category, priority, not_before, expires_at)
        _buffer(target, entries)
        return [entry.result for entry in entries]

    def _entries(
        self,
        session: Session,
        emails: Sequence[Email],
        keys: Sequence[str | None] | None,
        category: str | None,
        priority: int,
        not_before: datetime | None,
        expires_at: datetime | None,
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
            self._entry(session, email, key, category, priority, not_before, expires_at)
            for email, key in zip(emails, keys, strict=True)
        ]

    def _entry(
        self,
        session: Session,
        email: Email,
        key: str | None,
        category: str | None,
        priority: int,
        not_before: datetime | None,
        expires_at: datetime | None,
    ) -> _Entry:
        row, cat = self._row(email, key, category, priority, not_before, expires_at)
        result = EnqueueResult(key=row["idempotency_key"], resolve=_resolver(session))
        return _Entry(
            outbox=self, row=row, email=email, category=cat, result=result, generated=key is None
        )

    def _row(
        self,
        email: Email,
        key: str | None,
        category: str | None,
        priority: int,
        not_before: datetime | None,
        expires_at: datetime | None,
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
            sync_class = target.kw.get("sync_session_class", Session)
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
        entries: list[_Entry] = []
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
                    entries.append(
                        self._entry(
                            session, email, rule.key_for(obj), rule.category, rule.priority,
                            None, None,
                        )
                    )  # fmt: skip
        if entries:
            _buffer(session, entries)
