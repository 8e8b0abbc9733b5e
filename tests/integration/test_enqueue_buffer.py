"""Enqueue buffers rows in the session; the session's flush writes them, one batch per flush.

On SQLite, PostgreSQL and MariaDB: nothing touches the database before the flush, every kind of
flush writes (explicit, autoflush, ``begin_nested``, commit, reading a result), a rolled-back
transaction or savepoint writes nothing and its results say so, and a batch is one statement
where the database allows it.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, sessionmaker

from outbox import EnqueueNotWritten, InvalidArgument, InvalidKey, Outbox, signals
from outbox.schema import messages
from outbox.sqlite import enable_savepoints
from tests.support.db import Order, rows
from tests.support.factories import email


def outbox_count(session: Session) -> int:
    """Rows the session's own transaction sees, read on its connection without a flush."""
    conn = session.connection()
    return int(conn.execute(sa.select(sa.func.count()).select_from(messages)).scalar_one())


class Statements:
    """The INSERTs into the outbox table that SQLAlchemy runs on ``engine``."""

    def __init__(self, engine: sa.Engine) -> None:
        self.inserts: list[str] = []
        self.engine = engine

    def __enter__(self) -> Statements:
        event.listen(self.engine, "before_cursor_execute", self._seen)
        return self

    def __exit__(self, *exc: object) -> None:
        event.remove(self.engine, "before_cursor_execute", self._seen)

    def _seen(self, conn, cursor, statement, parameters, context, executemany) -> None:
        if "INSERT INTO outbox_messages" in statement:
            self.inserts.append(statement)


def test_nothing_is_written_before_the_flush_and_the_flush_writes_it(Sessions, ob):
    with Sessions() as session, session.begin():
        result = ob.enqueue(session, email(1), key="k1")
        assert outbox_count(session) == 0
        assert result.written is False
        session.flush()
        assert outbox_count(session) == 1
        assert result.written is True
        assert result.duplicate is False


def test_reading_the_id_flushes_the_session(engine, Sessions, ob):
    with Sessions() as session, session.begin():
        result = ob.enqueue(session, email(1), key="k1")
        new_id = result.id
        assert outbox_count(session) == 1
    assert [r.id for r in rows(engine)] == [new_id]


def test_an_orm_query_autoflushes_the_buffered_rows(Sessions, ob):
    with Sessions() as session, session.begin():
        ob.enqueue(session, email(1), key="k1")
        session.scalars(sa.select(Order)).all()  # autoflush, as for the session's own objects
        assert outbox_count(session) == 1


def test_no_autoflush_keeps_the_rows_buffered_until_the_commit(engine, Sessions, ob):
    with Sessions() as session, session.begin(), session.no_autoflush:
        ob.enqueue(session, email(1), key="k1")
        session.scalars(sa.select(Order)).all()
        assert outbox_count(session) == 0
    assert [r.idempotency_key for r in rows(engine)] == ["k1"]


def test_rollback_writes_nothing_and_the_result_says_so(engine, Sessions, ob):
    with Sessions() as session:
        session.add(Order(id=1, customer="ada"))
        result = ob.enqueue(session, email(1), key="k1")
        session.rollback()
        with pytest.raises(EnqueueNotWritten) as info:
            result.id  # noqa: B018 - reading it is the test
        assert info.value.key == "k1"
        assert "rolled back" in info.value.reason
        ob.enqueue(session, email(2), key="k2")
        session.commit()
    assert [r.idempotency_key for r in rows(engine)] == ["k2"]


def test_a_rolled_back_savepoint_drops_only_what_was_enqueued_inside_it(engine, Sessions, ob):
    with Sessions() as session, session.begin():
        before = ob.enqueue(session, email(1), key="before")
        nested = session.begin_nested()  # flushes: "before" is written ahead of the SAVEPOINT
        inside = ob.enqueue(session, email(2), key="inside")
        nested.rollback()
        after = ob.enqueue(session, email(3), key="after")
        with session.begin_nested():
            kept = ob.enqueue(session, email(4), key="kept")  # written when the savepoint ends
    assert [r.idempotency_key for r in rows(engine)] == ["before", "after", "kept"]
    assert not before.duplicate
    assert not after.duplicate
    assert not kept.duplicate
    with pytest.raises(EnqueueNotWritten):
        inside.duplicate  # noqa: B018 - reading it is the test


def test_a_key_enqueued_again_after_its_savepoint_rolled_back_is_written(engine, Sessions, ob):
    with Sessions() as session, session.begin():
        with session.begin_nested() as nested:
            ob.enqueue(session, email(1), key="k1")
            session.flush()  # written inside the savepoint, then rolled back with it
            nested.rollback()
        again = ob.enqueue(session, email(1), key="k1")
    assert again.duplicate is False
    assert [r.id for r in rows(engine)] == [again.id]


