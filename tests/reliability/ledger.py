"""A delivery ledger that breaks things on purpose, then reconciles SES against the outbox.

One run: enqueue N messages across three categories (``fast``: policy hold; ``digest``:
policy resend; ``expiring``: hold, with an ``expires_at`` a few seconds out), start K real
``outbox-relay run --sender ses`` processes against moto behind the fault server of
:mod:`tests.ses_emulator`, inject the scenario's faults on a schedule, let every row settle,
stop the relays (SIGTERM: they must drain and exit 0), then compare what SES accepted (the
fault server's ledger: per outbox id, how many times moto took it) with the outbox rows.

Every message must be exactly one of:

* ``sent``: received exactly once (at least once under ``resend``), with the provider id SES
  returned for the last accepted request;
* ``unknown_outcome``: received at most once, its last attempt recorded under the claim that
  made it (claim token and relay of the row's claim, outcome ``ambiguous``/``lease_expired``);
* ``failed``: received zero times, an error code recorded;
* ``cancelled`` / ``expired``: received zero times.

And ``unknown_outcome`` is bounded by what could be ambiguous: the sends in flight at each
fault (processing rows with ``send_started_at`` set, claimed by the killed/stopped relay, read
while it cannot move) plus the fault server's own ambiguous answers (hangs, resets).

Run alone::

    python -m tests.reliability.ledger --database-url URL --messages 3000 --relays 3 \\
        --scenario sigkill
"""

from __future__ import annotations

import argparse
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

from outbox import Category, Email, Outbox, migrations
from outbox.schema import attempts, messages, relays
from relay.db import make_engine
from tests.acceptance.relayproc import RELAY, RelayProc, clean_env
from tests.ses_emulator import FaultPlan, FaultServer, MotoSes, aws_env

FAST = Category(name="fast", backoff_base=0.2, backoff_cap=1.0)  # hold
DIGEST = Category(name="digest", backoff_base=0.2, backoff_cap=1.0, ambiguity="resend")
EXPIRING = Category(name="expiring", backoff_base=0.2, backoff_cap=1.0)  # hold, expires_at
OUTBOX = Outbox(categories=[FAST, DIGEST, EXPIRING])
SETTLED = frozenset({"sent", "failed", "unknown_outcome", "cancelled", "expired"})
AMBIGUOUS_KINDS = frozenset({"hang", "reset"})  # SES took it, the client never heard
SCENARIOS = (
    "clean",
    "sigkill",
    "sigterm",
    "ses_faults",
    "db_kill",
    "slow_sender",
    "poison",
    "xmin",
)
SEND_TIMEOUT = 2.0
LEASE = 5.0
BENIGN_ERRORS = ("BrokenPipeError", "ConnectionResetError")


@dataclass
class Summary:
    scenario: str
    backend: str
    messages: int
    relays: int
    runtime: float = 0.0
    delivered: int = 0  # distinct messages SES accepted at least once
    accepted: int = 0  # every acceptance, duplicates included
    duplicates: int = 0  # extra acceptances of hold mail: must be 0
    resend_duplicates: int = 0  # extra acceptances of resend mail: allowed
    lost: int = 0  # rows not accounted for by SES as their status says: must be 0
    unknown: int = 0
    failed: int = 0
    cancelled: int = 0
    expired: int = 0
    sent: int = 0
    in_flight_at_faults: list[int] = field(default_factory=list)
    ambiguous_faults: int = 0  # hangs and resets the fault server answered
    slow_answers: int = 0  # read timeouts on requests the fault server passed (moto too slow)
    requests: Counter[str] = field(default_factory=Counter)
    restarts: int = 0
    xmin_held: bool | None = None  # xmin: the open transaction still held the horizon at the end
    throughput: float = 0.0  # SES requests per second, first to last
    frozen_claims: dict[int, str] = field(default_factory=dict)  # slow_sender: id -> token
    stale_finalized: int = 0  # frozen claims whose late finalize was recorded as an attempt
    sent_after_sweep: int = 0  # frozen claims whose request reached SES after the sweep
    problems: list[str] = field(default_factory=list)

    @property
    def unknown_bound(self) -> int:
        return sum(self.in_flight_at_faults) + self.ambiguous_faults

    def line(self) -> str:
        return (
            f"[{self.backend}] {self.scenario}: N={self.messages} K={self.relays} "
            f"in {self.runtime:.1f}s; delivered {self.delivered} (accepted {self.accepted}), "
            f"sent {self.sent}, duplicates {self.duplicates} (resend {self.resend_duplicates}), "
            f"lost {self.lost}, unknown {self.unknown} <= bound {self.unknown_bound} "
            f"(in flight at faults {self.in_flight_at_faults}, ambiguous SES faults "
            f"{self.ambiguous_faults}; read timeouts on passed requests {self.slow_answers}), "
            f"failed {self.failed}, expired {self.expired}, "
            f"cancelled {self.cancelled}; stale finalizes recorded {self.stale_finalized} "
            f"(sent after the sweep {self.sent_after_sweep}); "
            f"relays restarted {self.restarts}; "
            f"SES requests {dict(self.requests)} at {self.throughput:.0f}/s; "
            f"problems {len(self.problems)}"
        )


