"""The shared send budget and the relay-id rules, against SQLite, PostgreSQL and MariaDB:
the statements of relay/store.py, and the relay loop in-process where a fault (a starved send
thread, a relay id taken over) can be produced for real.
"""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from outbox.exceptions import ConfigurationError
from outbox.schema import attempts, messages, relays, send_budget, send_budget_lock
from relay import store
from relay.clock import read_database_time
from relay.ratelimit import Booking
from relay.testing import FakeSender, run_until_idle
from tests.support.factories import enqueue
from tests.support.inprocess import relay_for
from tests.support.waiting import wait_for

T0 = datetime(2026, 1, 1, 12, 0, 0, 123456, tzinfo=UTC)


# -- the budget's statements ----------------------------------------------------------------


def test_bookings_round_trip_to_the_microsecond_and_old_ones_are_pruned(backend):
    with backend.engine.begin() as conn:
        conn.execute(sa.delete(send_budget_lock))
        store.lock_send_budget(conn)  # the lock's row is put back when it is missing
        assert conn.execute(sa.select(send_budget_lock.c.id)).scalars().all() == [1]
        store.book_sends(
            conn,
            relay_id="r1",
            bookings=[
                Booking(start=T0, recipients=2, until=T0),
                Booking(start=T0, recipients=3, until=T0),  # same start: one row
                Booking(
                    start=T0 + timedelta(seconds=1.05),
                    recipients=50,
                    until=T0 + timedelta(seconds=5.05),
                ),
            ],
        )
    with backend.engine.begin() as conn:
        store.lock_send_budget(conn)
        assert store.send_bookings(conn, since=T0 - timedelta(seconds=1)) == [
            Booking(start=T0, recipients=5, until=T0),
            Booking(
                start=T0 + timedelta(seconds=1.05),
                recipients=50,
                until=T0 + timedelta(seconds=5.05),
            ),
        ]
        # only a hold that ends after `since` can still matter
        later = store.send_bookings(conn, since=T0)
        assert [b.recipients for b in later] == [50]
        assert store.prune_send_budget(conn, before=T0 + timedelta(seconds=1)) == 1
        rows = conn.execute(sa.select(send_budget.c.relay_id, send_budget.c.recipients)).all()
        assert [tuple(r) for r in rows] == [("r1", 50)]


def test_relays_book_one_at_a_time_and_each_sees_the_bookings_before_it(server_backend):
    """Two connections as two relays: the second waits on the lock until the first commits,
    then reads what the first booked."""
    engine = server_backend.engine
    with engine.begin() as conn:
        store.lock_send_budget(conn)  # the lock's row exists before the race
    first = engine.connect()
    first.begin()
    store.lock_send_budget(first)
    store.book_sends(first, relay_id="first", bookings=[Booking(start=T0, recipients=7, until=T0)])
    seen: list[list[Booking]] = []
    locked_at: list[float] = []

    def second() -> None:
        with engine.begin() as conn:
            store.lock_send_budget(conn)
            locked_at.append(time.monotonic())
            seen.append(store.send_bookings(conn, since=T0 - timedelta(seconds=1)))

    thread = threading.Thread(target=second)
    thread.start()
    time.sleep(0.5)
    assert not locked_at, "the second relay booked while the first held the lock"
    committed = time.monotonic()
    first.commit()
    first.close()
    thread.join(10)
    assert locked_at[0] >= committed
    assert seen == [[Booking(start=T0, recipients=7, until=T0)]]


# -- one relay id, one relay ----------------------------------------------------------------


def db_now(engine: sa.Engine) -> datetime:
    with engine.connect() as conn:
        return read_database_time(conn)


def test_register_refuses_a_live_relays_id_and_takes_over_a_dead_ones_row(backend):
    engine = backend.engine
    now = db_now(engine)
    with engine.begin() as conn:
        assert store.register(conn, relay_id="r", host="h1", pid=1, now=now, dead_after=30) is None
        holder = store.register(conn, relay_id="r", host="h2", pid=2, now=now, dead_after=30)
    assert holder == store.RelayHolder(host="h1", pid=1, heartbeat_at=now, state="running")

    # stopped: free at once
    with engine.begin() as conn:
        store.stop_held(conn, relay_id="r", host="h1", pid=1, started_at=now, now=now)
        assert store.register(conn, relay_id="r", host="h2", pid=2, now=now, dead_after=30) is None
    # a heartbeat older than dead_after: free; a newer one: not yet
    later = now + timedelta(seconds=29)
    with engine.begin() as conn:
        holder = store.register(conn, relay_id="r", host="h3", pid=3, now=later, dead_after=30)
        assert holder is not None
        assert holder.pid == 2
        much_later = now + timedelta(seconds=31)
        assert (
            store.register(conn, relay_id="r", host="h3", pid=3, now=much_later, dead_after=30)
            is None
        )
        row = conn.execute(sa.select(relays).where(relays.c.relay_id == "r")).one()
    assert (row.host, row.pid, row.started_at, row.state) == ("h3", 3, much_later, "running")

    # the relay that looked dead cannot heartbeat or stop its successor's row
    with engine.begin() as conn:
        args = {"relay_id": "r", "host": "h2", "pid": 2, "started_at": now}
        assert not store.heartbeat_held(conn, **args, now=much_later, state="running")
        store.stop_held(conn, **args, now=much_later)
        row = conn.execute(sa.select(relays).where(relays.c.relay_id == "r")).one()
        assert (row.pid, row.state) == (3, "running")
        assert store.heartbeat_held(
            conn,
            relay_id="r",
            host="h3",
            pid=3,
            started_at=much_later,
            now=much_later,
            state="paused",
        )


