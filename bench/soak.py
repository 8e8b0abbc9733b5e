"""The soak: steady traffic for ``Sizes.soak_seconds`` (half an hour) through one real relay
process while ``outbox-relay prune`` runs as an operator would run it, the outbox tables'
size sampled as it goes. What it shows: the tables stay flat once the prune's horizon is
reached (bodies dropped and rows pruned as fast as they arrive, dead rows cleaned up), not
just that one drain is fast."""

from __future__ import annotations

import json
import random
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from subprocess import PIPE, Popen
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from bench import cases
from bench.cases import Result, Sizes
from bench.db import reset, url_string
from outbox import Attachment, Email, Outbox
from outbox.schema import CLAIMABLE, Status, messages

__all__ = ["Plan", "soak"]

m = messages
RATE = 50.0  # messages enqueued per second, one transaction each
SEND_RATE = 60.0  # the relay's --max-send-rate: a little above, so the queue stays near empty
FLAT = 1.5  # target: outbox bytes at the end over those at the first steady sample
MIN_PRUNE_EVERY = 5.0  # seconds; the prune command takes 2 s to start on a quiet machine
OPEN = tuple(s.value for s in (*CLAIMABLE, Status.PROCESSING))
_PRODUCTS = (
    "walnut desk lamp", "linen shirt", "espresso grinder", "trail running shoes",
    "ceramic mug set", "wool blanket", "phone case", "cast iron pan", "garden hose",
    "bike helmet", "notebook (A5, dotted)", "noise cancelling headphones",
)  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """The soak's clock in seconds, proportional to its length so that a short run still drops
    bodies and prunes rows: 30 minutes keep bodies 2 minutes and rows 10, prune each minute
    (at least every ``MIN_PRUNE_EVERY``) and sample each 30 s (a tenth of the run if less)."""

    seconds: float
    keep_bodies: float
    older_than: float
    prune_every: float
    sample_every: float

    @classmethod
    def of(cls, seconds: float) -> Plan:
        prune_every = max(seconds / 30, MIN_PRUNE_EVERY)
        return cls(seconds, seconds / 15, seconds / 3, prune_every, min(30.0, seconds / 10))


def _email(rng: random.Random, n: int) -> Email:
    """A shipping notice as a shop sends it: about 2.7 KB of HTML (the order's lines), its
    text part and a 2 KB attachment of random bytes that does not compress, so that the
    payload (JSON of about 6.7 KB) is stored out of line (TOAST on PostgreSQL)."""
    lines = [
        (rng.choice(_PRODUCTS), rng.randint(1, 4), rng.randint(199, 25_000) / 100)
        for _ in range(rng.randint(20, 30))
    ]
    rows = "".join(
        f'<tr><td class="item">{name}</td><td class="qty">{qty}</td>'
        f'<td class="price">{price:.2f} EUR</td></tr>'
        for name, qty, price in lines
    )
    text = "".join(f"{qty} x {name}: {price:.2f} EUR\n" for name, qty, price in lines)
    pdf = Attachment(filename=f"invoice-{n}.pdf", content=rng.randbytes(2048))
    return Email(
        sender="shop@example.com",
        to=(f"customer{n % 1000}@example.com",),
        subject=f"Your order {n} has shipped",
        text=f"Hello,\n\nyour order {n} is on its way:\n\n{text}",
        html=f"<html><body><h1>Order {n} has shipped</h1><p>Hello,</p><p>your parcel "
        f"{rng.getrandbits(48):012x} is on its way.</p><table>{rows}</table></body></html>",
        attachments=(pdf,),
        tags={"kind": "shipping"},
    )


# -- sampling --------------------------------------------------------------------------------

_PG_TABLES = """
SELECT s.relname AS name, pg_relation_size(s.relid) AS heap,
       pg_indexes_size(s.relid) AS indexes,
       coalesce(pg_total_relation_size(nullif(c.reltoastrelid, 0)), 0) AS toast,
       s.n_live_tup AS live, s.n_dead_tup AS dead, s.autovacuum_count AS autovacuums,
       s.vacuum_count AS vacuums, s.n_tup_upd AS updates, s.n_tup_hot_upd AS hot_updates
FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
WHERE s.schemaname = current_schema() AND s.relname LIKE 'outbox%'
"""
# the outbox tables autovacuum would vacuum now (its dead tuples rule; reltuples -1: never)
_PG_DUE_FOR_VACUUM = """
SELECT s.relname FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
WHERE s.schemaname = current_schema() AND s.relname LIKE 'outbox%'
  AND s.n_dead_tup > current_setting('autovacuum_vacuum_threshold')::int
      + current_setting('autovacuum_vacuum_scale_factor')::float8 * greatest(c.reltuples, 0)
"""
_MARIADB_TABLES = """
SELECT t.TABLE_NAME AS name, t.DATA_LENGTH AS data, t.INDEX_LENGTH AS indexes,
       t.DATA_FREE AS free, s.FILE_SIZE AS file
FROM information_schema.TABLES t
JOIN information_schema.INNODB_SYS_TABLESPACES s
  ON s.NAME = CONCAT(t.TABLE_SCHEMA, '/', t.TABLE_NAME)
WHERE t.TABLE_SCHEMA = DATABASE() AND t.TABLE_NAME LIKE 'outbox%'
"""
_MARIADB_HISTORY = (
    "SELECT count FROM information_schema.INNODB_METRICS WHERE name = 'trx_rseg_history_len'"
)
_SQLITE_TABLES = """
SELECT coalesce(s.tbl_name, d.name) AS name, sum(d.pgsize) AS bytes
FROM dbstat d LEFT JOIN sqlite_master s ON s.name = d.name
GROUP BY 1 HAVING coalesce(s.tbl_name, d.name) LIKE 'outbox%'
"""


