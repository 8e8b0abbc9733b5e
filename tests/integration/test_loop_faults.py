"""The relay loop against faults that once stopped it, or turned a known outcome into an unknown
one: a payload Python cannot decode, a commit that applied unseen before a drain or a pause, a
provider's answer longer than its column, a finished send the database refuses to save, calls
hung past --send-timeout, exit_when_idle under a pause, and a swept row's late answer finishing
beside its reclaim."""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from outbox import Email
from relay import signals, store, worker
from relay.pause import Scope, ScopeKind
from relay.senders import Accepted, Disabled, OutgoingMessage, Permanent
from relay.testing import FakeSender
from tests.support.db import attempt_rows, row, statuses
from tests.support.factories import enqueue
from tests.support.hand_clocks import Clock
from tests.support.inprocess import (
    OUTBOX,
    HeldSender,
    Run,
    closing,
    receiving,
    relay_for,
    running,
    settle,
)
from tests.support.loop_faults import commit_unseen_once
from tests.support.waiting import wait_for

# -- helpers -------------------------------------------------------------------------------


def sweep_at(engine: sa.Engine, now: datetime) -> list[int]:
    """Another relay's sweep at ``now``: the ids it settled."""
    with engine.begin() as conn:
        swept = store.sweep_expired_leases(conn, now=now, relay_id="sweeper", rng=random.Random())
    return [lease.claim.id for lease, _decision in swept]


# -- payloads Python cannot decode ---------------------------------------------------------

DEEP = "[" * 3000 + "]" * 3000
HUGE_NUMBER = '{"v": 1, "sender": ' + "9" * 5000 + "}"


def write_payload(backend, message_id: int, text: str) -> None:
    """Store ``text`` as the row's payload, as a writer outside the library could."""
    if backend.name == "postgresql":
        update = "UPDATE outbox_messages SET payload = CAST(:p AS json) WHERE id = :i"
    else:
        update = "UPDATE outbox_messages SET payload = :p WHERE id = :i"
    with backend.engine.begin() as conn:
        conn.execute(sa.text(update), {"p": text, "i": message_id})


@pytest.mark.parametrize(
    "payload",
    [pytest.param(DEEP, id="nested-3000-deep"), pytest.param(HUGE_NUMBER, id="5000-digit-number")],
)
def test_a_payload_python_cannot_decode_fails_alone_and_the_loop_goes_on(backend, payload):
    """JSON nested deeper than Python's decoder recurses, or a number longer than Python turns
    into an int: the row fails as invalid_payload, unsent, and the others are sent. (Such a
    row once broke the claim, or the decode after it, and stopped run() on every start.)"""
    ids = enqueue(backend.engine, 4)
    poison = ids[1]
    if backend.name == "mysql" and payload == DEEP:
        # MariaDB's JSON check (json_valid, 32 levels at most) refuses such a row outright:
        # it can never reach the relay there
        with pytest.raises(sa.exc.DBAPIError, match="CONSTRAINT"):
            write_payload(backend, poison, payload)
        payload = HUGE_NUMBER
    write_payload(backend, poison, payload)
    sender = FakeSender()
    run = Run(relay_for(backend, sender, exit_when_idle=True))
    if not run.returned_within(10):
        run.relay.request_stop()
        run.thread.join(10)
        pytest.fail("run() did not exit when idle")
    assert run.errors == []
    assert sorted(sender.called_ids) == [i for i in ids if i != poison]
    r = row(backend.engine, poison)
    assert (r.status, r.last_error_code) == ("failed", "invalid_payload")
    assert [a.outcome for a in attempt_rows(backend.engine, poison)] == ["invalid_payload"]
    assert {statuses(backend.engine)[i] for i in ids if i != poison} == {"sent"}


# -- a commit that applied unseen, then a drain or an account pause ------------------------


def assert_given_back_unsent(backend, ids: list[int], clock: Clock, sender: FakeSender) -> None:
    assert not set(ids) & set(sender.called_ids)
    # long after their lease would have run out, the sweep finds nothing of them
    swept = sweep_at(backend.engine, clock.now + timedelta(hours=1))
    state = statuses(backend.engine)
    assert {i: state[i] for i in ids} == dict.fromkeys(ids, "pending")
    assert swept == []
    for mid in ids:
        r = row(backend.engine, mid)
        assert (r.attempt_count, r.claim_token, r.send_started_at) == (0, None, None)
        assert attempt_rows(backend.engine, mid) == []


