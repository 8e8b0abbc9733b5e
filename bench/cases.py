"""The six benchmarks. Each returns result rows: a value, the baseline measured in the same
run, their ratio and whether its target (docs/design.md, "Performance targets") is met (None
where no target applies). On PostgreSQL the drain also runs the peer, pgqueuer (``bench.pgq``,
the ``bench`` extra), on the same database with the same message count."""

from __future__ import annotations

import json
import math
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.orm import Session

from bench.db import EMAIL, ORDERS, analyze, base_payload, count, fill, reset, url_string
from bench.senders import AcceptingSender
from outbox import Email, Outbox
from outbox.schema import Status, messages, utcnow
from outbox.sqlite import enable_savepoints
from relay import store
from relay.config import RelayConfig
from relay.wakeup import Listener
from relay.worker import Relay

__all__ = ["CASES", "Result", "Sizes"]

m = messages
REPO = Path(__file__).resolve().parent.parent


@dataclass(kw_only=True)
class Result:
    benchmark: str
    database: str
    value: float
    baseline: float
    unit: str
    ratio: float
    target: str
    met: bool | None
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Sizes:
    drain: int
    rate: int
    enqueue: int
    latency: int
    backlog_small: int
    backlog_due: int
    backlog_done: int
    fair_backlog: int  # key A's messages in the fairness benchmark
    fair_rate: float  # its shared send limit, recipients/s (not scaled)
    soak_seconds: int  # how long the soak enqueues and drains at a steady rate
    retention: int  # sent messages whose retained storage is measured
    console: int  # messages under the console's messages page

    @classmethod
    def make(cls, *, quick: bool, big: bool, scale: float) -> Sizes:
        if quick:
            base = dict(
                drain=2000,
                rate=600,
                enqueue=100,
                latency=30,
                backlog_small=2000,
                backlog_due=20_000,
                backlog_done=50_000,
                fair_backlog=2000,
                soak_seconds=60,
                retention=20_000,
                console=20_000,
            )
        else:
            base = dict(
                drain=20_000,
                rate=2000,
                enqueue=500,
                latency=200,
                backlog_small=10_000,
                backlog_due=100_000,
                backlog_done=500_000,
                fair_backlog=50_000,
                soak_seconds=1800,
                retention=1_000_000,
                console=1_000_000,
            )
        if big:
            base.update(backlog_small=10_000, backlog_due=1_000_000, backlog_done=5_000_000)
        # quick: a small backlog at a higher limit, so the fairness runs take seconds
        fair_rate = 1000.0 if quick else 500.0
        return cls(**{k: max(10, int(v * scale)) for k, v in base.items()}, fair_rate=fair_rate)


# A relay claims only as many rows as it has free send slots (never a backlog to sit on).
# With as many slots as the batch size, a claim waits for the whole previous batch to finish
# and averages half a batch; twice the batch size lets every claim take a full one.
DRAIN_CONCURRENCY = 100


def _pg(engine: sa.Engine) -> bool:
    return engine.dialect.name == "postgresql"


# -- 1. drain --------------------------------------------------------------------------------


_PG_RAW_CLAIM = """
UPDATE outbox_messages SET status = 'processing', claim_token = %(token)s, claimed_at = now(),
       lease_expires_at = now() + interval '120 seconds', send_started_at = now(),
       updated_at = now()
WHERE id IN (SELECT id FROM outbox_messages
             WHERE status = 'pending' AND next_attempt_at <= now()
             ORDER BY priority, next_attempt_at, id LIMIT %(batch)s FOR UPDATE SKIP LOCKED)
RETURNING id
"""
_PG_RAW_FINALIZE = """
UPDATE outbox_messages SET status = 'sent', claim_token = NULL, lease_expires_at = NULL,
       attempt_count = attempt_count + 1, sent_at = now(), updated_at = now()
WHERE id = ANY(%(ids)s) AND claim_token = %(token)s AND status = 'processing'
"""


@dataclass(kw_only=True)
class Cost:
    """What a drain cost the database and the client: statements sent, transactions ended,
    WAL bytes written for this database (PostgreSQL), CPU seconds of the client process."""

    statements: int = 0
    transactions: int = 0
    wal_bytes: int | None = None
    wal_bytes_cluster: int | None = None
    wal_by_record: dict[str, int] = field(default_factory=dict)  # "<relation> <rmgr>/<type>"
    cpu_seconds: float = 0.0

    def per(self, n: int) -> dict[str, float | None]:
        return {
            "statements_per_msg": self.statements / n,
            "transactions_per_msg": self.transactions / n,
            "wal_bytes_per_msg": None if self.wal_bytes is None else self.wal_bytes / n,
            "cpu_seconds_per_1000": self.cpu_seconds / n * 1000,
        }


class _Counting:
    """Counts the statements (``before_cursor_execute``) and the commits and rollbacks of
    every connection of ``engine`` while it is entered."""

    def __init__(self, engine: sa.Engine, cost: Cost) -> None:
        self.engine, self.cost = engine, cost

    def _statement(self, *_args: Any) -> None:
        self.cost.statements += 1

    def _end(self, *_args: Any) -> None:
        self.cost.transactions += 1

    def __enter__(self) -> Cost:
        event.listen(self.engine, "before_cursor_execute", self._statement)
        event.listen(self.engine, "commit", self._end)
        event.listen(self.engine, "rollback", self._end)
        return self.cost

    def __exit__(self, *_exc: object) -> None:
        event.remove(self.engine, "before_cursor_execute", self._statement)
        event.remove(self.engine, "commit", self._end)
        event.remove(self.engine, "rollback", self._end)


def _wal_lsn(engine: sa.Engine) -> str | None:
    if not _pg(engine):
        return None
    with engine.connect() as conn:
        return str(conn.execute(sa.text("SELECT pg_current_wal_lsn()::text")).scalar_one())


