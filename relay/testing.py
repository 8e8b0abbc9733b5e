"""Fakes for tests: a scriptable sender that counts every call, even across processes.

Used by this project's own tests and meant for host apps' tests too::

    sender = FakeSender()                       # accepts everything
    sender = FakeSender(outcomes=[Transient(code="Throttling"), Accepted(...)])
    sender = FakeSender(latency=0.05, record_file=tmp_path / "sent.log")

``outbox-relay run --sender relay.testing:sender_from_env`` builds one from ``OUTBOX_FAKE_*``
variables, so relay *processes* can be tested the same way; :func:`read_deliveries` counts what
they all sent.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.pool import SingletonThreadPool, StaticPool

from relay import store
from relay.clock import read_database_time
from relay.db import READ_COMMITTED
from relay.senders import Accepted, BaseSender, Outcome, OutgoingMessage

__all__ = [
    "DEFAULT_TIMEOUT",
    "LOCK_WAIT",
    "DatabaseInUse",
    "FakeSender",
    "RelayNotIdle",
    "read_deliveries",
    "run_until_idle",
    "sender_from_env",
]

_Script = Callable[[OutgoingMessage], Outcome]
_log = logging.getLogger(__name__)


class FakeSender(BaseSender):
    """A sender that records each call and answers from a script.

    ``outcomes`` is either a callable ``(message) -> Outcome`` or a sequence consumed one per
    call (then ``Accepted`` once it runs out). ``latency`` seconds are slept per send. With
    ``record_file``, each call appends ``id<TAB>key<TAB>pid`` to it (one ``write`` of one line
    under ``O_APPEND``, so concurrent processes never interleave).

    ``sent_ids`` are the messages it accepted (what a real provider would have delivered);
    ``called_ids`` and ``calls`` are every call, refused and failed ones too, in order.
    """

    name = "fake"

    def __init__(
        self,
        outcomes: _Script | Iterable[Outcome] | None = None,
        *,
        latency: float = 0.0,
        record_file: str | os.PathLike[str] | None = None,
    ) -> None:
        self._script: _Script | None = outcomes if callable(outcomes) else None
        self._queue = collections.deque(() if outcomes is None or callable(outcomes) else outcomes)
        self.latency = latency
        self.record_file = Path(record_file) if record_file is not None else None
        self.calls: list[OutgoingMessage] = []
        self._accepted: list[int] = []
        self._lock = threading.Lock()

    def send(self, message: OutgoingMessage) -> Outcome:
        if self.latency:
            time.sleep(self.latency)
        with self._lock:
            self.calls.append(message)
            if self.record_file is not None:
                line = f"{message.id}\t{message.key}\t{os.getpid()}\n".encode()
                fd = os.open(self.record_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, line)
                finally:
                    os.close(fd)
            script = self._script
            outcome: Outcome | None = None
            if script is None:
                outcome = self._queue.popleft() if self._queue else None
        if script is not None:  # outside the lock: a script that blocks holds up only its send
            outcome = script(message)
        if outcome is None:
            outcome = Accepted(provider_message_id=f"fake-{message.id}-{message.attempt}")
        if isinstance(outcome, Accepted):
            with self._lock:
                self._accepted.append(message.id)
        return outcome

    @property
    def sent_ids(self) -> list[int]:
        """The ids of the messages this sender accepted, in the order it accepted them."""
        with self._lock:
            return list(self._accepted)

    @property
    def called_ids(self) -> list[int]:
        """The id of every call, accepted or not, in order."""
        with self._lock:
            return [m.id for m in self.calls]


def sender_from_env() -> FakeSender:
    """A FakeSender configured by ``OUTBOX_FAKE_RECORD_FILE`` and ``OUTBOX_FAKE_LATENCY``."""
    return FakeSender(
        latency=float(os.environ.get("OUTBOX_FAKE_LATENCY", "0")),
        record_file=os.environ.get("OUTBOX_FAKE_RECORD_FILE") or None,
    )


def read_deliveries(record_file: str | os.PathLike[str]) -> collections.Counter[int]:
    """How many times each message id was sent, from a FakeSender's ``record_file``."""
    path = Path(record_file)
    if not path.exists():
        return collections.Counter()
    return collections.Counter(
        int(line.split("\t", 1)[0]) for line in path.read_text().splitlines() if line
    )