# -- setup -----------------------------------------------------------------------------------


def email(n: int) -> Email:
    return Email(
        sender="Shop <shop@example.com>",
        to=[f"customer{n}@example.com"],
        subject=f"ledger {n}",
        text=f"Thanks for order {n}.",
    )


def category_of(n: int) -> str:
    return ("fast", "digest", "expiring")[n % 3]


def enqueue(engine: sa.Engine, count: int, *, expires_in: float) -> dict[int, str]:
    """Enqueue ``count`` messages, a third per category; returns {id: category}."""
    Sessions, ids = sessionmaker(engine), {}
    expires_at = datetime.now(UTC) + timedelta(seconds=expires_in)
    for start in range(0, count, 500):
        with Sessions.begin() as session:
            for n in range(start, min(count, start + 500)):
                cat = category_of(n)
                result = OUTBOX.enqueue(
                    session,
                    email(n),
                    key=f"ledger:{n}",
                    category=cat,
                    expires_at=expires_at if cat == "expiring" else None,
                )
                ids[result.id] = cat
    return ids


def empty(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        for table in (attempts, messages, relays):
            conn.execute(table.delete())


def poison(engine: sa.Engine, ids: list[int]) -> None:
    """Edit payloads by hand into something no sender can build an email from."""
    with engine.begin() as conn:
        conn.execute(
            sa.update(messages).where(messages.c.id.in_(ids)).values(payload={"not": "an email"})
        )


# -- relay processes ---------------------------------------------------------------------------


@dataclass
class Fleet:
    url: str
    endpoint: str
    workdir: Path
    args: tuple[str, ...]
    started: list[RelayProc] = field(default_factory=list)

    def start(self) -> RelayProc:
        relay_id = f"ledger-{len(self.started) + 1}"
        log = self.workdir / f"{relay_id}.log"
        env = {k: v for k, v in clean_env().items() if not k.startswith("AWS_")}
        env.update(aws_env(self.endpoint))
        command = [RELAY, "run", "--database-url", self.url, "--sender", "ses"]
        with log.open("wb") as out:
            popen = subprocess.Popen(
                [*command, "--relay-id", relay_id, *self.args],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )
        proc = RelayProc(popen, relay_id, log)
        self.started.append(proc)
        return proc

    def running(self) -> list[RelayProc]:
        return [p for p in self.started if p.popen.poll() is None]

    def stop_all(self, summary: Summary, engine: sa.Engine, timeout: float = 30) -> None:
        """SIGTERM every running relay once each has registered: a relay signalled while
        Python is still importing has no handler yet and dies of the signal (it holds nothing
        then, but a drain is what this checks)."""

        def all_registered() -> bool:
            with engine.connect() as conn:
                ids = set(conn.execute(sa.select(relays.c.relay_id)).scalars())
            return all(p.relay_id in ids for p in self.running())

        wait_for(all_registered, timeout=timeout, what="every running relay registered")
        running = self.running()
        for proc in running:
            proc.popen.send_signal(signal.SIGCONT)
            proc.popen.send_signal(signal.SIGTERM)
        for proc in running:
            code = proc.wait(timeout)
            if code != 0:
                summary.problems.append(
                    f"{proc.relay_id} exited {code} on SIGTERM: {proc.output()[-1500:]}"
                )

    def kill_all(self) -> None:
        for proc in self.started:
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGKILL)
                proc.popen.wait(10)


