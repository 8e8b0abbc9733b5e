"""The relay loop in-process, with a FakeSender, on SQLite, PostgreSQL and MariaDB."""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from outbox import Status
from outbox.schema import messages
from relay import signals
from relay.ratelimit import RateController
from relay.senders import Accepted, Ambiguous, Disabled, OutgoingMessage, Permanent, Transient
from relay.testing import FakeSender
from tests.support.db import attempt_rows, row, statuses
from tests.support.factories import enqueue
from tests.support.hand_clocks import Clock
from tests.support.inprocess import OUTBOX, relay_for, settle


def test_run_drains_the_backlog_and_exits_when_idle(backend):
    ids = enqueue(backend.engine, 30)
    sender = FakeSender()
    relay_for(backend, sender, exit_when_idle=True, concurrency=4, batch_size=7).run()
    assert sorted(sender.called_ids) == ids
    assert set(statuses(backend.engine).values()) == {Status.SENT}
    first = row(backend.engine, ids[0])
    assert first.provider_message_id == f"fake-{ids[0]}-1"
    assert (first.attempt_count, first.claim_token, first.lease_expires_at) == (1, None, None)
    assert [a.outcome for a in attempt_rows(backend.engine, ids[0])] == ["accepted"]
    with backend.engine.connect() as conn:
        state = conn.execute(sa.text("SELECT state FROM outbox_relays")).scalar_one()
    assert state == "stopped"


def test_transient_error_is_retried_when_due_then_sent(backend):
    (mid,) = enqueue(backend.engine, 1)
    clock = Clock()
    sender = FakeSender([Transient(code="Throttling", throttled=True)])
    relay = relay_for(backend, sender, clock)
    settle(relay)
    r = row(backend.engine, mid)
    assert (r.status, r.attempt_count, r.last_error_code) == ("retrying", 1, "Throttling")
    assert r.next_attempt_at >= clock.now + timedelta(seconds=1)  # throttling floor
    settle(relay)
    assert len(sender.calls) == 1, "not due yet: no second send"
    clock.advance(3600)
    settle(relay)
    r = row(backend.engine, mid)
    assert (r.status, r.attempt_count) == ("sent", 2)
    assert [c.attempt for c in sender.calls] == [1, 2]
    assert [a.outcome for a in attempt_rows(backend.engine, mid)] == ["transient", "accepted"]


@pytest.mark.parametrize(
    ("outcome", "status", "code"),
    [
        (Permanent(code="MessageRejected", message="bad"), "failed", "MessageRejected"),
        (Ambiguous(code="ReadTimeout"), "unknown_outcome", "ReadTimeout"),
    ],
)
def test_permanent_fails_and_ambiguous_is_held(backend, outcome, status, code):
    (mid,) = enqueue(backend.engine, 1)
    sender = FakeSender([outcome])
    relay = relay_for(backend, sender)
    settle(relay)
    settle(relay)
    r = row(backend.engine, mid)
    assert (r.status, r.last_error_code, r.attempt_count) == (status, code, 1)
    assert len(sender.calls) == 1
    if status == "unknown_outcome":
        assert r.claimed_by == "test-relay"
        assert r.send_started_at is not None


def test_resend_policy_retries_an_ambiguous_send(backend):
    (mid,) = enqueue(backend.engine, 1, outbox=OUTBOX, category="digest")
    clock = Clock()
    sender = FakeSender([Ambiguous(code="ReadTimeout")])
    relay = relay_for(backend, sender, clock)
    settle(relay)
    assert row(backend.engine, mid).status == "retrying"
    clock.advance(3600)
    settle(relay)
    assert row(backend.engine, mid).status == "sent"
    assert len(sender.calls) == 2


def test_disabled_releases_without_counting_an_attempt(backend):
    (mid,) = enqueue(backend.engine, 1)
    before = row(backend.engine, mid)
    sender = FakeSender([Disabled(code="AccountSendingPausedException")])
    relay = relay_for(backend, sender)
    relay.step()
    deadline = time.monotonic() + 5
    while relay.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    relay.finalize()  # finalize without claiming again
    r = row(backend.engine, mid)
    assert (r.status, r.attempt_count, r.claim_token) == ("pending", 0, None)
    assert r.next_attempt_at == before.next_attempt_at
    assert r.last_error_code == "AccountSendingPausedException"


