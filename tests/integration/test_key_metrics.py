"""The queue by fairness key on SQLite, PostgreSQL and MariaDB: the ``outbox_fairness`` view,
the store's read of the busiest keys (``read_due_by_key``) and the relay's per-key gauges on
/metrics, with a small ``top`` so the rest is summed as ``other``, and keys that are hostile
label values."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

from outbox.schema import messages
from relay import metrics as relay_metrics
from relay import store
from relay.clock import read_database_time
from relay.http import start_http_server
from relay.metrics import OTHER_KEYS, UNKEYED, RelayMetrics
from relay.store.catalog import read_due_by_key
from relay.testing import FakeSender
from tests.support.factories import enqueue
from tests.support.inprocess import relay_for

LATER = timedelta(hours=1)  # a not-due row's next attempt, after now
# ages (seconds) of each key's due rows, oldest first, and its rows that are not due yet
BACKLOG: dict[str | None, tuple[list[int], int]] = {
    "acme": ([500, 400, 300, 200, 100], 1),
    "globex": ([900, 10, 10, 10], 0),
    "initech": ([700, 20, 20], 2),
    "umbrella": ([50, 40], 0),
    "hooli": ([800], 0),
    None: ([600, 30], 1),
}


def set_rows(engine: sa.Engine, ids: list[int], **values: Any) -> None:
    with engine.begin() as conn:
        conn.execute(messages.update().where(messages.c.id.in_(ids)).values(**values))


def queue(engine: sa.Engine, key: str | None, ages: list[int], later: int, now: datetime) -> None:
    """Messages of ``key`` due ``ages`` seconds before ``now``, and ``later`` not due yet."""
    ids = enqueue(engine, len(ages) + later, fairness_key=key, short=True)
    for row_id, age in zip(ids, ages, strict=False):
        set_rows(engine, [row_id], next_attempt_at=now - timedelta(seconds=age))
    if later:
        set_rows(engine, ids[len(ages) :], next_attempt_at=now + LATER)


def backlog(engine: sa.Engine, now: datetime) -> None:
    """:data:`BACKLOG`, and rows that are not queued: a key whose only message was sent, and
    one message of acme's being sent and one retrying."""
    for key, (ages, later) in BACKLOG.items():
        queue(engine, key, ages, later, now)
    (sent,) = enqueue(engine, 1, fairness_key="sent-only", short=True)
    set_rows(engine, [sent], status="sent", sent_at=now)
    sending, retrying = enqueue(engine, 2, fairness_key="acme", short=True)
    set_rows(engine, [sending], status="processing", claim_token="t", claimed_at=now)
    set_rows(
        engine, [retrying], status="retrying", attempt_count=1, next_attempt_at=now - timedelta(1)
    )


def expected(top: int) -> tuple[list[tuple[str, int, int]], tuple[int, int], tuple[int, int]]:
    """What :func:`backlog` holds by key: the ``top`` keys as (key, due, oldest age) with the
    most due first (ties by key), the rest as (due, oldest age), the unkeyed as (due, oldest
    age); acme's retrying message is a day old."""
    due = {key: (len(ages), max(ages)) for key, (ages, _) in BACKLOG.items()}
    due["acme"] = (due["acme"][0] + 1, 86400)
    unkeyed = due.pop(None)
    ranked = sorted(((k, n, age) for k, (n, age) in due.items() if k), key=lambda t: (-t[1], t[0]))
    rest = ranked[top:]
    return (
        ranked[:top],
        (sum(n for _, n, _ in rest), max((age for _, _, age in rest), default=0)),
        unkeyed,
    )


def database_now(engine: sa.Engine) -> datetime:
    with engine.connect() as conn:
        return read_database_time(conn)


# -- the view ---------------------------------------------------------------------------------


def test_the_fairness_view_has_a_row_per_key_and_one_for_the_unkeyed(backend):
    engine = backend.engine
    now = database_now(engine)
    backlog(engine, now)
    with engine.connect() as conn:
        rows = {r["fairness_key"]: r for r in store.read_view(conn, "outbox_fairness")}
    counts = {
        k: (r["due_count"], r["queued_count"], r["processing_count"]) for k, r in rows.items()
    }
    want = {key: (len(ages), len(ages) + later, 0) for key, (ages, later) in BACKLOG.items()}
    want["acme"] = (want["acme"][0] + 1, want["acme"][1] + 1, 1)  # its retrying and sending
    assert counts == want, "sent-only has no row: nothing of it is queued"
    for key, (ages, _) in BACKLOG.items():
        oldest = 86400 if key == "acme" else max(ages)
        assert rows[key]["oldest_due_at"] == now - timedelta(seconds=oldest), key
        assert oldest <= rows[key]["lag_seconds"] < oldest + 60, key


