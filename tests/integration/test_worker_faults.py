"""The relay loop under faults that once stopped it or lost what a provider said: a row erased
while its send was in flight, probes that say nothing, scoped pauses, sends past
--send-timeout, a wall clock stepped back, a database outage longer than the lease, garbage
payloads, a row in flight twice, and a sender that raises on every call."""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import socket
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy import event

from outbox.schema import attempts, messages
from outbox.sqlite import enable_savepoints
from relay import signals, store
from relay.config import RelayConfig
from relay.db import make_engine
from relay.senders import Accepted, Disabled, OutgoingMessage
from relay.testing import FakeSender
from relay.worker import Relay
from tests.support.db import attempt_rows, row, statuses
from tests.support.factories import email, enqueue
from tests.support.hand_clocks import Clock
from tests.support.inprocess import (
    OUTBOX,
    HeldSender,
    closing,
    receiving,
    relay_for,
    running,
    settle,
)
from tests.support.waiting import wait_for

# -- a finished send that cannot be saved ---------------------------------------------------


def relay_engine(backend) -> sa.Engine:
    """The relay's engine. SQLite enforces foreign keys only when asked, per connection, and
    the suite's engines do not ask: without this, an attempt row of a deleted message is
    simply written there and nothing fails."""
    if backend.name != "sqlite":
        return backend.engine
    engine = sa.create_engine(backend.url)
    enable_savepoints(engine)

    @event.listens_for(engine, "connect")
    def _foreign_keys(dbapi_connection, _record):
        dbapi_connection.execute("PRAGMA foreign_keys = ON")

    return engine


def test_a_send_whose_row_was_erased_in_flight_is_set_aside_and_the_relay_goes_on(backend, caplog):
    """A row deleted (a GDPR erase) while its send was in flight cannot take its attempt row
    (foreign key): that one is set aside, logged with the provider's id, and the send that
    finished beside it, and everything enqueued later, are saved and sent."""
    engine = relay_engine(backend)
    erased, kept = enqueue(backend.engine, 2)
    sender = HeldSender()
    gate = sender.hold(erased, kept)
    relay = relay_for(backend, sender, concurrency=4)
    relay.engine = engine
    caplog.set_level(logging.ERROR, logger="relay")
    try:
        with receiving(signals.save_failed) as set_aside, running(relay, sender):
            wait_for(lambda: len(sender.calls) == 2, what="both sends in flight")
            with backend.engine.begin() as conn:
                conn.execute(attempts.delete().where(attempts.c.message_id == erased))
                conn.execute(messages.delete().where(messages.c.id == erased))
            gate.set()
            wait_for(
                lambda: statuses(backend.engine).get(kept) == "sent",
                what="the send finished beside the erased one to be saved",
            )
            later = enqueue(backend.engine, 3)
            wait_for(
                lambda: all(statuses(backend.engine).get(i) == "sent" for i in later),
                what="messages enqueued after the erase to be sent",
            )
    finally:
        if engine is not backend.engine:
            engine.dispose()
    assert row(backend.engine, kept).provider_message_id == f"ses-{kept}-1"
    assert [a.outcome for a in attempt_rows(backend.engine, kept)] == ["accepted"]
    assert erased not in statuses(backend.engine)
    assert attempt_rows(backend.engine, erased) == []
    assert relay.set_aside == 1
    assert [(s["message_id"], s["provider_message_id"], s["outcome"]) for s in set_aside] == [
        (erased, f"ses-{erased}-1", "accepted")
    ]
    logged = [r for r in caplog.records if getattr(r, "action", None) == "save_failed"]
    assert [(r.message_id, r.provider_message_id) for r in logged] == [(erased, f"ses-{erased}-1")]


def test_a_drain_saves_the_other_sends_when_one_row_was_erased(backend):
    """The same erase, with the relay draining (a deploy) when both sends finish: the drain
    saves the other send at once and deals with the erased one as the loop does, instead of
    retrying the failing batch until its deadline and leaving the other send's lease to run
    out (the sweep would park a known send as unknown_outcome)."""
    engine = relay_engine(backend)
    erased, kept = enqueue(backend.engine, 2)
    sender = HeldSender()
    gate = sender.hold(erased, kept)
    relay = relay_for(backend, sender, concurrency=4, drain_seconds=5)
    relay.engine = engine
    try:
        with running(relay, sender) as runner:
            wait_for(lambda: len(sender.calls) == 2, what="both sends in flight")
            with backend.engine.begin() as conn:
                conn.execute(attempts.delete().where(attempts.c.message_id == erased))
                conn.execute(messages.delete().where(messages.c.id == erased))
            relay.request_stop()
            wait_for(lambda: relay.state == "draining", what="the drain to begin")
            gate.set()
            stopped = time.monotonic()
            runner.join(10)
            drained_in = time.monotonic() - stopped
    finally:
        if engine is not backend.engine:
            engine.dispose()
    assert statuses(backend.engine) == {kept: "sent"}
    assert drained_in < 2, f"the drain ran {drained_in:.1f}s, to its deadline"


