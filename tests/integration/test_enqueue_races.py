"""Enqueue racing other transactions on real servers: the caller's transaction is never aborted.

Each race is staged with threads on separate connections. A step that must wait is only
considered waiting once the server says so (an InnoDB lock wait or a named-lock wait on
MariaDB, a lock wait in ``pg_stat_activity`` on PostgreSQL), so the interleaving is the same on
every run. Lock waits are bounded by the engine's connect options, so a regression fails in
seconds instead of hanging.
"""

from __future__ import annotations

import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from outbox import Email, EnqueueResult, Outbox
from outbox.schema import messages
from tests.support.db import Backend, Order, emptied, rows
from tests.support.factories import email
from tests.support.waiting import wait_for

LOCK_WAIT_SECONDS = 5


def enqueued(ob: Outbox, session: Session, message: Email, *, key: str) -> EnqueueResult:
    """Enqueue and flush: the row is on the server from here on (enqueue alone buffers it
    until the session's next flush), so the races below are staged on real rows."""
    result = ob.enqueue(session, message, key=key)
    session.flush()
    return result


def bounded_engine(backend: Backend) -> Iterator[sa.Engine]:
    """An engine of its own whose lock waits give up after a few seconds, disposed after use."""
    if backend.name == "postgresql":
        connect_args = {"options": f"-c lock_timeout={LOCK_WAIT_SECONDS * 1000}"}
    else:
        connect_args = {"init_command": f"SET SESSION innodb_lock_wait_timeout={LOCK_WAIT_SECONDS}"}
    engine = sa.create_engine(backend.url, connect_args=connect_args)
    yield engine
    engine.dispose()


@pytest.fixture
def race_engine(server_backend: Backend) -> Iterator[sa.Engine]:
    """PostgreSQL and MariaDB."""
    yield from bounded_engine(server_backend)


@pytest.fixture
def mariadb_engine(_backends: dict[str, Backend]) -> Iterator[sa.Engine]:
    """MariaDB only: InnoDB can roll back a whole transaction on its own; PostgreSQL never does."""
    for backend in emptied(_backends["mysql"]):
        yield from bounded_engine(backend)


@pytest.fixture
def held() -> Iterator[list[Session]]:
    """Sessions a test keeps open across steps; closed (rolled back) at teardown even when the
    test fails half-way, so their locks never block the tables' cleanup."""
    sessions: list[Session] = []
    yield sessions
    for session in sessions:
        session.close()


def session_id(session: Session) -> int:
    conn = session.connection()
    query = (
        "SELECT pg_backend_pid()" if conn.dialect.name == "postgresql" else "SELECT CONNECTION_ID()"
    )
    return int(conn.exec_driver_sql(query).scalar_one())


def waiting(engine: sa.Engine, ids: list[int]) -> int:
    """How many of the sessions ``ids`` are blocked on a lock right now."""
    with engine.connect() as conn:
        if engine.dialect.name == "postgresql":
            query = sa.text(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE pid IN :ids AND wait_event_type = 'Lock'"
            ).bindparams(sa.bindparam("ids", expanding=True))
            return int(conn.execute(query, {"ids": ids}).scalar_one())
        query = sa.text(
            "SELECT ID FROM information_schema.PROCESSLIST WHERE ID IN :ids AND STATE = 'User lock'"
        ).bindparams(sa.bindparam("ids", expanding=True))
        named_lock = set(conn.execute(query, {"ids": ids}).scalars())
        return len((named_lock | innodb_lock_waiters(conn)) & set(ids))


_THREAD_ID = re.compile(r"^(?:MariaDB|MySQL) thread id (\d+)", re.MULTILINE)


def innodb_lock_waiters(conn: sa.Connection) -> set[int]:
    """The sessions in an InnoDB lock wait, read from SHOW ENGINE INNODB STATUS, which is built
    on each call. Not from information_schema.INNODB_TRX: InnoDB serves that from a server-wide
    cache it refreshes only once nobody has read it for 0.1 s, so polling it every 20 ms (as
    wait_for does, or any other client of the server) keeps showing the transactions of the
    last refresh, often the previous test's, and a new lock wait never appears."""
    status = conn.exec_driver_sql("SHOW ENGINE INNODB STATUS").one()[2]
    waiters: set[int] = set()
    for transaction in status.split("\n---TRANSACTION ")[1:]:
        thread = _THREAD_ID.search(transaction)
        if thread is not None and "\nLOCK WAIT " in transaction:
            waiters.add(int(thread.group(1)))
    return waiters


def wait_until_blocked(engine: sa.Engine, ids: list[int], timeout: float = 5.0) -> None:
    wait_for(
        lambda: waiting(engine, ids) >= len(ids),
        timeout=timeout,
        what=f"sessions {ids} to block on a lock",
    )


