"""Fair sending on SQLite, PostgreSQL and MariaDB: the turns enqueue gives keyed messages and
the order the claim takes them in (docs/design.md, "Fair sending").

Driven with an explicit clock, as tests/integration/test_store.py is: every message is due at
T0 (``not_before``), and each claim runs at a time built here.
"""

from __future__ import annotations

import functools
import sqlite3
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import Category, Outbox, migrations
from outbox.enqueue import build_row
from outbox.exceptions import ConfigurationError, InvalidArgument
from outbox.fairness import STRIDE, from_domain
from outbox.schema import messages
from outbox.sqlite import enable_savepoints
from outbox.testing import enqueued_messages
from relay import store
from relay.policy import Action, Decision
from tests.support import factories
from tests.support.factories import email

T0 = datetime(2099, 1, 1, 12, 0, tzinfo=UTC)
OB = Outbox(
    categories=[
        Category(name="news", fairness_key="newsletter"),
        Category(name="by-domain", fairness_key=from_domain),
    ],
    fairness_weights={"gold-*": 2, "slow": 0.5},
)
enqueue = functools.partial(factories.enqueue, outbox=OB, not_before=T0)


@pytest.fixture(autouse=True)
def written_at_t0(monkeypatch):
    """Mail is written at T0 (the app's clock), so a row due at T0 is written due: in its
    key's line, as mail enqueued for now is."""
    monkeypatch.setattr("outbox.session.utcnow", lambda: T0)


def claim(engine: sa.Engine, limit: int, now: datetime = T0) -> list[store.Claim]:
    with engine.begin() as conn:
        claims, expired = store.claim_batch(
            conn, relay_id="r", limit=limit, now=now, lease_seconds=60
        )
    assert expired == []
    return claims


def keys_of(claims: list[store.Claim]) -> list[str | None]:
    return [c.fairness_key for c in claims]


def fair_at(engine: sa.Engine, ids: list[int]) -> list[datetime]:
    with engine.connect() as conn:
        found = dict(
            conn.execute(
                sa.select(messages.c.id, messages.c.fair_at).where(messages.c.id.in_(ids))
            ).all()
        )
    return [found[i] for i in ids]


def test_a_key_that_enqueues_one_message_is_served_before_a_big_backlogs_second(engine):
    enqueue(engine, 50, fairness_key="A")
    (b,) = enqueue(engine, fairness_key="B")
    first = claim(engine, 2)
    assert keys_of(first) == ["A", "B"]
    assert first[1].id == b


def test_keys_take_turns_one_stride_apart_and_no_turn_is_before_its_row_is_due(engine):
    a = enqueue(engine, 3, fairness_key="A")
    b = enqueue(engine, 3, fairness_key="B")
    assert fair_at(engine, a) == [T0, T0 + STRIDE, T0 + 2 * STRIDE]
    assert fair_at(engine, b) == fair_at(engine, a)  # B's queue was empty: it starts now
    assert keys_of(claim(engine, 6)) == ["A", "B", "A", "B", "A", "B"]


def test_each_transaction_continues_its_keys_queue(engine):
    first = enqueue(engine, 2, fairness_key="A")
    then = enqueue(engine, 1, fairness_key="A")  # a later transaction sees the committed rows
    assert fair_at(engine, first + then) == [T0, T0 + STRIDE, T0 + 2 * STRIDE]


def test_a_key_whose_queue_emptied_starts_again_at_its_due_time(engine):
    enqueue(engine, 3, fairness_key="A")
    assert len(claim(engine, 3)) == 3  # nothing of A is pending now
    later = T0 + timedelta(seconds=30)
    (again,) = enqueue(engine, fairness_key="A", not_before=later)
    assert fair_at(engine, [again]) == [later]


def test_messages_without_a_key_are_served_in_due_order_among_the_keys(engine):
    (plain,) = enqueue(engine)
    enqueue(engine, 3, fairness_key="A")
    (late,) = enqueue(engine, not_before=T0 + timedelta(seconds=1))
    order = claim(engine, 5, now=T0 + timedelta(seconds=5))
    assert [c.id for c in order][:1] == [plain]
    assert keys_of(order) == [None, "A", "A", None, "A"]
    assert order[3].id == late


def test_priorities_come_before_turns(engine):
    enqueue(engine, 5, fairness_key="A", priority=0)
    enqueue(engine, 1, fairness_key="B", priority=1)
    assert keys_of(claim(engine, 6)) == ["A"] * 5 + ["B"]


