"""Fair sending with real ``outbox-relay run`` processes on SQLite, PostgreSQL and MariaDB:
a key's rate limit (``--key-limit``) measured at SES's door, a key's most sends in flight
measured from the attempts' own times, across three relays; a key at its limit does not hold
back the others; keys take turns and priorities come first.
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import Email, Outbox
from outbox.schema import attempts, messages
from tests.support.db import Backend
from tests.support.relays import Relays, SesRelays, read_records
from tests.support.ses import IDENTITY, FaultPlan, FaultServer, SendRequest
from tests.support.waiting import wait_for

QUIET = ("--poll-interval", "0.2", "--log-level", "WARNING")
OB = Outbox()


@pytest.fixture
def ses(moto):
    with FaultServer(moto.url, FaultPlan(seed=30)) as server:
        yield server


@pytest.fixture
def ses_relays(backend: Backend, ses, tmp_path: Path) -> Iterator[SesRelays]:
    started = SesRelays(url=backend.url, endpoint=ses.url, workdir=tmp_path, name="fair")
    yield started
    started.kill_all()


@pytest.fixture
def fake_relays(backend: Backend, tmp_path: Path) -> Iterator[Relays]:
    started = Relays(url=backend.url, workdir=tmp_path, record=tmp_path / "sent.log")
    yield started
    started.kill_all()


def enqueue(engine: sa.Engine, key: str, count: int, *, priority: int = 0) -> list[int]:
    """``count`` one-recipient emails of fairness ``key`` and ``priority``, in one
    transaction."""
    with Session(engine) as session, session.begin():
        return [
            OB.enqueue(
                session,
                Email(
                    sender=f"Shop <{IDENTITY}>",
                    to=[f"{key}-{n}@example.com"],
                    subject=f"{key} {n}",
                    text="Hello.",
                ),
                key=f"{key}:{priority}:{n}",
                fairness_key=key,
                priority=priority,
            ).id
            for n in range(count)
        ]


def run_all(procs, timeout: float) -> None:
    for proc in procs:
        assert proc.wait(timeout) == 0, proc.output()[-4000:]


def keys_by_id(engine: sa.Engine) -> dict[int, str | None]:
    with engine.connect() as conn:
        return {i: k for i, k in conn.execute(sa.select(messages.c.id, messages.c.fairness_key))}


def busiest_second(times: list[float]) -> int:
    """The most of ``times`` in any sliding one-second window."""
    times = sorted(times)
    return max((sum(1 for t in times if s <= t < s + 1.0) for s in times), default=0)


def test_a_keys_rate_holds_across_three_relays_and_other_keys_are_not_held_back(
    backend, ses, ses_relays
):
    """``limited`` may send 3 recipients/s; 12 of its messages are queued ahead of 24 of
    three other keys. At SES's door: no sliding second holds more than 3 of ``limited``; the
    other keys' 24 are all sent while ``limited`` still waits its turns; every message goes
    once, and a message held back by its key's limit used no attempt."""
    engine = backend.engine
    limited = enqueue(engine, "limited", 12)
    others = [i for key in ("b", "c", "d") for i in enqueue(engine, key, 8)]
    procs = [
        ses_relays.start(
            "--exit-when-idle", "--key-limit", "limited=3/s", "--concurrency", "4", *QUIET
        )
        for _ in range(3)
    ]
    run_all(procs, 90)

    sends: list[SendRequest] = ses.sends
    assert ses.accepted_per_message() == Counter(limited + others)
    keys = keys_by_id(engine)
    at_door = {key: [s.at for s in sends if keys[s.outbox_id] == key] for key in set(keys.values())}
    assert busiest_second(at_door["limited"]) <= 3, sorted(at_door["limited"])
    last_other = max(t for key, ts in at_door.items() if key != "limited" for t in ts)
    first = min(s.at for s in sends)
    # 12 at 3/s take at least 3 s; the others, unlimited, go at once beside them
    assert max(at_door["limited"]) - first >= 3.0
    assert last_other - first < 2.0, (last_other - first, sorted(at_door["limited"]))
    with engine.connect() as conn:
        counts = Counter(conn.execute(sa.select(messages.c.attempt_count)).scalars())
    assert counts == Counter({1: len(limited) + len(others)})


def test_a_keys_sends_in_flight_stay_within_its_limit_across_three_relays(backend, fake_relays):
    """``slow`` may have 2 sends in flight; every send takes 0.4 s; three relays of 4 threads
    each. From the attempts' own start and end (the database's clock): at no moment are more
    than 2 of ``slow`` in flight, while ``wide`` (no limit) has more than 2 at once."""
    engine = backend.engine
    enqueue(engine, "slow", 10)
    enqueue(engine, "wide", 10)
    procs = [
        fake_relays.start(
            "--exit-when-idle",
            "--key-limit",
            "slow=inflight:2",
            "--concurrency",
            "4",
            *QUIET,
            latency=0.4,
        )
        for _ in range(3)
    ]
    run_all(procs, 90)
    assert fake_relays.deliveries() == Counter(list(keys_by_id(engine)))
    with engine.connect() as conn:
        spans = conn.execute(
            sa.select(messages.c.fairness_key, attempts.c.started_at, attempts.c.finished_at).join(
                attempts, attempts.c.message_id == messages.c.id
            )
        ).all()
    tolerance = timedelta(milliseconds=20)  # the relays' clocks, each anchored to the database

    def most_at_once(key: str) -> int:
        mine = [(s + tolerance, f - tolerance) for k, s, f in spans if k == key]
        return max(sum(1 for s, f in mine if s <= start < f) for start, _ in mine)

    assert most_at_once("slow") <= 2, sorted(s for k, s, _ in spans if k == "slow")
    assert most_at_once("wide") > 2