class Caller(threading.Thread):
    """One application transaction in its own thread: ``body(session)`` runs after the session
    has written its business row; the thread then commits. ``id`` is its server session, set
    before ``body`` runs; ``error`` is whatever escaped the transaction."""

    def __init__(
        self, Sessions: sessionmaker[Session], order_id: int, body: Callable[[Session], Any]
    ) -> None:
        super().__init__(daemon=True)
        self.Sessions = Sessions
        self.order_id = order_id
        self.body = body
        self.started_body = threading.Event()
        self.id = 0
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with self.Sessions.begin() as session:
                session.add(Order(id=self.order_id, customer=f"caller {self.order_id}"))
                session.flush()
                self.id = session_id(session)
                self.started_body.set()
                self.result = self.body(session)
        except BaseException as exc:
            self.error = exc
        finally:
            self.started_body.set()

    def launch(self) -> Caller:
        self.start()
        assert self.started_body.wait(5)
        return self

    def finish(self) -> Any:
        self.join(timeout=3 * LOCK_WAIT_SECONDS)
        assert not self.is_alive(), "the caller never finished"
        if self.error is not None:
            raise self.error
        return self.result


def order_ids(engine: sa.Engine) -> list[int]:
    with engine.connect() as conn:
        return list(conn.execute(sa.select(Order.id).order_by(Order.id)).scalars())


def mysql_error_code(error: BaseException) -> int:
    assert isinstance(error, OperationalError), repr(error)
    return int(error.orig.args[0])


def test_rolled_back_key_with_two_waiting_callers_aborts_neither(race_engine, held):
    """T3 holds the key uncommitted while T1 and T2 enqueue it and wait; T3 rolls back. On
    InnoDB, two plain inserts waiting on one rolled-back key deadlock and one caller's whole
    transaction is lost. Here neither is: one inserts, the other reports it as a duplicate, and
    both commit their business rows."""
    ob = Outbox()
    Sessions = sessionmaker(race_engine)
    holder = Sessions()
    held.append(holder)
    holder.add(Order(id=3, customer="holder"))
    enqueued(ob, holder, email(3), key="race")
    callers = [
        Caller(Sessions, n, lambda s: enqueued(ob, s, email(3), key="race")).launch()
        for n in (1, 2)
    ]
    wait_until_blocked(race_engine, [c.id for c in callers])
    holder.rollback()
    holder.close()
    results: list[EnqueueResult] = [c.finish() for c in callers]
    assert sorted(r.duplicate for r in results) == [False, True]
    assert results[0].id == results[1].id
    assert [r.id for r in rows(race_engine)] == [results[0].id]
    assert order_ids(race_engine) == [1, 2]


def test_committed_key_with_two_waiting_callers(race_engine, held):
    """The same race when T3 commits: both callers report T3's row as a duplicate."""
    ob = Outbox()
    Sessions = sessionmaker(race_engine)
    holder = Sessions()
    held.append(holder)
    holder.add(Order(id=3, customer="holder"))
    first = enqueued(ob, holder, email(3), key="race")
    callers = [
        Caller(Sessions, n, lambda s: enqueued(ob, s, email(3), key="race")).launch()
        for n in (1, 2)
    ]
    wait_until_blocked(race_engine, [c.id for c in callers])
    holder.commit()
    holder.close()
    results = [c.finish() for c in callers]
    assert [(r.id, r.duplicate) for r in results] == [(first.id, True)] * 2
    assert len(rows(race_engine)) == 1
    assert order_ids(race_engine) == [1, 2, 3]


@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
@pytest.mark.parametrize("winner", ["committed before", "committed while waiting"])
def test_winner_committed_after_the_snapshot_is_a_duplicate(race_engine, held, isolation, winner):
    """The caller's snapshot predates the other transaction's commit of the key, so the row is
    invisible to it. It still gets duplicate=True with the winner's id and commits its own
    row."""
    ob = Outbox()
    Sessions = sessionmaker(race_engine)
    Snapshot = sessionmaker(race_engine.execution_options(isolation_level=isolation))
    winner_session = Sessions()
    held.append(winner_session)
    winner_session.add(Order(id=2, customer="winner"))
    won = enqueued(ob, winner_session, email(2), key="race")
    snapshot_taken = threading.Event()
    go = threading.Event()

    def body(session: Session) -> EnqueueResult:
        session.execute(sa.text("SELECT count(*) FROM shop_users")).scalar_one()
        snapshot_taken.set()
        assert go.wait(5)
        return enqueued(ob, session, email(1), key="race")

    caller = Caller(Snapshot, 1, body).launch()
    assert snapshot_taken.wait(5)
    if winner == "committed before":
        winner_session.commit()
        go.set()
    else:
        go.set()
        wait_until_blocked(race_engine, [caller.id])
        winner_session.commit()
    winner_session.close()
    result = caller.finish()
    assert (result.id, result.duplicate) == (won.id, True)
    assert [r.id for r in rows(race_engine)] == [won.id]
    assert order_ids(race_engine) == [1, 2]


