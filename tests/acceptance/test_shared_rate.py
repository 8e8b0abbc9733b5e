"""``--max-send-rate`` shared exactly by real ``outbox-relay run`` processes on PostgreSQL and
MariaDB, measured where SES measures it: the arrival of each ``SendEmail`` at the SES
emulator. And one relay id, one relay: a second process started with a live relay's
``--relay-id`` refuses to start.

The relays book every send in the database's send budget before starting it (see
relay/ratelimit.py), so the bound holds for any number of relays: at 1/s two relays never
put two sends in one sliding second, and a message with more recipients than the limit goes
alone and keeps the budget for the seconds its recipients are worth.
"""

from __future__ import annotations

import itertools
import signal
import time
from collections import Counter
from datetime import datetime

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

from outbox import Email, Outbox
from relay.clock import read_database_time
from tests.support.relays import RelayProc, SesRelays, message_rows, relay_rows
from tests.support.ses import IDENTITY, FaultPlan, FaultServer, SendRequest
from tests.support.waiting import wait_for

QUIET = ("--poll-interval", "0.2", "--log-level", "WARNING")


@pytest.fixture
def ses(moto):
    """moto emptied (sender verified again) behind a fault server that passes everything."""
    with FaultServer(moto.url, FaultPlan(seed=9)) as server:
        yield server


@pytest.fixture
def ses_relays(server_backend, ses, tmp_path):
    started = SesRelays(url=server_backend.url, endpoint=ses.url, workdir=tmp_path, name="rate")
    yield started
    started.kill_all()


def enqueue(engine: sa.Engine, sizes: list[int]) -> dict[int, int]:
    """One email per size, with that many recipients; returns {outbox id: recipients}."""
    outbox, Sessions, ids = Outbox(), sessionmaker(engine), {}
    with Sessions.begin() as session:
        for n, size in enumerate(sizes):
            email = Email(
                sender=f"Shop <{IDENTITY}>",
                to=[f"customer{n}-{i}@example.com" for i in range(size)],
                subject=f"rate {n}",
                text="Thanks.",
            )
            ids[outbox.enqueue(session, email, key=f"rate:{n}").id] = size
    return ids


def run_to_the_end(relays: list[RelayProc], timeout: float) -> None:
    for proc in relays:
        assert proc.wait(timeout) == 0, proc.output()[-4000:]


def gaps(sends: list[SendRequest]) -> list[float]:
    at = sorted(s.at for s in sends)
    return [round(b - a, 3) for a, b in itertools.pairwise(at)]


def test_two_relays_at_one_per_second_never_send_twice_in_one_second(
    server_backend, ses, ses_relays
):
    """The SES sandbox rate, which is also what ``--max-send-rate auto`` falls back to when
    the account's rate cannot be read (the emulator has no GetAccount): 1 recipient/s for
    both relays together. One-recipient sends at least a second apart at SES's door."""
    engine = server_backend.engine
    ids = enqueue(engine, [1] * 6)
    procs = [
        ses_relays.start(
            "--exit-when-idle", "--max-send-rate", "auto", "--concurrency", "4", *QUIET
        )
        for _ in range(2)
    ]
    run_to_the_end(procs, 60)
    assert all("using 1/s" in proc.output() for proc in procs)

    sends = ses.sends
    assert ses.accepted_per_message() == Counter(list(ids))  # each delivered once
    assert len(sends) == len(ids)
    apart = gaps(sends)
    print(f"\n[{server_backend.name}] seconds between sends at SES: {apart}")
    assert min(apart) >= 1.0, f"two sends within one second at SES: {apart}"
    senders = Counter(row.claimed_by for row in message_rows(engine).values())
    assert len(senders) == 2, f"one relay sent everything, nothing was shared: {senders}"


