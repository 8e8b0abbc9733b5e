"""An operator's walk through an incident, with real processes: a relay dies mid-send, the
next one parks what may have been sent, and the operator finds, inspects and requeues it."""

from __future__ import annotations

import json
import signal
import subprocess
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

from outbox.schema import messages
from tests.support.factories import enqueue
from tests.support.relays import RELAY, clean_env, in_flight_ids, message_rows, sleep_until
from tests.support.waiting import wait_for

FAST = ("--poll-interval", "0.2", "--log-level", "WARNING")
SHORT_LEASE = ("--lease-seconds", "3", "--send-timeout", "1")


def operator(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [RELAY, *args],
        env=clean_env(OUTBOX_DATABASE_URL=url),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_unknown_outcome_is_found_inspected_requeued_and_delivered_once(server_backend, relays):
    engine, url = server_backend.engine, server_backend.url
    enqueue(engine, 12, prefix="acceptance")
    victim = relays.start("--concurrency", "4", "--batch-size", "4", *SHORT_LEASE, *FAST, latency=2)
    wait_for(lambda: in_flight_ids(engine), timeout=30, what="sends in flight")
    victim.popen.send_signal(signal.SIGKILL)
    victim.wait(10)
    with engine.connect() as conn:
        last_lease = conn.execute(sa.select(sa.func.max(messages.c.lease_expires_at))).scalar()
    sleep_until(last_lease + timedelta(seconds=0.2))
    assert relays.start("--exit-when-idle", *SHORT_LEASE, *FAST).wait(60) == 0

    status = operator(url, "status")
    assert status.returncode == 0, status.stderr
    unknown = [i for i, r in message_rows(engine).items() if r.status == "unknown_outcome"]
    assert unknown, "the killed relay had sends in flight"
    assert f"unknown_outcome: {len(unknown)}" in status.stdout
    report = json.loads(operator(url, "status", "--json").stdout)
    assert report["unknown_outcomes"] == len(unknown)

    listed = json.loads(operator(url, "list", "--status", "unknown_outcome", "--json").stdout)
    assert [r["id"] for r in listed] == sorted(unknown)
    target = unknown[0]
    shown = json.loads(operator(url, "show", str(target), "--json").stdout)
    assert shown["message"]["claimed_by"] == victim.relay_id
    assert shown["message"]["send_started_at"] is not None
    assert [a["outcome"] for a in shown["attempts"]] == ["lease_expired"]

    # Reconciliation: the provider's records (the fake sender's ledger) show no delivery.
    assert relays.deliveries()[target] == 0
    requeued = operator(url, "requeue", str(target), "--reason", "not in the provider's log")
    assert requeued.returncode == 0, requeued.stderr
    assert relays.start("--exit-when-idle", *FAST).wait(60) == 0
    row = message_rows(engine)[target]
    assert row.status == "sent"
    assert relays.deliveries()[target] == 1
    shown = json.loads(operator(url, "show", str(target), "--json").stdout)
    assert [a["outcome"] for a in shown["attempts"]] == ["lease_expired", "requeued", "accepted"]
    others = [i for i in unknown if i != target]
    assert all(message_rows(engine)[i].status == "unknown_outcome" for i in others)
    assert all(n == 1 for n in relays.deliveries().values())
    assert datetime.now(UTC) - row.sent_at < timedelta(minutes=5)
