"""A page of messages (``store.list_messages``, the console's messages page) on a table whose
rows come in time order, with keys that gather: the rows are exactly the filter's newest, on
every backend, whichever way PostgreSQL is told to read them; and on PostgreSQL a date range
or a key prefix far from the newest rows is read through its index, not by walking every
newer row (the console's 200 ms at a million rows: bench/console.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from outbox.schema import messages
from relay import store
from relay.store import bulk

N = 6000
START = datetime(2026, 1, 1, tzinfo=UTC)
PAGE = 51


def _fill(engine: sa.Engine) -> None:
    """``N`` messages a minute apart, ids in time order; keys ``reset:<i>`` so a prefix
    (``reset:1*``) gathers in the oldest rows, every other one an ``order:<i>`` spread evenly."""
    rows = []
    for i in range(1, N + 1):
        at = START + timedelta(minutes=i)
        rows.append(
            {
                "idempotency_key": f"order:{i}" if i % 2 == 0 else f"reset:{i}",
                "category": "default",
                "status": "failed" if i % 7 == 0 else "sent",
                "payload": {"v": 1},
                "recipients": f"user{i}@example.com",
                "recipient_count": 1,
                "subject": f"message {i}",
                "max_attempts": 5,
                "backoff_base": 2.0,
                "backoff_cap": 60.0,
                "ambiguity_policy": "hold",
                "next_attempt_at": at,
                "created_at": at,
                "updated_at": at,
                "fair_at": at,
            }
        )
    with engine.begin() as conn:
        for start in range(0, N, 1000):
            conn.execute(sa.insert(messages), rows[start : start + 1000])
    if engine.dialect.name == "postgresql":
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.exec_driver_sql("VACUUM ANALYZE outbox_messages")


def _day(n: int) -> datetime:
    return START + timedelta(minutes=n)


FILTERS = {
    "key prefix, oldest rows": store.Filter(key="reset:1*"),
    "key prefix, evenly spread": store.Filter(key="order:*"),
    "exact key": store.Filter(key="reset:17"),
    "a range in the middle": store.Filter(created_after=_day(2000), created_before=_day(2600)),
    "a wide range": store.Filter(created_after=_day(100), created_before=_day(5900)),
    "only a start": store.Filter(created_after=_day(5000)),
    "only an end": store.Filter(created_before=_day(300)),
    "combination": store.Filter(
        statuses=("failed",), key="reset:*", created_after=_day(1000), created_before=_day(3000)
    ),
    "a prefix with a LIKE wildcard in it": store.Filter(key="re_et:1*"),
}


def _expected(f: store.Filter, before: int | None) -> list[int]:
    """The filter's page, worked out in Python from the rows as made."""
    found = []
    for i in range(N, 0, -1):
        key = f"order:{i}" if i % 2 == 0 else f"reset:{i}"
        status = "failed" if i % 7 == 0 else "sent"
        at = _day(i)
        if before is not None and i >= before:
            continue
        if f.key is not None and not (
            key.startswith(f.key[:-1]) if f.key.endswith("*") else key == f.key
        ):
            continue
        if f.statuses and status not in f.statuses:
            continue
        if f.created_after is not None and at < f.created_after:
            continue
        if f.created_before is not None and at >= f.created_before:
            continue
        found.append(i)
        if len(found) == PAGE:
            break
    return found


@pytest.fixture
def filled(engine: sa.Engine) -> sa.Engine:
    _fill(engine)
    return engine


@pytest.mark.parametrize("safe_read", [bulk.SAFE_READ, 200])
def test_a_page_is_the_filters_newest_rows_whichever_way_it_is_read(
    filled: sa.Engine, monkeypatch: pytest.MonkeyPatch, safe_read: int
) -> None:
    """Every filter, first page and a page further on, against the rows worked out in Python;
    twice on PostgreSQL, reading matches first as often as it may and only as the estimates
    choose (``SAFE_READ`` 200): both ways give the same rows."""
    monkeypatch.setattr(bulk, "SAFE_READ", safe_read)
    with filled.connect() as conn:
        first_id = conn.execute(sa.select(sa.func.min(messages.c.id))).scalar_one()
        offset = first_id - 1  # ids on a server may not start at 1
        for name, f in FILTERS.items():
            for before in (None, 2500):
                got = store.list_messages(
                    conn,
                    f,
                    limit=PAGE,
                    before_id=None if before is None else before + offset,
                    newest_first=True,
                )
                assert [r.id - offset for r in got] == _expected(f, before), name


def _sent_order(engine: sa.Engine, f: store.Filter) -> str:
    """The ORDER BY of the page's SELECT as sent to the database."""
    sent: list[str] = []

    def catch(_c: object, _cur: object, statement: str, *_: object) -> None:
        if statement.lstrip().upper().startswith("SELECT"):
            sent.append(statement)

    sa.event.listen(engine, "before_cursor_execute", catch)
    try:
        with engine.connect() as conn:
            store.list_messages(conn, f, limit=PAGE, newest_first=True)
    finally:
        sa.event.remove(engine, "before_cursor_execute", catch)
    return sent[-1].split("ORDER BY")[1]


def test_postgresql_reads_gathered_matches_through_their_index(
    postgres_backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key prefix of the oldest rows is read through the key's index (fewer matches than
    ``SAFE_READ``: the estimates cannot see where a prefix's rows gather). Then with the
    estimates deciding (``SAFE_READ`` 200): a range in the middle, and one ending in the
    oldest rows, are read through created_at's index; a prefix whose rows are everywhere, a
    range of nearly every row, and no filter walk the primary key newest first."""
    engine = postgres_backend.engine
    _fill(engine)
    walks, reads = "outbox_messages.id DESC", "outbox_messages.id + "
    assert reads in _sent_order(engine, FILTERS["key prefix, oldest rows"])
    with engine.begin() as conn:
        # the key's index can serve a prefix (under the database's collation a plain index
        # could not): asked not to scan the table, the planner reads it; on 6,000 rows it
        # would rightly scan otherwise
        conn.exec_driver_sql("SET LOCAL enable_seqscan = off")
        plan = "\n".join(
            conn.exec_driver_sql(
                "EXPLAIN SELECT id FROM outbox_messages WHERE idempotency_key LIKE 'reset:1%%' "
                "ORDER BY id + 0 DESC LIMIT 51"
            ).scalars()
        )
    assert "ix_outbox_messages_idempotency_key" in plan, plan
    monkeypatch.setattr(bulk, "SAFE_READ", 200)
    for name in ("a range in the middle", "only an end"):
        order = _sent_order(engine, FILTERS[name])
        assert walks not in order, name
        assert reads in order, name
    assert walks in _sent_order(engine, store.Filter())
    assert walks in _sent_order(engine, FILTERS["key prefix, evenly spread"])
    assert walks in _sent_order(engine, FILTERS["a wide range"])