# -- running the relay in a test ------------------------------------------------------------

DEFAULT_TIMEOUT = 30.0  # seconds run_until_idle waits for the outbox to become idle
LOCK_WAIT = 1.0  # seconds one relay statement waits for a lock before it fails (and is retried)
_ROLLBACK_JOURNAL_MODES = frozenset({"delete", "truncate", "persist"})


class RelayNotIdle(TimeoutError):
    """:func:`run_until_idle` stopped the relay at its timeout; the message says what was still
    due or in flight and the likely cause (most often: a session in the test holds an open
    transaction)."""


class DatabaseInUse(RuntimeError):
    """The test's own session holds the one connection of an in-memory SQLite database inside
    a transaction, so nothing else can read or commit beside it."""


def run_until_idle(
    engine: sa.Engine,
    sender: FakeSender | None = None,
    *,
    timeout: float = DEFAULT_TIMEOUT,
    **settings: Any,
) -> FakeSender:
    """Run a relay in this process until nothing is due and nothing is in flight, and return
    its sender (a new accepting :class:`FakeSender` unless one is given), so a test can assert
    ``sender.sent_ids`` (accepted) or ``sender.called_ids`` (every call). ``settings`` are
    :class:`~relay.config.RelayConfig` fields (``batch_size=``, ``concurrency=``, ...).
    ``engine`` is a sync engine; for an app on ``AsyncEngine``, create one on the same
    database with a sync driver.

    After ``timeout`` seconds the relay is stopped (it drains what is in flight) and
    :class:`RelayNotIdle` is raised, naming what was left and why. A test's session that holds
    an open transaction is the usual cause, and the relay never ends it for the test:

    * SQLite keeps one lock for the whole database. In rollback-journal mode a connection
      inside a read transaction holds a SHARED lock, and no other connection can commit until
      it ends; Flask-SQLAlchemy's scoped session stays in such a transaction (reloading an
      object after ``commit()``) for as long as a fixture keeps the app context pushed. So a
      file database in a rollback-journal mode is switched to WAL (persistent, for the file),
      where readers and one writer coexist; a transaction that *writes* still blocks the relay.
      A session whose transaction began before the relay committed keeps seeing the database
      as it was and cannot write in that transaction (SQLite's snapshot rule): end it to go on.
    * An in-memory SQLite database (``StaticPool``, ``SingletonThreadPool``) is one
      connection: the relay uses the app's engine, and refuses at once (:class:`DatabaseInUse`)
      while the app's session holds that connection inside a transaction.
    * PostgreSQL and MariaDB: due rows that another transaction holds locked are skipped by the
      claim (``SKIP LOCKED``); they are looked for again until ``timeout``. Each relay statement
      waits at most ``LOCK_WAIT`` seconds for a lock, so nothing can hang. The relay runs at
      READ COMMITTED on MariaDB, as ``relay.db.make_engine`` builds it in production.
    """
    from relay.config import RelayConfig
    from relay.worker import Relay

    _require_sync_engine(engine, "run_until_idle")
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ValueError(
            f"run_until_idle: timeout must be a positive number of seconds, not {timeout!r}"
        )
    _refuse_private_memory_database(engine, "run_until_idle")
    _refuse_held_connection(engine, "run_until_idle")
    _use_wal(engine)
    _note_held_connections(engine)
    sender = FakeSender() if sender is None else sender
    settings.setdefault("poll_interval", 0.05)
    settings.setdefault("relay_id", f"run-until-idle-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    config = RelayConfig(
        database_url=engine.url.render_as_string(hide_password=False),
        exit_when_idle=True,
        **settings,
    )
    relay_engine, check_engine = _relay_engines(engine)
    deadline = time.monotonic() + timeout
    pause = config.poll_interval
    with _DatabaseErrors.watching() as errors:
        while True:
            relay = Relay(engine=relay_engine, sender=sender, config=config)
            left = _run_until(relay, deadline)
            if left is not None:
                raise RelayNotIdle(_not_idle(timeout, check_engine, left, errors))
            if not _locked_due(check_engine):
                return sender
            if time.monotonic() + pause >= deadline:
                raise RelayNotIdle(_not_idle(timeout, check_engine, _Left.of(relay), errors))
            time.sleep(pause)  # another thread may yet release them
            pause = min(1.0, 2 * pause)


