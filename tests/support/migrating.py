"""What the live-upgrade tests share: a row as the app wrote it, a long transaction that
holds the table, the app's writer timing each insert while a migration runs, and a change
run past a reader holding the table."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from outbox import Category, Email
from outbox.enqueue import build_row
from outbox.schema import messages

__all__ = ["T0", "Holder", "Writer", "change_past_a_reader", "old_row"]

T0 = datetime(2026, 11, 1, tzinfo=UTC)


def old_row(i: int, status: str) -> dict[str, Any]:
    """A row as the app wrote it before the upgrade (no new column)."""
    row = build_row(
        Email(sender="shop@example.com", to=[f"c{i}@example.com"], subject=f"S{i}", text="t"),
        key=f"live-{i}",
        category=Category(name="default"),
        priority=0,
        not_before=T0,
        expires_at=None,
        now=T0,
    )
    return {**row, "status": status, "updated_at": T0 - timedelta(days=20)}


class Holder:
    """A long transaction that has read outbox_messages: it holds the table (PostgreSQL's
    ACCESS SHARE, MariaDB's metadata lock) until it ends, as a report or a slow request
    would."""

    def __init__(self, engine: sa.Engine, table: str = "outbox_messages") -> None:
        self.conn = engine.connect()
        self.tx = self.conn.begin()
        self.conn.execute(sa.text(f"SELECT COUNT(*) FROM {table}")).scalar_one()

    def end(self) -> None:
        self.tx.rollback()
        self.conn.close()


def _insert(conn: sa.Connection, i: int) -> None:
    conn.execute(sa.insert(messages).values(old_row(i, "pending")))


class Writer(threading.Thread):
    """The app: one write after another (``write(conn, i)``; by default an insert of a
    message), each its own transaction, timing each."""

    def __init__(
        self, engine: sa.Engine, write: Callable[[sa.Connection, int], None] = _insert
    ) -> None:
        super().__init__(daemon=True)
        self.engine = engine
        self.write = write
        self.waits: list[float] = []
        self.stop = threading.Event()
        self.errors: list[BaseException] = []

    def run(self) -> None:
        i = 1000
        while not self.stop.is_set():
            i += 1
            began = time.monotonic()
            try:
                with self.engine.begin() as conn:
                    self.write(conn, i)
            except BaseException as exc:  # reported by the test
                self.errors.append(exc)
                return
            self.waits.append(time.monotonic() - began)
            time.sleep(0.02)


def change_past_a_reader(
    engine: sa.Engine, change: Callable[[], object], *, held: float, table: str = "outbox_messages"
) -> None:
    """Run ``change`` while the app writes and a reader holds ``table`` for ``held`` seconds
    from its start: check it waited the reader out, and the app's inserts went on meanwhile,
    none held long (asserts carry their values: pytest rewrites only the test modules')."""
    writer = Writer(engine)
    writer.start()
    time.sleep(0.3)
    holder = Holder(engine, table)
    timer = threading.Timer(held, holder.end)
    timer.start()
    began = time.monotonic()
    try:
        change()
    finally:
        timer.join()
        took = time.monotonic() - began
        writer.stop.set()
        writer.join(10)
    assert writer.errors == [], writer.errors
    assert took >= held - 0.5, took  # it did wait for the reader
    assert len(writer.waits) > 15, len(writer.waits)  # the app kept writing meanwhile
    assert max(writer.waits) < 2.0, sorted(writer.waits)[-5:]
