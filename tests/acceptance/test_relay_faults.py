"""Real ``outbox-relay run`` processes under faults: an unmigrated database, a send that
outlives --send-timeout, and a relay host whose clock is two minutes ahead."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from datetime import UTC, datetime, timedelta

from tests.support.clocks import shifted
from tests.support.db import attempt_rows
from tests.support.factories import enqueue
from tests.support.relays import (
    FAKE_SENDER,
    RELAY,
    clean_env,
    in_flight_ids,
    message_rows,
    read_records,
    relay_rows,
    spawn,
    statuses,
)
from tests.support.waiting import wait_for

FAST = ("--poll-interval", "0.1")
SENDER = ("--sender", "console")


def test_run_refuses_an_unmigrated_database_in_one_line(tmp_path):
    database = tmp_path / "empty.db"
    database.touch()
    done = subprocess.run(
        [RELAY, "run", "--database-url", f"sqlite:///{database}", *SENDER, "--exit-when-idle"],
        capture_output=True,
        text=True,
        timeout=20,
        env=clean_env(),
    )
    assert done.returncode == 2, done.stderr
    naming = [line for line in done.stderr.splitlines() if "outbox-relay migrate" in line]
    assert len(naming) == 1, done.stderr
    assert naming[0].startswith("Error: --database-url:")
    assert "Traceback" not in done.stderr
    assert database.stat().st_size == 0  # it created nothing there


def test_a_send_past_send_timeout_is_swept_and_its_late_answer_kept(server_backend, relays):
    """A call that runs past --send-timeout is not renewed: the relay's own sweep parks the
    row as unknown_outcome while the call still runs, and the late answer is recorded as a
    stale attempt with the provider's id, the row left as the sweep set it."""
    engine = server_backend.engine
    (mid,) = enqueue(engine, 1, prefix="acceptance")
    proc = relays.start(
        "--exit-when-idle",
        "--send-timeout",
        "1",
        "--lease-seconds",
        "2.5",
        *FAST,
        latency=5.0,
    )
    wait_for(lambda: in_flight_ids(engine), timeout=15, what="the send to start")
    wait_for(
        lambda: message_rows(engine)[mid].status == "unknown_outcome",
        timeout=4.5,
        what="the overdue send to be parked as unknown_outcome",
    )
    assert relays.deliveries() == Counter(), "the call returned before it was swept"
    assert proc.wait(15) == 0, proc.output()
    assert relays.deliveries() == Counter({mid: 1})
    row = message_rows(engine)[mid]
    assert (row.status, row.provider_message_id, row.attempt_count) == ("unknown_outcome", None, 1)
    assert row.last_error_code == "lease_expired_after_send_started"
    tries = [(a.outcome, a.provider_message_id) for a in attempt_rows(engine)]
    assert tries == [("lease_expired", None), ("stale:accepted", f"fake-{mid}-1")]
    assert "send_overdue" in proc.output()


def first_log_time(log: str) -> datetime:
    for line in log.splitlines():
        if line.startswith("{"):
            return datetime.fromisoformat(json.loads(line)["ts"].replace("Z", "+00:00"))
    raise AssertionError(f"no JSON log line in:\n{log}")


def test_a_relay_whose_clock_is_two_minutes_ahead_sweeps_no_live_send(server_backend, relays):
    """Two relays share a backlog of slow sends; one host's clock is 118 s ahead. Leases and
    sweeps run on the database's clock, so the fast one never takes the other's live sends
    for abandoned: no lease_expired, no unknown_outcome, every message sent once."""
    engine = server_backend.engine
    ids = enqueue(engine, 16, prefix="acceptance")
    args = (
        "--exit-when-idle",
        "--concurrency",
        "4",
        "--lease-seconds",
        "4",
        "--send-timeout",
        "1.8",
        "--log-format",
        "json",
        "--log-level",
        "INFO",
        *FAST,
    )
    env = clean_env(OUTBOX_FAKE_RECORD_FILE=str(relays.record), OUTBOX_FAKE_LATENCY="1.5")
    launched = datetime.now(UTC)
    ahead = spawn(
        relays.url,
        FAKE_SENDER,
        "clock-ahead",
        relays.workdir / "clock-ahead.log",
        shifted(env, "+118s"),
        *args,
    )
    relays.started.append(ahead)
    normal = relays.start(*args, latency=1.5, name="clock-right")
    for proc in (ahead, normal):
        assert proc.wait(60) == 0, proc.output()[-4000:]

    skew = first_log_time(ahead.output()) - launched
    assert timedelta(seconds=100) < skew < timedelta(seconds=140), "the clock was not shifted"
    assert abs(first_log_time(normal.output()) - launched) < timedelta(seconds=30)

    records = read_records(relays.record)
    assert Counter(r.message_id for r in records) == Counter(ids)
    senders = Counter(r.pid for r in records)
    assert set(senders) == {ahead.pid, normal.pid}, f"only one relay sent: {senders}"
    assert statuses(engine) == Counter({"sent": len(ids)})
    assert Counter(a.outcome for a in attempt_rows(engine)) == Counter({"accepted": len(ids)})
    shown = relay_rows(engine)["clock-ahead"]  # its heartbeats are on the database's clock too
    assert abs(shown.started_at - launched) < timedelta(seconds=30)
    assert abs(shown.heartbeat_at - datetime.now(UTC)) < timedelta(seconds=30)
