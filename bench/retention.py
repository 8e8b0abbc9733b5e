"""Retained storage: what a sent message still costs once ``outbox-relay prune --keep-bodies``
has dropped its body. ``sizes.retention`` sent messages with realistic bodies and one accepted
attempt each are measured, their bodies dropped by the real command, then measured again in
place (after a plain VACUUM or ANALYZE) and compacted (VACUUM FULL, OPTIMIZE TABLE, VACUUM).
See docs/performance.md, "Retained storage per sent message"."""

from __future__ import annotations

import base64
import json
import math
import random
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from bench.cases import Result, Sizes, _child_env
from bench.db import reset, url_string
from outbox import Attachment, Email, Outbox
from outbox.enqueue import build_row
from outbox.schema import AttemptOutcome, Status, UTCDateTime, attempts, messages, utcnow

__all__ = ["retention", "shipping_notice"]

m = messages
TARGET = 250.0  # bytes per sent message, messages table with its indexes, PostgreSQL (issue)
POOL = 1000  # distinct emails built through the outbox API; every row copies one of them
CHUNK = 10_000  # rows per fill transaction
TABLES = ("outbox_messages", "outbox_attempts")
RELAYS = ("outbox-relay-7d9f8b6c4-x2k9p-1-3f2a", "outbox-relay-7d9f8b6c4-m8q4z-1-b71c")

_NAMES = (
    "Margaret Hendricks", "Jonathan Okafor", "Aisha Rahman", "Liam Byrne", "Sofia Castellanos",
    "Kenji Watanabe", "Chloé Lefèvre", "Noah Schmidt", "Priya Venkataraman", "Erik Lindqvist",
)  # fmt: skip
_DOMAINS = ("gmail.com", "outlook.com", "yahoo.co.uk", "icloud.com", "proton.me", "web.de")
_PRODUCTS = (
    "Trail Runner 2 GTX", "Merino Base Layer Crew", "Walnut Desk Lamp", "Linen Shirt Slim Fit",
    "Espresso Grinder Pro", "Cast Iron Skillet 28 cm", "Wool Throw Blanket", "Bike Helmet MIPS",
)  # fmt: skip
# A shop's templated notice: inline styles repeated on every cell, as email builders write them
_TD = 'style="padding:0 32px 16px;font-family:Helvetica,Arial,sans-serif;font-size:15px;'
_TD += 'line-height:22px;color:#333333;"'
_SHOP, _CDN = "https://www.northwind-outfitters.com", "https://cdn.northwind-outfitters.com"
_HEAD = (
    '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="'
    'width=device-width,initial-scale=1"><style>body{margin:0;padding:0;background:#f4f5f7;}tabl'
    "e{border-collapse:collapse;}img{border:0;display:block;}a{color:#1a73e8;}@media only screen"
    " and (max-width:620px){.card{width:100%!important;}td{padding-left:16px!important;padding-r"
    'ight:16px!important;}}</style></head><body><table role="presentation" width="100%" style="b'
    'ackground:#f4f5f7;padding:24px 0;"><tr><td align="center"><table class="card" role="presen'
    f'tation" width="600" style="background:#ffffff;"><tr><td {_TD}><a href="{_SHOP}?utm_source='
    f'email"><img src="{_CDN}/brand/logo-2x.png" width="180" height="40" alt="Northwind"></a>'
)