def test_a_sender_that_raises_is_treated_as_ambiguous(backend):
    (mid,) = enqueue(backend.engine, 1)

    def explode(message: OutgoingMessage):
        raise ConnectionResetError("peer reset after the request was written")

    settle(relay_for(backend, FakeSender(explode)))
    r = row(backend.engine, mid)
    assert (r.status, r.last_error_code) == ("unknown_outcome", "sender_exception")


def test_poison_row_fails_and_the_rest_is_delivered(backend):
    ids = enqueue(backend.engine, 5)
    with backend.engine.begin() as conn:
        conn.execute(
            messages.update().where(messages.c.id == ids[2]).values(payload={"v": 1, "to": 7})
        )
    sender = FakeSender()
    relay_for(backend, sender, exit_when_idle=True).run()
    assert sorted(sender.called_ids) == [i for i in ids if i != ids[2]]
    r = row(backend.engine, ids[2])
    assert (r.status, r.last_error_code) == ("failed", "invalid_payload")
    assert "sender" in r.last_error_message
    assert [a.outcome for a in attempt_rows(backend.engine, ids[2])] == ["invalid_payload"]


def test_expired_message_is_never_sent(backend):
    (mid,) = enqueue(backend.engine, 1, expires_at=datetime.now(UTC) + timedelta(seconds=30))
    clock = Clock()
    clock.advance(60)
    seen = []
    signals.expired.connect(lambda sender, **kw: seen.append(kw["message_id"]), weak=False)
    try:
        sender = FakeSender()
        settle(relay_for(backend, sender, clock))
    finally:
        signals.expired.receivers.clear()
    assert sender.calls == []
    assert row(backend.engine, mid).status == "expired"
    assert seen == [mid]


def test_stale_claimant_records_its_attempt_and_leaves_the_row(backend):
    """A relay whose send outlived its lease: another relay sweeps the row to unknown_outcome,
    then the first one's finalize fails its guard, and its provider id is still recorded."""
    (mid,) = enqueue(backend.engine, 1)
    clock = Clock()
    release_send = threading.Event()

    def slow(message: OutgoingMessage):
        release_send.wait(10)
        return Accepted(provider_message_id="ses-late-1")

    first = relay_for(backend, FakeSender(slow), clock, relay_id="first")
    first.step()  # claimed, marked, send in flight
    assert first.in_flight == 1
    clock.advance(60)  # the lease (5 s) is long gone; `first` never got to renew it
    second_clock = Clock()
    second_clock.now = clock.now
    second = relay_for(backend, FakeSender(), second_clock, relay_id="second")
    stale_seen = []
    signals.stale_finalize.connect(lambda s, **kw: stale_seen.append(kw), weak=False)
    try:
        second.step()
        r = row(backend.engine, mid)
        assert (r.status, r.claimed_by, r.last_error_code) == (
            "unknown_outcome",
            "first",
            "lease_expired_after_send_started",
        )
        release_send.set()
        deadline = time.monotonic() + 5
        while first.in_flight and time.monotonic() < deadline:
            first.finalize()
            time.sleep(0.01)
    finally:
        signals.stale_finalize.receivers.clear()
    r = row(backend.engine, mid)
    assert (r.status, r.provider_message_id) == ("unknown_outcome", None)
    outcomes = [
        (a.outcome, a.relay_id, a.provider_message_id) for a in attempt_rows(backend.engine, mid)
    ]
    assert outcomes == [("lease_expired", "first", None), ("stale:accepted", "first", "ses-late-1")]
    assert [s["provider_message_id"] for s in stale_seen] == ["ses-late-1"]


def test_lease_is_extended_while_a_send_is_in_flight(backend):
    (mid,) = enqueue(backend.engine, 1)
    clock = Clock()
    gate = threading.Event()
    relay = relay_for(
        backend, FakeSender(lambda m: (gate.wait(10), Accepted(provider_message_id="x"))[1]), clock
    )
    relay.step()
    first_lease = row(backend.engine, mid).lease_expires_at
    clock.advance(4)  # past half of the 5 s lease
    relay.step()
    assert row(backend.engine, mid).lease_expires_at == clock.now + timedelta(seconds=5)
    assert row(backend.engine, mid).lease_expires_at > first_lease
    gate.set()
    settle(relay)
    assert row(backend.engine, mid).status == "sent"


