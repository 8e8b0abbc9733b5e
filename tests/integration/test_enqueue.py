"""Enqueue inside the caller's transaction, on SQLite, PostgreSQL and MariaDB."""

from __future__ import annotations

import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

from outbox import (
    Category,
    Email,
    EnqueueError,
    HeaderInjection,
    InvalidArgument,
    InvalidKey,
    Outbox,
    Status,
    UnknownCategory,
    signals,
)
from tests.support.db import Order, User, rows
from tests.support.factories import email


def order_count(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(Order)).scalar_one()


def test_commit_writes_the_row_with_the_business_change(engine, Sessions, ob):
    before = datetime.now(UTC)
    with Sessions.begin() as session:
        session.add(Order(id=42, customer="ada"))
        result = ob.enqueue(
            session, email(42), key="order-confirmation:42", category="transactional"
        )
    assert result.duplicate is False
    assert result.key == "order-confirmation:42"
    (row,) = rows(engine)
    assert row.id == result.id
    assert row.status == Status.PENDING
    assert row.category == "transactional"
    assert row.recipients == "customer42@example.com"
    assert row.recipient_count == 1
    assert row.subject == "Order 42"
    assert row.attempt_count == 0
    assert row.max_attempts == ob.categories["transactional"].max_attempts
    assert row.ambiguity_policy == "hold"
    for ts in (row.created_at, row.updated_at, row.next_attempt_at):
        assert ts.tzinfo is not None
        assert before - timedelta(seconds=1) <= ts <= datetime.now(UTC) + timedelta(seconds=1)
    assert Email.from_payload(row.payload) == email(42)
    assert order_count(engine) == 1


def test_rollback_leaves_no_row(engine, Sessions, ob):
    with Sessions() as session:
        session.add(Order(id=1, customer="bob"))
        ob.enqueue(session, email(1), key="order:1")
        session.rollback()
    assert rows(engine) == []
    assert order_count(engine) == 0


def test_duplicate_key_is_swallowed_and_the_transaction_goes_on(engine, Sessions, ob):
    with Sessions.begin() as session:
        session.add(Order(id=1, customer="ada"))
        first = ob.enqueue(session, email(1), key="order:1")
        again = ob.enqueue(session, email(1, subject="changed"), key="order:1")
        session.add(Order(id=2, customer="ada"))
        session.flush()
        session.add(Order(id=3, customer="ada"))
    assert again.duplicate is True
    assert again.id == first.id
    assert order_count(engine) == 3
    (row,) = rows(engine)
    assert row.subject == "Order 1"


def test_duplicate_key_in_a_later_transaction(engine, Sessions, ob):
    with Sessions.begin() as session:
        first = ob.enqueue(session, email(1), key="welcome:7")
    with Sessions.begin() as session:
        again = ob.enqueue(session, email(1), key="welcome:7")
        session.add(Order(id=9, customer="later"))
    assert (again.id, again.duplicate) == (first.id, True)
    assert len(rows(engine)) == 1
    assert order_count(engine) == 1


def test_key_is_generated_when_none_is_given(engine, Sessions, ob):
    with Sessions.begin() as session:
        a = ob.enqueue(session, email(1))
        b = ob.enqueue(session, email(1))
    assert a.key != b.key
    assert a.key.startswith("auto:")
    assert [r.idempotency_key for r in rows(engine)] == [a.key, b.key]


def test_schedule_priority_and_expiry_are_stored(engine, Sessions, ob):
    later = datetime.now(UTC) + timedelta(hours=1)
    expiry = later + timedelta(days=1)
    with Sessions.begin() as session:
        ob.enqueue(session, email(1), priority=-5, not_before=later, expires_at=expiry)
    (row,) = rows(engine)
    assert row.priority == -5
    assert abs(row.next_attempt_at - later) < timedelta(milliseconds=1)
    assert abs(row.expires_at - expiry) < timedelta(milliseconds=1)


def test_category_policy_is_copied_onto_the_row(engine, Sessions):
    ob = Outbox(
        categories=[
            Category(
                name="digest", max_attempts=3, backoff_base=10, backoff_cap=60, ambiguity="resend"
            )
        ]
    )
    with Sessions.begin() as session:
        ob.enqueue(session, email(1), category="digest")
    (row,) = rows(engine)
    assert (
        row.category,
        row.max_attempts,
        row.backoff_base,
        row.backoff_cap,
        row.ambiguity_policy,
    ) == ("digest", 3, 10.0, 60.0, "resend")


@pytest.mark.parametrize(
    ("call", "error", "field"),
    [
        (lambda ob, s: ob.enqueue(s, email(1), category="nope"), UnknownCategory, None),
        (lambda ob, s: ob.enqueue(s, email(1), key=""), InvalidKey, "key"),
        (lambda ob, s: ob.enqueue(s, email(1), key="k" * 256), InvalidKey, "key"),
        (lambda ob, s: ob.enqueue(s, email(1), priority=40000), InvalidArgument, "priority"),
        (lambda ob, s: ob.enqueue(s, email(1), priority="1"), InvalidArgument, "priority"),
        (
            lambda ob, s: ob.enqueue(s, email(1), not_before=datetime(2030, 1, 1)),
            InvalidArgument,
            "not_before",
        ),
        (
            lambda ob, s: ob.enqueue(
                s, email(1), expires_at=datetime.now(UTC) - timedelta(seconds=1)
            ),
            InvalidArgument,
            "expires_at",
        ),
        (
            lambda ob, s: ob.enqueue(s, email(1, subject="Hi\r\nBcc: evil@example.com")),
            HeaderInjection,
            "subject",
        ),
    ],
    ids=[
        "category",
        "empty-key",
        "long-key",
        "priority-range",
        "priority-type",
        "naive-not-before",
        "expired",
        "crlf-subject",
    ],
)
def test_bad_input_raises_before_the_database_and_the_transaction_stays_usable(
    engine, Sessions, ob, call, error, field
):
    with Sessions() as session:
        session.add(Order(id=1, customer="ada"))
        session.flush()
        with pytest.raises(error) as info:
            call(ob, session)
        assert isinstance(info.value, EnqueueError)
        if field is not None:
            assert info.value.field == field
        session.add(Order(id=2, customer="bob"))
        ob.enqueue(session, email(2), key="still-works")
        session.commit()
    assert order_count(engine) == 2
    assert [r.idempotency_key for r in rows(engine)] == ["still-works"]