def _email(rng: random.Random) -> Email:
    """A shipping notice as a shop sends it: a templated HTML body of 7 to 14 KB (customer,
    order lines, links and tokens vary; zlib takes it to about a quarter), its text part, a
    realistic address and subject; one in five carries a 20 to 40 KB invoice PDF."""
    name, order = rng.choice(_NAMES), f"NW-{rng.randrange(10**7):07d}"
    tracking, token = f"1Z{rng.getrandbits(64):016X}", f"{rng.getrandbits(128):032x}"
    lines, text = [], [f"Hi {name.split()[0]},\n\nyour order {order} is on its way."]
    for _ in range(rng.randint(7, 18)):
        product, qty, sku = rng.choice(_PRODUCTS), rng.randint(1, 3), f"{rng.getrandbits(24):06X}"
        total, slug = f"{qty * rng.randint(499, 24999) / 100:,.2f}", product.replace(" ", "-")
        image = f"{rng.getrandbits(40):010x}"
        click = base64.urlsafe_b64encode(rng.randbytes(48)).decode()  # link tracking
        lines.append(
            f'<tr><td width="96"><a href="https://click.northwind-outfitters.com/ls/click?upn='
            f'{click}&amp;u={slug}"><img src="{_CDN}/img/{image}/thumb.jpg" width="80" height="80" '
            f'alt="{product}"></a></td><td {_TD}>{product}<br><span style="font-size:12px;color:#8'
            f'88888;">SKU {sku} &middot; Qty {qty}</span></td><td align="right" style="white-space:'
            f'nowrap;">&euro;{total}</td></tr>'
        )
        text.append(f"  {qty} x {product} (SKU {sku})  EUR {total}")
    paragraphs = (
        f'<h1 style="font-size:22px;color:#111111;">Your order {order} is on its way</h1>',
        f"Hi {name.split()[0]},", f"Good news: your order <b>{order}</b> left our warehouse "
        f"today. Most parcels arrive within {rng.randint(2, 5)} working days.",
        f'<a href="https://www.ups.com/track?loc=en_US&amp;tracknum={tracking}" style="background'
        ':#1a73e8;color:#ffffff;padding:12px 22px;border-radius:4px;text-decoration:none;font-wei'
        f'ght:bold;">Track parcel {tracking}</a>', f'<table width="100%">{"".join(lines)}</table>',
        f"<b>Shipping to</b><br>{name}<br>{rng.randint(1, 240)} Mill Road<br>Bristol BS"
        f"{rng.randint(1, 99)} {rng.randint(1, 9)}QX",
        f"<small>Northwind Outfitters Ltd, 14 Harbour Street, Leith, Edinburgh EH6 6QU, UK. "
        f'Company no. SC482913.<br><a href="{_SHOP}/account/emails?t={token}">Email preferences</a>'
        f' &middot; <a href="{_SHOP}/privacy">Privacy</a></small>',
    )  # fmt: skip
    html = _HEAD + "".join(f"</td></tr><tr><td {_TD}>{p}" for p in paragraphs)
    local = name.lower().replace(" ", ".").replace("é", "e").replace("è", "e")
    return Email(
        sender='"Northwind Outfitters" <orders@mail.northwind-outfitters.com>',
        to=(f'"{name}" <{local}{rng.choice(("", "84", "1990"))}@{rng.choice(_DOMAINS)}>',),
        subject=f"{name.split()[0]}, your order {order} has shipped",
        text="\n".join(text) + f"\nTrack it: https://www.ups.com/track?tracknum={tracking}\n",
        html=html + "</td></tr></table></td></tr></table></body></html>",
        attachments=(_pdf(rng, order),) if rng.random() < 0.2 else (),
        configuration_set="transactional",
        tags={"kind": "order_shipped"},
    )


def shipping_notice() -> Email:
    """One of :func:`_email`'s notices without an attachment, the same every run."""
    rng = random.Random(20261206)
    while (email := _email(rng)).attachments:
        pass
    return email


def _pdf(rng: random.Random, order: str) -> Attachment:
    """An invoice shaped like a PDF of 20 to 40 KB: page objects (compressible text) between
    deflated streams (random bytes)."""
    page = b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 595.28 841.89] /Resources << /Font << "
    page += b"/F1 5 0 R >> >> /Contents 4 0 R /Invoice (%s) >>\nendobj\n" % order.encode()
    body = b"".join(
        page * 3 + b"stream\n" + rng.randbytes(rng.randint(600, 1400)) + b"\nendstream\n"
        for _ in range(rng.randint(15, 30))
    )
    pdf = b"%PDF-1.7\n" + body + b"%%EOF\n"
    return Attachment(filename=f"invoice-{order}.pdf", content=pdf, content_type="application/pdf")


# -- the fill --------------------------------------------------------------------------------

_bench = sa.MetaData()
# the built rows' columns that are the email's or its category's: one pool row per email
_FROM_POOL = (
    "category", "priority", "payload", "recipients", "recipient_count", "subject",
    "max_attempts", "backoff_base", "backoff_cap", "ambiguity_policy", "reconcile_after",
)  # fmt: skip
POOL_TABLE = sa.Table(
    "bench_retention_pool", _bench,
    sa.Column("n", sa.Integer, primary_key=True, autoincrement=False),
    *(sa.Column(name, m.c[name].type) for name in _FROM_POOL),
)  # fmt: skip
# a chunk's own values: which email, key, provider id, claim token, relay, times
KEYS_TABLE = sa.Table(
    "bench_retention_keys", _bench, sa.Column("pool", sa.Integer),
    sa.Column("seq", sa.Integer, primary_key=True, autoincrement=False),
    *(sa.Column(c, sa.String(255)) for c in ("key", "provider_id", "token", "relay")),
    *(sa.Column(c, UTCDateTime()) for c in ("created", "claimed", "started", "sent")),
)  # fmt: skip