_WAL_OF_THIS_DATABASE = """
WITH r AS (SELECT xid::text AS xid, record_length, coalesce(block_ref, '') AS block_ref
           FROM pg_get_wal_records_info(CAST(:start AS pg_lsn), CAST(:end AS pg_lsn))),
     ours AS (SELECT DISTINCT xid FROM r WHERE block_ref ~ :pattern AND xid <> '0')
SELECT coalesce(sum(record_length), 0) FROM r
WHERE block_ref ~ :pattern OR xid IN (SELECT xid FROM ours)
"""
# the same records, by the relation of their first block (a commit has none) and kind
_WAL_BY_RECORD = """
WITH r AS (SELECT xid::text AS xid, record_length, coalesce(block_ref, '') AS block_ref,
                  resource_manager || '/' || record_type AS kind
           FROM pg_get_wal_records_info(CAST(:start AS pg_lsn), CAST(:end AS pg_lsn))),
     ours AS (SELECT DISTINCT xid FROM r WHERE block_ref ~ :pattern AND xid <> '0')
SELECT coalesce(c.relname, CASE WHEN r.block_ref = '' THEN '-' ELSE '?' END) || ' ' || r.kind,
       sum(r.record_length)
FROM r LEFT JOIN pg_class c
  ON c.relfilenode = CAST(nullif(substring(r.block_ref from :first), '') AS oid)
WHERE r.block_ref ~ :pattern OR r.xid IN (SELECT xid FROM ours)
GROUP BY 1 ORDER BY 2 DESC
"""


def _wal_bytes(engine: sa.Engine, start: str | None, cost: Cost) -> None:
    """Fill ``cost``'s WAL bytes from ``start`` to now (PostgreSQL only)."""
    if start is not None:
        end = _wal_lsn(engine)
        assert end is not None
        _wal_bytes_between(engine, start, end, cost)


def _wal_bytes_between(engine: sa.Engine, start: str, end: str, cost: Cost) -> None:
    """Fill ``cost``'s WAL bytes between two positions: every WAL record touching a block of
    this database, plus the commit records of the transactions that did (pg_walinspect; the
    server is shared, so the cluster-wide ``pg_wal_lsn_diff`` is kept only as a detail).
    pg_walinspect reads only flushed WAL: wait up to 10 s for the flush to pass ``end``."""
    flushed = sa.text("SELECT pg_wal_lsn_diff(pg_current_wal_flush_lsn(), CAST(:e AS pg_lsn)) >= 0")
    deadline = time.monotonic() + 10.0
    with engine.connect() as conn:
        while not conn.execute(flushed, {"e": end}).scalar_one():
            if time.monotonic() > deadline:
                raise RuntimeError(f"WAL not flushed up to {end} within 10 s")
            conn.rollback()
            time.sleep(0.05)
        conn.rollback()
        cost.wal_bytes_cluster = int(
            conn.execute(
                sa.text("SELECT pg_wal_lsn_diff(CAST(:e AS pg_lsn), CAST(:s AS pg_lsn))"),
                {"s": start, "e": end},
            ).scalar_one()
        )
        oid = conn.execute(
            sa.text("SELECT oid FROM pg_database WHERE datname = current_database()")
        ).scalar_one()
        conn.execute(sa.text("CREATE EXTENSION IF NOT EXISTS pg_walinspect"))
        cost.wal_bytes = int(
            conn.execute(
                sa.text(_WAL_OF_THIS_DATABASE),
                {"start": start, "end": end, "pattern": f"rel \\d+/{oid}/"},
            ).scalar_one()
        )
        where = {"start": start, "end": end, "pattern": f"rel \\d+/{oid}/"}
        where["first"] = f"rel \\d+/{oid}/(\\d+)"
        cost.wal_by_record = {
            str(what): int(size) for what, size in conn.execute(sa.text(_WAL_BY_RECORD), where)
        }
        conn.commit()


def raw_drain(engine: sa.Engine, batch: int = 50, cost: Cost | None = None) -> int:
    """The floor: claim ``batch`` due rows (FOR UPDATE SKIP LOCKED) to processing, then one
    guarded finalize of the batch to sent; until nothing is due. Returns rows moved, and
    counts its statements and transactions into ``cost``.

    On PostgreSQL it is hand-written SQL on the driver's own connection (one statement per
    step, no SQLAlchemy in the loop): the fastest loop that still claims and fences."""
    cost = cost if cost is not None else Cost()
    if _pg(engine):
        return _raw_drain_pg(engine, batch, cost)
    with _Counting(engine, cost):
        return _raw_drain_core(engine, batch)


def _raw_drain_core(engine: sa.Engine, batch: int) -> int:
    done = 0
    while True:
        now = utcnow()
        token = str(uuid.uuid4())
        with engine.begin() as conn:
            ids = list(
                conn.execute(
                    sa.select(m.c.id)
                    .where(m.c.status == Status.PENDING.value, m.c.next_attempt_at <= now)
                    .order_by(m.c.priority, m.c.next_attempt_at, m.c.id)
                    .limit(batch)
                    .with_for_update(skip_locked=True)
                ).scalars()
            )
            if not ids:
                return done
            conn.execute(
                sa.update(m)
                .where(m.c.id.in_(ids))
                .values(
                    status=Status.PROCESSING.value,
                    claim_token=token,
                    claimed_at=now,
                    lease_expires_at=now + timedelta(seconds=120),
                    send_started_at=now,
                    updated_at=now,
                )
            )
        with engine.begin() as conn:
            conn.execute(
                sa.update(m)
                .where(
                    m.c.id.in_(ids),
                    m.c.claim_token == token,
                    m.c.status == Status.PROCESSING.value,
                )
                .values(
                    status=Status.SENT.value,
                    claim_token=None,
                    lease_expires_at=None,
                    attempt_count=m.c.attempt_count + 1,
                    sent_at=now,
                    updated_at=now,
                )
            )
        done += len(ids)


def _raw_drain_pg(engine: sa.Engine, batch: int, cost: Cost) -> int:
    done = 0
    with engine.connect() as conn:
        driver = conn.connection.driver_connection
        assert driver is not None
        while True:
            token = str(uuid.uuid4())
            with driver.transaction():
                ids = [
                    row[0]
                    for row in driver.execute(_PG_RAW_CLAIM, {"token": token, "batch": batch})
                ]
            cost.statements += 1
            cost.transactions += 1
            if not ids:
                return done
            with driver.transaction():
                driver.execute(_PG_RAW_FINALIZE, {"ids": ids, "token": token})
            cost.statements += 1
            cost.transactions += 1
            done += len(ids)