def test_enqueue_many_writes_one_batch_in_order(engine, Sessions, ob):
    with Statements(engine) as seen, Sessions() as session, session.begin():
        results = ob.enqueue_many(
            session, [email(n) for n in range(10)], keys=[f"k{n}" for n in range(10)]
        )
        session.add(Order(id=1, customer="ada"))
    assert [r.idempotency_key for r in rows(engine)] == [f"k{n}" for n in range(10)]
    assert [r.id for r in rows(engine)] == [r.id for r in results]
    if engine.dialect.name in ("postgresql", "sqlite"):
        assert len(seen.inserts) == 1, seen.inserts


def test_separate_enqueues_of_one_flush_share_its_batch(engine, Sessions, ob):
    with Statements(engine) as seen, Sessions() as session, session.begin():
        for n in range(5):
            ob.enqueue(session, email(n), key=f"k{n}")
    assert len(rows(engine)) == 5
    expected = 1 if engine.dialect.name in ("postgresql", "sqlite") else 5
    assert len(seen.inserts) == expected, seen.inserts


def test_duplicate_keys_inside_one_batch_and_across_flushes(engine, Sessions, ob):
    with Sessions() as session, session.begin():
        first, same, other = ob.enqueue_many(
            session, [email(1), email(1, subject="changed"), email(2)], keys=["a", "a", "b"]
        )
        session.flush()
        later = ob.enqueue(session, email(1), key="a")
        auto = ob.enqueue_many(session, [email(3), email(4)])
    assert (same.id, same.duplicate) == (first.id, True)
    assert (later.id, later.duplicate) == (first.id, True)
    assert first.duplicate is False
    assert other.duplicate is False
    assert auto[0].key != auto[1].key
    written = rows(engine)
    assert [r.idempotency_key for r in written] == ["a", "b", auto[0].key, auto[1].key]
    assert written[0].subject == "Order 1"


def test_enqueue_many_checks_every_email_before_buffering_any(engine, Sessions, ob):
    with Sessions() as session, session.begin():
        kept = ob.enqueue(session, email(1), key="kept")
        with pytest.raises(InvalidKey):
            ob.enqueue_many(session, [email(2), email(3)], keys=["fine", ""])
        with pytest.raises(InvalidArgument) as info:
            ob.enqueue_many(session, [email(2), email(3)], keys=["only one"])
        assert info.value.field == "keys"
        with pytest.raises(TypeError):
            ob.enqueue_many(session, email(2))  # type: ignore[arg-type]
    assert kept.duplicate is False
    assert [r.idempotency_key for r in rows(engine)] == ["kept"]


def test_signals_fire_when_the_row_is_written_not_when_it_is_buffered(Sessions, ob):
    seen: list[tuple[str, bool]] = []

    def record(sender, result, category):
        seen.append((result.key, result.duplicate))

    signals.enqueued.connect(record)
    signals.duplicate_skipped.connect(record)
    try:
        with Sessions() as session, session.begin():
            ob.enqueue_many(session, [email(1), email(1)], keys=["a", "a"])
            assert seen == []
            session.flush()
            assert seen == [("a", False), ("a", True)]
            rolled_back = Sessions()
            ob.enqueue(rolled_back, email(2), key="never")
            rolled_back.rollback()
            rolled_back.close()
    finally:
        signals.enqueued.disconnect(record)
        signals.duplicate_skipped.disconnect(record)
    assert seen == [("a", False), ("a", True)]


def test_enqueue_inside_a_flush_event_writes_at_once(engine, Sessions, ob):
    """Code that enqueues from its own flush listener is inside the flush: the row is written
    there, like a rule's."""
    results = []

    def on_flush(session, flush_context):
        for obj in session.new:
            if isinstance(obj, Order):
                results.append(ob.enqueue(session, email(obj.id), key=f"order:{obj.id}"))

    event.listen(Sessions, "after_flush", on_flush)
    with Sessions() as session, session.begin():
        session.add(Order(id=7, customer="ada"))
        session.flush()
        assert outbox_count(session) == 1
    assert results[0].written
    assert [r.idempotency_key for r in rows(engine)] == ["order:7"]


def test_rules_and_explicit_enqueues_share_the_batch_and_the_keys(engine):
    ob = Outbox()

    @ob.on_insert(Order, name="confirm")
    def confirm(order: Order):
        return email(order.id)

    Sessions = sessionmaker(engine)
    ob.install(Sessions)
    with Sessions() as session, session.begin():
        session.add(Order(id=5, customer="ada"))
        explicit = ob.enqueue(session, email(5), key="confirm:5")
    assert explicit.duplicate is False
    assert [r.idempotency_key for r in rows(engine)] == ["confirm:5"]


