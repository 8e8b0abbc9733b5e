"""An attack review of the merged pass: on PostgreSQL a busy pass runs the last wave's
sent saves (the guarded finalize and the attempt rows, as CTEs) inside the claim's locking
read, one statement (``store.save_and_lock``). These drive it with real faults: a message
deleted under its save (a real FK violation of the attempt INSERT) beside a retry decision
and due rows; the relay's backend killed at the combined statement; the COMMIT of such a
pass applied unseen; and three relays racing. Each message must be sent once and saved
once."""

from __future__ import annotations

import time
from collections import Counter

import sqlalchemy as sa

from relay.senders import Accepted, Transient
from relay.testing import FakeSender
from tests.support.db import attempt_rows, statuses
from tests.support.factories import enqueue
from tests.support.inprocess import closing, relay_for, running, settle
from tests.support.loop_faults import commit_unseen_once
from tests.support.waiting import wait_for

COMBINED = ("SKIP LOCKED", "INSERT INTO outbox_attempts")


def _combined(statement: str) -> bool:
    return all(part in statement for part in COMBINED)


def _idle(relay, sender, n):
    wait_for(lambda: relay.dispatch.pool._work_queue.empty() and len(sender.calls) == n)
    time.sleep(0.05)


def _step_through_outages(relay, steps: int = 300) -> None:
    for _ in range(steps):
        try:
            busy = relay.step()
        except sa.exc.OperationalError:
            time.sleep(0.02)
            continue
        if not busy and relay.in_flight == 0 and not relay.completer.unsaved:
            return
        time.sleep(0.005)
    raise AssertionError("relay did not settle")


def test_a_deleted_message_in_the_combined_save_beside_a_retry_and_due_rows(postgres_backend):
    engine = postgres_backend.engine
    gone, kept, flaky = enqueue(engine, 3, prefix="first")
    tries: Counter[int] = Counter()

    def script(message):
        tries[message.id] += 1
        if message.id == flaky and tries[message.id] == 1:
            return Transient(code="throttled_once")
        return Accepted(provider_message_id=f"ses-{message.id}-{message.attempt}")

    sender = FakeSender(script)
    relay = relay_for(postgres_backend, sender, concurrency=8)
    statements: list[str] = []

    def record(*a):
        statements.append(a[2])

    sa.event.listen(engine, "before_cursor_execute", record)
    try:
        with closing(relay):
            relay.step()
            _idle(relay, sender, 3)
            with engine.begin() as conn:  # an operator deletes it while its result waits
                conn.execute(sa.text("DELETE FROM outbox_messages WHERE id = :i"), {"i": gone})
            later = enqueue(engine, 2, prefix="later")
            statements.clear()
            settle(relay)
            stuck = list(relay.completer.stuck)
    finally:
        sa.event.remove(engine, "before_cursor_execute", record)
    assert any(_combined(s) for s in statements), "the combined statement never ran"
    called = Counter(m.id for m in sender.calls)
    assert called[gone] == 1
    assert called[kept] == 1
    assert all(called[i] == 1 for i in later), called
    state = statuses(engine)
    assert gone not in state
    assert {state[i] for i in [kept, *later]} == {"sent"}
    assert [a.outcome for a in attempt_rows(engine, kept)] == ["accepted"]
    for mid in later:
        assert [a.outcome for a in attempt_rows(engine, mid)] == ["accepted"]
    assert next(a.outcome for a in attempt_rows(engine, flaky)) != "accepted"
    assert stuck == []


def test_the_relays_backend_killed_at_the_combined_statement(postgres_backend):
    engine = postgres_backend.engine
    first = enqueue(engine, 3, prefix="first")
    sender = FakeSender()
    relay = relay_for(postgres_backend, sender, concurrency=8)
    killed: list[int] = []

    def kill(conn, cursor, statement, parameters, context, executemany):
        if _combined(statement) and not killed:
            pid = conn.connection.dbapi_connection.info.backend_pid
            killed.append(pid)
            other_engine = sa.create_engine(postgres_backend.url)
            try:
                with other_engine.connect() as other:
                    other.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid})
                    other.commit()
            finally:
                other_engine.dispose()

    with closing(relay):
        relay.step()
        _idle(relay, sender, 3)
        later = enqueue(engine, 3, prefix="later")
        sa.event.listen(engine, "before_cursor_execute", kill)
        try:
            _step_through_outages(relay)
        finally:
            sa.event.remove(engine, "before_cursor_execute", kill)
        settle(relay)
    assert killed, "the combined statement never ran"
    ids = first + later
    assert Counter(sender.called_ids) == Counter(ids)
    assert {statuses(engine)[i] for i in ids} == {"sent"}
    for mid in ids:
        assert [a.outcome for a in attempt_rows(engine, mid)] == ["accepted"], mid