def _relay_config(engine: sa.Engine, **options: Any) -> RelayConfig:
    return RelayConfig(database_url=url_string(engine), **options)


def _check_all_sent(engine: sa.Engine, n: int) -> None:
    sent = count(engine, Status.SENT.value)
    if sent != n:
        raise RuntimeError(f"expected {n} sent rows, found {sent}")


def _db_span_rate(engine: sa.Engine, n: int) -> float:
    """Messages/s between the first claim and the last finalize, from the rows themselves."""
    with engine.connect() as conn:
        first, last = conn.execute(
            sa.select(sa.func.min(m.c.claimed_at), sa.func.max(m.c.sent_at))
        ).one()
    if isinstance(first, str):  # SQLite without the type's result processing on aggregates
        from datetime import datetime

        first, last = datetime.fromisoformat(first), datetime.fromisoformat(last)
    return float(n / max(1e-6, (last - first).total_seconds()))


PEER_BATCH = 50


def _pgqueuer(engine: sa.Engine, n: int, email: Email = EMAIL) -> dict[str, Any]:
    """pgqueuer (batch ``PEER_BATCH``) draining ``n`` jobs in a process of its own on this
    database: its rate, statements, WAL bytes of this database and CPU seconds."""
    dsn = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
    with tempfile.NamedTemporaryFile(suffix=".json") as payload:
        payload.write(base_payload(email))
        payload.flush()
        proc = subprocess.run(
            [
                sys.executable, "-m", "bench.pgq", "--dsn", dsn, "--jobs", str(n),
                "--batch-size", str(PEER_BATCH), "--payload-file", payload.name,
            ],
            cwd=REPO,
            env=_child_env(),
            capture_output=True,
            text=True,
            timeout=900,
        )  # fmt: skip
    if proc.returncode:
        raise RuntimeError("pgqueuer drain failed: " + (proc.stderr or proc.stdout)[-2000:])
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    cost = Cost(
        statements=report["statements"],
        transactions=report["statements"],  # autocommit: one transaction per statement
        cpu_seconds=report["cpu_seconds"],
    )
    _wal_bytes_between(engine, report["wal_start"], report["wal_end"], cost)
    return {"rate": n / report["seconds"], "cost": cost, "seconds": report["seconds"]}


def _child_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _mean_cost(a: Cost, b: Cost) -> Cost:
    def mid(x: float | None, y: float | None) -> Any:
        return None if x is None or y is None else (x + y) / 2

    return Cost(
        statements=round((a.statements + b.statements) / 2),
        transactions=round((a.transactions + b.transactions) / 2),
        wal_bytes=mid(a.wal_bytes, b.wal_bytes),
        wal_bytes_cluster=mid(a.wal_bytes_cluster, b.wal_bytes_cluster),
        wal_by_record={
            k: round(mid(a.wal_by_record.get(k, 0), b.wal_by_record.get(k, 0)))
            for k in a.wal_by_record.keys() | b.wal_by_record.keys()
        },
        cpu_seconds=(a.cpu_seconds + b.cpu_seconds) / 2,
    )


def _rounded(values: dict[str, float | None]) -> dict[str, float | None]:
    return {k: None if v is None else round(v, 4) for k, v in values.items()}


def _relay_drain_cost(engine: sa.Engine, n: int, *, email: Email = EMAIL) -> tuple[float, Cost]:
    """Drain ``n`` fresh due rows of ``email`` with one in-process relay until idle: its rate
    (msg/s) and its cost. The drain and the drain with a real email run the same relay, so
    their numbers compare; raises unless all ``n`` were sent."""
    reset(engine)
    fill(engine, n, prefix="drain", email=email)
    config = _relay_config(
        engine,
        concurrency=DRAIN_CONCURRENCY,
        batch_size=50,
        exit_when_idle=True,
        poll_interval=0.1,
    )
    relay = Relay(engine=engine, sender=AcceptingSender(), config=config)
    relay_cost = Cost()
    wal = _wal_lsn(engine)
    with _Counting(engine, relay_cost):
        cpu = time.process_time()
        began = time.perf_counter()
        relay.run()
        rate = n / (time.perf_counter() - began)
        relay_cost.cpu_seconds = time.process_time() - cpu
    _wal_bytes(engine, wal, relay_cost)
    _check_all_sent(engine, n)
    return rate, relay_cost


def _wal_by_record_per_msg(costs: dict[str, Cost], n: int, *, top: int) -> dict[str, Any]:
    """Where the bytes go: each cost's ``top`` largest WAL record kinds, bytes per message."""
    return {
        who: {
            k: round(v / n, 1)
            for k, v in sorted(c.wal_by_record.items(), key=lambda kv: -kv[1])[:top]
        }
        for who, c in costs.items()
    }