# -- pauses ------------------------------------------------------------------------------


@pytest.mark.parametrize("code", ["lease_lost", "disabled"])
def test_a_probe_answered_by_a_non_pausing_disabled_does_not_leave_the_relay_paused(backend, code):
    """The probe of a paused relay comes back Disabled without a pause (the relay's own
    lease_lost, or a custom sender switched off): that says nothing about the provider, so the
    next message probes at once, and when it is accepted sending resumes."""
    ids = enqueue(backend.engine, 5)
    sender = HeldSender(
        outcomes=[Disabled(code="AccountSendingPausedException", pause=True), Disabled(code=code)]
    )
    relay = relay_for(backend, sender, concurrency=1, pause_seconds=0.2, exit_when_idle=True)
    with running(relay, sender) as runner:
        runner.join(5)
        assert not runner.is_alive(), f"still paused ({relay.pause_code}) after the probe"
    assert set(statuses(backend.engine).values()) == {"sent"}
    assert [row(backend.engine, i).attempt_count for i in ids] == [1] * len(ids)
    assert len(sender.calls) == len(ids) + 2
    assert not relay.paused


SCOPED = [
    pytest.param(
        {"configuration_set": "marketing"},
        ("configuration_set", "marketing"),
        "ConfigurationSetSendingPausedException",
        id="configuration-set",
    ),
    pytest.param(
        {"sender": "promo@example.com"},
        ("identity", "promo@example.com"),
        "AccessDenied",
        id="identity",
    ),
]


@pytest.mark.parametrize(("special", "scope_of", "code"), SCOPED)
def test_a_scoped_pause_holds_only_its_own_messages(backend, special, scope_of, code):
    """One configuration set (or sending identity) is paused: the other 19 messages are sent,
    the paused one waits for its probe (at most one call per pause period), steps back in line
    without losing an attempt, and is sent once its scope works again."""
    from relay.pause import Scope, ScopeKind

    scope = Scope(ScopeKind(scope_of[0]), scope_of[1])
    pause_seconds = 0.4
    emails = [email(n, short=True) for n in range(20)]
    emails[5] = email(5, short=True, **special)
    ids = enqueue(backend.engine, emails, outbox=OUTBOX)
    paused_id = ids[5]
    enqueued_due = row(backend.engine, paused_id).next_attempt_at
    refusing = threading.Event()
    refusing.set()

    def answer(m: OutgoingMessage):
        if m.id == paused_id and refusing.is_set():
            return Disabled(code=code, pause=True, scope=scope)
        return Accepted(provider_message_id=f"ses-{m.id}-{m.attempt}")

    sender = HeldSender(answer)
    relay = relay_for(
        backend,
        sender,
        concurrency=4,
        batch_size=4,
        pause_seconds=pause_seconds,
    )
    with running(relay, sender):
        others = [i for i in ids if i != paused_id]
        wait_for(
            lambda: all(statuses(backend.engine).get(i) == "sent" for i in others),
            what="the 19 messages outside the paused scope to be sent",
        )
        assert relay.pauses.paused(scope)
        assert not relay.paused  # the account is not paused
        wait_for(
            lambda: len(sender.times(paused_id)) >= 3,
            what="two probes of the paused scope",
            timeout=6,
        )
        held = wait_for(
            lambda: (r := row(backend.engine, paused_id)).status in ("pending", "retrying") and r,
            what="the paused message back in line between probes",
        )
        assert (held.attempt_count, held.claim_token) == (0, None)
        assert held.next_attempt_at > enqueued_due
        assert held.last_error_code == code
        calls = sender.times(paused_id)
        gaps = [b - a for a, b in itertools.pairwise(calls)]
        assert min(gaps) >= 0.9 * pause_seconds, f"probes closer than the pause: {gaps}"
        refusing.clear()
        wait_for(
            lambda: statuses(backend.engine).get(paused_id) == "sent", what="the scope to resume"
        )
        wait_for(lambda: not relay.pauses, what="the pause to end")
    assert set(statuses(backend.engine).values()) == {"sent"}
    done = row(backend.engine, paused_id)
    assert (done.attempt_count, done.provider_message_id) == (1, f"ses-{paused_id}-1")
    assert {len(sender.times(i)) for i in others} == {1}