def registered(engine: sa.Engine, fleet: Fleet) -> list[RelayProc]:
    """Running relays that registered (their signal handlers are installed by then)."""

    def ready() -> list[RelayProc]:
        with engine.connect() as conn:
            ids = set(conn.execute(sa.select(relays.c.relay_id)).scalars())
        return [p for p in fleet.running() if p.relay_id in ids]

    return wait_for(ready, timeout=30, what="a registered relay")


def in_flight(engine: sa.Engine, relay_id: str | None = None) -> int:
    """Processing rows whose send has started (of one relay, or of all)."""
    query = sa.select(sa.func.count()).where(
        messages.c.status == "processing", messages.c.send_started_at.is_not(None)
    )
    if relay_id is not None:
        query = query.where(messages.c.claimed_by == relay_id)
    with engine.connect() as conn:
        return conn.execute(query).scalar_one()


def claims_of(engine: sa.Engine, relay_id: str) -> dict[int, str]:
    """{id: claim token} of one relay's rows with a send in flight."""
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(messages.c.id, messages.c.claim_token).where(
                messages.c.status == "processing",
                messages.c.send_started_at.is_not(None),
                messages.c.claimed_by == relay_id,
            )
        )
        return {id_: token for id_, token in rows}


def statuses(engine: sa.Engine) -> Counter[str]:
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(messages.c.status, sa.func.count()).group_by(messages.c.status)
        )
        return Counter({status: n for status, n in rows})