def test_a_weight_of_two_gives_two_turns_for_one(engine):
    enqueue(engine, 4, fairness_key="gold-1")
    enqueue(engine, 4, fairness_key="plain")
    assert keys_of(claim(engine, 6)) == ["gold-1", "plain", "gold-1", "gold-1", "plain", "gold-1"]


def test_a_category_sets_the_key_when_enqueue_names_none(engine):
    (news,) = enqueue(engine, category="news")
    (mine,) = enqueue(engine, category="news", fairness_key="tenant-9")
    sent_by = [email(0, sender="Shop <News@Mail.Example.COM>")]
    (domain,) = enqueue(engine, sent_by, category="by-domain")
    with engine.connect() as conn:
        keys = dict(conn.execute(sa.select(messages.c.id, messages.c.fairness_key)).all())
    assert (keys[news], keys[mine], keys[domain]) == ("newsletter", "tenant-9", "mail.example.com")


def test_a_retry_keeps_a_turn_at_or_after_its_new_due_time(engine):
    enqueue(engine, 3, fairness_key="A")
    first, *_ = claim(engine, 1)
    retry_at = T0 + timedelta(seconds=10)
    with engine.begin() as conn:
        assert store.apply_decision(
            conn,
            first,
            Decision(action=Action.RETRY, code="x", message="x", next_attempt_at=retry_at),
            T0,
        )
    assert fair_at(engine, [first.id]) == [retry_at]
    # an earlier due time never moves a turn back: the turn of a held row stays where it was
    (second,) = claim(engine, 1)
    with engine.begin() as conn:
        store.release_unsent(
            conn, ids=[second.id], claim_token=second.claim_token, now=T0, next_attempt_at=T0
        )
    assert fair_at(engine, [second.id]) == [T0 + STRIDE]


@pytest.mark.parametrize(
    ("given", "field", "reason"),
    [
        ("", "fairness_key", "must not be empty"),
        ("acme ", "fairness_key", "must not begin or end with whitespace"),
        ("a\x00b", "fairness_key", "must be printable"),
        ("a\ud800", "fairness_key", "must be printable"),
        ("x" * 256, "fairness_key", "the limit is 255"),
        (42, "fairness_key", "must be a string or None"),
    ],
)
def test_a_bad_key_names_its_field_and_writes_nothing(engine, given, field, reason):
    with Session(engine) as session, session.begin():
        with pytest.raises(InvalidArgument) as raised:
            OB.enqueue(session, email(0), fairness_key=given)
        assert raised.value.field == field
        assert reason in str(raised.value)
        assert session.scalar(sa.select(sa.func.count()).select_from(messages)) == 0


def test_a_category_key_function_that_fails_names_the_category():
    def broken(_email: object) -> str:
        raise KeyError("tenant")

    ob = Outbox(categories=[Category(name="c", fairness_key=broken)])
    engine = sa.create_engine("sqlite://")
    with Session(engine) as session, pytest.raises(InvalidArgument) as raised:
        ob.enqueue(session, email(0), category="c")
    assert raised.value.field == "categories['c'].fairness_key"
    assert "KeyError" in str(raised.value)


def test_bad_fairness_settings_name_the_setting():
    with pytest.raises(ConfigurationError, match=r"categories\['c'\].fairness_key"):
        Category(name="c", fairness_key="")
    with pytest.raises(ConfigurationError, match=r"fairness_weights\['x'\]"):
        Outbox(fairness_weights={"x": 0})
    with pytest.raises(ConfigurationError, match="fairness_weights"):
        Outbox(fairness_weights=[("x", 1)])  # type: ignore[arg-type]


def test_rows_written_before_the_upgrade_are_first_in_line(engine):
    """A row an app not yet upgraded writes (no fairness columns) gets the column's default
    turn: first in line, so it never waits behind keyed backlogs."""
    (new,) = enqueue(engine, fairness_key="A")
    row = build_row(
        email(1),
        key="old-app",
        category=Category(name="default"),
        priority=0,
        not_before=T0,
        expires_at=None,
        now=T0,
    )
    del row["fairness_key"], row["fair_at"]
    with engine.begin() as conn:
        old = conn.execute(sa.insert(messages).values(row)).inserted_primary_key[0]
    assert fair_at(engine, [old]) == [datetime(1970, 1, 1, tzinfo=UTC)]
    assert [c.id for c in claim(engine, 2)] == [old, new]


def test_an_apps_tests_see_each_messages_fairness_key(engine):
    (keyed,) = enqueue(engine, fairness_key="tenant-1")
    (plain,) = enqueue(engine)
    seen = {m.id: m.fairness_key for m in enqueued_messages(engine)}
    assert seen == {keyed: "tenant-1", plain: None}