@dataclass(frozen=True, slots=True)
class _Left:
    """The relay's own state when the timeout stopped it."""

    in_flight: int
    paused: bool
    pause_code: str | None
    pause_seconds: float

    @classmethod
    def of(cls, relay: Any) -> _Left:
        return cls(relay.in_flight, relay.paused, relay.pause_code, relay.config.pause_seconds)


def _run_until(relay: Any, deadline: float) -> _Left | None:
    """Run ``relay`` to its idle exit, or stop it at ``deadline`` (``request_stop`` from a timer
    thread: the relay claims nothing more, drains what is in flight, and returns); then the
    state it was stopped in."""
    left: list[_Left] = []

    def stop() -> None:
        left.append(_Left.of(relay))
        relay.request_stop()

    timer = threading.Timer(max(0.0, deadline - time.monotonic()), stop)
    timer.daemon = True
    timer.start()
    try:
        relay.run()
    finally:
        timer.cancel()
        timer.join()
    return left[0] if left else None


def _require_sync_engine(engine: object, what: str) -> None:
    """A precise TypeError for anything but a sync Engine (an AsyncEngine's ``sync_engine``
    cannot be used from sync code either: its driver needs the event loop)."""
    if isinstance(engine, sa.Engine):
        return
    raise TypeError(
        f"{what} needs a sync sqlalchemy Engine, not {type(engine).__name__}; "
        + _sync_engine_advice(engine)
    )


def _sync_engine_advice(engine: object) -> str:
    url = getattr(engine, "url", None)
    if not isinstance(url, sa.URL):
        return "pass the sqlalchemy Engine your app's sessions are bound to"
    sync = {
        "aiosqlite": "sqlite",
        "asyncpg": "postgresql+psycopg",
        "psycopg": "postgresql+psycopg",
        "psycopg_async": "postgresql+psycopg",
        "aiomysql": "mysql+pymysql",
        "asyncmy": "mysql+pymysql",
    }.get(url.get_driver_name())
    target = url.set(drivername=sync) if sync else url
    return (
        "for an app on an AsyncEngine, create a sync engine on the same database, e.g. "
        f"sqlalchemy.create_engine({target.render_as_string(hide_password=True)!r})"
        + ("" if sync else " with a sync driver")
    )


def _shares_one_connection(engine: sa.Engine) -> bool:
    """A pool that hands out one connection to everyone (``StaticPool``) or to each thread
    (``SingletonThreadPool``): SQLite's ``:memory:`` database lives in that connection."""
    return isinstance(engine.pool, StaticPool | SingletonThreadPool)


def _refuse_private_memory_database(engine: sa.Engine, what: str) -> None:
    """A precise ValueError for an in-memory SQLite engine whose pool opens more than one
    connection (``QueuePool``, ``NullPool``): each connection is a database of its own, so the
    relay would see no outbox tables, or take the one connection that holds the app's data and
    close it for good, and the data with it."""
    url = engine.url
    private = url.database in (None, "", ":memory:") and not url.query.get("uri")
    if engine.dialect.name != "sqlite" or not private or _shares_one_connection(engine):
        return
    raise ValueError(
        f"{what}: this in-memory SQLite database lives inside one connection, and the engine's "
        f"{type(engine.pool).__name__} gives every other connection an empty database of its "
        "own; create the engine with poolclass=sqlalchemy.pool.StaticPool and "
        "connect_args={'check_same_thread': False}, or use a file database"
    )