def test_invisible_winner_is_a_duplicate_even_with_every_pooled_connection_in_use(
    postgres_backend, held
):
    """Both of the pool's connections are held by callers whose snapshots predate the
    winner's commit: the lookup outside their snapshots does not wait for (or fail on) a
    connection of that pool. It once raised the serialization failure after pool_timeout."""
    ob = Outbox()
    engine = sa.create_engine(postgres_backend.url, pool_size=2, max_overflow=0, pool_timeout=1)
    try:
        Snapshot = sessionmaker(engine.execution_options(isolation_level="REPEATABLE READ"))
        callers = [Snapshot(), Snapshot()]
        held.extend(callers)
        for n, session in enumerate(callers, start=1):
            session.add(Order(id=n, customer=f"caller {n}"))
            session.flush()  # each holds a connection and a snapshot from here on
        with postgres_backend.engine.begin() as conn:  # the winner, on another pool
            won = enqueued(ob, Session(bind=conn), email(3), key="race")
        started = time.monotonic()
        results = [enqueued(ob, session, email(n), key="race") for n, session in enumerate(callers)]
        assert time.monotonic() - started < 1.0  # no wait for a connection of the full pool
        for session in callers:
            session.commit()
    finally:
        engine.dispose()
    assert [(r.id, r.duplicate) for r in results] == [(won.id, True)] * 2
    assert order_ids(postgres_backend.engine) == [1, 2]


def test_same_transaction_enqueues_its_key_again_while_another_waits(race_engine, held):
    """T3 enqueues a key, T1 enqueues it and waits on T3, T3 enqueues it again: T3 is not made
    to wait for T1 (which waits for T3), and both commit."""
    ob = Outbox()
    Sessions = sessionmaker(race_engine)
    holder = Sessions()
    held.append(holder)
    holder.add(Order(id=3, customer="holder"))
    first = enqueued(ob, holder, email(3), key="race")
    caller = Caller(Sessions, 1, lambda s: enqueued(ob, s, email(3), key="race")).launch()
    wait_until_blocked(race_engine, [caller.id])
    started = time.monotonic()
    again = enqueued(ob, holder, email(3), key="race")
    assert time.monotonic() - started < 1.0
    assert (again.id, again.duplicate) == (first.id, True)
    holder.commit()
    holder.close()
    result = caller.finish()
    assert (result.id, result.duplicate) == (first.id, True)
    assert order_ids(race_engine) == [1, 3]


def test_a_key_its_own_savepoint_rolled_back_is_enqueued_like_any_other(race_engine, held):
    """T2 enqueues a key inside its own savepoint and rolls that back: the key is no longer
    T2's. T1 then holds the key, T3 waits on it, T2 enqueues it again and waits too, T1 rolls
    back: nobody's transaction is aborted (T2 once skipped the key's lock on the strength of
    the rolled-back insert, and deadlocked with T3)."""
    ob = Outbox()
    Sessions = sessionmaker(race_engine)
    gate = threading.Event()
    # a key no earlier test used: a delete-marked index entry of an old "race" row, not yet
    # purged, would make T2's first insert take a lock its savepoint's rollback keeps
    key = f"race-{uuid.uuid4()}"

    def again(session: Session) -> Any:
        nested = session.begin_nested()
        enqueued(ob, session, email(2), key=key)
        nested.rollback()
        gate.wait(5)
        return enqueued(ob, session, email(2), key=key)

    second = Caller(Sessions, 2, again).launch()
    holder = Sessions()
    held.append(holder)
    holder.add(Order(id=1, customer="holder"))
    time.sleep(0.2)  # T2's savepoint has come and gone before T1 holds the key
    enqueued(ob, holder, email(1), key=key)
    third = Caller(Sessions, 3, lambda s: enqueued(ob, s, email(3), key=key)).launch()
    wait_until_blocked(race_engine, [third.id])
    gate.set()
    wait_until_blocked(race_engine, [second.id, third.id])
    holder.rollback()
    holder.close()
    results = [second.finish(), third.finish()]
    assert sorted(r.duplicate for r in results) == [False, True]
    assert results[0].id == results[1].id
    assert [r.id for r in rows(race_engine)] == [results[0].id]
    assert order_ids(race_engine) == [2, 3]