def _pool(engine: sa.Engine, size: int) -> None:
    """``size`` emails, each built as ``Outbox.enqueue`` builds its row, into the pool."""
    rng, category = random.Random(20261205), Outbox().categories["transactional"]
    built = (
        build_row(
            _email(rng), key="-", category=category, priority=0, not_before=None,
            expires_at=None, now=utcnow(),
        )
        for _ in range(size)
    )  # fmt: skip
    with engine.begin() as conn:
        pool = [{"n": n, **{c: row[c] for c in _FROM_POOL}} for n, row in enumerate(built)]
        conn.execute(sa.insert(POOL_TABLE), pool)


def _keys(rng: random.Random, first: int, count: int, n: int, pool: int) -> list[dict[str, Any]]:
    """The own values of messages ``first`` to ``first + count``: created evenly over the two
    weeks before the last hour, claimed, started and sent milliseconds later; keys
    ``order-shipped:<uuid4>``; SES message ids (60 characters, led by the send's time)."""
    end, step, rows = utcnow() - timedelta(hours=1), timedelta(days=14) / n, []
    for seq in range(first, first + count):
        created = end - (n - seq) * step
        claimed = created + timedelta(milliseconds=rng.uniform(2, 50))
        started = claimed + timedelta(milliseconds=rng.uniform(1, 10))
        ses = f"01000{int(started.timestamp() * 1000):011x}-{_uuid4(rng)}-000000"
        rows.append(
            {
                "seq": seq, "pool": rng.randrange(pool), "key": f"order-shipped:{_uuid4(rng)}",
                "provider_id": ses, "token": _uuid4(rng), "relay": rng.choice(RELAYS),
                "created": created, "claimed": claimed, "started": started,
                "sent": started + timedelta(milliseconds=rng.uniform(40, 200)),
            }
        )  # fmt: skip
    return rows