def test_a_combined_pass_whose_commit_applied_unseen(postgres_backend, monkeypatch):
    engine = postgres_backend.engine
    first = enqueue(engine, 2, prefix="first")
    sender = FakeSender()
    relay = relay_for(postgres_backend, sender, concurrency=8)
    with closing(relay):
        relay.step()
        _idle(relay, sender, 2)
        later = enqueue(engine, 2, prefix="later")
        commit_unseen_once(relay, monkeypatch)
        _step_through_outages(relay)
        settle(relay)
    ids = first + later
    called = Counter(sender.called_ids)
    assert all(called[i] <= 1 for i in ids), called  # never twice
    state = statuses(engine)
    # every message sent, or visibly parked; none pending forever unsent
    assert {state[i] for i in first} == {"sent"}
    assert next(a.outcome for a in attempt_rows(engine, first[0])) == "accepted"
    assert {state[i] for i in later} == {"sent"}
    assert all(called[i] == 1 for i in later), called


def test_three_relays_race_with_combined_passes(postgres_backend):
    engine = postgres_backend.engine
    ids = enqueue(engine, 300, prefix="race", per_transaction=50)
    sender = FakeSender(latency=0.002)
    relays = [
        relay_for(postgres_backend, sender, relay_id=f"r{k}", concurrency=8, batch_size=10)
        for k in range(3)
    ]
    with running(relays[0]), running(relays[1]), running(relays[2]):
        wait_for(lambda: set(statuses(engine).values()) == {"sent"}, timeout=60, what="all sent")
        time.sleep(0.3)
    assert Counter(sender.called_ids) == Counter(ids)
    with engine.connect() as conn:
        per = conn.execute(
            sa.text(
                "SELECT message_id, count(*), min(outcome), max(outcome) "
                "FROM outbox_attempts GROUP BY message_id"
            )
        ).all()
    assert len(per) == len(ids)
    assert {(n, lo, hi) for _m, n, lo, hi in per} == {(1, "accepted", "accepted")}


def test_the_combined_statement_with_held_keys_skips_them_and_saves(postgres_backend):
    """save_and_lock with skip_keys (the c_skip expanding list inside the CTE statement)."""
    from datetime import UTC, datetime, timedelta

    from relay import store

    engine = postgres_backend.engine
    (held,) = enqueue(engine, 1, prefix="held", fairness_key="K")
    (free,) = enqueue(engine, 1, prefix="free", fairness_key="L")
    (saving,) = enqueue(engine, 1, prefix="saving")
    now = datetime.now(UTC) + timedelta(seconds=5)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE outbox_messages SET status='processing', claim_token='t1', "
                "send_started_at=:n WHERE id=:i"
            ),
            {"n": now, "i": saving},
        )
    rec = store.AttemptRecord(
        message_id=saving, claim_token="t1", relay_id="x", started_at=now, finished_at=now,
        outcome="accepted", provider_message_id="ses-1",
    )  # fmt: skip
    save = store.SentSave([(saving, "t1", "ses-1")], [(rec, True)], now)
    with engine.begin() as conn:
        moved, taking = store.save_and_lock(
            conn, save, relay_id="x", limit=10, now=now, lease_seconds=30, skip_keys=["K"]
        )
        store.take_batch(conn, taking, mark=[], now=now)
    assert moved == {(saving, "t1")}
    assert [c.id for c in taking.claims] == [free]
    assert statuses(engine)[held] == "pending"
    assert [a.outcome for a in attempt_rows(engine, saving)] == ["accepted"]