def test_claims_committed_unseen_are_given_back_unsent_by_the_drain(backend, monkeypatch):
    """The pass's COMMIT applied (rows claimed and marked as send-started) but the relay saw an
    error; the claims stay queued, unsent. A stop then drains: the rows go back to pending by
    their claim token, no attempt counted, never sent, and no sweep parks them later as
    unknown_outcome. (The give-back once required send_started_at IS NULL and matched none.)"""
    ids = enqueue(backend.engine, 2)
    clock = Clock()
    sender = FakeSender()
    relay = relay_for(backend, sender, clock, concurrency=4)
    commit_unseen_once(relay, monkeypatch)
    assert relay.connection.guard(relay.step) is None  # the pass saw a database error
    for mid in ids:
        r = row(backend.engine, mid)
        assert (r.status, r.send_started_at is not None) == ("processing", True)
    with receiving(signals.released, relay) as released:
        relay.request_stop()
        relay.run()  # a stop before the next pass: the loop ends at once and drains
    assert sorted(s["message_id"] for s in released) == ids
    assert sender.calls == []
    assert_given_back_unsent(backend, ids, clock, sender)
    later = FakeSender()
    with closing(relay_for(backend, later, clock.later(1), relay_id="later")) as next_relay:
        settle(next_relay)
    assert sorted(later.called_ids) == ids


def test_claims_committed_unseen_are_given_back_unsent_by_an_account_pause(backend, monkeypatch):
    """As above, but what gives the claims back is an account pause: a send in flight comes
    back paused while the unseen commit's claims wait. They go back to pending unsent, and
    the sweep finds nothing of them."""
    (first,) = enqueue(backend.engine, 1)
    clock = Clock()
    answer = threading.Event()

    def paused(message: OutgoingMessage):
        answer.wait(10)
        return Disabled(code="AccountSendingPausedException", pause=True)

    sender = FakeSender(paused)
    relay = relay_for(backend, sender, clock, concurrency=4, pause_seconds=30)
    with closing(relay):
        try:
            relay.step()
            wait_for(lambda: sender.calls, what="the first send to start")
            waiting = enqueue(backend.engine, 2)
            clock.advance(1)  # they are due
            commit_unseen_once(relay, monkeypatch)
            assert relay.connection.guard(relay.step) is None  # the pass saw a database error
            for mid in waiting:
                assert row(backend.engine, mid).status == "processing"
            answer.set()
            wait_for(
                lambda: all(f.future.done() for f in relay.dispatch.in_flight.values()),
                what="the paused answer",
            )
            with receiving(signals.released, relay) as released:
                relay.step()  # the answer pauses the relay, which gives back what it holds
        finally:
            answer.set()
    assert relay.paused
    assert relay.pause_code == "AccountSendingPausedException"
    assert sorted(s["message_id"] for s in released) == sorted([first, *waiting])
    assert [m.id for m in sender.calls] == [first]
    r = row(backend.engine, first)
    assert (r.status, r.attempt_count, r.claim_token) == ("pending", 0, None)
    assert_given_back_unsent(backend, waiting, clock, sender)


# -- what the relay cannot save as it is ---------------------------------------------------

LONG_PROVIDER_ID = "ses-" + "".join(f"{n:03d}" for n in range(100))  # 304 characters


def test_a_provider_id_longer_than_its_column_is_saved_cut_and_kept_whole(backend):
    """The provider accepts a message and answers with an id longer than the 255 characters of
    provider_message_id: the row is sent with the id's first 255 characters, the attempt row
    keeps the whole id, and it is delivered once. (The save once failed on PostgreSQL and
    MariaDB; the item was dropped, its lease ran out, and the sweep resent a `resend` message,
    or parked a `hold` one as unknown_outcome.) SQLite keeps any length; the same holds."""
    long_id, short_id = enqueue(backend.engine, 2, outbox=OUTBOX, category="digest")
    sender = FakeSender(
        lambda m: Accepted(
            provider_message_id=LONG_PROVIDER_ID if m.id == long_id else f"ses-{m.id}"
        )
    )
    clock = Clock()
    with closing(relay_for(backend, sender, clock)) as relay:
        settle(relay)
    # long after the lease would have run out, another relay sweeps and claims what is due
    later = FakeSender()
    with closing(relay_for(backend, later, clock.later(3600), relay_id="later")) as other:
        settle(other)
    r = row(backend.engine, long_id)
    assert (r.status, r.provider_message_id) == ("sent", LONG_PROVIDER_ID[:255])
    assert [m.id for m in sender.calls + later.calls].count(long_id) == 1
    (attempt,) = attempt_rows(backend.engine, long_id)
    assert (attempt.outcome, attempt.provider_message_id) == ("accepted", LONG_PROVIDER_ID[:255])
    assert LONG_PROVIDER_ID in attempt.error_message
    assert row(backend.engine, short_id).provider_message_id == f"ses-{short_id}"
    assert set(statuses(backend.engine).values()) == {"sent"}