def test_a_sender_that_raises_on_every_call_pauses_after_three(backend):
    """A custom sender with a bug raises on every call: three sends become unknown_outcome,
    then the relay pauses instead of burning the whole queue into unknown_outcome."""
    enqueue(backend.engine, 8)

    def broken(message: OutgoingMessage):
        raise RuntimeError("bug in a custom sender")

    sender = FakeSender(broken)
    relay = relay_for(backend, sender, concurrency=1, pause_seconds=30)
    with running(relay):
        wait_for(lambda: len(sender.calls) >= 3, what="three sends")
        time.sleep(0.5)  # time enough to burn the rest, were the relay still sending
        assert collections.Counter(statuses(backend.engine).values()) == {
            "unknown_outcome": 3,
            "pending": 5,
        }
        assert len(sender.calls) == 3
        assert relay.paused
        assert relay.pause_code == "sender_exception"


def test_a_sender_that_keeps_raising_stays_paused_with_one_probe_per_period(backend, caplog):
    """Once paused for raising, the relay probes once per pause period; a probe that raises
    again keeps the pause (it does not resume and burn more messages into unknown_outcome)."""
    enqueue(backend.engine, 20)

    def broken(message: OutgoingMessage):
        raise RuntimeError("bug in a custom sender")

    pause_seconds = 0.3
    sender = FakeSender(broken)
    relay = relay_for(backend, sender, concurrency=1, pause_seconds=pause_seconds)
    caplog.set_level(logging.WARNING, logger="relay")
    with running(relay):
        wait_for(lambda: relay.paused, what="the pause after three exceptions")
        paused_at = time.monotonic()
        unpaused = 0
        while time.monotonic() - paused_at < 4 * pause_seconds:
            unpaused += not relay.paused
            time.sleep(0.005)
        calls = len(sender.calls)
    resumed = [r for r in caplog.records if getattr(r, "action", None) == "resumed"]
    assert resumed == [], "a probe that raised was taken for a sign that sending works"
    assert unpaused == 0
    assert calls <= 3 + 4 + 1, f"{calls} calls: more than one probe per pause period"
    unknown = collections.Counter(statuses(backend.engine).values())["unknown_outcome"]
    assert unknown == len(sender.calls)  # each probe costs the message it was sent with


# -- time ------------------------------------------------------------------------------------


def test_a_send_past_its_timeout_is_left_to_the_sweep_and_its_late_result_recorded(backend):
    """A call runs past --send-timeout: its lease is no longer renewed, the sweep parks the row
    as unknown_outcome (category policy hold), and when the call finally returns its answer is
    kept as a stale attempt with the provider's id, the row untouched."""
    (mid,) = enqueue(backend.engine, 1)
    assert row(backend.engine, mid).ambiguity_policy == "hold"
    sender = HeldSender()
    late = sender.hold(mid)
    relay = relay_for(backend, sender, send_timeout=1.0, lease_seconds=2.5)
    with running(relay, sender):
        wait_for(lambda: sender.calls, what="the send to start")
        wait_for(
            lambda: row(backend.engine, mid).status == "unknown_outcome",
            what="the overdue send to be swept to unknown_outcome",
        )
        parked = row(backend.engine, mid)
        assert parked.last_error_code == "lease_expired_after_send_started"
        late.set()
        wait_for(lambda: len(attempt_rows(backend.engine, mid)) == 2, what="the late result")
    r = row(backend.engine, mid)
    assert (r.status, r.provider_message_id, r.attempt_count) == ("unknown_outcome", None, 1)
    assert r.updated_at == parked.updated_at
    assert [(a.outcome, a.provider_message_id) for a in attempt_rows(backend.engine, mid)] == [
        ("lease_expired", None),
        ("stale:accepted", f"ses-{mid}-1"),
    ]