def _tables(conn: sa.Connection, sql: str) -> dict[str, dict[str, Any]]:
    """``sql``'s rows, each under its table's name."""
    rows = conn.execute(sa.text(sql)).mappings()
    return {row["name"]: {k: v for k, v in row.items() if k != "name"} for row in rows}


def _storage_pg(conn: sa.Connection) -> dict[str, Any]:
    """Heap, indexes and TOAST (with its index) of every outbox table, and its counters.
    Garbage: outbox_messages' dead tuples, of its live ones."""
    tables = _tables(conn, _PG_TABLES)
    return {
        "bytes": sum(t["heap"] + t["indexes"] + t["toast"] for t in tables.values()),
        "garbage": tables["outbox_messages"]["dead"],
        "garbage_of": tables["outbox_messages"]["live"],
        "tables": tables,
    }


def _storage_mariadb(conn: sa.Connection) -> dict[str, Any]:
    """After ANALYZE TABLE (so data, index and free lengths are not stale): each outbox table's
    .ibd file size, the bytes counted; its lengths; and the server-wide undo history length
    (InnoDB's dead rows, purged behind). Garbage: data_free of all outbox tables, of the bytes."""
    conn.execute(sa.text(f"ANALYZE TABLE {', '.join(_tables(conn, _MARIADB_TABLES))}")).all()
    tables = _tables(conn, _MARIADB_TABLES)
    history = conn.exec_driver_sql(_MARIADB_HISTORY).scalar_one()
    return {
        "bytes": sum(t["file"] for t in tables.values()),
        "garbage": sum(t["free"] for t in tables.values()),
        "garbage_of": sum(t["file"] for t in tables.values()),
        "history_length": history,
        "tables": tables,
    }


def _storage_sqlite(conn: sa.Connection) -> dict[str, Any]:
    """The database file (page_count x page_size), the bytes counted; each outbox table's
    pages with its indexes (dbstat). Garbage: the free list's bytes, of the file's."""
    page = conn.exec_driver_sql("PRAGMA page_size").scalar_one()
    pages = conn.exec_driver_sql("PRAGMA page_count").scalar_one()
    free = conn.exec_driver_sql("PRAGMA freelist_count").scalar_one()
    tables = _tables(conn, _SQLITE_TABLES)
    size = pages * page
    return {"bytes": size, "garbage": free * page, "garbage_of": size, "tables": tables}


# each backend's storage sampler, and its garbage: name, unit, what it is measured against
_BACKENDS = {
    "postgresql": (_storage_pg, "dead tuples", "tuples", "outbox_messages' live tuples"),
    "mysql": (_storage_mariadb, "data_free", "B", "the outbox tables' files"),
    "sqlite": (_storage_sqlite, "free pages", "B", "the database file"),
}
_BACKENDS["mariadb"] = _BACKENDS["mysql"]


def _sample(engine: sa.Engine, elapsed: float, enqueued: int) -> dict[str, Any]:
    """The outbox's rows (all, queued, still carrying a body) and its storage, now."""
    with engine.connect() as conn:
        rows, queued, bodies = conn.execute(
            sa.select(
                sa.func.count(),
                sa.func.count(sa.case((m.c.status.in_(OPEN), 1))),
                sa.func.count(sa.case((m.c.body_dropped_at.is_(None), 1))),
            )
        ).one()
        measure, garbage, *_ = _BACKENDS[engine.dialect.name]
        storage = measure(conn)
    sample: dict[str, Any] = {"t": round(elapsed, 1), "enqueued": enqueued, "rows": rows}
    sample |= {"queued": queued, "bodies": bodies, **storage}
    print(
        f"#   t={elapsed:6.1f}s outbox {storage['bytes'] / 1e6:8.2f} MB  rows {rows:6d}  "
        f"bodies {bodies:6d}  queued {queued:4d}  {garbage} {storage['garbage']}",
        file=sys.stderr,
        flush=True,
    )
    return sample


