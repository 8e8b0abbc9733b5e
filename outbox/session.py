"""The app-side entry point: :class:`Outbox` enqueues email in the caller's session transaction
and runs declarative rules from SQLAlchemy session events."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncSession, async_scoped_session, async_sessionmaker
from sqlalchemy.orm import Session, UOWTransaction, scoped_session, sessionmaker
from sqlalchemy.util.concurrency import in_greenlet

from outbox import signals
from outbox.category import DEFAULT_CATEGORIES, Category
from outbox.enqueue import EnqueueResult, build_row, check_key, insert_message
from outbox.exceptions import ConfigurationError, UnknownCategory
from outbox.message import Email
from outbox.schema import messages, utcnow

__all__ = ["Outbox", "Rule"]

_T = TypeVar("_T")
_RuleFunction = Callable[[Any], Email | None]
_SessionTarget = sessionmaker[Any] | async_sessionmaker[Any] | type[Session] | type[AsyncSession]

_BIND_ARGS = {"clause": messages}


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

        It commits or rolls back with the caller's changes. Repeating a ``key`` is harmless:
        nothing is written, ``duplicate`` is True and ``id`` is the existing row's, and the
        caller's transaction stays usable. Lower ``priority`` sends first. Bad input raises an
        :class:`~outbox.exceptions.EnqueueError` before anything touches the database.
        """
        _check_sync_session(session)
        row, cat = self._row(email, key, category, priority, not_before, expires_at)
        conn = session.connection(bind_arguments=_BIND_ARGS)
        return self._write(conn, row, email, cat)

    async def enqueue_async(
        self,
        session: AsyncSession,
        email: Email,
        *,
        key: str | None = None,
        category: str | None = None,
        priority: int = 0,
        not_before: datetime | None = None,
        expires_at: datetime | None = None,
    ) -> EnqueueResult:
        """:meth:`enqueue` for an ``AsyncSession``."""
        _check_async_session(session)
        row, cat = self._row(email, key, category, priority, not_before, expires_at)
        conn = await session.connection(bind_arguments=_BIND_ARGS)
        return await conn.run_sync(lambda sync_conn: self._write(sync_conn, row, email, cat))

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

    def _write(
        self, conn: sa.Connection, row: dict[str, Any], email: Email, cat: Category
    ) -> EnqueueResult:
        new_id, duplicate = insert_message(conn, row, email)
        result = EnqueueResult(id=new_id, key=row["idempotency_key"], duplicate=duplicate)
        signal = signals.duplicate_skipped if duplicate else signals.enqueued
        signal.send(self, result=result, category=cat.name)
        return result

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
        conn: sa.Connection | None = None
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
                    row, cat = self._row(
                        email, rule.key_for(obj), rule.category, rule.priority, None, None
                    )
                    if conn is None:
                        conn = session.connection(bind_arguments=_BIND_ARGS)
                    self._write(conn, row, email, cat)
