"""The ``outbox`` pytest plugin (``outbox.testing``, entry point ``pytest11``) as a host app
uses it: a tiny app and its test written from the plugin's documentation, run by pytest in a
subprocess that finds the plugin only through the installed entry point."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine
from sqlalchemy.orm import sessionmaker

from outbox import Email, Outbox, Status, migrations
from outbox.schema import messages
from outbox.sqlite import enable_savepoints
from outbox.testing import EnqueuedMessage, enqueued_messages
from relay.senders import Disabled, Permanent, Transient
from relay.testing import FakeSender, RelayNotIdle, run_until_idle
from tests.support.db import User
from tests.support.factories import enqueue

pytest_plugins = ["pytester"]

APP = """
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from outbox import Email, Outbox

class Base(DeclarativeBase):
    pass

class User(Base):
    __tablename__ = "users"
    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(sa.String(255))

ob = Outbox()

@ob.on_insert(User, name="welcome")
def welcome(user):
    return Email(sender="shop@example.com", to=[user.email], subject="Welcome", text="Hi!")

def sign_up(Session, address):
    with Session.begin() as session:
        user = User(email=address)
        session.add(user)
    return user.id
"""

CONFTEST = """
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

from outbox import migrations
from outbox.sqlite import enable_savepoints

from app import Base, ob

@pytest.fixture(scope="session")
def engine(tmp_path_factory):
    engine = sa.create_engine(f"sqlite:///{tmp_path_factory.mktemp('db') / 'app.db'}")
    enable_savepoints(engine)
    migrations.upgrade(engine)
    Base.metadata.create_all(engine)
    yield engine
    engine.dispose()

@pytest.fixture
def outbox_engine(engine):
    return engine

@pytest.fixture
def Session(engine):
    Session = sessionmaker(engine, expire_on_commit=False)
    ob.install(Session)
    return Session
"""

TESTS = """
from app import sign_up

def test_signup_sends_welcome(Session, outbox_messages, outbox_relay):
    user_id = sign_up(Session, "ada@example.com")

    [message] = outbox_messages()
    assert message.key == f"welcome:{user_id}"
    assert message.email.to == ("ada@example.com",)
    assert message.status == "pending"

    sender = outbox_relay()
    assert sender.sent_ids == [message.id]
    assert outbox_messages()[0].status == "sent"

def test_each_test_sees_only_its_own_messages(Session, outbox_messages, outbox_relay):
    assert outbox_messages() == []
    sign_up(Session, "bob@example.com")
    assert [m.email.to for m in outbox_messages()] == [("bob@example.com",)]
    assert outbox_relay().sent_ids == [outbox_messages()[0].id]
"""


def test_a_host_app_test_written_from_the_docs_passes(pytester):
    pytester.makepyfile(app=APP, conftest=CONFTEST, test_signup=TESTS)
    result = pytester.runpytest_subprocess("-W", "error", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def test_each_test_starts_with_an_empty_outbox_before_its_own_fixtures_run(pytester):
    """An earlier test's mail, left unsent, is neither seen nor sent by the next test; what
    the test's own fixture committed before it is kept; ``outbox_keep`` keeps the rest."""
    pytester.makepyfile(
        app=APP,
        conftest=CONFTEST,
        test_isolation="""
import pytest
from app import sign_up

@pytest.fixture
def customer(Session):
    return sign_up(Session, "fixture@example.com")

def test_a_leaves_mail_unsent(Session, outbox_messages):
    sign_up(Session, "left@example.com")
    assert len(outbox_messages()) == 1

def test_b_sends_only_its_own(customer, Session, outbox_relay):
    sign_up(Session, "bob@example.com")
    sender = outbox_relay()
    assert sorted(c.email.to for c in sender.calls) == [
        ("bob@example.com",), ("fixture@example.com",)
    ]

@pytest.mark.outbox_keep
def test_c_keeps_what_is_there(Session, outbox_engine, outbox_relay):
    from outbox.testing import enqueued_messages
    assert len(enqueued_messages(outbox_engine)) == 2  # test b's, sent
""",
    )
    result = pytester.runpytest_subprocess("-W", "error", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)