# -- autovacuum's stand-in -------------------------------------------------------------------


def _autovacuum_off(engine: sa.Engine) -> bool:
    """PostgreSQL with autovacuum off (CI servers turn it off): the soak then vacuums."""
    if engine.dialect.name != "postgresql":
        return False
    with engine.connect() as conn:
        return bool(conn.exec_driver_sql("SHOW autovacuum").scalar_one() == "off")


def _autovacuum(
    engine: sa.Engine, naptime: float, began: float, stop: threading.Event, log: list[Any]
) -> None:
    """Stand in for autovacuum (a thread: the daemon holds up no one either): each ``naptime``
    seconds, VACUUM (ANALYZE) the outbox tables past its threshold; each round that did, in
    ``log`` (seconds into the run, tables, how long it took)."""
    while not stop.wait(naptime):
        at = time.monotonic()
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            due = list(conn.execute(sa.text(_PG_DUE_FOR_VACUUM)).scalars())
            for name in due:
                conn.exec_driver_sql(f"VACUUM (ANALYZE) {name}")
        if due:
            took = round(time.monotonic() - at, 2)
            log.append({"t": round(at - began, 1), "tables": due, "seconds": took})


# -- pruning ---------------------------------------------------------------------------------


def _start_prune(engine: sa.Engine, plan: Plan) -> Popen[str]:
    """``outbox-relay prune`` as an operator runs it; its counts come as JSON on stdout."""
    horizon = f"{plan.older_than:g}s"
    command = [
        str(Path(sys.executable).with_name("outbox-relay")), "prune",
        "--database-url", url_string(engine), "--older-than", horizon,
        "--dedup-window", horizon, "--keep-bodies", f"{plan.keep_bodies:g}s", "--json",
    ]  # fmt: skip
    return Popen(command, env=cases._child_env(), stdout=PIPE, stderr=PIPE, text=True)


def _pruned(proc: Popen[str], at: float, began: float) -> dict[str, Any]:
    """The counts of the prune started ``at`` seconds into the run begun at ``began`` (the
    monotonic clock), once it ended; a failed prune fails the soak."""
    out, err = proc.communicate(timeout=600)
    if proc.returncode:
        raise RuntimeError(f"prune exited {proc.returncode}: {err[-2000:]}")
    report = json.loads(out)
    counts = {k: report[k] for k in ("deleted", "bodies_dropped")}
    return {"t": round(at, 1), "seconds": round(time.monotonic() - began - at, 2), **counts}


# -- the run ---------------------------------------------------------------------------------


def _run(engine: sa.Engine, plan: Plan, vacuum: bool) -> tuple[list[Any], list[Any], list[Any]]:
    """Enqueue ``RATE`` messages a second for ``plan.seconds`` while one relay process drains
    them and a prune starts every ``plan.prune_every`` seconds (or when the last one ends, if
    later), sampling every ``plan.sample_every``, and if ``vacuum`` autovacuum's stand-in
    looks each minute (a tenth of the run if less); then wait for the queue to empty. The
    samples, the prunes' counts and the stand-in's rounds."""
    reset(engine)
    app = cases._app_engine(engine)
    outbox = Outbox()
    rng = random.Random(20261205)
    samples: list[dict[str, Any]] = []
    prunes: list[dict[str, Any]] = []
    prune: tuple[Popen[str], float] | None = None  # the prune under way, when it started
    enqueued = 0
    stop, vacuums = threading.Event(), list[Any]()
    began = time.monotonic()
    nap = min(60.0, plan.seconds / 10)
    vacuumer = threading.Thread(target=_autovacuum, args=(engine, nap, began, stop, vacuums))
    with tempfile.TemporaryDirectory(prefix="outbox-bench-soak-") as logs:
        relays = cases._start_relays(engine, 1, SEND_RATE, Path(logs))
        relay = relays[0][0]
        try:
            if vacuum:
                vacuumer.start()
            next_prune, next_sample = plan.prune_every, 0.0
            while (elapsed := time.monotonic() - began) < plan.seconds:
                if relay.poll() is not None:
                    raise RuntimeError("the relay process exited during the soak")
                while enqueued < min(int(elapsed * RATE) + 1, plan.seconds * RATE):
                    with Session(app) as session, session.begin():
                        outbox.enqueue(session, _email(rng, enqueued))
                    enqueued += 1
                if prune is not None and prune[0].poll() is not None:
                    prunes.append(_pruned(*prune, began))
                    prune = None
                if prune is None and elapsed >= next_prune:
                    prune = (_start_prune(engine, plan), elapsed)
                    next_prune += plan.prune_every
                if elapsed >= next_sample:
                    samples.append(_sample(engine, elapsed, enqueued))
                    next_sample += plan.sample_every
                next_enqueue = enqueued / RATE - (time.monotonic() - began)
                time.sleep(min(max(next_enqueue, 0.0), 0.05))
            samples.append(_sample(engine, time.monotonic() - began, enqueued))
            if prune is not None:
                prunes.append(_pruned(*prune, began))
                prune = None
            drained = "the queue drained after the soak"
            cases._wait_until(
                lambda: _drained(engine, relay), timeout=60, interval=0.25, what=drained
            )
        finally:
            stop.set()
            if vacuumer.is_alive():
                vacuumer.join()
            if prune is not None and prune[0].poll() is None:
                prune[0].terminate()  # only on failure: its batch rolls back
                prune[0].wait()
            errors = cases._stop_relays(relays)
            app.dispose()
    if errors:
        raise RuntimeError("relay process failed: " + "\n".join(errors))
    return samples, prunes, vacuums