def test_a_key_with_nothing_due_has_no_lag(backend):
    engine = backend.engine
    now = database_now(engine)
    queue(engine, "later", [], 2, now)
    (sending,) = enqueue(engine, 1, fairness_key="in-flight", short=True)
    set_rows(engine, [sending], status="processing", claim_token="t", claimed_at=now)
    with engine.connect() as conn:
        rows = {r["fairness_key"]: r for r in store.read_view(conn, "outbox_fairness")}
    shape = {
        k: (r["due_count"], r["queued_count"], r["processing_count"], r["oldest_due_at"])
        for k, r in rows.items()
    }
    assert shape == {"later": (0, 2, 0, None), "in-flight": (0, 0, 1, None)}
    assert [r["lag_seconds"] for r in rows.values()] == [0.0, 0.0]


# -- the store's read of the busiest keys -----------------------------------------------------


@pytest.mark.parametrize("top", [0, 2, 3, 10])
def test_the_busiest_keys_are_named_and_the_rest_summed(backend, top):
    engine = backend.engine
    now = database_now(engine)
    backlog(engine, now)
    with engine.connect() as conn:
        due = read_due_by_key(conn, now=now, top=top)
    named, (rest_count, rest_age), (unkeyed_count, unkeyed_age) = expected(top)
    assert [(d.key, d.due_count, now - d.oldest_due_at) for d in due.top] == [
        (key, n, timedelta(seconds=age)) for key, n, age in named
    ]
    assert (due.rest.key, due.rest.due_count) == (None, rest_count)
    assert due.rest.oldest_due_at == (now - timedelta(seconds=rest_age) if rest_count else None)
    assert (due.unkeyed.due_count, due.unkeyed.oldest_due_at) == (
        unkeyed_count,
        now - timedelta(seconds=unkeyed_age),
    )


def test_the_busiest_keys_agree_with_the_view(backend):
    engine = backend.engine
    now = database_now(engine)
    backlog(engine, now)
    with engine.connect() as conn:
        due = read_due_by_key(conn, now=now, top=100)
        rows = {r["fairness_key"]: r for r in store.read_view(conn, "outbox_fairness")}
    read = {d.key: (d.due_count, d.oldest_due_at) for d in [*due.top, due.unkeyed]}
    assert read == {k: (r["due_count"], r["oldest_due_at"]) for k, r in rows.items()}


def test_a_negative_top_is_refused(backend):
    with backend.engine.connect() as conn, pytest.raises(ValueError, match="top"):
        read_due_by_key(conn, now=datetime.now(UTC), top=-1)
    with pytest.raises(ValueError, match="top_keys"):
        RelayMetrics(relay_for(backend, FakeSender()), top_keys=-1)


# -- the gauges -------------------------------------------------------------------------------


@contextmanager
def metrics_of(backend, **options: Any) -> Iterator[RelayMetrics]:
    metrics = RelayMetrics(relay_for(backend, FakeSender()), key_interval=0.0, **options)
    try:
        yield metrics
    finally:
        metrics.close()


def gauges(body: str) -> dict[str, dict[str, float]]:
    """The per-key gauges of a /metrics page: ``{metric: {key label: value}}``."""
    found: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(body):
        if family.name.startswith("outbox_key_"):
            for s in family.samples:
                found.setdefault(s.name, {})[s.labels.get("key", "?")] = s.value
    return found


def test_the_gauges_name_the_top_keys_and_sum_the_rest_as_other(backend):
    engine = backend.engine
    backlog(engine, database_now(engine))
    with metrics_of(backend, top_keys=2) as metrics:
        page = gauges(metrics.exposition().decode())
    named, (rest_count, rest_age), (unkeyed_count, unkeyed_age) = expected(2)
    due = {key: float(n) for key, n, _ in named}
    due |= {OTHER_KEYS: float(rest_count), UNKEYED: float(unkeyed_count)}
    assert page["outbox_key_due_messages"] == due
    ages = {key: age for key, _, age in named} | {OTHER_KEYS: rest_age, UNKEYED: unkeyed_age}
    lag = page["outbox_key_lag_seconds"]
    assert set(lag) == set(ages)
    assert all(ages[k] <= lag[k] < ages[k] + 60 for k in ages), (lag, ages)
    assert page["outbox_key_refresh_errors_total"] == {"?": 0.0}