def test_an_error_code_and_message_longer_than_their_columns_are_saved_cut(backend):
    """A provider refuses a message with a code over the 100 characters of last_error_code and
    a text over what MariaDB's TEXT holds: the failure is saved, both cut, and no sweep finds
    the row later. (The save once failed on PostgreSQL and MariaDB, and the sweep parked a
    known failure as unknown_outcome.)"""
    (mid,) = enqueue(backend.engine, 1)
    code = "Rejected" + "X" * 142  # 150 characters
    text = "refused: " + "y" * 70_000
    sender = FakeSender([Permanent(code=code, message=text)])
    clock = Clock()
    with closing(relay_for(backend, sender, clock)) as relay:
        settle(relay)
    assert sweep_at(backend.engine, clock.now + timedelta(hours=1)) == []
    r = row(backend.engine, mid)
    assert (r.status, r.last_error_code) == ("failed", code[:100])
    assert r.last_error_message
    assert text.startswith(r.last_error_message)
    assert len(r.last_error_message) < len(text)
    (attempt,) = attempt_rows(backend.engine, mid)
    assert (attempt.outcome, attempt.error_code) == ("permanent", code[:100])
    assert len(sender.calls) == 1


@contextlib.contextmanager
def refusing_sent(backend, message_id: int) -> Iterator[None]:
    """While the block runs, the database refuses to move this row to sent, with a data error
    (a trigger): a finished send the relay cannot save, whatever it writes."""
    if backend.name == "postgresql":
        create = [
            "CREATE FUNCTION refuse_sent() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN RAISE EXCEPTION 'refused' USING ERRCODE = '22001'; END $$",
            "CREATE TRIGGER refuse_sent BEFORE UPDATE ON outbox_messages FOR EACH ROW "
            f"WHEN (NEW.status = 'sent' AND OLD.id = {message_id}) EXECUTE FUNCTION refuse_sent()",
        ]
        drop = [
            "DROP TRIGGER IF EXISTS refuse_sent ON outbox_messages",
            "DROP FUNCTION IF EXISTS refuse_sent()",
        ]
    elif backend.name == "mysql":
        create = [
            "CREATE TRIGGER refuse_sent BEFORE UPDATE ON outbox_messages FOR EACH ROW "
            f"BEGIN IF NEW.status = 'sent' AND OLD.id = {message_id} THEN "
            "SIGNAL SQLSTATE '22001' SET MESSAGE_TEXT = 'refused', MYSQL_ERRNO = 1406; "
            "END IF; END"
        ]
        drop = ["DROP TRIGGER IF EXISTS refuse_sent"]
    else:
        create = [
            "CREATE TRIGGER refuse_sent BEFORE UPDATE ON outbox_messages FOR EACH ROW "
            f"WHEN NEW.status = 'sent' AND OLD.id = {message_id} "
            "BEGIN SELECT RAISE(ABORT, 'refused'); END"
        ]
        drop = ["DROP TRIGGER IF EXISTS refuse_sent"]
    with backend.engine.begin() as conn:
        for statement in create:
            conn.exec_driver_sql(statement)
    try:
        yield
    finally:
        with backend.engine.begin() as conn:
            for statement in drop:
                conn.exec_driver_sql(statement)