def _drained(engine: sa.Engine, relay: Popen[bytes]) -> bool:
    """Whether no message is queued any more; the relay must still be running."""
    if relay.poll() is not None:
        raise RuntimeError("the relay process exited during the soak")
    with engine.connect() as conn:
        stmt = sa.select(sa.func.count()).select_from(m).where(m.c.status.in_(OPEN))
        return conn.execute(stmt).scalar_one() == 0


def soak(engine: sa.Engine, sizes: Sizes, db: str) -> list[Result]:
    """The soak, judged on its steady samples (from the prune's horizon plus a prune interval
    on: the rows held then cycle between the horizon and the next prune): outbox bytes at the
    end over those at the first steady sample; the most rows, bodies and queued messages held
    against what the prune's horizons and the send rate allow; the most garbage (dead tuples,
    free space) seen. Every sample and prune is in the first row's details."""
    plan = Plan.of(sizes.soak_seconds)
    vacuum = _autovacuum_off(engine)
    samples, prunes, vacuums = _run(engine, plan, vacuum)
    steady = [s for s in samples if s["t"] >= plan.older_than + plan.prune_every]
    first, end = steady[0], samples[-1]
    enqueued = end["enqueued"]
    most = {k: max(s[k] for s in steady) for k in ("bytes", "rows", "bodies", "queued")}
    longest = max((p["seconds"] for p in prunes), default=0.0)
    worst = max(samples, key=lambda s: s["garbage"])
    _storage, garbage, unit, of = _BACKENDS[engine.dialect.name]
    setup = {
        **asdict(plan),
        "enqueue_per_s": RATE,
        "enqueued_per_s": round(enqueued / end["t"], 1),
        "max_send_rate": SEND_RATE,
        "steady_from_sample_at": first["t"],
        "vacuum": "the soak's, autovacuum being off" if vacuum else "the database's own",
    }

    def row(name: str, value: float, baseline: float, unit: str, **more: Any) -> Result:
        target, met = more.pop("target", "(reported)"), more.pop("met", None)
        return Result(
            benchmark=f"soak {name}", database=db, value=value, baseline=baseline, unit=unit,
            ratio=value / max(baseline, 1), target=target, met=met, details=more,
        )  # fmt: skip

    flat = end["bytes"] / first["bytes"] <= FLAT
    return [
        row(
            "outbox bytes, end vs steady", end["bytes"], first["bytes"], "B",
            target=f"<= {FLAT:g}", met=flat, steady_max=most["bytes"], setup=setup,
            samples=samples, prunes=prunes, vacuums=vacuums,
        ),
        row(
            "rows held, steady max", most["rows"],
            RATE * (plan.older_than + plan.prune_every + longest), "rows",
            bound="enqueue rate x (--older-than + prune interval + longest prune)",
        ),
        row(
            "bodies held, steady max", most["bodies"],
            RATE * (plan.keep_bodies + plan.prune_every + longest), "rows",
            bound="enqueue rate x (--keep-bodies + prune interval + longest prune)",
        ),
        row(
            "queued, steady max", most["queued"], SEND_RATE, "msgs",
            bound="one second of --max-send-rate",
            max_from_start=max(s["queued"] for s in samples),
        ),
        row("bodies dropped", sum(p["bodies_dropped"] for p in prunes), enqueued, "rows"),
        row(
            "rows pruned", sum(p["deleted"] for p in prunes), enqueued, "rows",
            prunes=len(prunes), longest_prune_seconds=longest,
        ),
        row(
            f"{garbage}, max", worst["garbage"], worst["garbage_of"], unit, at=worst["t"],
            baseline_is=of, tables_at_end=end["tables"],
        ),
    ]  # fmt: skip