def _uuid4(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _fill(engine: sa.Engine, n: int) -> float:
    """``n`` sent messages as the relay leaves them (claim token and lease cleared, one
    attempt, the provider's id), each with its accepted attempt row, copied from the pool
    ``CHUNK`` at a time by INSERT ... SELECT. Returns the seconds it took, to a tenth."""
    began, pool, k, p = time.perf_counter(), min(n, POOL), KEYS_TABLE.c, POOL_TABLE.c
    _bench.drop_all(engine)
    _bench.create_all(engine)
    _pool(engine, pool)
    message = {
        **{name: p[name] for name in _FROM_POOL},
        "idempotency_key": k.key, "status": sa.literal(Status.SENT.value),
        "attempt_count": sa.literal(1), "next_attempt_at": k.created, "fair_at": k.created,
        "created_at": k.created, "updated_at": k.sent, "claimed_by": k.relay,
        "claimed_at": k.claimed, "send_started_at": k.started, "last_attempt_at": k.started,
        "sent_at": k.sent, "provider_message_id": k.provider_id,
    }  # fmt: skip
    attempt = {
        "message_id": m.c.id, "claim_token": k.token, "relay_id": m.c.claimed_by,
        "started_at": m.c.send_started_at, "finished_at": m.c.sent_at,
        "outcome": sa.literal(AttemptOutcome.ACCEPTED.value),
        "provider_message_id": m.c.provider_message_id,
    }  # fmt: skip
    inserts = (
        sa.insert(m).from_select(list(message), sa.select(*message.values())
            .join_from(KEYS_TABLE, POOL_TABLE, p.n == k.pool).order_by(k.seq)),
        sa.insert(attempts).from_select(list(attempt), sa.select(*attempt.values())
            .join_from(m, KEYS_TABLE, m.c.idempotency_key == k.key).order_by(m.c.id)),
        sa.delete(KEYS_TABLE),
    )  # fmt: skip
    rng = random.Random(n)
    for first in range(0, n, CHUNK):
        with engine.begin() as conn:
            conn.execute(sa.insert(KEYS_TABLE), _keys(rng, first, min(CHUNK, n - first), n, pool))
            for statement in inserts:
                conn.execute(statement)
        if first and first % (20 * CHUNK) == 0:
            print(f"#   filled {first:,} of {n:,}", file=sys.stderr, flush=True)
    _bench.drop_all(engine)
    return round(time.perf_counter() - began, 1)


# -- measuring -------------------------------------------------------------------------------

_SIZES = {  # per backend: a table's heap, TOAST, total bytes (free, file); its indexes' bytes
    "postgresql": (
        "SELECT pg_relation_size(c.oid) AS heap, pg_total_relation_size(c.oid) AS total, "
        "coalesce(pg_total_relation_size(nullif(c.reltoastrelid, 0)), 0) AS toast "
        "FROM pg_class c WHERE c.oid = to_regclass(:t)",
        "SELECT i.relname, pg_relation_size(i.oid) FROM pg_index x "
        "JOIN pg_class i ON i.oid = x.indexrelid WHERE x.indrelid = to_regclass(:t)",
    ),
    "mysql": (
        "SELECT t.data_length AS heap, t.data_length + t.index_length AS total, "
        "t.data_free AS free, s.file_size AS file FROM information_schema.tables t "
        "LEFT JOIN information_schema.innodb_sys_tablespaces s "
        "ON s.name = concat(database(), '/', :t) "
        "WHERE t.table_schema = database() AND t.table_name = :t",
        "SELECT index_name, stat_value * @@innodb_page_size FROM mysql.innodb_index_stats "
        "WHERE database_name = database() AND table_name = :t AND stat_name = 'size' "
        "AND index_name <> 'PRIMARY'",
    ),
    "sqlite": (
        "SELECT sum(CASE WHEN d.name = :t AND pagetype <> 'overflow' THEN pgsize END) AS heap, "
        "sum(CASE WHEN d.name = :t AND pagetype = 'overflow' THEN pgsize ELSE 0 END) AS toast, "
        "sum(pgsize) AS total FROM dbstat d JOIN sqlite_master s ON s.name = d.name "
        "WHERE s.tbl_name = :t",
        "SELECT s.name, sum(d.pgsize) FROM sqlite_master s JOIN dbstat d ON d.name = s.name "
        "WHERE s.tbl_name = :t AND s.type = 'index' GROUP BY s.name",
    ),
}
_SIZES["mariadb"] = _SIZES["mysql"]


def _measure(engine: sa.Engine, n: int) -> dict[str, Any]:
    """Each table's bytes per message: ``heap`` its rows (MariaDB: the clustered index, long
    values included; SQLite: its b-tree but the overflow pages), ``toast`` its values stored
    out of line (PostgreSQL: TOAST with its index; SQLite: overflow pages), ``total`` with its
    ``indexes`` (PostgreSQL: and the free-space and visibility maps), on MariaDB ``free``
    (data_free) and its ``file``; on SQLite also the database ``file`` and its ``free`` list."""
    found: dict[str, Any] = {}
    with engine.connect() as conn:
        table_sql, index_sql = _SIZES[engine.dialect.name]
        for t in TABLES:
            found[t] = dict(conn.execute(sa.text(table_sql), {"t": t}).one()._mapping)
            found[t]["indexes"] = dict(conn.execute(sa.text(index_sql), {"t": t}).tuples().all())
        if engine.dialect.name == "sqlite":
            page = conn.exec_driver_sql("PRAGMA page_size").scalar_one()
            found["file"] = conn.exec_driver_sql("PRAGMA page_count").scalar_one() * page
            found["free"] = conn.exec_driver_sql("PRAGMA freelist_count").scalar_one() * page
        if engine.dialect.name == "postgresql":
            found["live_messages"] = _live_pg(conn)
    return _per_message(found, n)


def _per_message(found: dict[str, Any], n: int) -> dict[str, Any]:
    """The byte counts in ``found`` (nested) divided by ``n``, to a tenth."""
    return {
        k: _per_message(v, n) if isinstance(v, dict) else round(int(v) / n, 1)
        for k, v in found.items() if v is not None
    }  # fmt: skip


def _live_pg(conn: sa.Connection) -> dict[str, Any]:
    """pgstattuple's live tuple bytes, dead tuple bytes and free space in outbox_messages and
    in its TOAST table; none if the extension cannot be created."""
    stats = "SELECT tuple_len, dead_tuple_len, free_space FROM pgstattuple(CAST(:r AS regclass))"
    toast = "SELECT reltoastrelid::regclass::text FROM pg_class WHERE oid = to_regclass(:r)"
    try:
        with conn.begin_nested():
            conn.execute(sa.text("CREATE EXTENSION IF NOT EXISTS pgstattuple"))
    except sa.exc.DBAPIError:
        return {}
    toast_table = conn.execute(sa.text(toast), {"r": TABLES[0]}).scalar()
    return {
        part: dict(conn.execute(sa.text(stats), {"r": rel}).one()._mapping)
        for part, rel in (("heap", TABLES[0]), ("toast", toast_table))
    }


def _maintain(engine: sa.Engine, *, compact: bool) -> None:
    """PostgreSQL: VACUUM (FULL if ``compact``) and ANALYZE; MariaDB: once InnoDB purged the
    old row versions (and their long values; five minutes at most), OPTIMIZE TABLE if
    ``compact``, and ANALYZE TABLE; SQLite: VACUUM if ``compact``."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        if engine.dialect.name == "sqlite":
            statements = ["VACUUM"] if compact else []
        elif engine.dialect.name == "postgresql":
            statements = [f"VACUUM ({'FULL, ' if compact else ''}ANALYZE) {t}" for t in TABLES]
        else:
            history = "SELECT count FROM information_schema.innodb_metrics WHERE name = :n"
            for _ in range(300):  # until its undo history is down to 10 transactions
                if conn.execute(sa.text(history), {"n": "trx_rseg_history_len"}).scalar_one() <= 10:
                    break
                time.sleep(1.0)
            verbs = ("OPTIMIZE", "ANALYZE") if compact else ("ANALYZE",)
            statements = [f"{verb} TABLE {t}" for t in TABLES for verb in verbs]
        for statement in statements:
            conn.execute(sa.text(statement))


# -- the benchmark ---------------------------------------------------------------------------


def _drop(engine: sa.Engine, n: int) -> dict[str, Any]:
    """Drop every sent message's body through ``outbox-relay prune --keep-bodies 0`` (its
    ``--older-than`` deletes nothing: the rows are two weeks old at most); the bodies it
    dropped, its seconds (process start-up included) and rows per second."""
    command = [
        str(Path(sys.executable).with_name("outbox-relay")), "prune", "--database-url",
        url_string(engine), "--older-than", "3650d", "--keep-bodies", "0", "--json",
    ]  # fmt: skip
    began = time.perf_counter()
    proc = subprocess.run(command, env=_child_env(), capture_output=True, text=True)
    seconds = time.perf_counter() - began
    if proc.returncode:
        raise RuntimeError(f"prune exited {proc.returncode}: {proc.stderr[-2000:]}")
    report = json.loads(proc.stdout)
    if report["bodies_dropped"] != n or report["deleted"]:
        raise RuntimeError(f"expected {n} bodies dropped and no row deleted: {report}")
    return {"bodies": n, "seconds": round(seconds, 2), "rows_per_s": round(n / seconds, 1)}


def retention(engine: sa.Engine, sizes: Sizes, db: str) -> list[Result]:
    """Fill, measure, drop the bodies, measure in place, compact, measure: the messages table
    with its indexes per sent message (PostgreSQL's judged against ``TARGET``), the same with
    its attempt row, and how fast the prune dropped the bodies. Every stage's bytes per
    message, table by table and index by index, are in the first row's details."""
    n, pg = sizes.retention, engine.dialect.name == "postgresql"
    reset(engine)
    details = {"messages": n, "distinct_emails": min(n, POOL), "fill_seconds": _fill(engine, n)}
    _maintain(engine, compact=False)
    per = {"before": _measure(engine, n)}
    drop = _drop(engine, n)
    _maintain(engine, compact=False)
    per["in place"] = _measure(engine, n)
    _maintain(engine, compact=True)
    per["compacted"] = _measure(engine, n)
    for stage, found in per.items():
        for table in TABLES:
            print(f"#   {stage}, {table}: {json.dumps(found[table])}", file=sys.stderr)
    kept = {stage: found[TABLES[0]]["total"] for stage, found in per.items()}
    both = {stage: kept[stage] + found[TABLES[1]]["total"] for stage, found in per.items()}

    def row(name: str, value: float, baseline: float, what: str, **more: Any) -> Result:
        return Result(
            benchmark=name, database=db, value=value, baseline=baseline, unit="B",
            ratio=value / baseline, target=more.pop("target", "(reported)"),
            met=more.pop("met", None), details={"value": what, **more},
        )  # fmt: skip

    return [
        row(
            "retained B/msg, compacted", kept["compacted"], kept["before"],
            "messages table with its indexes per message, compacted; baseline: with the bodies",
            target=f"< {TARGET:g} B incl. indexes" if pg else "(reported)",
            met=kept["compacted"] < TARGET if pg else None, bytes_per_message=per, **details,
        ),
        row(
            "retained B/msg, in place", kept["in place"], kept["before"],
            "the same after a plain VACUUM / ANALYZE: the files, free space in them included",
        ),
        row(
            "retained B/msg with attempt", both["compacted"], both["before"],
            "messages and attempts tables with their indexes, compacted",
            in_place=both["in place"],
        ),
        Result(
            benchmark="body drop", database=db, value=drop["rows_per_s"], baseline=math.nan,
            unit="rows/s", ratio=math.nan, target="(reported)", met=None,
            details={"how": "outbox-relay prune --keep-bodies 0", **drop},
        ),
    ]  # fmt: skip