def test_signals_fire_for_new_and_duplicate(Sessions, ob):
    seen: list[tuple[str, str, bool]] = []

    def on_enqueued(sender, result, category):
        seen.append(("enqueued", result.key, result.duplicate))

    def on_duplicate(sender, result, category):
        seen.append(("duplicate", result.key, result.duplicate))

    signals.enqueued.connect(on_enqueued, sender=ob)
    signals.duplicate_skipped.connect(on_duplicate, sender=ob)
    try:
        with Sessions.begin() as session:
            ob.enqueue(session, email(1), key="k1")
            ob.enqueue(session, email(1), key="k1")
    finally:
        signals.enqueued.disconnect(on_enqueued)
        signals.duplicate_skipped.disconnect(on_duplicate)
    assert seen == [("enqueued", "k1", False), ("duplicate", "k1", True)]


def test_on_insert_rule_writes_in_the_same_transaction(engine, Sessions):
    ob = Outbox()

    @ob.on_insert(User, name="welcome")
    def welcome(user: User) -> Email | None:
        if user.email.endswith("@example.org"):
            return None
        return Email(
            sender="shop@example.com", to=[user.email], subject=f"Welcome #{user.id}", text="Hello"
        )

    ob.install(Sessions)
    with Sessions.begin() as session:
        session.add_all([User(id=1, email="a@example.com"), User(id=2, email="b@example.org")])
    with Sessions() as session:
        session.add(User(id=3, email="c@example.com"))
        session.flush()
        session.rollback()
    (row,) = rows(engine)
    assert row.idempotency_key == "welcome:1"
    assert row.subject == "Welcome #1"


def test_rule_duplicate_inside_the_flush_keeps_the_transaction(engine, Sessions):
    ob = Outbox()
    ob.on_insert(Order, name="confirm", key=lambda order: order.customer)(
        lambda order: email(order.id)
    )
    ob.install(Sessions)
    with Sessions.begin() as session:
        session.add(Order(id=1, customer="ada"))
        session.flush()
        session.add(Order(id=2, customer="ada"))  # same rule key: swallowed in the flush
        session.flush()
        session.add(Order(id=3, customer="bob"))
    assert order_count(engine) == 3
    assert [r.idempotency_key for r in rows(engine)] == ["confirm:ada", "confirm:bob"]


def test_on_update_rule_fires_on_changed_rows(engine, Sessions):
    ob = Outbox()

    @ob.on_update(Order, name="shipped", key=lambda o: f"{o.id}:{o.status}")
    def shipped(order: Order) -> Email | None:
        return email(order.id, subject="Shipped") if order.status == "shipped" else None

    ob.install(Sessions)
    with Sessions.begin() as session:
        session.add(Order(id=5, customer="ada"))
    assert rows(engine) == []
    with Sessions.begin() as session:
        session.get(Order, 5).status = "packed"
    with Sessions.begin() as session:
        session.get(Order, 5).status = "shipped"
    with Sessions.begin() as session:
        session.get(Order, 5).customer = "ada lovelace"  # still shipped: same key, no new row
    assert [(r.idempotency_key, r.subject) for r in rows(engine)] == [
        ("shipped:5:shipped", "Shipped")
    ]


def test_install_is_idempotent(engine, Sessions):
    ob = Outbox()
    ob.on_insert(User, name="welcome")(lambda u: email(u.id))
    ob.install(Sessions)
    ob.install(Sessions)
    with Sessions.begin() as session:
        session.add(User(id=1, email="a@example.com"))
    assert len(rows(engine)) == 1


def test_concurrent_duplicate_waits_for_the_first_and_reports_it(server_backend, ob):
    """Two real connections race on one key: the second waits for the first to commit, then
    gets duplicate=True and the first row's id, and its own transaction commits."""
    backend = server_backend
    Sessions = sessionmaker(backend.engine)
    first = Sessions()
    first.add(Order(id=1, customer="first"))
    a = ob.enqueue(first, email(1), key="race")
    first.flush()  # the row is on the server: the other transaction's insert waits on it
    outcome: dict[str, object] = {}

    def second() -> None:
        with Sessions.begin() as session:
            session.add(Order(id=2, customer="second"))
            outcome["result"] = ob.enqueue(session, email(1), key="race")

    thread = threading.Thread(target=second)
    thread.start()
    time.sleep(0.5)
    assert thread.is_alive(), "the second insert should wait on the first transaction's key"
    first.commit()
    first.close()
    thread.join(timeout=30)
    assert not thread.is_alive()
    b = outcome["result"]
    assert (b.id, b.duplicate) == (a.id, True)
    assert order_count(backend.engine) == 2
    assert len(rows(backend.engine)) == 1