def _refuse_held_connection(engine: sa.Engine, what: str) -> None:
    """Raise :class:`DatabaseInUse` if ``engine`` is an in-memory SQLite database whose one
    connection is inside a transaction (the app's session holds it). Reading or running the
    relay beside it is impossible: a second checkout of a ``StaticPool`` connection would roll
    the app's transaction back on its return, and its uncommitted rows would look committed."""
    if engine.dialect.name != "sqlite" or not _shares_one_connection(engine):
        return
    pool = engine.pool
    if isinstance(pool, StaticPool):
        if "connection" not in pool.__dict__:  # never connected
            return
        held = bool(getattr(pool.connection.dbapi_connection, "in_transaction", False))
    else:  # SingletonThreadPool: a nested checkout in the same thread is counted, not reset
        raw = engine.raw_connection()
        try:
            held = bool(getattr(raw.dbapi_connection, "in_transaction", False))
        finally:
            raw.close()
    if held:
        raise DatabaseInUse(
            f"{what}: this in-memory SQLite database is one connection, and a session in the "
            "test holds it inside a transaction; nothing can read or commit beside it. Commit "
            "or roll that session back first (Flask-SQLAlchemy: db.session.commit()), or use "
            "a file database"
        )


def _note_held_connections(engine: sa.Engine) -> None:
    """Log (where a failing test shows it) that a SQLite connection of ``engine`` is checked
    out while the relay runs: a session inside a transaction, which after the relay's commits
    sees an old snapshot and can no longer write in that transaction."""
    checked_out = getattr(engine.pool, "checkedout", None)
    if engine.dialect.name != "sqlite" or not callable(checked_out) or not checked_out():
        return
    _log.warning(
        "%d connection(s) of the SQLite engine are checked out while the relay runs (a session "
        "inside a transaction?): that transaction keeps seeing the database as it was, and a "
        "write in it will fail with 'database is locked' (SQLite's snapshot rule); end it "
        "(session.commit() or rollback()) before the test writes again",
        checked_out(),
        extra={"action": "connection_held"},
    )


def _use_wal(engine: sa.Engine) -> None:
    """Switch a SQLite file database in a rollback-journal mode to WAL, so that a session left
    inside a read transaction (a SHARED lock) no longer blocks the relay's commits. The mode is
    the file's: it stays WAL. Only the main database is switched (where the outbox tables
    are), never one the app ATTACHes. Nothing is done for other databases, for in-memory ones, or if
    the database is locked right now (then the relay reports the lock)."""
    if engine.dialect.name != "sqlite" or _shares_one_connection(engine):
        return
    raw = engine.raw_connection()  # its driver-level cursor: no BEGIN (WAL needs none open)
    try:
        cursor = raw.cursor()
        try:
            # main only: without a schema name the PRAGMA switches every ATTACHed database too
            (mode,) = cursor.execute("PRAGMA main.journal_mode").fetchone()
            if str(mode).lower() in _ROLLBACK_JOURNAL_MODES:
                cursor.execute("PRAGMA main.journal_mode = WAL")
        finally:
            cursor.close()
    except engine.dialect.loaded_dbapi.Error as exc:
        _log.warning(
            "could not switch the SQLite database to WAL: %s", exc, extra={"action": "wal"}
        )
    finally:
        raw.close()


def _relay_engines(engine: sa.Engine) -> tuple[sa.Engine, sa.Engine]:
    """Copies of ``engine`` sharing its pool: one for the relay (READ COMMITTED on MySQL and
    MariaDB, and each statement's lock wait bounded by ``LOCK_WAIT``: the relay's connections
    are closed for good after the run, so the setting never reaches the app's), and one at that
    isolation level for run_until_idle's own reads."""
    options: dict[str, Any] = {}
    if engine.dialect.name in ("mysql", "mariadb"):
        options["isolation_level"] = READ_COMMITTED
    relay_engine, check_engine = (
        engine.execution_options(**options),
        engine.execution_options(**options),
    )
    if not _shares_one_connection(engine):
        event.listen(relay_engine, "engine_connect", _bound_lock_waits)
    return relay_engine, check_engine