def test_drain_finishes_sends_in_flight_and_leaves_no_unknown_outcome(backend):
    ids = enqueue(backend.engine, 12)
    sender = FakeSender(latency=0.3)
    relay = relay_for(backend, sender, concurrency=4, drain_seconds=5)
    runner = threading.Thread(target=relay.run)
    runner.start()
    deadline = time.monotonic() + 10
    while not sender.calls and time.monotonic() < deadline:
        time.sleep(0.01)
    relay.request_stop()
    runner.join(10)
    assert not runner.is_alive()
    state = statuses(backend.engine)
    assert "processing" not in state.values()
    assert "unknown_outcome" not in state.values()
    sent = [i for i, s in state.items() if s == "sent"]
    assert sorted(sent) == sorted(sender.called_ids)
    assert 0 < len(sent) < len(ids)
    assert all(state[i] == "pending" for i in ids if i not in sent)


def test_rate_limit_is_never_exceeded_in_any_second(backend):
    enqueue(backend.engine, 25)
    stamps: list[float] = []

    def timed(message: OutgoingMessage):
        stamps.append(time.monotonic())
        return Accepted(provider_message_id="x")

    relay_for(
        backend, FakeSender(timed), exit_when_idle=True, max_send_rate=10, concurrency=8
    ).run()
    assert len(stamps) == 25
    stamps.sort()
    worst = max(sum(1 for t in stamps if s <= t < s + 1.0) for s in stamps)
    assert worst <= 10
    assert stamps[-1] - stamps[0] >= 2.0  # 25 sends at 10/s need more than two seconds


def test_expiry_of_rows_that_are_not_due_yet(backend):
    later = datetime.now(UTC) + timedelta(hours=1)
    (mid,) = enqueue(backend.engine, 1, not_before=later, expires_at=later + timedelta(minutes=1))
    clock = Clock()
    clock.advance(2 * 3600)
    relay = relay_for(backend, FakeSender(), clock)
    relay.step()
    assert row(backend.engine, mid).status == "expired"


def test_relay_survives_its_connections_being_killed(server_backend):
    """The database drops every relay connection mid-run: the relay logs, reconnects and
    delivers everything exactly once."""
    backend = server_backend
    ids = enqueue(backend.engine, 40)
    sender = FakeSender(latency=0.02)
    relay = relay_for(backend, sender, exit_when_idle=True, concurrency=2, batch_size=2)
    runner = threading.Thread(target=relay.run)
    runner.start()
    killer = sa.create_engine(backend.url, poolclass=sa.pool.NullPool)
    kills = 0
    try:
        deadline = time.monotonic() + 30
        while runner.is_alive() and kills < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
            with killer.connect() as conn:
                if backend.name == "postgresql":
                    killed = conn.exec_driver_sql(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                    ).scalar()
                else:
                    own = conn.exec_driver_sql("SELECT CONNECTION_ID()").scalar()
                    rows_ = (
                        conn.exec_driver_sql(
                            "SELECT id FROM information_schema.processlist "
                            f"WHERE db = DATABASE() AND id <> {int(own)}"
                        )
                        .scalars()
                        .all()
                    )
                    for pid in rows_:
                        conn.exec_driver_sql(f"KILL {int(pid)}")
                    killed = len(rows_)
            kills += 1 if killed else 0
        runner.join(60)
    finally:
        killer.dispose()
    assert not runner.is_alive()
    assert kills >= 1
    # A statement whose COMMIT went through while its answer was lost leaves a claim the relay
    # never learned about; the next relay sweeps it once the lease has run out.
    clock = Clock()
    clock.advance(3600)
    relay_for(backend, sender, clock, exit_when_idle=True, relay_id="after").run()
    counts = collections.Counter(sender.called_ids)
    assert max(counts.values()) == 1, "a message was sent twice"
    state = statuses(backend.engine)
    for mid in ids:
        # unknown_outcome is allowed only for a send-started mark whose answer was lost: then
        # the message was never handed to the sender.
        assert state[mid] == "sent" or (state[mid] == "unknown_outcome" and mid not in counts)
    assert sum(1 for s in state.values() if s == "sent") >= len(ids) - kills