CONFTEST_ON_A_SHARED_DATABASE = """
import os
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import sessionmaker

from app import ob

@pytest.fixture(scope="session")
def engine():
    engine = sa.create_engine(os.environ["APP_DATABASE_URL"])
    yield engine
    engine.dispose()

@pytest.fixture
def outbox_engine(engine):
    return engine

@pytest.fixture
def Session(engine):
    Session = sessionmaker(engine, expire_on_commit=False)
    ob.install(Session)
    return Session
"""


def shared_database(tmp_path) -> tuple[str, int]:
    """A database whose outbox holds real mail enqueued an hour ago (a development or shared
    database), with the app's tables: its URL and the old message's id."""
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    engine = sa.create_engine(url)
    enable_savepoints(engine)
    migrations.upgrade(engine)
    with engine.begin() as conn:  # the app's table (APP's User)
        conn.exec_driver_sql("CREATE TABLE users (id INTEGER PRIMARY KEY, email VARCHAR(255))")
    (old,) = enqueue(engine, 1)
    with engine.begin() as conn:
        conn.execute(sa.update(messages).values(created_at=datetime.now(UTC) - timedelta(hours=1)))
    engine.dispose()
    return url, old


def test_the_fixtures_refuse_to_empty_an_outbox_holding_mail_from_before_the_session(
    pytester, tmp_path, monkeypatch
):
    """Emptying the outbox before each test is for test databases: one that holds mail
    enqueued before the session began is refused (naming it, password masked), its mail kept;
    `outbox_empty_database = true` lets it."""
    url, old = shared_database(tmp_path)
    monkeypatch.setenv("APP_DATABASE_URL", url)
    pytester.makepyfile(
        app=APP,
        conftest=CONFTEST_ON_A_SHARED_DATABASE,
        test_it="def test_it(outbox_messages):\n    assert outbox_messages() == []\n",
    )
    refused = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert refused.ret != 0
    refused.stdout.fnmatch_lines(["*holds 1 message(s) enqueued before this test session*"])
    assert [m.id for m in enqueued_messages(sa.create_engine(url))] == [old], "kept"

    pytester.makeini("[pytest]\noutbox_empty_database = true\n")
    allowed = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    allowed.assert_outcomes(passed=1)
    assert enqueued_messages(sa.create_engine(url)) == []


def test_mail_there_before_the_first_check_is_never_deleted_whatever_its_clock_says(
    pytester, tmp_path, monkeypatch
):
    """A real message stamped two minutes ahead (an app host whose clock runs fast, or a
    frozen clock) is not caught by the time check: it is still never deleted, because the
    fixtures delete only messages with an id above the highest they first saw."""
    url, old = shared_database(tmp_path)
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(
            sa.update(messages).values(created_at=datetime.now(UTC) + timedelta(minutes=2))
        )
    monkeypatch.setenv("APP_DATABASE_URL", url)
    pytester.makepyfile(
        app=APP,
        conftest=CONFTEST_ON_A_SHARED_DATABASE,
        test_it="""
from app import sign_up

def test_one(Session, outbox_messages):
    sign_up(Session, "ada@example.com")
    assert len(outbox_messages()) == 1

def test_two(Session, outbox_messages):
    assert outbox_messages() == []
""",
    )
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=2)
    assert [m.id for m in enqueued_messages(engine)] == [old], "the session's own were emptied"
    engine.dispose()


