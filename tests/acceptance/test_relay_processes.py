"""Real ``outbox-relay run`` processes against PostgreSQL and MariaDB: several replicas share a
backlog without sending anything twice; SIGTERM drains; a second signal exits at once; a
SIGKILL mid-send leaves rows the next relay parks as unknown_outcome instead of resending."""

from __future__ import annotations

import signal
import time
from collections import Counter
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

from outbox.schema import messages
from tests.support.db import attempt_rows
from tests.support.factories import enqueue
from tests.support.relays import (
    in_flight_ids,
    message_rows,
    read_records,
    relay_rows,
    sleep_until,
    statuses,
)
from tests.support.waiting import wait_for

FAST = ("--poll-interval", "0.2", "--log-level", "WARNING")


def test_three_relays_share_a_backlog_and_send_each_message_exactly_once(server_backend, relays):
    engine = server_backend.engine
    ids = enqueue(engine, 2000, prefix="acceptance", per_transaction=500)
    procs = [
        relays.start(
            "--exit-when-idle",
            "--concurrency",
            "8",
            "--batch-size",
            "25",
            *FAST,
            latency=0.003,
        )
        for _ in range(3)
    ]
    for proc in procs:
        assert proc.wait(120) == 0, proc.output()

    records = read_records(relays.record)
    sends = Counter(r.message_id for r in records)
    assert set(sends) == set(ids)
    assert set(sends.values()) == {1}, [i for i, n in sends.items() if n > 1][:10]

    by_pid = {p.pid: p.relay_id for p in procs}
    sender_of = {r.message_id: by_pid[r.pid] for r in records}
    per_relay = Counter(sender_of.values())
    assert len(per_relay) >= 2, f"only one relay sent anything: {per_relay}"

    rows = message_rows(engine)
    assert {row.status for row in rows.values()} == {"sent"}
    for row in rows.values():
        assert row.provider_message_id == f"fake-{row.id}-1"
        assert row.attempt_count == 1
        assert row.claim_token is None
        assert row.lease_expires_at is None
        assert row.claimed_by == sender_of[row.id]  # the holder of the claim is who sent it

    tries = attempt_rows(engine)
    assert Counter(a.message_id for a in tries) == Counter(ids)
    assert {a.outcome for a in tries} == {"accepted"}
    assert all(a.relay_id == sender_of[a.message_id] for a in tries)

    states = relay_rows(engine)
    assert {p.relay_id for p in procs} <= set(states)
    assert all(states[p.relay_id].state == "stopped" for p in procs)


def test_sigterm_drains_sends_in_flight_and_releases_the_rest(server_backend, relays):
    engine = server_backend.engine
    ids = enqueue(engine, 200, prefix="acceptance")
    proc = relays.start("--concurrency", "8", "--batch-size", "8", *FAST, latency=0.3)

    def sending_now():
        return relays.deliveries() and in_flight_ids(engine)

    in_flight = wait_for(sending_now, timeout=30, what="sends in flight after the first ones")
    sent_before = sum(relays.deliveries().values())
    signalled = time.monotonic()
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0, proc.output()
    assert time.monotonic() - signalled < 5  # sends of 0.3 s need no more than that to drain

    sends = relays.deliveries()
    rows = message_rows(engine)
    assert set(sends.values()) == {1}
    assert set(Counter(row.status for row in rows.values())) <= {"sent", "pending"}
    sent = {i for i, row in rows.items() if row.status == "sent"}
    assert sent == set(sends)
    assert in_flight <= sent  # what was in flight at SIGTERM finished and was finalized
    assert len(sent) <= sent_before + 2 * 8  # it stopped claiming at once
    pending = [row for row in rows.values() if row.status == "pending"]
    assert pending, "the relay sent everything: SIGTERM came too late to test a drain"
    for row in pending:
        assert row.claim_token is None
        assert row.send_started_at is None
        assert row.attempt_count == 0
    assert relay_rows(engine)[proc.relay_id].state == "stopped"
    assert {a.outcome for a in attempt_rows(engine)} == {"accepted"}

    second = relays.start("--exit-when-idle", "--concurrency", "8", *FAST)
    assert second.wait(60) == 0, second.output()
    assert relays.deliveries() == Counter(ids)
    assert statuses(engine) == Counter({"sent": len(ids)})