def test_a_small_key_is_served_within_a_big_backlog_and_priorities_come_first(backend, fake_relays):
    """One relay sending one at a time (so the sends' order is the claims'), 200 of ``big``
    queued first, then 5 each of three small keys and 5 of an urgent priority. The urgent five
    go first; then the four keys take turns, so each small key's five are among the first 30
    sends (5 urgent, then 5 rounds of 4 keys), not after the 200."""
    engine = backend.engine
    enqueue(engine, "big", 200)
    smalls = {key: enqueue(engine, key, 5) for key in ("s1", "s2", "s3")}
    urgent = enqueue(engine, "big", 5, priority=-1)
    proc = fake_relays.start("--exit-when-idle", "--concurrency", "1", *QUIET)
    run_all([proc], 90)
    order = [r.message_id for r in read_records(fake_relays.record)]
    assert len(order) == 220
    assert len(set(order)) == 220
    assert set(order[:5]) == set(urgent)
    for key, ids in smalls.items():
        positions = [order.index(i) for i in ids]
        assert max(positions) < 30, (key, positions)


def test_a_bad_limit_stops_the_relay_before_it_starts_naming_the_flag(backend, fake_relays):
    proc = fake_relays.start("--key-limit", "tenant-*=fast")
    assert proc.wait(30) == 2
    output = proc.output()
    assert "Error: --key-limit: 'tenant-*=fast'" in output
    assert "Traceback" not in output


def test_a_limited_keys_old_backlog_does_not_hold_back_other_keys(backend, fake_relays):
    """``L`` (1/s) has 5,000 due messages written by an app not yet upgraded (the default
    turn, first in line), ahead of every turn of ``b``'s 300. The relay sends L's claims back
    a second apart and leaves L's other rows unclaimed until the first is due again, so b's
    300 go at once (before: 120 of them in two minutes, while L's claims went back 100,000
    times)."""
    engine = backend.engine
    enqueue(engine, "L", 5000)
    with engine.begin() as conn:
        conn.execute(
            sa.update(messages)
            .where(messages.c.fairness_key == "L")
            .values(fair_at=datetime(1970, 1, 1, tzinfo=UTC))
        )
    others = enqueue(engine, "b", 300)
    proc = fake_relays.start("--key-limit", "L=1/s", *QUIET, latency=0.02)
    started = time.monotonic()
    wait_for(
        lambda: set(others) <= set(fake_relays.deliveries()),
        timeout=60,
        what="b's 300 messages sent",
        interval=0.1,
    )
    took = time.monotonic() - started
    proc.popen.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0, proc.output()[-4000:]
    keys = keys_by_id(engine)
    sent_l = [i for i in fake_relays.deliveries() if keys[i] == "L"]
    assert took < 10.0, f"b's 300 took {took:.1f}s behind L's backlog ({len(sent_l)} of L sent)"
    with engine.connect() as conn:
        attempts_of_l = conn.scalar(
            sa.select(sa.func.sum(messages.c.attempt_count)).where(messages.c.fairness_key == "L")
        )
    assert attempts_of_l == len(sent_l)  # sent back in line: no attempt used


def test_a_relay_killed_holding_a_keys_only_send_slot_frees_it_when_its_lease_is_swept(
    backend, fake_relays
):
    """``K`` may have one send in flight. A relay is SIGKILLed in the middle of K's first
    send; another relay keeps K's other three back while that slot counts, then, once the
    dead relay's lease is swept (the send had started: unknown_outcome), sends them one at a
    time. Nothing is sent twice, nothing stays behind."""
    engine = backend.engine
    first, *rest = enqueue(engine, "K", 4)
    flags = (
        "--key-limit",
        "K=inflight:1",
        "--concurrency",
        "1",
        "--lease-seconds",
        "4",
        "--send-timeout",
        "1",
        "--drain-seconds",
        "1",
        *QUIET,
    )
    victim = fake_relays.start(*flags, latency=30.0)

    def mid_send() -> bool:
        with engine.connect() as conn:
            return bool(
                conn.scalar(
                    sa.select(sa.func.count())
                    .select_from(messages)
                    .where(
                        messages.c.status == "processing", messages.c.send_started_at.is_not(None)
                    )
                )
            )

    wait_for(mid_send, timeout=30, what="the victim's first send in flight", interval=0.05)
    victim.popen.send_signal(signal.SIGKILL)
    assert victim.wait(10) == -signal.SIGKILL
    heir = fake_relays.start("--exit-when-idle", *flags)
    run_all([heir], 90)
    with engine.connect() as conn:
        status = dict(conn.execute(sa.select(messages.c.id, messages.c.status)).all())
    assert status == {first: "unknown_outcome", **dict.fromkeys(rest, "sent")}
    assert fake_relays.deliveries() == Counter(rest)
    with engine.connect() as conn:
        tries = conn.execute(
            sa.select(
                attempts.c.message_id,
                attempts.c.outcome,
                attempts.c.started_at,
                attempts.c.finished_at,
            )
        ).all()
    (swept,) = [t for t in tries if t.message_id == first]
    assert swept.outcome == "lease_expired"
    # the dead relay's slot counted until its lease was swept: no send of K began before
    assert min(t.started_at for t in tries if t.message_id in rest) >= swept.finished_at