def test_a_failing_expectation_fails_the_host_test(pytester):
    """The fixtures report what happened: a test expecting a second email fails."""
    pytester.makepyfile(
        app=APP,
        conftest=CONFTEST,
        test_wrong="""
from app import sign_up

def test_expects_two(Session, outbox_messages):
    sign_up(Session, "ada@example.com")
    assert len(outbox_messages()) == 2
""",
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*assert 1 == 2*"])


def test_without_an_outbox_engine_the_fixtures_say_what_to_define(pytester):
    pytester.makepyfile(test_nothing="def test_it(outbox_messages):\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret != 0
    result.stdout.fnmatch_lines(["*define a fixture named `outbox_engine`*"])


def test_enqueued_messages_decodes_committed_rows_after_an_id(backend):
    ob = Outbox()
    Session = sessionmaker(backend.engine)
    email = Email(sender="shop@example.com", to=["ada@example.com"], subject="Hi", text="Hi!")
    with Session.begin() as session:
        first = ob.enqueue(session, email, key="first")
        second = ob.enqueue(session, email, key="second", category="transactional")
    with Session() as session:  # not committed: not seen
        ob.enqueue(session, email, key="uncommitted")
        assert [m.key for m in enqueued_messages(backend.engine)] == ["first", "second"]
        session.rollback()

    assert enqueued_messages(backend.engine, after_id=first.id) == [
        EnqueuedMessage(
            id=second.id,
            key="second",
            category="transactional",
            status=Status.PENDING,
            email=email,
        )
    ]


def test_run_until_idle_delivers_with_a_fake_sender_and_returns_it(backend):
    ob = Outbox()
    Session = sessionmaker(backend.engine)

    @ob.on_insert(User, name="welcome")
    def welcome(user):
        return Email(sender="shop@example.com", to=[user.email], subject="Welcome", text="Hi")

    ob.install(Session)
    with Session.begin() as session:
        session.add_all([User(id=1, email="ada@example.com"), User(id=2, email="bob@example.com")])

    sender = run_until_idle(backend.engine, FakeSender([Permanent(code="MessageRejected")]))
    rows = enqueued_messages(backend.engine)
    assert sorted(sender.called_ids) == sorted(m.id for m in rows)
    # sent_ids: only what was accepted; the refused message is a call, not a send
    assert sender.sent_ids == [m.id for m in rows if m.status is Status.SENT]
    assert sorted(m.status for m in rows) == [Status.FAILED, Status.SENT]
    assert run_until_idle(backend.engine).called_ids == []


def test_sent_ids_leaves_out_a_throttled_message_retried_later(backend):
    """A throttled first call is in ``called_ids`` but not ``sent_ids`` until a later call is
    accepted: ``assert sender.sent_ids == [message.id]`` proves a delivery, not an attempt."""
    (mid,) = enqueue(backend.engine, 1, short=True)
    throttled = FakeSender([Transient(code="Throttling")])
    run_until_idle(backend.engine, throttled, timeout=10)
    assert throttled.called_ids[0] == mid
    assert throttled.sent_ids.count(mid) == len(throttled.called_ids) - 1


def not_idle_error(engine, **settings):
    """run_until_idle's error (it must raise one) and the seconds it took."""
    began = time.monotonic()
    with pytest.raises(RelayNotIdle) as raised:
        run_until_idle(engine, **settings)
    return str(raised.value), time.monotonic() - began


@pytest.mark.timeout(60)
def test_rows_another_transaction_holds_locked_time_out_with_what_to_do(server_backend):
    """The claim skips locked rows (SKIP LOCKED): the relay went idle, the message unsent."""
    engine = server_backend.engine
    enqueue(engine, key="one")
    with engine.connect() as holder:
        holder.execute(sa.select(messages.c.id).with_for_update()).all()
        message, seconds = not_idle_error(engine, timeout=2)
        holder.rollback()
    assert message.startswith("the relay was not idle after 2s: 1 message still due, 0 sends")
    assert "1 due message locked by another transaction" in message
    assert "commit it or roll it back before running the relay" in message
    assert seconds < 15
    assert len(run_until_idle(engine).sent_ids) == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("backend", ["sqlite"], indirect=True)
def test_a_transaction_holding_the_sqlite_database_times_out_saying_so(backend):
    engine = backend.engine
    enqueue(engine, key="one")
    with engine.connect() as holder:
        holder.begin()
        holder.execute(sa.insert(User).values(email="bob@example.com"))  # the write lock
        message, seconds = not_idle_error(engine, timeout=2)
        holder.rollback()
    assert "The database stayed locked (database is locked" in message
    assert "a session in the test holds an open transaction; commit it or roll" in message
    assert seconds < 15
    assert len(run_until_idle(engine).sent_ids) == 1


def test_a_relay_paused_past_the_timeout_says_how_to_let_it_probe(backend):
    enqueue(backend.engine, key="one")
    sender = FakeSender([Disabled(code="AccountSuspended", pause=True)])
    message, _ = not_idle_error(backend.engine, sender=sender, timeout=1)
    assert "Sending is paused (AccountSuspended) and probed again every 60s" in message
    assert "pass a smaller pause_seconds=" in message


@pytest.mark.parametrize(
    ("async_url", "sync_url"),
    [
        ("sqlite+aiosqlite:////tmp/app.db", "sqlite:////tmp/app.db"),
        ("postgresql+psycopg://app:secret@db/shop", "postgresql+psycopg://app:***@db/shop"),
        ("mysql+aiomysql://app@db/shop", "mysql+pymysql://app@db/shop"),
    ],
)
def test_an_async_engine_is_refused_naming_the_sync_engine_to_create(async_url, sync_url):
    engine = create_async_engine(async_url)
    for call, name in (
        (enqueued_messages, "enqueued_messages"),
        (run_until_idle, "run_until_idle"),
    ):
        with pytest.raises(TypeError) as raised:
            call(engine)
        assert str(raised.value) == (
            f"{name} needs a sync sqlalchemy Engine, not AsyncEngine; for an app on an "
            f"AsyncEngine, create a sync engine on the same database, e.g. "
            f"sqlalchemy.create_engine({sync_url!r})"
        )


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), "30", True])
def test_a_timeout_that_is_not_a_positive_number_is_refused_naming_it(timeout):
    engine = sa.create_engine("sqlite://")
    with pytest.raises(ValueError, match=r"run_until_idle: timeout must be a positive number"):
        run_until_idle(engine, timeout=timeout)
    engine.dispose()