def test_a_second_signal_exits_at_once_even_with_slow_sends_in_flight(server_backend, relays):
    engine = server_backend.engine
    enqueue(engine, 20, prefix="acceptance")
    proc = relays.start(
        "--concurrency",
        "8",
        "--lease-seconds",
        "60",
        "--send-timeout",
        "5",
        "--drain-seconds",
        "30",
        *FAST,
        latency=5.0,
    )
    in_flight = wait_for(lambda: in_flight_ids(engine), timeout=30, what="sends in flight")
    proc.popen.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    assert proc.popen.poll() is None, "the first signal must drain, not exit"
    signalled = time.monotonic()
    proc.popen.send_signal(signal.SIGTERM)
    code = proc.wait(10)
    assert time.monotonic() - signalled < 2
    assert code != 0
    assert "second signal" in proc.output()
    assert relays.deliveries() == Counter()  # no 5 s send got to finish
    rows = message_rows(engine)
    # Sends that were in flight keep their lease; the sweep settles them once it expires.
    assert in_flight <= {i for i, row in rows.items() if row.status == "processing"}
    for i in in_flight:
        assert rows[i].send_started_at is not None
        assert rows[i].claimed_by == proc.relay_id


def test_sigkill_mid_send_leaves_rows_the_next_relay_holds_and_never_resends(
    server_backend, relays
):
    engine = server_backend.engine
    ids = enqueue(engine, 30, prefix="acceptance")
    short_lease = ("--lease-seconds", "3", "--send-timeout", "1")
    victim = relays.start("--concurrency", "8", "--batch-size", "8", *short_lease, *FAST, latency=1)

    def mid_send():
        return relays.deliveries() and in_flight_ids(engine)

    wait_for(mid_send, timeout=30, what="a second wave of sends in flight")
    victim.popen.send_signal(signal.SIGKILL)
    assert victim.wait(10) == -signal.SIGKILL

    at_kill = message_rows(engine)
    sends_at_kill = relays.deliveries()
    started = {i for i, r in at_kill.items() if r.status == "processing" and r.send_started_at}
    unstarted = {
        i for i, r in at_kill.items() if r.status == "pending" or r.status == "processing"
    } - started
    sent_before = {i for i, r in at_kill.items() if r.status == "sent"}
    assert started, "nothing was in flight when the relay was killed"
    assert unstarted, "nothing was left for the next relay to deliver"
    assert set(sends_at_kill.values()) <= {1}
    for i in started:
        assert at_kill[i].claimed_by == victim.relay_id

    # The next relay only sweeps leases that have run out; wait for the victim's to.
    with engine.connect() as conn:
        last_lease = conn.execute(
            sa.select(sa.func.max(messages.c.lease_expires_at)).where(
                messages.c.status == "processing"
            )
        ).scalar_one()
    assert last_lease is not None
    assert last_lease - datetime.now(UTC) < timedelta(seconds=3.5)
    sleep_until(last_lease + timedelta(seconds=0.2))

    rescuer = relays.start("--exit-when-idle", "--concurrency", "8", *short_lease, *FAST)
    assert rescuer.wait(60) == 0, rescuer.output()

    rows = message_rows(engine)
    sends = relays.deliveries()
    for i in started:
        assert rows[i].status == "unknown_outcome", (i, rows[i].status)
        assert rows[i].attempt_count == 1
        assert sends[i] == sends_at_kill[i]  # held for an operator, not sent again
    for i in unstarted:
        assert rows[i].status == "sent"
        assert sends[i] == 1
        assert rows[i].attempt_count == 1
    for i in sent_before:
        assert rows[i].status == "sent"
        assert sends[i] == 1
    assert started | unstarted | sent_before == set(ids)

    swept = [a for a in attempt_rows(engine) if a.outcome == "lease_expired"]
    assert Counter(a.message_id for a in swept) == Counter(started)
    for a in swept:
        assert a.relay_id == victim.relay_id
        assert a.started_at is not None
        assert a.error_message == f"swept by {rescuer.relay_id}"
    states = relay_rows(engine)
    assert states[victim.relay_id].state == "running"  # killed: never said goodbye
    assert states[rescuer.relay_id].state == "stopped"