def test_other_and_the_unkeyed_are_there_from_the_first_scrape(backend):
    with metrics_of(backend) as metrics:
        page = gauges(metrics.exposition().decode())
    idle = {OTHER_KEYS: 0.0, UNKEYED: 0.0}
    assert page["outbox_key_due_messages"] == idle
    assert page["outbox_key_lag_seconds"] == idle


def test_a_key_spelled_other_is_counted_in_other(backend):
    engine = backend.engine
    now = database_now(engine)
    queue(engine, OTHER_KEYS, [300, 20, 10], 0, now)
    queue(engine, "big", [100, 10, 10, 10], 0, now)
    queue(engine, "small", [900], 0, now)
    with metrics_of(backend, top_keys=2) as metrics:
        page = gauges(metrics.exposition().decode())
    assert page["outbox_key_due_messages"] == {"big": 4.0, OTHER_KEYS: 4.0, UNKEYED: 0.0}
    assert 900 <= page["outbox_key_lag_seconds"][OTHER_KEYS] < 960


HOSTILE = [
    'quote"d',
    "back\\slash\\",
    "new\nline",
    'x"} 1\noutbox_injected_total 1\n# TYPE outbox_injected counter',
    "\\n is not a newline",
    "cr\rand\ttab",
    "unicode ✉ 中文 é ß",
    "k" * 255,
]


def test_hostile_keys_are_escaped_label_values_on_the_page(backend):
    """Each key is a label value the Prometheus parser reads back as it was written; nothing
    in a key adds a line or a metric to the page."""
    engine = backend.engine
    now = database_now(engine)
    for n, key in enumerate(HOSTILE, start=1):
        queue(engine, f"hostile-{n}", [60 * n] * n, 0, now)
        # enqueue refuses control characters in a key; the table may still hold them
        # (written by SQL, or by a release before the check): the page must stay whole
        with engine.begin() as conn:
            conn.execute(
                sa.update(messages)
                .where(messages.c.fairness_key == f"hostile-{n}")
                .values(fairness_key=key)
            )
    with metrics_of(backend, top_keys=len(HOSTILE)) as metrics:
        server = start_http_server(metrics.relay, metrics, 0, "127.0.0.1")
        try:
            body = fetch(f"http://127.0.0.1:{server.port}/metrics")
        finally:
            server.stop()
    families = {f.name for f in text_string_to_metric_families(body)}
    assert not any("injected" in name for name in families)
    assert not any(line.startswith("outbox_injected") for line in body.split("\n"))
    due = gauges(body)["outbox_key_due_messages"]
    want = {key: float(n) for n, key in enumerate(HOSTILE, start=1)}
    assert due == want | {OTHER_KEYS: 0.0, UNKEYED: 0.0}
    samples = [line for line in body.split("\n") if line.startswith("outbox_key_")]
    assert len(samples) == 2 * (len(HOSTILE) + 2) + 1  # both gauges, and the error counter


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


def test_a_failed_read_leaves_the_key_series_out_and_is_counted(backend, monkeypatch):
    engine = backend.engine
    queue(engine, "acme", [100], 0, database_now(engine))

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise sa.exc.OperationalError("SELECT", {}, Exception("the database went away"))

    with metrics_of(backend) as metrics:
        monkeypatch.setattr(relay_metrics, "read_due_by_key", refuse)
        failed = gauges(metrics.exposition().decode())
        monkeypatch.undo()
        again = gauges(metrics.exposition().decode())
    assert failed == {"outbox_key_refresh_errors_total": {"?": 1.0}}
    assert again["outbox_key_due_messages"] == {"acme": 1.0, OTHER_KEYS: 0.0, UNKEYED: 0.0}
    assert again["outbox_key_refresh_errors_total"] == {"?": 1.0}


def test_the_keys_are_read_at_most_once_per_interval(backend):
    engine = backend.engine
    relay = relay_for(backend, FakeSender())
    metrics = RelayMetrics(relay, key_interval=3600)
    try:
        first = gauges(metrics.exposition().decode())["outbox_key_due_messages"]
        queue(engine, "acme", [100], 0, database_now(engine))
        cached = gauges(metrics.exposition().decode())["outbox_key_due_messages"]
        metrics.refresh_keys()
        read = gauges(metrics.exposition().decode())["outbox_key_due_messages"]
    finally:
        metrics.close()
    assert first == cached == {OTHER_KEYS: 0.0, UNKEYED: 0.0}
    assert read == {"acme": 1.0, OTHER_KEYS: 0.0, UNKEYED: 0.0}