@pytest.mark.parametrize("poolclass", [sa.pool.QueuePool, sa.pool.NullPool])
def test_an_in_memory_sqlite_engine_with_a_pool_of_many_connections_is_refused(poolclass):
    """Each connection of such an engine is an empty database of its own: the relay would find
    no outbox tables, or take the one pooled connection holding the app's rows and close it
    for good (the app's committed rows gone)."""
    engine = sa.create_engine("sqlite:///:memory:", poolclass=poolclass)
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE orders (id INTEGER PRIMARY KEY)")
        conn.exec_driver_sql("INSERT INTO orders VALUES (42)")
    for call, name in (
        (enqueued_messages, "enqueued_messages"),
        (run_until_idle, "run_until_idle"),
    ):
        with pytest.raises(ValueError, match="in-memory SQLite") as raised:
            call(engine)
        assert str(raised.value) == (
            f"{name}: this in-memory SQLite database lives inside one connection, and the "
            f"engine's {poolclass.__name__} gives every other connection an empty database of "
            "its own; create the engine with poolclass=sqlalchemy.pool.StaticPool and "
            "connect_args={'check_same_thread': False}, or use a file database"
        )
    if poolclass is sa.pool.QueuePool:  # the connection holding the app's rows is untouched
        with engine.connect() as conn:
            assert conn.exec_driver_sql("SELECT id FROM orders").scalars().all() == [42]
    engine.dispose()


def test_only_the_main_sqlite_database_is_switched_to_wal_not_an_attached_one(tmp_path):
    """The WAL switch used a PRAGMA without a schema name, which switches every database the
    app's connections ATTACH (a reference database of the app's, for good) as well."""
    reference = tmp_path / "reference.db"
    with contextlib.closing(sqlite3.connect(reference)) as conn:
        conn.execute("CREATE TABLE countries (code TEXT)")
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'app.db'}")

    @sa.event.listens_for(engine, "connect")
    def attach(dbapi_connection, _record):
        dbapi_connection.execute(f"ATTACH DATABASE '{reference}' AS reference")

    migrations.upgrade(engine)
    enqueue(engine, key="one")
    assert len(run_until_idle(engine).sent_ids) == 1
    engine.dispose()
    for path, mode in ((tmp_path / "app.db", "wal"), (reference, "delete")):
        with contextlib.closing(sqlite3.connect(path)) as conn:
            assert conn.execute("PRAGMA journal_mode").fetchone() == (mode,), path
