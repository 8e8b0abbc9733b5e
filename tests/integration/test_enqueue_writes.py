"""Enqueue writes at once, in the session's transaction, one batch per call.

On SQLite, PostgreSQL and MariaDB: the row is on the session's connection when ``enqueue``
returns, its result is known then, a rolled-back transaction or savepoint takes the row with it,
and an ``enqueue_many`` batch is one statement where the database allows it.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import Session, sessionmaker

from outbox import InvalidArgument, InvalidKey, Outbox, signals
from outbox.schema import messages, metadata
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


def test_the_row_is_written_when_enqueue_returns(Sessions, ob):
    with Sessions() as session, session.begin():
        result = ob.enqueue(session, email(1), key="k1")
        assert outbox_count(session) == 1
        assert (result.key, result.duplicate) == ("k1", False)
        assert session.scalar(sa.select(messages.c.id)) == result.id


def test_enqueue_does_not_flush_the_apps_pending_objects(Sessions, ob):
    with Sessions() as session, session.begin():
        order = Order(id=1, customer="ada")
        session.add(order)
        ob.enqueue(session, email(1), key="k1")
        assert order in session.new  # still the app's to flush, when it chooses


def test_rollback_takes_the_row_with_it(engine, Sessions, ob):
    with Sessions() as session:
        session.add(Order(id=1, customer="ada"))
        ob.enqueue(session, email(1), key="k1")
        session.rollback()
        ob.enqueue(session, email(2), key="k2")
        session.commit()
    assert [r.idempotency_key for r in rows(engine)] == ["k2"]


def test_a_rolled_back_savepoint_drops_only_what_was_enqueued_inside_it(engine, Sessions, ob):
    with Sessions() as session, session.begin():
        before = ob.enqueue(session, email(1), key="before")
        nested = session.begin_nested()
        ob.enqueue(session, email(2), key="inside")
        nested.rollback()
        after = ob.enqueue(session, email(3), key="after")
        with session.begin_nested(), session.begin_nested():
            kept = ob.enqueue(session, email(4), key="kept")
    assert [r.idempotency_key for r in rows(engine)] == ["before", "after", "kept"]
    assert [r.id for r in rows(engine)] == [before.id, after.id, kept.id]


def test_a_key_enqueued_again_after_its_savepoint_rolled_back_is_written(engine, Sessions, ob):
    with Sessions() as session, session.begin():
        with session.begin_nested() as nested:
            first = ob.enqueue(session, email(1), key="k1")
            assert first.duplicate is False
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


def test_duplicate_keys_inside_one_batch_and_across_calls(engine, Sessions, ob):
    with Sessions() as session, session.begin():
        first, same, other = ob.enqueue_many(
            session, [email(1), email(1, subject="changed"), email(2)], keys=["a", "a", "b"]
        )
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


def test_enqueue_many_checks_every_email_before_writing_any(engine, Sessions, ob):
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


def test_signals_fire_when_the_row_is_written(Sessions, ob):
    seen: list[tuple[str, bool]] = []

    def record(sender, result, category):
        seen.append((result.key, result.duplicate))

    signals.enqueued.connect(record)
    signals.duplicate_skipped.connect(record)
    try:
        with Sessions() as session, session.begin():
            ob.enqueue_many(session, [email(1), email(1)], keys=["a", "a"])
            assert seen == [("a", False), ("a", True)]
    finally:
        signals.enqueued.disconnect(record)
        signals.duplicate_skipped.disconnect(record)


def test_a_signal_receiver_that_raises_is_logged_and_the_caller_sees_its_result(
    engine, Sessions, ob, caplog
):
    """The row is written when the signal fires: an error raised there would tell the app the
    email was not enqueued while the commit still sends it."""
    later: list[str] = []

    def broken(sender, result, category):
        raise RuntimeError("statsd down")

    def after(sender, result, category):
        later.append(result.key)

    signals.enqueued.connect(broken)
    signals.enqueued.connect(after)
    try:
        with Sessions() as session, session.begin():
            result = ob.enqueue(session, email(1), key="k1")
    finally:
        signals.enqueued.disconnect(broken)
        signals.enqueued.disconnect(after)
    assert later == ["k1"]
    assert [r.id for r in rows(engine)] == [result.id]
    (record,) = [r for r in caplog.records if "action=signal_failed" in r.getMessage()]
    assert "key=k1" in record.getMessage()
    assert "statsd down" in record.exc_text


def test_enqueue_inside_a_flush_event_is_written_in_that_flush(engine, Sessions, ob):
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
    assert results[0].duplicate is False
    assert [r.idempotency_key for r in rows(engine)] == ["order:7"]


def test_rules_and_explicit_enqueues_share_the_keys(engine):
    ob = Outbox()

    @ob.on_insert(Order, name="confirm")
    def confirm(order: Order):
        return email(order.id)

    Sessions = sessionmaker(engine)
    ob.install(Sessions)
    with Sessions() as session, session.begin():
        session.add(Order(id=5, customer="ada"))
        session.flush()
        explicit = ob.enqueue(session, email(5), key="confirm:5")
    assert explicit.duplicate is True
    assert [r.idempotency_key for r in rows(engine)] == ["confirm:5"]


def test_a_session_bound_to_a_connection_writes_in_the_connections_transaction(engine, ob):
    """The app commits the connection's own transaction, not the session's (a Core app that
    makes a Session only to enqueue, or the test-suite pattern)."""
    with engine.connect() as conn:
        transaction = conn.begin()
        result = ob.enqueue(Session(bind=conn), email(1), key="k1")
        transaction.commit()
    assert [r.id for r in rows(engine)] == [result.id]


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
    assert "not active" in str(errors[0])
    assert rows(engine) == []


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
        assert "not active" in str(info.value)
        savepoint.rollback()
        kept = ob.enqueue(session, email(2), key="k2")
    assert kept.duplicate is False


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


def test_a_generated_key_another_transaction_committed_is_a_duplicate(server_backend, ob):
    """MariaDB writes generated keys without the named lock; if another transaction holds one
    (a key the app reused from a result), the batch falls back to the careful path."""
    Sessions = sessionmaker(server_backend.engine)
    with Sessions.begin() as other:
        taken = ob.enqueue(other, email(3))
    with Sessions() as session, session.begin():
        session.add(Order(id=1, customer="ada"))
        entries = ob._entries([email(1), email(2)], None, None, 0, None, None)
        entries[0].row["idempotency_key"] = taken.key  # as if new_key() had repeated itself
        from outbox.session import _write

        first, second = _write(session, entries, None)
    assert (first.id, first.duplicate) == (taken.id, True)
    assert second.duplicate is False
    assert sorted(r.idempotency_key for r in rows(server_backend.engine)) == sorted(
        [taken.key, second.key]
    )


def test_a_batch_over_one_insert_statement_is_still_all_or_nothing(tmp_path, ob):
    """SQLite writes a batch as one INSERT without a savepoint; past 1000 rows SQLAlchemy sends
    several, so the batch takes a savepoint again: a failure in the last leaves none."""
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'pages.db'}")
    enable_savepoints(engine)
    try:
        metadata.create_all(engine)
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "CREATE TRIGGER refuse BEFORE INSERT ON outbox_messages "
                "WHEN NEW.idempotency_key = 'k1500' BEGIN SELECT RAISE(ABORT, 'refused'); END"
            )
        with Session(engine) as session:
            with pytest.raises(sa.exc.IntegrityError):
                ob.enqueue_many(
                    session, [email(n) for n in range(1600)], keys=[f"k{n}" for n in range(1600)]
                )
            assert session.in_transaction()
            session.commit()
        with engine.connect() as conn:
            count = conn.execute(sa.select(sa.func.count()).select_from(messages)).scalar_one()
        assert count == 0
    finally:
        engine.dispose()


def test_async_results_are_known_when_enqueue_returns(backend):
    ob = Outbox()

    async def scenario():
        engine = create_async_engine(backend.async_url)
        enable_savepoints(engine)
        try:
            Sessions = async_sessionmaker(engine, expire_on_commit=False)
            async with Sessions.begin() as session:
                first = await ob.enqueue_async(session, email(1), key="a")
                assert first.duplicate is False  # no flush needed: it is written
                many = await ob.enqueue_many_async(session, [email(1), email(2)], keys=["a", "b"])
            return first, many
        finally:
            await engine.dispose()

    first, many = asyncio.run(scenario())
    assert (many[0].id, many[0].duplicate) == (first.id, True)
    assert many[1].duplicate is False
    assert [r.idempotency_key for r in rows(backend.engine)] == ["a", "b"]
