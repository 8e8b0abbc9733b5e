"""The benchmark's own database: created if missing, its tables dropped and migrated afresh,
and filled with due or finished rows by fast bulk SQL."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import sqlalchemy as sa

from outbox import Email, Outbox
from outbox.enqueue import build_row
from outbox.migrations import VERSION_TABLE, VIEWS, upgrade
from outbox.schema import messages, metadata, utcnow
from relay.db import make_engine

__all__ = [
    "EMAIL",
    "ORDERS",
    "base_payload",
    "count",
    "fill",
    "prepare",
    "reset",
    "url_string",
]

EMAIL = Email(
    sender="shop@example.com",
    to=("customer@example.com",),
    subject="Your order has shipped",
    text="Hello,\n\nyour order is on its way.\n" * 5,
    html="<p>Hello,</p><p>your order is on its way.</p>" * 5,
    tags={"kind": "shipping"},
)

bench_metadata = sa.MetaData()
ORDERS = sa.Table(
    "bench_orders",
    bench_metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("customer", sa.String(100), nullable=False),
    sa.Column("total", sa.Numeric(10, 2), nullable=False),
    sa.Column("created_at", sa.DateTime, nullable=False),
)

_ROW_COLUMNS = (
    "idempotency_key", "category", "priority", "status", "payload", "recipients",
    "recipient_count", "subject", "attempt_count", "max_attempts", "backoff_base",
    "backoff_cap", "ambiguity_policy", "next_attempt_at", "expires_at", "created_at",
    "updated_at",
)  # fmt: skip
_CHUNK = 5000


def url_string(engine: sa.Engine) -> str:
    return engine.url.render_as_string(hide_password=False)


def _ensure_database(url: sa.URL) -> None:
    backend = url.get_backend_name()
    if backend == "postgresql":
        server = sa.create_engine(url.set(database="postgres"), isolation_level="AUTOCOMMIT")
        try:
            with server.connect() as conn:
                exists = conn.execute(
                    sa.text("SELECT 1 FROM pg_database WHERE datname = :n"), {"n": url.database}
                ).scalar()
                if not exists:
                    conn.execute(sa.text(f'CREATE DATABASE "{url.database}"'))
        finally:
            server.dispose()
    elif backend in ("mysql", "mariadb"):
        # URL.set ignores None: a URL naming no database, to create it in
        server = sa.create_engine(url._replace(database=None))
        try:
            with server.begin() as conn:
                conn.execute(sa.text(f"CREATE DATABASE IF NOT EXISTS `{url.database}`"))
        finally:
            server.dispose()


def prepare(url: str) -> sa.Engine:
    """An engine on ``url`` with a fresh outbox schema (and the benchmark's orders table)."""
    parsed = sa.make_url(url)
    _ensure_database(parsed)
    engine = make_engine(parsed, pool_size=20, max_overflow=20)
    with engine.begin() as conn:
        for view in sorted(VIEWS):
            conn.execute(sa.text(f"DROP VIEW IF EXISTS {view}"))
    metadata.drop_all(engine)
    bench_metadata.drop_all(engine)
    with engine.begin() as conn:
        conn.execute(sa.text(f"DROP TABLE IF EXISTS {VERSION_TABLE}"))
    upgrade(engine)
    bench_metadata.create_all(engine)
    return engine


def reset(engine: sa.Engine) -> None:
    """Empty the outbox tables."""
    with engine.begin() as conn:
        for table in reversed(metadata.sorted_tables):
            conn.execute(table.delete())
        conn.execute(ORDERS.delete())


def analyze(engine: sa.Engine) -> None:
    name = engine.dialect.name
    with engine.begin() as conn:
        if name == "postgresql":
            conn.execute(sa.text("ANALYZE outbox_messages"))
        elif name in ("mysql", "mariadb"):
            conn.execute(sa.text("ANALYZE TABLE outbox_messages"))
        else:
            conn.execute(sa.text("ANALYZE"))


def _base_row(status: str, age: timedelta, email: Email = EMAIL) -> dict[str, Any]:
    outbox = Outbox()
    row = build_row(
        email,
        key="template",
        category=outbox.categories[outbox.default_category],
        priority=0,
        not_before=None,
        expires_at=None,
        now=utcnow() - age,
    )
    row["status"] = status
    return row


def base_payload(email: Email = EMAIL) -> bytes:
    """The payload every benchmark row stores, as JSON bytes: what the peer's jobs carry."""
    return json.dumps(_base_row("pending", timedelta(0), email)["payload"]).encode()


def count(engine: sa.Engine, status: str | None = None) -> int:
    stmt = sa.select(sa.func.count()).select_from(messages)
    if status is not None:
        stmt = stmt.where(messages.c.status == status)
    with engine.connect() as conn:
        return int(conn.execute(stmt).scalar_one())


def fill(
    engine: sa.Engine, n: int, *, prefix: str, status: str = "pending", email: Email = EMAIL
) -> None:
    """Insert ``n`` due rows of ``status`` as ``Outbox.enqueue`` writes them: up to one chunk
    by executemany of copies of one built row, then by doubling (INSERT ... SELECT) when more
    are needed. Keys are ``prefix-...``, distinct."""
    base = _base_row(status, timedelta(minutes=5), email)
    first = min(n, _CHUNK)
    with engine.begin() as conn:
        rows = [{**base, "idempotency_key": f"{prefix}-{i}"} for i in range(first)]
        conn.execute(sa.insert(messages), rows)
    have, generation = first, 0
    m = messages
    while have < n:
        generation += 1
        take = min(have, n - have)
        cols = [m.c[c] for c in _ROW_COLUMNS]
        copied = [
            (m.c.idempotency_key + f"-g{generation}").label("idempotency_key")
            if c.name == "idempotency_key"
            else c
            for c in cols
        ]
        src = (
            sa.select(*copied)
            .where(m.c.idempotency_key.like(f"{prefix}-%"), m.c.status == status)
            .order_by(m.c.id)
            .limit(take)
        )
        with engine.begin() as conn:
            conn.execute(sa.insert(m).from_select(list(_ROW_COLUMNS), src))
        have += take