def drain(engine: sa.Engine, sizes: Sizes, db: str) -> list[Result]:
    n = sizes.drain
    pg = _pg(engine)
    server = engine.dialect.name != "sqlite"
    reset(engine)
    fill(engine, n, prefix="drain")
    floor_cost = Cost()
    wal = _wal_lsn(engine)
    cpu = time.process_time()
    began = time.perf_counter()
    moved = raw_drain(engine, cost=floor_cost)
    raw_rate = moved / (time.perf_counter() - began)
    floor_cost.cpu_seconds = time.process_time() - cpu
    _wal_bytes(engine, wal, floor_cost)
    assert moved == n, (moved, n)

    peers = [_pgqueuer(engine, n)] if pg else []

    rate, relay_cost = _relay_drain_cost(engine, n)

    if pg:
        peers.append(_pgqueuer(engine, n))
    results = [
        Result(
            benchmark="drain",
            database=db,
            value=rate,
            baseline=raw_rate,
            unit="msg/s",
            ratio=rate / raw_rate,
            target=">= 0.50 of the floor",
            met=rate / raw_rate >= 0.5,
            details={"messages": n, "concurrency": DRAIN_CONCURRENCY, "batch_size": 50},
        )
    ]
    peer_rate = statistics.fmean(p["rate"] for p in peers) if peers else 0.0
    peer_cost = _mean_cost(peers[0]["cost"], peers[1]["cost"]) if peers else None
    if peers:
        results.append(
            Result(
                benchmark=f"drain vs pgqueuer b{PEER_BATCH}",
                database=db,
                value=rate,
                baseline=peer_rate,
                unit="msg/s",
                ratio=rate / peer_rate,
                target=">= 1.0",
                met=rate / peer_rate >= 1.0,
                details={
                    "messages": n,
                    "pgqueuer_before_jobs_per_s": round(peers[0]["rate"], 1),
                    "pgqueuer_after_jobs_per_s": round(peers[1]["rate"], 1),
                    "pgqueuer": "1.6 (asyncpg, uvloop), drain mode, no-op handler",
                },
            )
        )

    reset(engine)
    fill(engine, n, prefix="drain")
    cli = Path(sys.executable).with_name("outbox-relay")
    command = [
        str(cli), "run", "--database-url", url_string(engine),
        "--sender", "bench.senders:accepting_sender", "--concurrency", str(DRAIN_CONCURRENCY),
        "--batch-size", "50", "--poll-interval", "0.1", "--exit-when-idle",
        "--log-level", "warning",
    ]  # fmt: skip
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    procs = [
        subprocess.Popen(
            command, env=_child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        for _ in range(2)
    ]
    errors = []
    for proc in procs:
        try:
            _out, err = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            _out, err = proc.communicate()
        if proc.returncode:
            errors.append(err.decode(errors="replace")[-2000:])
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if errors:
        raise RuntimeError("relay process failed: " + "\n".join(errors))
    _check_all_sent(engine, n)
    two = _db_span_rate(engine, n)
    two_cpu = (after.ru_utime - children.ru_utime) + (after.ru_stime - children.ru_stime)
    results.append(
        Result(
            benchmark="drain x2 procs",
            database=db,
            value=two,
            baseline=rate,
            unit="msg/s",
            ratio=two / rate,
            target=">= 1.7 of one relay" if server else "(none: one writer)",
            met=two / rate >= 1.7 if server else None,
            details={
                "messages": n,
                "wall_seconds_incl_startup": round(wall, 3),
                "cpu_seconds_per_1000_incl_startup": round(two_cpu / n * 1000, 4),
                "floor_msg_per_s": round(raw_rate, 1),
            },
        )
    )

    peer = "pgqueuer" if peer_cost is not None else "floor"
    versus = peer_cost if peer_cost is not None else floor_cost
    mine, theirs = relay_cost.per(n), versus.per(n)
    costs = {
        "relay": _rounded(mine),
        "floor": _rounded(floor_cost.per(n)),
        **({"pgqueuer": _rounded(peer_cost.per(n))} if peer_cost is not None else {}),
        "statements": "client side: SQLAlchemy before_cursor_execute (relay, floor off "
        "PostgreSQL), calls of the driver (floor on PostgreSQL, pgqueuer's driver); "
        "BEGIN/COMMIT not counted as statements",
        "wal": "pg_walinspect records of this database and their transactions' commits",
        "cpu": "process CPU (user + system, all threads) over the drain, startup excluded",
    }

    def cost(
        name: str, measure: str, unit: str, details: dict[str, Any], *, judged: bool = False
    ) -> Result:
        """One per-message cost, relay against the peer; ``judged``: met when lower."""
        ratio = _ratio(mine[measure], theirs[measure])
        return Result(
            benchmark=f"{name} vs {peer}",
            database=db,
            value=mine[measure] or 0.0,
            baseline=theirs[measure] or 0.0,
            unit=unit,
            ratio=ratio,
            target="< pgqueuer's" if judged else "(reported)",
            met=ratio < 1.0 if judged else None,
            details=details,
        )

    results.append(cost("statements/msg", "statements_per_msg", "stmt", costs))
    if pg:
        cluster = {
            "relay": _per(relay_cost.wal_bytes_cluster, n),
            "pgqueuer": _per(versus.wal_bytes_cluster, n),
        }
        by_record = _wal_by_record_per_msg({"relay": relay_cost, "pgqueuer": versus}, n, top=15)
        details = {"cluster_wide_bytes_per_msg": cluster, "by_record_per_msg": by_record}
        results.append(cost("WAL bytes/msg", "wal_bytes_per_msg", "B", details))
    where = {"relay": "in-process", **({"pgqueuer": "its own process"} if pg else {})}
    results.append(cost("CPU s/1k msgs", "cpu_seconds_per_1000", "s", where, judged=pg))
    return results


def drain_email(engine: sa.Engine, sizes: Sizes, db: str) -> list[Result]:
    """The drain's per-message cost with a real email in each row instead of the short one:
    a shop's shipping notice (about 10 KB of templated HTML and its text part, no
    attachment; PostgreSQL compresses it and keeps it out of the row, in TOAST), the same
    payload for pgqueuer's jobs. PostgreSQL only (the peer runs there)."""
    if not _pg(engine):
        return []
    from bench.retention import shipping_notice

    n, email = max(1000, sizes.drain // 2), shipping_notice()
    rate, relay_cost = _relay_drain_cost(engine, n, email=email)
    peer = _pgqueuer(engine, n, email)
    mine, theirs = relay_cost.per(n), peer["cost"].per(n)
    payload = len(base_payload(email))
    by_record = _wal_by_record_per_msg({"relay": relay_cost, "pgqueuer": peer["cost"]}, n, top=12)
    details = {"messages": n, "payload_bytes": payload, "wal_by_record_per_msg": by_record}
    rows = [
        ("drain, email", rate, peer["rate"], "msg/s"),
        ("statements/msg, email", mine["statements_per_msg"], theirs["statements_per_msg"], "stmt"),
        ("WAL bytes/msg, email", mine["wal_bytes_per_msg"], theirs["wal_bytes_per_msg"], "B"),
        ("CPU s/1k msgs, email", mine["cpu_seconds_per_1000"], theirs["cpu_seconds_per_1000"], "s"),
    ]
    return [
        Result(
            benchmark=f"{name} vs pgqueuer",
            database=db,
            value=value or 0.0,
            baseline=baseline or 0.0,
            unit=unit,
            ratio=_ratio(value, baseline),
            target="(reported)",
            met=None,
            details=details,
        )
        for name, value, baseline, unit in rows
    ]


def _ratio(value: float | None, baseline: float | None) -> float:
    if value is None or not baseline:
        return math.nan
    return value / baseline


def _per(total: float | None, n: int) -> float | None:
    return None if total is None else round(total / n, 1)


# -- 2. rate ---------------------------------------------------------------------------------


def rate(engine: sa.Engine, sizes: Sizes, db: str) -> list[Result]:
    n, limit = sizes.rate, 500.0
    reset(engine)
    fill(engine, n, prefix="rate")
    sender = AcceptingSender(latency=0.05, record=True)
    config = _relay_config(
        engine,
        concurrency=64,
        batch_size=50,
        exit_when_idle=True,
        poll_interval=0.1,
        max_send_rate=limit,
    )
    Relay(engine=engine, sender=sender, config=config).run()
    _check_all_sent(engine, n)
    starts = sorted(sender.starts)
    t0 = starts[0]
    span = starts[-1] - t0
    windows = int(span)  # full one-second windows from the first send
    if windows >= 1:
        counts = [0] * windows
        for t in starts:
            k = int(t - t0)
            if k < windows:
                counts[k] += 1
        achieved = statistics.fmean(counts)
    else:
        achieved = n / max(span, 1e-6)
    peak, j = 0, 0
    for i, t in enumerate(starts):  # sliding: most sends in any one-second window
        while starts[j] <= t - 1.0:
            j += 1
        peak = max(peak, i - j + 1)
    ratio = achieved / limit
    return [
        Result(
            benchmark="rate 500/s @50ms",
            database=db,
            value=achieved,
            baseline=limit,
            unit="msg/s",
            ratio=ratio,
            target=">= 0.95, peak 1s window <= 500",
            met=ratio >= 0.95 and peak <= limit,
            details={"messages": n, "peak_window": peak, "full_windows": windows},
        )
    ]


# -- 3. enqueue overhead ---------------------------------------------------------------------


ENQUEUE_TARGETS = {1: 1.30, 10: 2.0, 100: 6.0}


def enqueue(engine: sa.Engine, sizes: Sizes, db: str) -> list[Result]:
    reset(engine)
    app = sa.create_engine(engine.url)  # the host app's own plain engine
    outbox = Outbox()

    def txn(emails: int, i: int) -> float:
        began = time.perf_counter()
        with Session(app) as session, session.begin():
            session.execute(ORDERS.insert().values(customer=f"c{i}", total=42, created_at=utcnow()))
            if emails == 1:
                outbox.enqueue(session, EMAIL)
            elif emails > 1:  # a batch: one enqueue_many, one statement
                outbox.enqueue_many(session, [EMAIL] * emails)
            else:  # -n: n separate enqueue calls, n statements
                for _ in range(-emails):
                    outbox.enqueue(session, EMAIL)
        return time.perf_counter() - began

    try:
        times = _interleaved(txn, sizes.enqueue, extra=(-10,))
    finally:
        app.dispose()
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    mean = {k: statistics.fmean(v) * 1000 for k, v in times.items()}
    results = [
        Result(
            benchmark="enqueue 1 email" if emails == 1 else f"enqueue_many {emails} emails",
            database=db,
            value=med[emails],
            baseline=med[0],
            unit="ms/txn",
            ratio=med[emails] / med[0],
            target=f"<= {limit:.2f}",
            met=med[emails] / med[0] <= limit,
            details={"transactions": len(times[emails]), "mean_ms": mean},
        )
        for emails, limit in ENQUEUE_TARGETS.items()
    ]
    results.append(
        Result(
            benchmark="enqueue 10 emails, one call each",
            database=db,
            value=med[-10],
            baseline=med[0],
            unit="ms/txn",
            ratio=med[-10] / med[0],
            target="reported",
            met=None,
            details={"transactions": len(times[-10]), "mean_ms": mean},
        )
    )
    if engine.dialect.driver == "psycopg":
        results.extend(_enqueue_floor(engine, sizes, db))
    return results


def _interleaved(
    txn: Callable[[int, int], float], rounds: int, extra: tuple[int, ...] = ()
) -> dict[int, list[float]]:
    """Times of ``txn(emails, i)`` with 0, 1, 10 and 100 emails (and the ``extra`` variants),
    interleaved in a random order each round after a warm-up (pool, statement caches); the
    hundred-email transaction in every fifth round only, since it costs the most to measure."""
    times: dict[int, list[float]] = {v: [] for v in (0, 1, 10, 100, *extra)}
    for i in range(10):
        for variant in (0, 1, 10, *extra):
            txn(variant, -1 - i)
    txn(100, -11)
    for i in range(rounds):
        order = [v for v in times if v != 100 or i % 5 == 0]
        random.shuffle(order)
        for variant in order:
            times[variant].append(txn(variant, i))
    return times


def _enqueue_floor(engine: sa.Engine, sizes: Sizes, db: str) -> list[Result]:
    """What the database itself charges for the outbox rows: the same order insert, and the
    same batch statement with its savepoint in one pipeline, sent by hand on a psycopg
    connection (no ORM, no SQLAlchemy, rows built once), against the order insert alone."""
    from outbox.enqueue import _as_json, _pipeline_statement  # the statement enqueue sends

    outbox = Outbox()
    rows = {
        n: [outbox._row(EMAIL, None, None, 0, None, None)[0] for _ in range(n)]
        for n in (1, 10, 100)
    }
    order_sql = "INSERT INTO bench_orders (customer, total, created_at) VALUES (%s, 42, now())"
    with engine.connect() as conn:
        sql, params = _pipeline_statement(conn)
    raw_conn = engine.raw_connection()
    raw: Any = raw_conn.driver_connection

    def txn(emails: int, i: int) -> float:
        batch = ""
        if emails:
            for row in rows[emails]:
                row["idempotency_key"] = f"floor:{i}:{emails}:{id(row)}"
            batch = _as_json(rows[emails])
        began = time.perf_counter()
        raw.execute(order_sql, (f"f{i}",))
        if emails:
            with raw.pipeline():
                raw.execute("SAVEPOINT outbox_batch")
                cursor = raw.execute(sql, {**params, "rows": batch})
                raw.execute("RELEASE SAVEPOINT outbox_batch")
            cursor.fetchall()
        raw.commit()
        return time.perf_counter() - began

    try:
        times = _interleaved(txn, sizes.enqueue)
    finally:
        raw_conn.close()
    med = {k: statistics.median(v) * 1000 for k, v in times.items()}
    return [
        Result(
            benchmark=f"enqueue {emails} email{'s' if emails > 1 else ''}, floor",
            database=db,
            value=med[emails],
            baseline=med[0],
            unit="ms/txn",
            ratio=med[emails] / med[0],
            target="reported",
            met=None,
            details={"transactions": len(times[emails])},
        )
        for emails in (1, 10, 100)
    ]


# -- 4. commit-to-send latency ---------------------------------------------------------------


def latency(engine: sa.Engine, sizes: Sizes, db: str) -> list[Result]:
    reset(engine)
    pg = _pg(engine)
    # On PostgreSQL a long poll interval, so the NOTIFY wake-up is what is measured.
    poll = 1.0 if pg else 0.1
    sender = AcceptingSender(record=True)
    relay = Relay(
        engine=engine,
        sender=sender,
        config=_relay_config(engine, concurrency=8, batch_size=50, poll_interval=poll),
    )
    listener = Listener.for_engine(engine, relay.wake)
    thread = threading.Thread(target=relay.run, name="bench-relay", daemon=True)
    thread.start()
    if listener is not None:
        listener.start()
    app = sa.create_engine(engine.url)
    outbox = Outbox()
    samples: list[float] = []
    try:
        time.sleep(0.5)  # relay registered, listener connected
        for i in range(sizes.latency):
            key = f"latency-{i}"
            with Session(app) as session, session.begin():
                outbox.enqueue(session, EMAIL, key=key)
            committed = time.monotonic()
            started = sender.wait_for(key, timeout=10.0)
            if started is None:
                raise RuntimeError(f"{key} was not sent within 10 s")
            samples.append((started - committed) * 1000)
            time.sleep(random.uniform(0.0, 0.02))
    finally:
        if listener is not None:
            listener.stop()
        relay.request_stop()
        thread.join(30)
        app.dispose()
    cuts = statistics.quantiles(samples, n=100, method="inclusive")
    p50, p99 = statistics.median(samples), cuts[98]
    wake = "NOTIFY" if listener is not None else f"poll {poll:g}s"
    return [
        Result(
            benchmark=f"latency p50 ({wake})",
            database=db,
            value=p50,
            baseline=20.0,
            unit="ms",
            ratio=p50 / 20.0,
            target="<= 20 ms (PG)",
            met=p50 <= 20.0 if pg else None,
            details={"samples": len(samples), "max_ms": max(samples)},
        ),
        Result(
            benchmark=f"latency p99 ({wake})",
            database=db,
            value=p99,
            baseline=100.0,
            unit="ms",
            ratio=p99 / 100.0,
            target="<= 100 ms (PG)",
            met=p99 <= 100.0 if pg else None,
            details={"samples": len(samples)},
        ),
    ]


# -- 5. claim latency vs backlog -------------------------------------------------------------


def _claim_ms(engine: sa.Engine, repeats: int = 40) -> float:
    times = []
    for i in range(repeats + 5):
        with engine.connect() as conn:
            began = time.perf_counter()
            tx = conn.begin()
            store.claim_batch(conn, relay_id="bench", limit=50, now=utcnow(), lease_seconds=120)
            tx.rollback()
            if i >= 5:  # warm-up passes are not counted
                times.append(time.perf_counter() - began)
    return statistics.median(times) * 1000


def _finish_held_back(engine: sa.Engine, n: int) -> sa.Connection:
    """Open a REPEATABLE READ transaction that read a row (it holds PostgreSQL's xmin horizon
    back), then move the first ``n`` due rows, in claim order, to sent: each leaves a dead
    tuple and a dead claim-index entry that nothing can clean while the reader lives. Returns
    the reader; the caller rolls it back."""
    reader = engine.connect().execution_options(isolation_level="REPEATABLE READ")
    reader.begin()
    reader.execute(sa.select(m.c.id).limit(1)).all()
    first = (
        sa.select(m.c.id)
        .where(m.c.status == Status.PENDING.value)
        .order_by(m.c.priority, m.c.next_attempt_at, m.c.id)
        .limit(n)
    )
    now = utcnow()
    with engine.begin() as conn:
        conn.execute(
            sa.update(m)
            .where(m.c.id.in_(first.scalar_subquery()))
            .values(status=Status.SENT.value, sent_at=now, updated_at=now)
        )
    return reader


def backlog(engine: sa.Engine, sizes: Sizes, db: str) -> list[Result]:
    reset(engine)
    fill(engine, sizes.backlog_small, prefix="due")
    analyze(engine)
    small = _claim_ms(engine)
    fill(engine, sizes.backlog_done, prefix="done", status=Status.SENT.value)
    more = sizes.backlog_due - sizes.backlog_small
    if more > 0:
        fill(engine, more, prefix="more")
    analyze(engine)
    big = _claim_ms(engine)
    results = [
        Result(
            benchmark="backlog claim",
            database=db,
            value=big,
            baseline=small,
            unit="ms/claim",
            ratio=big / small,
            target="<= 2.0",
            met=big / small <= 2.0,
            details={
                "small_due": sizes.backlog_small,
                "big_due": sizes.backlog_due,
                "big_finished": sizes.backlog_done,
            },
        )
    ]
    if _pg(engine):
        dead_rows = sizes.backlog_small
        reader = _finish_held_back(engine, dead_rows)
        try:
            dead = _claim_ms(engine)
        finally:
            reader.rollback()
            reader.close()
        results.append(
            Result(
                benchmark="claim, dead tuples",
                database=db,
                value=dead,
                baseline=big,
                unit="ms/claim",
                ratio=dead / big,
                target="(none)",
                met=None,
                details={"dead_rows_ahead_of_the_claim": dead_rows, "xmin_held": True},
            )
        )
    return results


# -- 6. fair sending ------------------------------------------------------------------------


BIG_KEY = "A"
SMALL_KEYS = tuple("BCDEFGHIJK")
SMALL = "B..K"
PER_SMALL_KEY = 10  # messages each small key enqueues, in one transaction
FAIR_CHUNK = 1000  # A's messages per transaction (one enqueue_many each)
FAIR_DELAY = 2.0  # seconds into the drain when the small keys enqueue (less for a small backlog)
FAIR_BOUND = 2.0  # every small key's message sent within this many seconds of its enqueue
FAIR_THROUGHPUT = 0.90  # the drain with keys against the same drain without
FAIR_CONCURRENCY = 64  # send slots per relay, as in the rate benchmark
FAIR_BATCH = 50


def _app_engine(engine: sa.Engine) -> sa.Engine:
    """The app's own plain engine, with savepoints working on SQLite as the docs say."""
    app = sa.create_engine(engine.url)
    enable_savepoints(app)
    return app


def _fair_enqueue(
    app: sa.Engine, outbox: Outbox, key: str, n: int, *, keyed: bool
) -> tuple[list[int], float]:
    """Enqueue ``n`` benchmark emails for ``key`` as an app does, FAIR_CHUNK to a transaction,
    with ``key`` as their fairness key when ``keyed`` (else none); their ids, and the
    monotonic time the last transaction committed."""
    ids: list[int] = []
    committed = time.monotonic()
    for start in range(0, n, FAIR_CHUNK):
        with Session(app) as session, session.begin():
            results = outbox.enqueue_many(
                session,
                [EMAIL] * min(FAIR_CHUNK, n - start),
                fairness_key=key if keyed else None,
            )
        committed = time.monotonic()
        ids.extend(r.id for r in results)
    return ids, committed


Relays = list[tuple[subprocess.Popen[bytes], Path]]  # each relay process and its log file


def _start_relays(engine: sa.Engine, count: int, rate: float, logs: Path) -> Relays:
    """``count`` ``outbox-relay run`` processes sharing the send limit ``rate``; no
    ``--exit-when-idle``: the small keys enqueue into a drain already under way."""
    cli = Path(sys.executable).with_name("outbox-relay")
    command = [
        str(cli), "run", "--database-url", url_string(engine),
        "--sender", "bench.senders:accepting_sender", "--concurrency", str(FAIR_CONCURRENCY),
        "--batch-size", str(FAIR_BATCH), "--poll-interval", "0.1",
        "--max-send-rate", f"{rate:g}", "--log-level", "warning",
    ]  # fmt: skip
    relays: Relays = []
    for i in range(count):
        log = logs / f"relay-{i}.log"
        with log.open("wb") as err:
            proc = subprocess.Popen(
                command, env=_child_env(), stdout=subprocess.DEVNULL, stderr=err
            )
        relays.append((proc, log))
    return relays


def _stop_relays(relays: Relays) -> list[str]:
    """SIGTERM each relay (nothing is in flight by then) and wait for it; what those that
    failed wrote."""
    for proc, _log in relays:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    errors = []
    for proc, log in relays:
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.returncode:
            errors.append(f"exit {proc.returncode}: {log.read_text(errors='replace')[-2000:]}")
    return errors


def _sent_at_least(engine: sa.Engine, n: int, relays: Relays) -> bool:
    if any(proc.poll() is not None for proc, _log in relays):
        raise RuntimeError("a relay process exited during the drain")
    return count(engine, Status.SENT.value) >= n


def _wait_until(test: Callable[[], bool], *, timeout: float, interval: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not test():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout:.0f} s")
        time.sleep(interval)


def _spread(values: list[float]) -> dict[str, float]:
    """p50, p99 and max of ``values``, to the millisecond."""
    p99 = statistics.quantiles(values, n=100, method="inclusive")[98] if values[1:] else values[0]
    return {
        "p50": round(statistics.median(values), 3),
        "p99": round(p99, 3),
        "max": round(max(values), 3),
    }


def _fair_run(engine: sa.Engine, sizes: Sizes, *, relays: int, keyed: bool) -> dict[str, Any]:
    """One drain: A's backlog committed, ``relays`` relay processes started, each small key's
    messages enqueued (a transaction per key) ``FAIR_DELAY`` seconds after the first send (a
    quarter of A's drain if that is less), until every message is sent. Latency: a row's
    ``sent_at`` (the relay saved the send as done) minus its ``created_at`` (enqueue)."""
    reset(engine)
    app = _app_engine(engine)
    outbox = Outbox()
    total = sizes.fair_backlog + len(SMALL_KEYS) * PER_SMALL_KEY
    delay = min(FAIR_DELAY, sizes.fair_backlog / sizes.fair_rate / 4)
    ids: dict[str, list[int]] = {}
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        ids[BIG_KEY], _ = _fair_enqueue(app, outbox, BIG_KEY, sizes.fair_backlog, keyed=keyed)
        analyze(engine)  # as autovacuum would after a bulk load: the claim's plan
        with tempfile.TemporaryDirectory(prefix="outbox-bench-fair-") as logs:
            procs = _start_relays(engine, relays, sizes.fair_rate, Path(logs))
            try:
                _wait_until(
                    lambda: _sent_at_least(engine, 1, procs),
                    timeout=60,
                    interval=0.05,
                    what="the first send",
                )
                time.sleep(delay)
                unclaimed = count(engine, Status.PENDING.value)  # A's, not yet claimed
                began = time.monotonic()
                for key in SMALL_KEYS:
                    ids[key], committed = _fair_enqueue(
                        app, outbox, key, PER_SMALL_KEY, keyed=keyed
                    )
                enqueue_seconds = committed - began
                _wait_until(
                    lambda: _sent_at_least(engine, total, procs),
                    timeout=3 * total / sizes.fair_rate + 60,
                    interval=0.25,
                    what=f"all {total} messages sent",
                )
            finally:
                errors = _stop_relays(procs)
                if errors:
                    raise RuntimeError("relay process failed: " + "\n".join(errors))
    finally:
        app.dispose()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - children.ru_utime) + (after.ru_stime - children.ru_stime)

    with engine.connect() as conn:
        rows = {
            row.id: row
            for row in conn.execute(
                sa.select(m.c.id, m.c.created_at, m.c.claimed_at, m.c.send_started_at, m.c.sent_at)
            )
        }

    def seconds(ids_: list[int], since: str, until: str) -> list[float]:
        return [(getattr(rows[i], until) - getattr(rows[i], since)).total_seconds() for i in ids_]

    small = [i for key in SMALL_KEYS for i in ids[key]]
    last_small = max(rows[i].sent_at for i in small)
    first = min(row.claimed_at for row in rows.values())
    last = max(row.sent_at for row in rows.values())
    return {
        "keys": keyed,
        "relays": relays,
        BIG_KEY: _spread(seconds(ids[BIG_KEY], "created_at", "sent_at")),
        SMALL: _spread(seconds(small, "created_at", "sent_at")),
        "per_key": {k: _spread(seconds(ids[k], "created_at", "sent_at")) for k in SMALL_KEYS},
        # where a small key's message waits: for its claim, claimed before its wave is
        # marked (the relay's ready list, the budget), marked until saved as sent
        f"{SMALL}_parts": {
            "enqueue_to_claim": _spread(seconds(small, "created_at", "claimed_at")),
            "claim_to_mark": _spread(seconds(small, "claimed_at", "send_started_at")),
            "mark_to_sent": _spread(seconds(small, "send_started_at", "sent_at")),
        },
        f"{BIG_KEY}_sent_by_last_{SMALL}": round(
            sum(rows[i].sent_at <= last_small for i in ids[BIG_KEY]) / len(ids[BIG_KEY]), 4
        ),
        f"{BIG_KEY}_unclaimed_when_{SMALL}_enqueued": unclaimed,
        f"{SMALL}_enqueued_seconds_after_first_send": delay,
        f"{SMALL}_enqueue_seconds": round(enqueue_seconds, 3),
        "msg_per_s": round(total / (last - first).total_seconds(), 1),
        "relay_cpu_seconds_per_1000": round(cpu / total * 1000, 4),
    }


def fairness(engine: sa.Engine, sizes: Sizes, db: str) -> list[Result]:
    """Key A's backlog, then ten small keys' ten messages each, drained under one shared send
    limit by one relay process and by three; each against the same run with no fairness
    key at all (the small keys' messages then queue behind A's)."""
    results = []
    for relays in (1, 3):
        label = f"{relays} relay{'s' if relays > 1 else ''}"
        keyed = _fair_run(engine, sizes, relays=relays, keyed=True)
        plain = _fair_run(engine, sizes, relays=relays, keyed=False)
        for run in (keyed, plain):
            print(
                f"#   {label}, {'keys' if run['keys'] else 'no keys'}: {SMALL} "
                + "/".join(f"{run[SMALL][q]:.3f}" for q in ("p50", "p99", "max"))
                + f" s, {BIG_KEY} "
                + "/".join(f"{run[BIG_KEY][q]:.1f}" for q in ("p50", "p99", "max"))
                + f" s (p50/p99/max), {run['msg_per_s']:.1f} msg/s",
                file=sys.stderr,
                flush=True,
            )
        setup = {
            "messages": {BIG_KEY: sizes.fair_backlog, SMALL: len(SMALL_KEYS) * PER_SMALL_KEY},
            "send_limit": sizes.fair_rate,
            "relays": relays,
            "concurrency": FAIR_CONCURRENCY,
            "batch_size": FAIR_BATCH,
            "latency": "sent_at - created_at",
        }
        small, plain_small = keyed[SMALL], plain[SMALL]
        ratio = keyed["msg_per_s"] / plain["msg_per_s"]
        results += [
            Result(
                benchmark=f"fair {SMALL} max latency, {label}",
                database=db,
                value=small["max"],
                baseline=FAIR_BOUND,
                unit="s",
                ratio=small["max"] / FAIR_BOUND,
                target=f"<= {FAIR_BOUND:g} s",
                met=small["max"] <= FAIR_BOUND,
                details={**setup, "keys": keyed, "no_keys": plain},
            ),
            Result(
                benchmark=f"fair {SMALL} p99 latency, {label}",
                database=db,
                value=small["p99"],
                baseline=plain_small["p99"],
                unit="s",
                ratio=small["p99"] / plain_small["p99"],
                target="(reported: vs no keys)",
                met=None,
                details={"p50": small["p50"], "no_keys_p50": plain_small["p50"]},
            ),
            Result(
                benchmark=f"fair throughput, {label}",
                database=db,
                value=keyed["msg_per_s"],
                baseline=plain["msg_per_s"],
                unit="msg/s",
                ratio=ratio,
                target=f">= {FAIR_THROUGHPUT:.2f} of no keys",
                met=ratio >= FAIR_THROUGHPUT,
                details={
                    "send_limit": sizes.fair_rate,
                    "span": "first claim to last sent_at, from the rows",
                    "relay_cpu_seconds_per_1000": {
                        "keys": keyed["relay_cpu_seconds_per_1000"],
                        "no_keys": plain["relay_cpu_seconds_per_1000"],
                    },
                },
            ),
        ]
    return results


CASES = {
    "drain": drain,
    "rate": rate,
    "enqueue": enqueue,
    "latency": latency,
    "backlog": backlog,
    "fairness": fairness,
}