def test_pause_releases_without_attempts_and_resumes_by_itself(backend):
    """The provider says sending is paused: the relay gives the message back untouched,
    shows itself paused, probes with one message at a time, and resumes when a send works."""
    ids = enqueue(backend.engine, 6)
    paused = threading.Event()
    paused.set()
    probes: list[int] = []

    def account(message: OutgoingMessage):
        if paused.is_set():
            probes.append(message.id)
            return Disabled(code="AccountSendingPausedException", pause=True)
        return Accepted(provider_message_id=f"ses-{message.id}")

    sender = FakeSender(account)
    relay = relay_for(backend, sender, concurrency=3, pause_seconds=0.2, exit_when_idle=True)
    runner = threading.Thread(target=relay.run)
    runner.start()
    deadline = time.monotonic() + 10
    while len(probes) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert relay.paused
    with backend.engine.connect() as conn:
        assert conn.execute(sa.text("SELECT state FROM outbox_relays")).scalar_one() == "paused"
        attempted = conn.execute(sa.select(sa.func.max(messages.c.attempt_count))).scalar_one()
        assert attempted == 0
    assert set(statuses(backend.engine).values()) <= {"pending", "processing"}
    paused.clear()
    runner.join(15)
    assert not runner.is_alive()
    assert not relay.paused
    assert set(statuses(backend.engine).values()) == {"sent"}
    assert [row(backend.engine, i).attempt_count for i in ids] == [1] * len(ids)
    assert [row(backend.engine, i).provider_message_id for i in ids] == [f"ses-{i}" for i in ids]
    assert len(sender.calls) == len(probes) + len(ids)


def test_the_server_ends_a_transaction_the_relay_left_idle_past_its_lease(server_backend):
    """The relay's loop connection asks the server to end any transaction of its left idle
    longer than the lease: a relay frozen mid-transaction (SIGSTOP, a paused VM) must not hold
    its rows' locks until it wakes. Shown here with a 1-second lease on the same setting."""
    relay = relay_for(server_backend, FakeSender(), lease_seconds=1.0, send_timeout=0.4)
    with relay.connection.transaction() as conn:  # the loop's own connection, as a pass gets it
        conn.execute(sa.select(messages.c.id).limit(1)).all()
    frozen = relay.connection.conn
    assert frozen is not None
    frozen.begin()
    frozen.execute(sa.select(messages.c.id).limit(1)).all()
    time.sleep(2.5)  # "frozen" inside the transaction, past the lease
    with pytest.raises(sa.exc.DBAPIError):
        frozen.execute(sa.select(messages.c.id).limit(1)).all()
    relay.connection.drop()
    with relay.connection.transaction() as conn:  # the next pass starts on a fresh connection
        assert conn.execute(sa.select(sa.literal(1))).scalar() == 1
    relay.connection.drop()


def test_a_sender_or_settings_replaced_on_the_relay_are_what_its_loop_uses(backend):
    """An embedder (or a test) that replaces the relay's sender or settings after building it
    gets them used by every part of the loop, as when the loop read them from the relay at
    each use. Found by the attack review of the loop's split into services: the services kept
    the ones they were built with."""
    ids = enqueue(backend.engine, 3)
    built_with, replaced = FakeSender(), FakeSender()
    relay = relay_for(backend, built_with, concurrency=8, batch_size=50)
    relay.sender = replaced
    relay.config = dataclasses.replace(relay.config, concurrency=1, batch_size=1)
    relay.step()
    assert sum(s != "pending" for s in statuses(backend.engine).values()) == 1
    settle(relay)
    assert built_with.calls == []
    assert sorted(replaced.called_ids) == ids


def test_a_rate_controller_replaced_on_the_relay_is_the_one_throttles_reach(backend):
    """A throttled send slows the rate controller the relay holds now, not the one it was
    built with (found by the second attack review of the split)."""
    (mid,) = enqueue(backend.engine, 1)
    sender = FakeSender(lambda m: Transient(code="Throttling", message="slow", throttled=True))
    relay = relay_for(backend, sender)
    built_with, replaced = relay.rate, RateController(10.0)
    relay.rate = replaced
    settle(relay)
    assert sender.called_ids[:1] == [mid]
    assert built_with.factor == 1.0
    assert replaced.factor < 1.0


def test_a_relay_given_an_engine_in_autocommit_refuses_to_start_and_sends_nothing(backend):
    """The claim reads and locks its rows, then writes them, in one transaction: on an engine
    whose every statement commits by itself the locks would end between the two, and two
    relays could take one message. ``run`` refuses such an engine in one line naming it."""
    from outbox.exceptions import ConfigurationError

    (mid,) = enqueue(backend.engine)
    sender = FakeSender()
    unlocked = backend.engine.execution_options(isolation_level="AUTOCOMMIT")
    relay = relay_for(None, sender, engine=unlocked, url=backend.url, exit_when_idle=True)
    with pytest.raises(ConfigurationError) as refused:
        relay.run()
    assert refused.value.setting == "engine"
    assert "AUTOCOMMIT" in str(refused.value)
    assert sender.calls == []
    assert row(backend.engine, mid).status == Status.PENDING.value