def test_a_session_discarded_before_its_flush_wrote_nothing(engine, ob):
    session = Session(engine)
    result = ob.enqueue(session, email(1), key="k1")
    session.close()
    with pytest.raises(EnqueueNotWritten):
        result.id  # noqa: B018 - reading it is the test
    assert rows(engine) == []


def test_async_results_are_known_after_the_flush(backend):
    ob = Outbox()

    async def scenario():
        engine = create_async_engine(backend.async_url)
        enable_savepoints(engine)
        try:
            Sessions = async_sessionmaker(engine, expire_on_commit=False)
            async with Sessions.begin() as session:
                first = await ob.enqueue_async(session, email(1), key="a")
                with pytest.raises(EnqueueNotWritten) as info:
                    first.id  # noqa: B018 - reading it is the test
                assert "await session.flush()" in info.value.reason
                await session.flush()
                assert first.duplicate is False
                many = await ob.enqueue_many_async(session, [email(1), email(2)], keys=["a", "b"])
            return first, many
        finally:
            await engine.dispose()

    first, many = asyncio.run(scenario())
    assert (many[0].id, many[0].duplicate) == (first.id, True)
    assert many[1].duplicate is False
    assert [r.idempotency_key for r in rows(backend.engine)] == ["a", "b"]


def test_a_session_bound_to_a_connection_writes_at_once(engine, ob):
    """The app commits the connection's own transaction, not the session's: the email must be
    in it (a Core app that makes a Session only to enqueue, or the test-suite pattern)."""
    with engine.connect() as conn:
        transaction = conn.begin()
        result = ob.enqueue(Session(bind=conn), email(1), key="k1")
        assert result.written
        transaction.commit()
    assert [r.idempotency_key for r in rows(engine)] == ["k1"]


def test_rows_whose_placeholder_was_expunged_are_still_written_at_the_commit(engine, Sessions, ob):
    with Sessions() as session, session.begin():
        result = ob.enqueue(session, email(1), key="k1")
        session.expunge_all()
    assert result.duplicate is False
    assert [r.id for r in rows(engine)] == [result.id]


def test_a_result_written_then_rolled_back_stops_claiming_its_row(engine, Sessions, ob):
    with Sessions() as session:
        result = ob.enqueue(session, email(1), key="k1")
        session.flush()
        assert result.written
        session.rollback()
        with pytest.raises(EnqueueNotWritten) as info:
            result.id  # noqa: B018 - reading it is the test
        assert "rolled back" in info.value.reason
        with session.begin():
            kept = ob.enqueue(session, email(2), key="k2")
            nested = session.begin_nested()
            inside = ob.enqueue(session, email(3), key="k3")
            session.flush()
            assert inside.written
            nested.rollback()
        assert not inside.written
    assert [r.id for r in rows(engine)] == [kept.id]


def test_enqueue_after_the_transaction_committed_is_refused(engine, Sessions, ob):
    """An ``after_commit`` listener's enqueue would land in no transaction (or the next)."""
    errors = []

    def late(session):
        try:
            ob.enqueue(session, email(9), key="late")
        except sa.exc.InvalidRequestError as exc:
            errors.append(exc)

    with Sessions() as session:
        event.listen(session, "after_commit", late)
        session.add(Order(id=1, customer="ada"))
        session.commit()
        event.remove(session, "after_commit", late)
        session.add(Order(id=2, customer="bob"))
        session.commit()
    assert len(errors) == 1
    assert "no longer active" in str(errors[0])
    assert rows(engine) == []


def test_a_session_without_a_bind_for_the_outbox_table_is_refused_at_enqueue(engine, ob):
    session = Session(binds={Order: engine})
    with pytest.raises(sa.exc.UnboundExecutionError):
        ob.enqueue(session, email(1), key="k1")
    session.close()


def test_an_expiry_out_of_range_in_utc_is_refused_at_enqueue(Sessions, ob):
    far = datetime(9999, 12, 31, 22, tzinfo=timezone(timedelta(hours=-5)))
    with Sessions() as session, session.begin():
        with pytest.raises(InvalidArgument) as info:
            ob.enqueue(session, email(1), key="k1", expires_at=far)
        assert info.value.field == "expires_at"
        ob.enqueue(session, email(2), key="k2")