def test_keys_that_differ_only_in_case_are_two_keys(engine):
    """Compared byte for byte on every backend (MariaDB's default collation would merge
    them): each key's queue is its own."""
    enqueue(engine, 2, fairness_key="Acme")
    (lower,) = enqueue(engine, fairness_key="acme")
    assert fair_at(engine, [lower]) == [T0]  # not after Acme's two
    with engine.connect() as conn:
        keys = conn.scalars(
            sa.select(messages.c.fairness_key).where(messages.c.fairness_key == "acme")
        ).all()
    assert keys == ["acme"]


def test_a_keys_scheduled_mail_does_not_push_its_due_mail_behind_other_keys(engine):
    """A reminder scheduled a month out is not in the key's line yet: the key's mail due now
    takes its turn now, not after the reminder."""
    enqueue(engine, fairness_key="A", not_before=T0 + timedelta(days=30))
    enqueue(engine, 20, fairness_key="B")
    (reset,) = enqueue(engine, fairness_key="A")
    assert fair_at(engine, [reset]) == [T0]
    assert reset in [c.id for c in claim(engine, 2)]


def test_a_keys_low_priority_backlog_does_not_push_its_urgent_mail_behind_other_keys(engine):
    enqueue(engine, 50, fairness_key="A", priority=10)
    enqueue(engine, 20, fairness_key="B")
    (urgent,) = enqueue(engine, fairness_key="A")
    assert fair_at(engine, [urgent]) == [T0]
    assert urgent in [c.id for c in claim(engine, 2)]


def test_a_batch_rerun_gives_its_new_rows_the_turns_its_duplicates_would_have_had(engine):
    """An idempotent job enqueues the same batch again with one more email: the duplicates
    are not written, so they take no turn; the new email is next in its key's line."""
    mails = [email(i) for i in range(5)]
    keys = [f"job:{i}" for i in range(6)]
    with Session(engine) as session, session.begin():
        OB.enqueue_many(session, mails, keys=keys[:5], fairness_key="A", not_before=T0)
    with Session(engine) as session, session.begin():
        again = OB.enqueue_many(
            session, [*mails, email(5)], keys=keys, fairness_key="A", not_before=T0
        )
    assert [r.duplicate for r in again] == [True] * 5 + [False]
    assert fair_at(engine, [again[-1].id]) == [T0 + 5 * STRIDE]


def test_a_keyed_enqueue_on_sqlite_waits_for_another_writer_instead_of_failing(tmp_path):
    """The turn is read before the row is written; on SQLite a transaction that read a table
    first cannot wait for another writer's lock (it fails at once, "database is locked"), so
    the enqueue takes the write lock before it reads, and waits as an unkeyed one does."""
    path = tmp_path / "app.db"
    engine = sa.create_engine(f"sqlite:///{path}")
    enable_savepoints(engine)
    migrations.upgrade(engine)
    enqueue(engine, fairness_key="tenant-42")  # the key has a line
    locked, released = threading.Event(), threading.Event()

    def relay_pass() -> None:  # another process's write transaction, held a moment
        other = sqlite3.connect(path, isolation_level=None, timeout=5)
        other.execute("BEGIN IMMEDIATE")
        locked.set()
        released.wait(5)
        time.sleep(0.2)
        other.execute("COMMIT")
        other.close()

    writer = threading.Thread(target=relay_pass)
    with Session(engine) as session, session.begin():
        session.execute(sa.text("SELECT 1")).all()  # the transaction is open, nothing read
        writer.start()
        assert locked.wait(5)
        released.set()
        result = OB.enqueue(session, email(1), fairness_key="tenant-42", not_before=T0)
    writer.join()
    assert fair_at(engine, [result.id]) == [T0 + STRIDE]
    engine.dispose()


def test_a_keys_scheduled_batch_does_not_put_its_mail_of_now_behind_it(engine):
    """A newsletter of the key scheduled for tomorrow (one batch) is spaced among itself, and
    is still not in the key's line today: the key's password reset of now takes its turn now."""
    tomorrow = T0 + timedelta(days=1)
    with Session(engine) as session, session.begin():
        batch = OB.enqueue_many(
            session, [email(i) for i in range(50)], fairness_key="A", not_before=tomorrow
        )
    assert fair_at(engine, [r.id for r in batch[:2]]) == [tomorrow, tomorrow + STRIDE]
    enqueue(engine, 20, fairness_key="B")
    (reset,) = enqueue(engine, fairness_key="A")
    assert fair_at(engine, [reset]) == [T0]