def test_a_send_that_cannot_be_saved_is_kept_and_its_lease_renewed(backend, monkeypatch):
    """The provider accepted a message but the database refuses the row's move to sent: the
    finished send is kept, its lease renewed, so no sweep turns the known acceptance into
    unknown_outcome; once the database takes it, it is saved, sent once. (Such a send was
    once dropped, and swept.)"""
    monkeypatch.setattr(worker, "STUCK_RETRY", 0.0, raising=False)  # retry on every pass
    (mid,) = enqueue(backend.engine, 1)
    clock = Clock()
    sender = FakeSender()
    with closing(relay_for(backend, sender, clock)) as relay:
        with refusing_sent(backend, mid):
            settle(relay)
            assert row(backend.engine, mid).status == "processing"
            for _ in range(3):
                clock.advance(4)  # past half of the 5 s lease each time
                relay.step()
            # 12 s on: the first lease is long gone, the renewed one is not
            assert sweep_at(backend.engine, clock.now) == []
            r = row(backend.engine, mid)
            assert r.status == "processing"
            assert r.lease_expires_at > clock.now
        relay.step()
    r = row(backend.engine, mid)
    assert (r.status, r.provider_message_id) == ("sent", f"fake-{mid}-1")
    assert [a.outcome for a in attempt_rows(backend.engine, mid)] == ["accepted"]
    assert len(sender.calls) == 1


# -- calls hung past --send-timeout --------------------------------------------------------


def test_a_call_hung_past_send_timeout_holds_no_slot(backend, caplog):
    """Concurrency 1, and the provider call of the first message never returns: past
    --send-timeout it holds no slot (the relay has a spare thread for it), its lease runs
    out and the sweep parks it as unknown_outcome, and the other messages are sent. (The hung
    call once kept the only slot for ever: nothing else was sent.) With every slot hung the
    relay pauses as sender_hung; its probe goes through and sending resumes."""
    ids = enqueue(backend.engine, 4)
    hung, others = ids[0], ids[1:]
    sender = HeldSender()
    sender.hold(hung)
    caplog.set_level(logging.INFO, logger="relay")
    relay = relay_for(
        backend,
        sender,
        concurrency=1,
        batch_size=1,
        send_timeout=1.0,
        lease_seconds=2.5,
        drain_seconds=1.0,
        pause_seconds=0.2,
    )
    with running(relay, sender):
        wait_for(lambda: sender.calls, what="the first call")
        wait_for(
            lambda: all(statuses(backend.engine)[i] == "sent" for i in others),
            what="the other messages to be sent beside the hung call",
        )
        wait_for(
            lambda: statuses(backend.engine)[hung] == "unknown_outcome",
            what="the hung call's row to be swept to unknown_outcome",
        )
    assert row(backend.engine, hung).last_error_code == "lease_expired_after_send_started"
    assert [sender.count(i) for i in ids] == [1, 1, 1, 1]
    actions = [(r.action, getattr(r, "code", None)) for r in caplog.records if hasattr(r, "action")]
    assert ("paused", "sender_hung") in actions
    assert ("resumed", None) in actions


def test_as_many_hung_calls_as_slots_pause_the_relay(backend):
    """Both calls of a relay with concurrency 2 hang past --send-timeout: the relay pauses
    (code sender_hung) and claims nothing more, while the sweep settles the hung rows."""
    hung = enqueue(backend.engine, 2)
    sender = HeldSender()
    sender.hold(*hung)
    relay = relay_for(
        backend,
        sender,
        concurrency=2,
        batch_size=2,
        send_timeout=1.0,
        lease_seconds=2.5,
        drain_seconds=1.0,
        pause_seconds=30,
    )
    with running(relay, sender):
        wait_for(lambda: len(sender.calls) == 2, what="both calls")
        wait_for(lambda: relay.paused, what="the relay to pause with both calls hung")
        assert relay.pause_code == "sender_hung"
        waiting = enqueue(backend.engine, 2)
        wait_for(
            lambda: {statuses(backend.engine)[i] for i in hung} == {"unknown_outcome"},
            what="the hung rows to be swept",
        )
        assert relay.paused
        assert [statuses(backend.engine)[i] for i in waiting] == ["pending", "pending"]
        assert [sender.count(i) for i in waiting] == [0, 0]


# -- exit_when_idle under a pause ----------------------------------------------------------