def test_read_database_time_is_the_servers_clock(backend):
    from relay.clock import read_database_time

    with backend.engine.connect() as conn:
        before = datetime.now(UTC)
        value = read_database_time(conn)
        after = datetime.now(UTC)
    assert value.tzinfo is UTC
    assert before - timedelta(seconds=1) <= value <= after + timedelta(seconds=1)


def test_a_wall_clock_stepped_back_does_not_stop_the_sweep(backend):
    """An NTP step sets the relay's clock back an hour: sweeps still run every second (the
    interval is measured on the monotonic clock), so a dead relay's row is still rescued."""
    clock = Clock()
    sender = FakeSender()
    relay = relay_for(backend, sender, clock)
    with closing(relay):
        relay.step()  # the first pass sweeps (nothing yet)
        (mid,) = enqueue(backend.engine, 1)
        long_ago = clock.now - timedelta(hours=3)
        with backend.engine.begin() as conn:
            conn.execute(
                messages.update().where(messages.c.id == mid).values(next_attempt_at=long_ago)
            )
            claims, _ = store.claim_batch(
                conn, relay_id="dead", limit=1, now=long_ago, lease_seconds=5
            )
        assert [c.id for c in claims] == [mid]
        clock.advance(-3600)  # the step back; the dead relay's lease ran out long before
        time.sleep(1.1)
        settle(relay)
    assert sender.called_ids == [mid]
    assert row(backend.engine, mid).status == "sent"


# -- a database outage longer than the lease -----------------------------------------------


class TcpProxy:
    """Forwards a local port to a database server. ``cut()`` drops every connection and stops
    listening (new connections are refused) until ``restore()`` listens on the same port."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.port = 0
        self._listening = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self.restore()

    def restore(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        listener.settimeout(0.05)
        self.port = listener.getsockname()[1]
        self._listening.set()
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        self._listening.clear()
        time.sleep(0.1)  # the accept loop closes its listener
        with self._lock:
            doomed, self._sockets = self._sockets, []
        for sock in doomed:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        with listener:
            while self._listening.is_set():
                try:
                    client, _ = listener.accept()
                except TimeoutError:
                    continue
                client.settimeout(None)
                try:
                    server = socket.create_connection(self.upstream)
                except OSError:
                    client.close()
                    continue
                with self._lock:
                    self._sockets += [client, server]
                for src, dst in ((client, server), (server, client)):
                    threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


def test_after_an_outage_longer_than_the_lease_a_relay_saves_its_sends_first(
    server_backend, monkeypatch
):
    """The database is unreachable for longer than the lease while the provider accepts the
    relay's sends: when it is back, the relay saves them as sent, and sweeps none of them."""
    backend = server_backend
    ids = enqueue(backend.engine, 4)
    url = sa.make_url(backend.url)
    proxy = TcpProxy(
        url.host or "127.0.0.1", url.port or {"postgresql": 5432}.get(backend.name, 3306)
    )
    engine = make_engine(url.set(host="127.0.0.1", port=proxy.port))
    sender = HeldSender()
    gate = sender.hold(*ids)
    relay = Relay(
        engine=engine,
        sender=sender,
        config=RelayConfig(
            database_url=backend.url,
            relay_id="through-the-outage",
            concurrency=4,
            lease_seconds=3.0,
            send_timeout=1.0,
            drain_seconds=5.0,
            poll_interval=0.05,
        ),
    )
    monkeypatch.setattr(relay.connection, "backoff", lambda: 0.1)  # reconnect soon after it is back
    try:
        with running(relay, sender):
            wait_for(lambda: len(sender.calls) == 4, what="four sends in flight")
            proxy.cut()
            gate.set()  # the provider accepts all four while the database is gone
            wait_for(lambda: len(sender.returned) == 4, what="the sends to return")
            time.sleep(4.0)  # longer than the 3 s lease
            proxy.restore()
            wait_for(
                lambda: "processing" not in statuses(backend.engine).values(),
                what="the relay to settle its sends",
                timeout=10,
            )
    finally:
        proxy.cut()
        engine.dispose()
    assert collections.Counter(statuses(backend.engine).values()) == {"sent": 4}
    for mid in ids:
        assert row(backend.engine, mid).provider_message_id == f"ses-{mid}-1"
    outcomes = collections.Counter(
        a.outcome for mid in ids for a in attempt_rows(backend.engine, mid)
    )
    assert outcomes == {"accepted": 4}