def test_a_relay_refuses_to_start_under_a_live_relays_id(backend):
    now = db_now(backend.engine)
    with backend.engine.begin() as conn:
        store.register(
            conn, relay_id="budget-relay", host="elsewhere", pid=4242, now=now, dead_after=30
        )
    relay = relay_for(backend, FakeSender(), relay_id="budget-relay", exit_when_idle=True)
    with pytest.raises(ConfigurationError, match="--relay-id") as refused:
        relay.run()
    assert "elsewhere" in str(refused.value)
    assert "pid 4242" in str(refused.value)
    with backend.engine.connect() as conn:
        row = conn.execute(sa.select(relays)).one()
    assert (row.host, row.pid, row.state) == ("elsewhere", 4242, "running")  # untouched


def test_a_relay_whose_id_was_taken_over_stops_and_leaves_the_row_to_its_successor(backend, caplog):
    """The relay looked dead (frozen, cut off) and another took its id: at its next heartbeat
    it finds the row is not its own, and stops instead of sharing it."""
    # lease 5 s: a heartbeat every 1.25 s
    relay = relay_for(backend, FakeSender(), relay_id="budget-relay")
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: relay.loop_at is not None, what="the relay to run")
        now = db_now(backend.engine)
        with backend.engine.begin() as conn:
            conn.execute(
                sa.update(relays)
                .where(relays.c.relay_id == "budget-relay")
                .values(host="successor", pid=7, started_at=now, heartbeat_at=now)
            )
        thread.join(10)
        assert not thread.is_alive(), "the relay did not stop"
    finally:
        relay.request_stop()
        thread.join(10)
    assert "relay_id_taken" in [getattr(r, "action", None) for r in caplog.records]
    with backend.engine.connect() as conn:
        row = conn.execute(sa.select(relays)).one()
    assert (row.host, row.pid, row.state) == ("successor", 7, "running")


# -- the relay loop -------------------------------------------------------------------------


def statements_during(engine: sa.Engine, run) -> list[str]:
    seen: list[str] = []

    def record(conn, cursor, statement, parameters, context, executemany) -> None:
        seen.append(statement)

    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        run()
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)
    return seen


def test_without_a_send_limit_the_budget_is_never_touched(backend):
    enqueue(backend.engine, 5)
    unlimited = statements_during(backend.engine, lambda: run_until_idle(backend.engine))
    assert not [s for s in unlimited if "outbox_send_budget" in s]
    with backend.engine.begin() as conn:  # the same messages again
        conn.execute(sa.delete(attempts))
        conn.execute(sa.delete(messages))
    enqueue(backend.engine, 5)
    limited = statements_during(
        backend.engine, lambda: run_until_idle(backend.engine, max_send_rate=1000.0)
    )
    assert [s for s in limited if "outbox_send_budget" in s]  # the check above means something


def test_a_send_thread_that_starts_too_late_gives_its_message_back_unsent(backend):
    """The relay's send threads are all busy past the send's booked time (a starved pool):
    the send must not start late. The message goes back unsent, with no attempt counted,
    and is sent once later, on time."""
    (mid,) = enqueue(backend.engine, 1)
    sender = FakeSender()
    relay = relay_for(backend, sender, concurrency=1, max_send_rate=100.0)
    gate = threading.Event()
    for _ in range(16):  # every send thread taken, and more work queued before the send
        relay.dispatch.pool.submit(gate.wait, 5)
    assert relay.step()  # claimed, booked, handed to the busy pool
    time.sleep(0.3)  # well past its booked time and what a late start may be
    gate.set()

    def settled() -> bool:
        relay.step()
        with backend.engine.connect() as conn:
            return conn.execute(sa.select(messages.c.status)).scalar_one() == "sent"

    wait_for(settled, what="the message to be sent on time")
    relay.request_stop()
    relay.run()  # drains and deregisters at once
    assert sender.called_ids == [mid]  # once, on its second booking
    with backend.engine.connect() as conn:
        row = conn.execute(sa.select(messages)).one()
        tries = conn.execute(sa.select(attempts).order_by(attempts.c.id)).all()
    assert row.attempt_count == 1  # the give-back used no attempt
    assert [(a.outcome, a.error_code) for a in tries] == [
        ("disabled", "send_slot_missed"),
        ("accepted", None),
    ]