def test_lock_wait_timeout_rolls_back_only_the_outbox_statement(race_engine, held):
    """A lock wait that times out is the database's error, raised as itself. Where the server
    rolls back only the statement (PostgreSQL; InnoDB unless innodb_rollback_on_timeout), the
    caller's transaction goes on and commits."""
    ob = Outbox()
    Sessions = sessionmaker(race_engine)
    holder = Sessions()
    held.append(holder)
    enqueued(ob, holder, email(3), key="held")
    postgres = race_engine.dialect.name == "postgresql"
    if postgres:
        statement_only = True
    else:
        with race_engine.connect() as conn:
            statement_only = not conn.exec_driver_sql(
                "SELECT @@innodb_rollback_on_timeout"
            ).scalar()

    def body(session: Session) -> str:
        conn = session.connection()
        conn.exec_driver_sql(
            "SET LOCAL lock_timeout = '500ms'" if postgres else "SET innodb_lock_wait_timeout = 1"
        )
        with pytest.raises(OperationalError) as info:
            enqueued(ob, session, email(1), key="held")
        if not postgres:
            conn.exec_driver_sql(f"SET innodb_lock_wait_timeout = {LOCK_WAIT_SECONDS}")
        if statement_only:
            session.add(Order(id=2, customer="after the timeout"))
            enqueued(ob, session, email(2), key="other")
        else:
            session.rollback()
        return str(info.value.orig)

    caller = Caller(Sessions, 1, body).launch()
    message = caller.finish()
    holder.rollback()
    holder.close()
    if postgres:
        assert "lock timeout" in message
    else:
        assert "1205" in message or "Lock wait timeout" in message
    if statement_only:
        assert order_ids(race_engine) == [1, 2]
        assert [r.idempotency_key for r in rows(race_engine)] == ["other"]


def test_deadlock_that_rolls_back_the_whole_transaction_surfaces_as_itself(mariadb_engine, held):
    """The caller's enqueue waits on a key another transaction holds, and that transaction then
    waits on a row the caller holds. InnoDB rolls back the lighter transaction, the caller's,
    all of it, savepoint included. The caller must see the deadlock (1213), which its retry
    logic looks for, not an error from cleaning up a savepoint that no longer exists."""
    engine = mariadb_engine
    ob = Outbox()
    Sessions = sessionmaker(engine)
    with Sessions.begin() as session:
        session.add(Order(id=100, customer="contended"))
    heavy = Sessions()
    held.append(heavy)
    heavy.add_all([Order(id=200 + n, customer="heavy") for n in range(20)])
    heavy.flush()
    enqueued(ob, heavy, email(3), key="held")

    def body(session: Session) -> EnqueueResult:
        session.execute(sa.update(Order).where(Order.id == 100).values(status="mine"))
        return enqueued(ob, session, email(1), key="held")

    caller = Caller(Sessions, 1, body).launch()
    wait_until_blocked(engine, [caller.id])
    heavy.execute(sa.update(Order).where(Order.id == 100).values(status="heavy"))
    with pytest.raises(OperationalError) as info:
        caller.finish()
    assert mysql_error_code(info.value) == 1213, info.value
    heavy.commit()
    heavy.close()
    assert 1 not in order_ids(engine)
    with Sessions.begin() as session:
        session.add(Order(id=1, customer="retried"))
        retried = enqueued(ob, session, email(1), key="held")
    assert retried.duplicate is True
    with engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(messages)).scalar_one() == 1


def test_invisible_winner_without_a_second_connection_raises_the_serialization_failure(
    postgres_backend, held
):
    """When the winner's row cannot be read outside the caller's snapshot (here a pool that
    shares one connection), PostgreSQL's own serialization failure propagates, rolled back to
    the savepoint: the caller's transaction goes on, and a retry of the whole transaction would
    see the row."""
    ob = Outbox()
    engine = sa.create_engine(
        postgres_backend.url, poolclass=sa.pool.StaticPool, isolation_level="REPEATABLE READ"
    )
    try:
        with Session(engine) as session:
            session.add(Order(id=1, customer="caller"))
            session.execute(sa.text("SELECT count(*) FROM shop_users")).scalar_one()
            with sessionmaker(postgres_backend.engine).begin() as winner:
                enqueued(ob, winner, email(2), key="race")
            with pytest.raises(OperationalError) as info:
                enqueued(ob, session, email(1), key="race")
            assert info.value.orig.sqlstate == "40001"
            session.add(Order(id=2, customer="caller, after the error"))
            session.commit()
    finally:
        engine.dispose()
    assert order_ids(postgres_backend.engine) == [1, 2]
    assert len(rows(postgres_backend.engine)) == 1