# -- payloads and claims -------------------------------------------------------------------


def test_a_payload_that_is_not_an_email_fails_alone(backend):
    """SQLite stores any text in the JSON column: a row edited into garbage must fail as
    invalid_payload, not break the claim that reads it. PostgreSQL and MariaDB refuse text
    that is not JSON; there, valid JSON that is not an email."""
    ids = enqueue(backend.engine, 4)
    poison = ids[1]
    garbage = "not json{" if backend.name == "sqlite" else "[1, 2]"
    with backend.engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE outbox_messages SET payload = :payload WHERE id = :id"),
            {"payload": garbage, "id": poison},
        )
    sender = FakeSender()
    relay_for(backend, sender, exit_when_idle=True).run()
    assert sorted(sender.called_ids) == [i for i in ids if i != poison]
    r = row(backend.engine, poison)
    assert (r.status, r.last_error_code, r.attempt_count) == ("failed", "invalid_payload", 1)
    assert [a.outcome for a in attempt_rows(backend.engine, poison)] == ["invalid_payload"]


def test_a_row_swept_and_reclaimed_while_its_first_call_runs_keeps_both_results(backend):
    """A resend-category row whose lease ran out mid-call is swept and claimed again by the
    same relay while the first call still runs: both calls are in flight under one id, and
    both answers are recorded (the first as stale, with its provider id), nothing lost."""
    (mid,) = enqueue(backend.engine, 1, outbox=OUTBOX, category="digest")
    clock = Clock()
    sender = HeldSender()
    first_call = sender.hold((mid, 1))
    second_call = sender.hold((mid, 2))
    relay = relay_for(backend, sender, clock, relay_id="holder")
    sweeper_clock = Clock()
    sweeper = relay_for(backend, FakeSender(), sweeper_clock, relay_id="sweeper")
    with closing(relay), closing(sweeper):
        try:
            relay.step()
            wait_for(lambda: len(sender.calls) == 1, what="the first call")
            clock.advance(60)  # the 5 s lease ran out without a renewal
            sweeper_clock.now = clock.now
            sweeper.step()
            assert row(backend.engine, mid).status == "retrying"  # resend: due after backoff
            clock.advance(3600)
            relay.step()  # the holder claims it again: a second call for the same id
            wait_for(lambda: len(sender.calls) == 2, what="the second call")

            first_call.set()
            wait_for(
                lambda: (
                    relay.step() is not None
                    and any(
                        a.outcome == "stale:accepted" for a in attempt_rows(backend.engine, mid)
                    )
                ),
                what="the first call's answer to be recorded",
            )
            second_call.set()
            settle(relay)
        finally:
            sender.release_all()
    r = row(backend.engine, mid)
    assert (r.status, r.provider_message_id, r.attempt_count) == ("sent", f"ses-{mid}-2", 2)
    assert [(a.outcome, a.provider_message_id) for a in attempt_rows(backend.engine, mid)] == [
        ("lease_expired", None),
        ("stale:accepted", f"ses-{mid}-1"),
        ("accepted", f"ses-{mid}-2"),
    ]


def test_text_a_sender_returns_that_no_column_stores_is_escaped_not_left_unsaved(backend):
    """A provider id or an error text with a NUL (PostgreSQL text refuses it) or a lone
    surrogate: the outcome is saved with the value escaped (the id whole in the message), never
    left unsaved for the sweep to park an accepted send as ambiguous."""
    ids = enqueue(backend.engine, 3)

    def odd(message: OutgoingMessage):
        if message.id == ids[0]:
            return Accepted(provider_message_id="id\x00tail")
        if message.id == ids[1]:
            return Accepted(provider_message_id="id\udcfftail")
        raise RuntimeError("broken \x00 sender")

    relay = relay_for(backend, FakeSender(odd))
    settle(relay)
    assert statuses(backend.engine) == {
        ids[0]: "sent",
        ids[1]: "sent",
        ids[2]: "unknown_outcome",
    }
    first, second = row(backend.engine, ids[0]), row(backend.engine, ids[1])
    assert first.provider_message_id == "id\\x00tail"
    assert second.provider_message_id == "id\\udcfftail"
    (accepted,) = attempt_rows(backend.engine, ids[0])
    assert accepted.error_message.startswith("provider message id: id\\x00tail")
    (failed,) = attempt_rows(backend.engine, ids[2])
    assert "\\x00" in failed.error_message