def _bound_lock_waits(conn: sa.Connection) -> None:
    name = conn.dialect.name
    if name == "postgresql":
        conn.exec_driver_sql(f"SET lock_timeout = {int(LOCK_WAIT * 1000)}")
    elif name in ("mysql", "mariadb"):
        conn.exec_driver_sql(f"SET SESSION innodb_lock_wait_timeout = {max(1, int(LOCK_WAIT))}")
    else:
        conn.exec_driver_sql(f"PRAGMA busy_timeout = {int(LOCK_WAIT * 1000)}")
    conn.commit()


def _locked_due(engine: sa.Engine) -> int:
    """How many due messages another transaction holds locked (the claim skipped them): due
    ones that ``FOR UPDATE SKIP LOCKED`` does not return. SQLite locks no rows: 0."""
    if engine.dialect.name == "sqlite":
        return 0
    with engine.connect() as conn:
        locked = store.count_locked_due(conn, now=read_database_time(conn))
        conn.rollback()
    return locked


def _not_idle(timeout: float, engine: sa.Engine, relay: _Left, errors: _DatabaseErrors) -> str:
    """What was left when the relay was stopped, and the likely cause."""
    in_flight = _many(relay.in_flight, "send") + " in flight"
    try:
        with engine.connect() as conn:
            due = store.count_due(conn, now=read_database_time(conn))
        locked = _locked_due(engine)
        left = f"{_many(due, 'message')} still due, {in_flight}"
    except sa.exc.DBAPIError as exc:
        locked, left = 0, f"{in_flight} (the due messages could not be counted: {exc.orig})"
    head = f"the relay was not idle after {timeout:g}s: {left}. "
    fix = "commit it or roll it back before running the relay (outbox_relay(), run_until_idle())"
    if errors.locked:
        return head + (
            f"The database stayed locked ({errors.last_lock}; {_many(errors.locked, 'time')}): "
            f"a session in the test holds an open transaction; {fix}"
        )
    if locked:
        return head + (
            f"{_many(locked, 'due message')} locked by another transaction (a session in the "
            f"test updated them or selected them FOR UPDATE, and did not commit); {fix}"
        )
    if relay.paused:
        return head + (
            f"Sending is paused ({relay.pause_code}) and probed again every "
            f"{relay.pause_seconds:g}s: pass a smaller pause_seconds= or a longer timeout="
        )
    if relay.in_flight:
        return head + (
            "The sender has not returned (a FakeSender latency, or an outcomes script that "
            "blocks): pass a longer timeout= if that is expected"
        )
    if errors.count:
        return head + f"{_many(errors.count, 'database error')}, the last: {errors.last}"
    return head + "Pass a longer timeout= if the work is expected to take that long"


def _many(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


class _DatabaseErrors(logging.Handler):
    """The database errors the relay in this thread logged (``action=db_error``), and how many
    of them were lock waits that gave up."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.thread = threading.get_ident()
        self.count = self.locked = 0
        self.last: str | None = None
        self.last_lock: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread != self.thread or getattr(record, "action", None) != "db_error":
            return
        error = record.args[0] if isinstance(record.args, tuple) and record.args else None
        text = str(error) if error is not None else record.getMessage()
        self.count += 1
        self.last = text.strip()
        if _is_lock_error(error, text):
            self.locked += 1
            self.last_lock = self.last

    @classmethod
    @contextlib.contextmanager
    def watching(cls) -> Iterator[_DatabaseErrors]:
        handler, logger = cls(), logging.getLogger("relay")
        logger.addHandler(handler)
        try:
            yield handler
        finally:
            logger.removeHandler(handler)


def _is_lock_error(error: object, text: str) -> bool:
    """A lock wait that gave up or a deadlock: SQLite's busy database, PostgreSQL's
    lock_not_available / deadlock_detected, MySQL/MariaDB's 1205 / 1213."""
    if getattr(error, "sqlstate", None) in ("55P03", "40P01"):
        return True
    args = getattr(error, "args", ())
    if args and args[0] in (1205, 1213):
        return True
    return "database is locked" in text or "database table is locked" in text