def test_exit_when_idle_exits_while_only_a_paused_scopes_messages_wait(backend):
    """A sending identity is paused: its message steps back in line until its probe, which is
    not due, so with nothing else due run() exits; the other message was sent. (A pause once
    kept exit_when_idle from ever exiting.)"""
    scope = Scope(ScopeKind.IDENTITY, "example.com")
    held, other = enqueue(
        backend.engine,
        [
            Email(sender=f"shop@{domain}", to=["c@example.net"], subject="s", text="t")
            for domain in ("example.com", "example.org")
        ],
    )
    enqueued_due = row(backend.engine, held).next_attempt_at

    def answer(message: OutgoingMessage):
        if message.id == held:
            return Disabled(code="MailFromDomainNotVerified", pause=True, scope=scope)
        return Accepted(provider_message_id=f"ses-{message.id}")

    sender = FakeSender(answer)
    relay = relay_for(backend, sender, exit_when_idle=True, pause_seconds=10)
    with running(relay) as run:
        assert run.returned_within(5), "run() did not exit with only held messages left"
    assert run.errors == []
    assert relay.pauses.paused(scope)
    assert statuses(backend.engine)[other] == "sent"
    r = row(backend.engine, held)
    assert (r.status, r.attempt_count, r.claim_token) == ("pending", 0, None)
    assert r.next_attempt_at > enqueued_due
    assert sorted(sender.called_ids) == sorted([held, other])


def test_exit_when_idle_exits_when_an_account_probe_finds_nothing_due(backend):
    """The account is paused and its only message is then cancelled: the next probe's claim
    finds nothing due, and run() exits."""
    (mid,) = enqueue(backend.engine, 1)
    sender = FakeSender(lambda m: Disabled(code="AccountSendingPausedException", pause=True))
    relay = relay_for(backend, sender, exit_when_idle=True, pause_seconds=0.5)
    with running(relay) as run:
        wait_for(
            lambda: relay.paused and statuses(backend.engine)[mid] == "pending",
            what="the pause, and the message given back",
        )

        def cancelled() -> bool:
            with backend.engine.begin() as conn:
                return store.cancel(conn, message_id=mid, now=datetime.now(UTC))

        wait_for(cancelled, what="the message to be cancelled")
        assert run.returned_within(5), "run() did not exit with nothing due"
    assert run.errors == []
    assert relay.paused
    assert statuses(backend.engine)[mid] == "cancelled"


# -- a swept row's late answer finishing beside its reclaim --------------------------------


def test_a_stale_call_finishing_beside_its_reclaim_is_recorded_stale_and_signalled_once(backend):
    """A resend message's call runs past --send-timeout; the relay's own sweep settles the row
    and the relay claims it again, so two calls for one id are in flight; both are accepted
    and finish in the same pass. The row holds the second call's answer; the first is
    recorded as stale:accepted, and `sent` fires once. (Both were once taken as applied: two
    attempts `accepted`, two `sent` signals.) Stepped by hand on a clock moved by hand."""
    (mid,) = enqueue(backend.engine, 1, outbox=OUTBOX, category="digest")
    clock = Clock()
    sender = HeldSender()
    answer = sender.hold(mid)  # both calls wait on one event, let go together
    relay = relay_for(backend, sender, clock, concurrency=2, send_timeout=1.0, lease_seconds=5)
    with closing(relay):
        try:
            relay.step()
            wait_for(lambda: sender.calls == [(mid, 1)], what="the first call")
            time.sleep(1.1)  # past --send-timeout, and past the sweep interval
            clock.advance(60)  # the lease is long gone
            relay.step()  # not renewed; the relay's own sweep settles it
            assert row(backend.engine, mid).status == "retrying"
            clock.advance(3600)
            relay.step()  # claimed again
            wait_for(lambda: sender.calls == [(mid, 1), (mid, 2)], what="the second call")
            answer.set()
            wait_for(
                lambda: all(f.future.done() for f in relay.dispatch.in_flight.values()),
                what="both calls to return",
            )
            with (
                receiving(signals.sent, relay) as sent,
                receiving(signals.stale_finalize, relay) as stale,
            ):
                relay.step()  # both saved in one pass
        finally:
            sender.release_all()
    r = row(backend.engine, mid)
    assert (r.status, r.provider_message_id, r.attempt_count) == ("sent", f"ses-{mid}-2", 2)
    assert [(s["message_id"], s["provider_message_id"]) for s in sent] == [(mid, f"ses-{mid}-2")]
    assert [(s["message_id"], s["provider_message_id"]) for s in stale] == [(mid, f"ses-{mid}-1")]
    assert [(a.outcome, a.provider_message_id) for a in attempt_rows(backend.engine, mid)] == [
        ("lease_expired", None),
        ("stale:accepted", f"ses-{mid}-1"),
        ("accepted", f"ses-{mid}-2"),
    ]


