"""PostgreSQL: one NOTIFY per committed transaction that enqueued, none for a rollback."""

from __future__ import annotations

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

from outbox import NOTIFY_CHANNEL, Email, Outbox


@pytest.fixture
def listener(postgres_backend):
    backend = postgres_backend
    url = sa.make_url(backend.url).set(drivername="postgresql")
    conn = psycopg.connect(url.render_as_string(hide_password=False), autocommit=True)
    conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
    yield backend, conn
    conn.close()


def drain(conn) -> list:
    return list(conn.notifies(timeout=0.5))


def test_one_notification_per_committed_transaction(listener):
    backend, conn = listener
    ob = Outbox()
    Sessions = sessionmaker(backend.engine)
    email = Email(sender="shop@example.com", to=["a@example.com"], subject="s", text="t")
    with Sessions.begin() as session:
        for n in range(5):
            ob.enqueue(session, email, key=f"n{n}")
        ob.enqueue(session, email, key="n0")  # a duplicate changes nothing
    with Sessions() as session:
        ob.enqueue(session, email, key="rolled-back")
        session.rollback()
    received = drain(conn)
    assert [(n.channel, n.payload) for n in received] == [(NOTIFY_CHANNEL, "")]
    with Sessions.begin() as session:
        ob.enqueue(session, email, key="n0")  # only a duplicate: nothing new, no wake-up
    assert drain(conn) == []
    with backend.engine.begin() as c:
        c.exec_driver_sql("DELETE FROM outbox_messages")