def test_the_apps_own_flush_and_commit_listeners_never_see_the_placeholder(engine, ob):
    Sessions = sessionmaker(engine)
    seen: list[str] = []

    def record(session, *args):
        seen.extend(type(obj).__name__ for obj in session.new)

    event.listen(Sessions, "before_flush", record)
    event.listen(Sessions, "before_commit", record)
    with Sessions() as session, session.begin():
        session.add(Order(id=1, customer="ada"))
        ob.enqueue(session, email(1), key="k1")
    assert "Order" in seen
    assert "_Pending" not in seen
    assert [r.idempotency_key for r in rows(engine)] == ["k1"]


def test_after_expunge_all_a_savepoint_still_drops_only_its_own_rows(engine, Sessions, ob):
    """The placeholder was expunged, so ``begin_nested()`` had nothing to flush: the rows
    enqueued before it still belong to the enclosing transaction, those inside to the
    savepoint, wherever they end up being written."""
    with Sessions() as session, session.begin():
        before = ob.enqueue(session, email(1), key="before")
        session.expunge_all()
        savepoint = session.begin_nested()
        inside = ob.enqueue(session, email(2), key="inside")
        assert before.id  # written inside the savepoint, though enqueued outside it
        savepoint.rollback()
        assert not inside.written
        assert not before.written  # its write was rolled back; it is buffered again
    assert before.duplicate is False
    assert [r.idempotency_key for r in rows(engine)] == ["before"]


def test_reading_a_result_while_its_session_flushes_says_so(engine, ob):
    """A listener that runs ahead of the outbox's own (insert=True on the app's Session class)
    reads a result the flush is about to write: it is told so, and the result is not marked
    as lost."""
    seen: list[str] = []

    class AppSession(Session):
        pass

    @event.listens_for(AppSession, "before_flush", insert=True)
    def early(session, flush_context, instances):
        try:
            result.id  # noqa: B018 - reading it is the test
        except EnqueueNotWritten as exc:
            seen.append(exc.reason)

    with AppSession(engine) as session, session.begin():
        result = ob.enqueue(session, email(1), key="k1")
        session.add(Order(id=1, customer="ada"))
        session.flush()
    assert seen == ["a flush of its session is writing it; read the result after the flush"]
    assert result.duplicate is False


def test_enqueue_in_a_savepoint_a_failed_flush_deactivated_is_refused(Sessions, ob):
    with Sessions() as session, session.begin():
        session.add(Order(id=1, customer="ada"))
        session.flush()
        savepoint = session.begin_nested()
        session.add(Order(id=1, customer="again"))  # the same primary key: the flush fails
        with pytest.raises(sa.exc.IntegrityError):
            session.flush()
        with pytest.raises(sa.exc.InvalidRequestError) as info:
            ob.enqueue(session, email(1), key="k1")
        assert "no longer active" in str(info.value)
        savepoint.rollback()
        kept = ob.enqueue(session, email(2), key="k2")
    assert kept.duplicate is False


def test_a_generated_key_another_transaction_committed_is_a_duplicate(server_backend, ob):
    """A generated key is shown in the result before the flush; if another transaction commits
    it first, the caller still gets a duplicate and commits (MariaDB writes generated keys
    without the named lock, and falls back to it)."""
    Sessions = sessionmaker(server_backend.engine)
    with Sessions() as session, session.begin():
        session.add(Order(id=1, customer="ada"))
        first, second = ob.enqueue_many(session, [email(1), email(2)])
        with Sessions.begin() as other:
            taken = ob.enqueue(other, email(3), key=first.key)
    assert (first.id, first.duplicate) == (taken.id, True)
    assert second.duplicate is False
    assert sorted(r.idempotency_key for r in rows(server_backend.engine)) == sorted(
        [first.key, second.key]
    )


def test_a_batch_over_one_insert_statement_is_still_all_or_nothing(tmp_path, ob):
    """SQLite writes a batch as one INSERT without a savepoint; past 1000 rows SQLAlchemy sends
    several, so the batch takes a savepoint again: a failure in the last leaves none."""
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'pages.db'}")
    enable_savepoints(engine)
    try:
        from outbox.schema import metadata

        metadata.create_all(engine)
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "CREATE TRIGGER refuse BEFORE INSERT ON outbox_messages "
                "WHEN NEW.idempotency_key = 'k1500' BEGIN SELECT RAISE(ABORT, 'refused'); END"
            )
        with Session(engine) as session:
            results = ob.enqueue_many(
                session, [email(n) for n in range(1600)], keys=[f"k{n}" for n in range(1600)]
            )
            with pytest.raises(sa.exc.IntegrityError):
                session.flush()
            assert session.in_transaction()
            session.commit()
        assert not results[0].written
        with engine.connect() as conn:
            count = conn.execute(sa.select(sa.func.count()).select_from(messages)).scalar_one()
        assert count == 0
    finally:
        engine.dispose()