@pytest.mark.parametrize("category", [None, "digest"], ids=["hold", "resend"])
def test_a_finished_send_beside_a_pause_is_saved_when_the_give_back_fails(
    backend, monkeypatch, category
):
    """Two sends finish in one pass: the first pauses the account, whose give-back of the
    claims waiting to start meets a dropped connection. The second, accepted by the provider,
    is still saved as sent, once: it stays in flight for the next pass (it was once dropped
    with the pass, its lease left to the sweep: unknown_outcome, or a second send under
    ``resend``). Found by the attack review of the loop's split into services."""
    kw = {"outbox": OUTBOX, "category": category} if category else {}
    ids = enqueue(backend.engine, 4, to=[f"a{i}@example.com" for i in range(6)], **kw)
    gates = {i: threading.Event() for i in ids}

    def script(message: OutgoingMessage) -> Disabled | None:
        gates[message.id].wait(10)
        if message.id == ids[0]:
            return Disabled(code="AccountSendingPaused", message="paused", pause=True)
        return None  # accepted

    clock = Clock()
    sender = FakeSender(script)
    with closing(relay_for(backend, sender, clock, concurrency=4, max_send_rate=6.0)) as relay:
        relay.step()  # the first send in flight, a claim waiting for the budget
        for _ in range(40):
            if len(relay.dispatch.in_flight) >= 2:
                break
            time.sleep(0.1)
            clock.advance(0.1)
            relay.step()
        first, second = sorted(key[0] for key in relay.dispatch.in_flight)
        assert relay.producer.ready, "a claim waits to start, to be given back by the pause"
        for gate in gates.values():
            gate.set()
        wait_for(
            lambda: all(f.future.done() for f in relay.dispatch.in_flight.values()),
            what="both sends to finish",
        )

        def dropped(*args: object, **kwargs: object) -> int:
            raise sa.exc.OperationalError(
                "UPDATE", {}, ConnectionResetError("server closed the connection unexpectedly")
            )

        with monkeypatch.context() as patched:
            patched.setattr(store, "release_unsent", dropped)
            assert relay.connection.guard(relay.step) is None  # the pass saw the drop
        for _ in range(3):
            relay.connection.guard(relay.step)
    r = row(backend.engine, second)
    assert (r.status, r.provider_message_id) == ("sent", f"fake-{second}-1")
    assert [a.outcome for a in attempt_rows(backend.engine, second)] == ["accepted"]
    assert [m.id for m in sender.calls].count(second) == 1
    assert first != second


def test_a_pass_whose_save_and_claim_statement_fails_saves_alone_and_claims_again(
    server_backend,
):
    """The last wave's save fails alone in a pass that also claims (on PostgreSQL the save
    and the claim's read are one statement): the pass rolls back whole, each finished send
    is saved in a transaction of its own, and the due rows are claimed by the next pass;
    every message is sent once and saved once, with its attempt row. (SQLite's error for
    the injected statement reads as an outage, which keeps the batch instead.)"""
    first = enqueue(server_backend.engine, 2)
    sender = FakeSender()
    relay = relay_for(server_backend, sender, concurrency=4)
    failures: list[str] = []

    def fail_once(conn, cursor, statement, parameters, context, executemany):
        if "INSERT INTO outbox_attempts" in statement and not failures:
            failures.append(statement)
            return "SELECT * FROM outbox_no_such_table", parameters  # refused alone
        return statement, parameters

    with closing(relay):
        relay.step()  # claims and sends the first two
        wait_for(lambda: relay.dispatch.pool._work_queue.empty() and len(sender.calls) == 2)
        time.sleep(0.05)
        later = enqueue(server_backend.engine, 2)  # due when the failing pass runs
        sa.event.listen(server_backend.engine, "before_cursor_execute", fail_once, retval=True)
        try:
            settle(relay)
        finally:
            sa.event.remove(server_backend.engine, "before_cursor_execute", fail_once)
    assert len(failures) == 1
    if server_backend.name == "postgresql":
        assert "SKIP LOCKED" in failures[0]  # the save and the claim's read, one statement
    ids = first + later
    assert sorted(sender.called_ids) == sorted(ids)  # each once
    assert {statuses(server_backend.engine)[i] for i in ids} == {"sent"}
    for mid in ids:
        assert [a.outcome for a in attempt_rows(server_backend.engine, mid)] == ["accepted"]