def wait_for(condition: Callable[[], Any], *, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


def progress(engine: sa.Engine, total: int) -> float:
    counts = statuses(engine)
    return sum(n for s, n in counts.items() if s in SETTLED) / max(total, 1)


# -- the faults --------------------------------------------------------------------------------


def kill_db_connections(engine: sa.Engine) -> int:
    """Kill every other connection to this database (the relays'): PostgreSQL
    ``pg_terminate_backend``, MariaDB ``KILL``. Only this test's own database is touched."""
    engine.dispose()  # the harness's pooled connections are not the target
    with engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            killed = conn.execute(
                sa.text(
                    "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) "
                    "FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            ).scalar_one()
        else:
            ids = conn.execute(
                sa.text(
                    "SELECT id FROM information_schema.processlist "
                    "WHERE db = DATABASE() AND id <> CONNECTION_ID()"
                )
            ).scalars()
            killed = 0
            for id_ in list(ids):
                try:
                    conn.execute(sa.text(f"KILL {int(id_)}"))
                    killed += 1
                except sa.exc.DBAPIError:  # it ended by itself meanwhile
                    pass
        conn.commit()
    return int(killed)


def inject(
    scenario: str,
    engine: sa.Engine,
    fleet: Fleet,
    ses: FaultServer,
    summary: Summary,
    rng: random.Random,
    total: int,
) -> None:
    """The scenario's fault schedule, spread over the first ~80% of the run."""
    marks = sorted(rng.uniform(0.05, 0.7) for _ in range(rng.randint(3, 5)))
    if scenario == "ses_faults":
        ses.plan.set(throttle=0.10, server_error=0.05, hang=0.02, reset=0.01)
        wait_for(lambda: progress(engine, total) >= 0.3, timeout=120, what="30% settled")
        ses.plan.paused = True
        time.sleep(2.0)
        ses.plan.paused = False
        return
    if scenario == "slow_sender":
        marks = marks[:1]
    for mark in marks:
        wait_for(
            lambda m=mark: progress(engine, total) >= m,
            timeout=120,
            what=f"{mark:.0%} of rows settled",
        )
        if scenario == "db_kill":
            summary.in_flight_at_faults.append(in_flight(engine))
            kill_db_connections(engine)
            continue
        victim = rng.choice(registered(engine, fleet))
        if scenario == "sigkill":
            victim.popen.send_signal(signal.SIGKILL)
            victim.popen.wait(10)
            # dead: its rows cannot move until their lease runs out (LEASE s), so this is exact
            summary.in_flight_at_faults.append(in_flight(engine, victim.relay_id))
            fleet.start()
            summary.restarts += 1
        elif scenario == "sigterm":
            summary.in_flight_at_faults.append(in_flight(engine, victim.relay_id))
            victim.popen.send_signal(signal.SIGTERM)
            fleet.start()  # the replacement starts while the old one drains, as in a deploy
            summary.restarts += 1
            code = victim.wait(30)
            if code != 0:
                summary.problems.append(f"{victim.relay_id} exited {code} on SIGTERM")
        elif scenario == "slow_sender":
            # stop it while it has a send in flight, hold it past its lease, let others sweep
            deadline = time.monotonic() + 30
            while True:
                victim.popen.send_signal(signal.SIGSTOP)
                frozen = in_flight(engine, victim.relay_id)
                if frozen or time.monotonic() > deadline:
                    break
                victim.popen.send_signal(signal.SIGCONT)
                time.sleep(rng.uniform(0.01, 0.05))
            summary.in_flight_at_faults.append(frozen)
            summary.frozen_claims = claims_of(engine, victim.relay_id)
            time.sleep(LEASE + 2.0)
            wait_for(
                lambda v=victim: in_flight(engine, v.relay_id) == 0,
                timeout=30,
                what="the stopped relay's rows to be swept",
            )
            victim.popen.send_signal(signal.SIGCONT)
        else:  # clean, poison, xmin: no fault during the run
            return


def warm_up(moto: MotoSes) -> None:
    """One send straight to moto (not through the fault server, so not in the ledger): moto
    loads its SES backend on the first request, which can outlast the relays' read timeout
    and would make an ambiguous send no fault of ours caused."""
    moto.client().send_email(
        FromEmailAddress="shop@example.com",
        Destination={"ToAddresses": ["warm-up@example.com"]},
        Content={"Simple": {"Subject": {"Data": "warm-up"}, "Body": {"Text": {"Data": "."}}}},
    )


def hold_xmin(engine: sa.Engine) -> sa.Connection:
    """A REPEATABLE READ transaction that read a row and stays open: on PostgreSQL it holds the
    xmin horizon back, so no dead tuple made after it can be vacuumed while it lives."""
    if engine.dialect.name != "postgresql":
        raise ValueError("the xmin scenario is PostgreSQL only")
    conn = engine.connect().execution_options(isolation_level="REPEATABLE READ")
    conn.begin()
    conn.execute(sa.select(messages.c.id).limit(1)).all()
    return conn


# -- reconciliation ----------------------------------------------------------------------------


def reconcile(
    engine: sa.Engine,
    ses: FaultServer,
    categories: dict[int, str],
    summary: Summary,
    poisoned: set[int],
) -> None:
    sends = ses.sends
    accepted = ses.accepted_per_message()
    provider_ids: defaultdict[int, set[str | None]] = defaultdict(set)
    for s in sends:
        if s.accepted and s.outbox_id is not None:
            provider_ids[s.outbox_id].add(s.message_id)
    summary.requests = Counter(s.kind for s in sends)
    if len(sends) > 1:
        summary.throughput = (len(sends) - 1) / max(sends[-1].at - sends[0].at, 1e-6)
    summary.ambiguous_faults = sum(1 for s in sends if s.kind in AMBIGUOUS_KINDS)
    summary.delivered = len(accepted)
    summary.accepted = sum(accepted.values())
    # a relay killed (or a connection reset) mid-answer breaks the server's write: benign, the
    # request is in the ledger already; anything else means the ledger cannot be trusted
    errors = [e for e in ses.errors if not any(b in e for b in BENIGN_ERRORS)]
    if errors:
        summary.problems.append(f"fault server errors: {errors[:3]}")
    unknown_ids = set(accepted) - set(categories)
    if unknown_ids:
        summary.problems.append(f"SES accepted ids that are not rows: {sorted(unknown_ids)[:5]}")

    with engine.connect() as conn:
        rows = {r.id: r for r in conn.execute(sa.select(messages))}
        tries: defaultdict[int, list[Any]] = defaultdict(list)
        for a in conn.execute(sa.select(attempts).order_by(attempts.c.id)):
            tries[a.message_id].append(a)

    def problem(id_: int, what: str) -> None:
        row = rows[id_]
        summary.problems.append(
            f"#{id_} ({categories[id_]}) {row.status}: {what}; received {accepted[id_]}, "
            f"requests {[s.kind for s in sends if s.outbox_id == id_]}"
        )

    for id_, row in rows.items():
        got, resend = accepted[id_], categories[id_] == "digest"
        if got > 1:
            if resend:
                summary.resend_duplicates += got - 1
            else:
                summary.duplicates += got - 1
                problem(id_, "delivered more than once under hold")
        if id_ in poisoned and (row.status, row.last_error_code) != ("failed", "invalid_payload"):
            problem(id_, f"poisoned row ended {row.status}/{row.last_error_code}")
        match row.status:
            case "sent":
                summary.sent += 1
                if got == 0:
                    summary.lost += 1
                    problem(id_, "marked sent, SES never accepted it")
                elif row.provider_message_id not in provider_ids[id_]:
                    problem(id_, f"provider id {row.provider_message_id} is not SES's")
            case "unknown_outcome":
                summary.unknown += 1
                if resend:
                    problem(id_, "resend mail parked as unknown_outcome")
                # the attempt that parked it, under the claim that made the send (a stale
                # finalize of the same claim may be recorded after it)
                parking = [
                    a
                    for a in tries[id_]
                    if a.outcome in ("ambiguous", "lease_expired")
                    and a.claim_token is not None
                    and a.relay_id == row.claimed_by
                    and a.started_at == row.send_started_at
                ]
                if not parking:
                    problem(id_, f"no attempt under the claim that made it: {tries[id_]}")
            case "failed":
                summary.failed += 1
                if got:
                    problem(id_, "failed but SES accepted it")
                if not row.last_error_code:
                    problem(id_, "failed with no error code")
            case "cancelled" | "expired":
                if row.status == "cancelled":
                    summary.cancelled += 1
                else:
                    summary.expired += 1
                if got:
                    problem(id_, f"{row.status} but SES accepted it")
            case _:
                summary.lost += 1
                problem(id_, "never settled")
    for id_, token in summary.frozen_claims.items():
        mine = [a for a in tries[id_] if a.claim_token == token]
        outcomes = [a.outcome for a in mine]
        # swept by another relay (lease_expired), then the stopped relay's own finalize, stale,
        # recorded under the same claim all the same
        if "lease_expired" not in outcomes:
            problem(id_, f"the frozen claim was never swept: {outcomes}")
        else:
            # did the stopped relay's request reach SES only after another relay swept it?
            swept_at = next(a for a in mine if a.outcome == "lease_expired").finished_at
            stale_call = next((a for a in mine if a.outcome != "lease_expired"), None)
            if stale_call is not None and stale_call.provider_message_id is not None:
                arrival = next(
                    (s.wall for s in sends if s.message_id == stale_call.provider_message_id),
                    None,
                )
                if arrival is not None and arrival > swept_at.timestamp():
                    summary.sent_after_sweep += 1
        if not any(o != "lease_expired" for o in outcomes):
            problem(id_, f"the stale finalize left no attempt: {outcomes}")
        else:
            summary.stale_finalized += 1
    faulted = {s.outbox_id for s in sends if s.kind in AMBIGUOUS_KINDS}
    summary.slow_answers = sum(
        1
        for id_, mine in tries.items()
        for a in mine
        if a.outcome == "ambiguous" and a.error_code == "ReadTimeoutError" and id_ not in faulted
    )
    if summary.unknown > summary.unknown_bound:
        summary.problems.append(
            f"{summary.unknown} unknown_outcome rows, but only {summary.unknown_bound} sends "
            "were ambiguous (in flight at a fault, or a hang/reset)"
        )


# -- one run -----------------------------------------------------------------------------------


def relay_args(scenario: str) -> tuple[str, ...]:
    return (
        "--concurrency",
        "8",
        "--batch-size",
        "10",
        "--lease-seconds",
        str(LEASE),
        "--send-timeout",
        str(SEND_TIMEOUT),
        "--drain-seconds",
        str(SEND_TIMEOUT + 1),
        "--poll-interval",
        "0.2",
        "--pause-seconds",
        "0.5",
        "--max-send-rate",
        "400",
        "--log-level",
        "WARNING",
    )


def run(
    database_url: str,
    *,
    scenario: str,
    count: int,
    replicas: int,
    workdir: Path,
    moto: MotoSes | None = None,
    seed: int = 10,
    settle_timeout: float = 180,
) -> Summary:
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}: one of {', '.join(SCENARIOS)}")
    engine = make_engine(database_url)
    own_moto = moto is None
    moto = moto or MotoSes()
    rng = random.Random(seed)
    summary = Summary(scenario, engine.dialect.name, count, replicas)
    try:
        migrations.upgrade(engine)
        empty(engine)
        moto.reset()
        warm_up(moto)
        categories = enqueue(engine, count, expires_in=3 + count / 60)
        poisoned: set[int] = set()
        if scenario == "poison":
            poisoned = set(rng.sample(sorted(i for i, c in categories.items() if c == "fast"), 3))
            poison(engine, sorted(poisoned))
        held_back = hold_xmin(engine) if scenario == "xmin" else None
        # hangs outlive the client's read timeout (an ambiguous send)
        with FaultServer(moto.url, FaultPlan(seed=seed, hang_seconds=SEND_TIMEOUT + 1)) as ses:
            fleet = Fleet(database_url, ses.url, workdir, relay_args(scenario))
            started = time.monotonic()
            try:
                for _ in range(replicas):
                    fleet.start()
                inject(scenario, engine, fleet, ses, summary, rng, count)
                wait_for(
                    lambda: progress(engine, count) >= 1.0,
                    timeout=settle_timeout,
                    what=f"every row settled ({dict(statuses(engine))})",
                )
                summary.runtime = time.monotonic() - started
                fleet.stop_all(summary, engine)
            finally:
                fleet.kill_all()
            reconcile(engine, ses, categories, summary, poisoned)
        if held_back is not None:
            if not held_back.in_transaction():
                summary.problems.append("the xmin-holding transaction ended early")
            summary.xmin_held = held_back.execute(
                sa.text(
                    "SELECT backend_xmin IS NOT NULL FROM pg_stat_activity "
                    "WHERE pid = pg_backend_pid()"
                )
            ).scalar_one()
            held_back.close()
        if scenario == "sigterm" and summary.unknown:
            summary.problems.append(f"SIGTERM drains left {summary.unknown} unknown_outcome rows")
    finally:
        engine.dispose()
        if own_moto:
            moto.stop()
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database-url", required=True)
    parser.add_argument("--messages", type=int, default=3000)
    parser.add_argument("--relays", type=int, default=3)
    parser.add_argument("--scenario", choices=SCENARIOS, default="sigkill")
    parser.add_argument("--seed", type=int, default=10)
    options = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ledger-") as workdir:
        summary = run(
            options.database_url,
            scenario=options.scenario,
            count=options.messages,
            replicas=options.relays,
            workdir=Path(workdir),
            seed=options.seed,
            settle_timeout=max(180, options.messages / 10),
        )
    print(summary.line())
    for problem in summary.problems[:50]:
        print("  PROBLEM", problem)
    return 1 if summary.problems else 0


if __name__ == "__main__":
    sys.exit(main())