def test_messages_over_the_limit_go_alone_across_three_relays(server_backend, ses, ses_relays):
    """25 recipients/s over three relays; three messages of 50 recipients (two seconds' worth
    each) among messages of two. At SES: every sliding second of small messages holds at most
    25 recipients; each big one arrives alone, with nothing in the second before it nor in
    the two seconds after it; and the average over the run stays within 25/s."""
    limit = 25
    engine = server_backend.engine
    sizes = [50, 2, 2, 2, 2] * 3
    ids = enqueue(engine, sizes)
    procs = [
        ses_relays.start(
            "--exit-when-idle",
            "--max-send-rate",
            str(limit),
            "--concurrency",
            "4",
            "--batch-size",
            "2",
            *QUIET,
        )
        for _ in range(3)
    ]
    run_to_the_end(procs, 90)

    sends = sorted(ses.sends, key=lambda s: s.at)
    assert ses.accepted_per_message() == Counter(list(ids))
    assert len(sends) == len(ids)
    assert [s.recipients for s in sends].count(50) == 3
    timeline = [(round(s.at - sends[0].at, 3), s.recipients) for s in sends]
    print(f"\n[{server_backend.name}] (seconds, recipients) at SES: {timeline}")
    for big in (s for s in sends if s.recipients > limit):
        worth = big.recipients / limit
        crowding = [
            (round(o.at - big.at, 3), o.recipients)
            for o in sends
            if o is not big and big.at - 1.0 < o.at < big.at + worth
        ]
        assert not crowding, (
            f"{big.recipients} recipients at +{big.at - sends[0].at:.3f}s not alone: "
            f"{crowding}; all: {timeline}"
        )
    for start in sends:
        window = [s for s in sends if start.at <= s.at < start.at + 1.0]
        if all(s.recipients <= limit for s in window):
            assert sum(s.recipients for s in window) <= limit, timeline
    total = sum(s.recipients for s in sends)
    span = sends[-1].at - sends[0].at + max(1.0, sends[-1].recipients / limit)
    assert total <= limit * span, (total, span, timeline)
    senders = Counter(row.claimed_by for row in message_rows(engine).values())
    assert len(senders) >= 2, f"the relays did not share the work: {senders}"


# -- one relay id, one relay -------------------------------------------------------------------


@pytest.fixture
def fake_relays(relays):
    """The suite's ``relays`` (fake sender), named apart from ``ses_relays``."""
    return relays


def refusal(proc: RelayProc) -> str:
    """The one ``Error:`` line of a relay that refused to start (exit code 2)."""
    assert proc.wait(30) == 2, proc.output()
    output = proc.output()
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, output
    return errors[0]


def registered(engine: sa.Engine, proc: RelayProc) -> bool:
    row = relay_rows(engine).get(proc.relay_id)
    return row is not None and row.pid == proc.pid and row.state == "running"


def test_a_second_relay_with_a_live_relays_id_refuses_to_start(server_backend, fake_relays):
    engine = server_backend.engine
    first = fake_relays.start(*QUIET, name="twin")
    wait_for(lambda: registered(engine, first), timeout=30, what="the first relay's row")
    held = relay_rows(engine)["twin"]

    second = fake_relays.start(*QUIET, name="twin")
    error = refusal(second)
    assert "--relay-id" in error
    assert f"pid {first.pid}" in error, error
    assert held.host in error, error
    assert first.popen.poll() is None  # the first relay runs on, its row untouched
    row = relay_rows(engine)["twin"]
    assert (row.pid, row.started_at, row.state) == (held.pid, held.started_at, "running")

    first.popen.send_signal(signal.SIGTERM)
    assert first.wait(30) == 0, first.output()
    assert relay_rows(engine)["twin"].state == "stopped"
    third = fake_relays.start("--exit-when-idle", *QUIET, name="twin")  # a stopped row is free
    assert third.wait(30) == 0, third.output()
    row = relay_rows(engine)["twin"]
    assert (row.pid, row.state) == (third.pid, "stopped")


# serial: it must see the live case within 3 s of a kill, which other workers' load outlasted
@pytest.mark.serial
def test_a_killed_relays_id_is_free_once_its_heartbeat_is_three_intervals_old(
    server_backend, fake_relays
):
    """--lease-seconds 4: a heartbeat a second, so the row is dead three seconds after the
    last one (by the database's clock)."""
    engine = server_backend.engine
    beat = ("--lease-seconds", "4", "--send-timeout", "1", "--drain-seconds", "1", *QUIET)
    victim = fake_relays.start(*beat, name="phoenix")
    wait_for(lambda: registered(engine, victim), timeout=30, what="the relay's row")
    victim.popen.send_signal(signal.SIGKILL)
    assert victim.wait(10) == -signal.SIGKILL
    killed_at = time.monotonic()

    assert "--relay-id" in refusal(fake_relays.start(*beat, name="phoenix"))
    assert time.monotonic() - killed_at < 3.0, "too slow to test the live case"

    last = relay_rows(engine)["phoenix"].heartbeat_at
    wait_for(
        lambda: _database_seconds_since(engine, last) > 3.2,
        timeout=10,
        what="the killed relay's heartbeat to age past three intervals",
        interval=0.1,
    )
    heir = fake_relays.start("--exit-when-idle", *beat, name="phoenix")
    assert heir.wait(30) == 0, heir.output()
    row = relay_rows(engine)["phoenix"]
    assert (row.pid, row.state) == (heir.pid, "stopped")


def _database_seconds_since(engine: sa.Engine, moment: datetime) -> float:
    with engine.connect() as conn:
        return (read_database_time(conn) - moment).total_seconds()
