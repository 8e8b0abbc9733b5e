"""The ``outbox`` pytest plugin in the test suites of real apps, run by pytest in a subprocess
that finds the plugin only through its entry point: the Flask shop with the usual fixture that
keeps ``app.app_context()`` pushed around each test (so Flask-SQLAlchemy's scoped session, and
whatever transaction it is in, lives across requests), on a SQLite file, SQLite in memory and
PostgreSQL; and the FastAPI shop through its TestClient on aiosqlite, with a sync engine on the
same file for the plugin.

Each inner run has ``--timeout`` small: a relay that waits for a lock forever fails the inner
test quickly instead of hanging this one."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]
INNER_TIMEOUT = "30"

FLASK_CONFTEST = """
import os

import pytest
import sqlalchemy as sa

from examples.flask_shop.app import create_app, db
from outbox import migrations
from outbox.schema import metadata as outbox_metadata


@pytest.fixture
def app(tmp_path):
    url = os.environ["SHOP_DATABASE_URL"].replace("TMP", str(tmp_path))
    app = create_app(url)
    with app.app_context():  # kept pushed for the whole test: one scoped session throughout
        migrations.upgrade(db.engine)
        db.create_all()
        yield app
        db.session.remove()
        db.drop_all()
        with db.engine.begin() as conn:
            for table in reversed(outbox_metadata.sorted_tables):
                conn.execute(table.delete())
        db.engine.dispose()


@pytest.fixture
def client(app):
    return app.test_client()


@pytest.fixture
def outbox_engine(app):
    return db.engine


def sign_up(client, address):
    answer = client.post("/signup", json={"email": address})
    assert answer.status_code == 201, answer.text
    return answer.json["id"]


def check_out(client, user_id, item):
    answer = client.post("/checkout", json={"user_id": user_id, "item": item})
    assert answer.status_code == 201, answer.text
    return answer.json["id"]
"""

FLASK_TESTS = """
import pytest

from conftest import check_out, sign_up
from examples.flask_shop.app import User, db
from relay.testing import RelayNotIdle


def test_signup_sends_welcome(client, outbox_messages, outbox_relay):
    user_id = sign_up(client, "ada@example.com")

    [message] = outbox_messages()
    assert message.key == f"welcome:{user_id}"
    sender = outbox_relay()
    assert sender.sent_ids == [message.id]
    assert [m.status for m in outbox_messages()] == ["sent"]


def test_a_second_request_after_the_relay_once_the_session_ended(
    client, outbox_messages, outbox_relay
):
    user_id = sign_up(client, "ada@example.com")
    assert len(outbox_relay().sent_ids) == 1
    db.session.commit()  # the scoped session's transaction began before the relay committed
    order_id = check_out(client, user_id, "teapot")
    [confirmation] = outbox_relay().calls
    assert confirmation.email.subject == f"Order {order_id} confirmed"
    assert [m.status for m in outbox_messages()] == ["sent", "sent"]


def test_a_transaction_left_open_times_out_naming_it(client, outbox_messages, outbox_relay):
    sign_up(client, "ada@example.com")
    db.session.add(User(email="bob@example.com"))
    db.session.flush()  # written, not committed: the test holds the database's write lock
    with pytest.raises(RelayNotIdle) as raised:
        outbox_relay(timeout=2)
    message = str(raised.value)
    assert "not idle after 2s: 1 message still due" in message
    assert "a session in the test holds an open transaction" in message
    assert "commit it or roll it back" in message
    db.session.rollback()
    assert len(outbox_relay().sent_ids) == 1
"""

FLASK_MEMORY_TESTS = """
import pytest

from conftest import check_out, sign_up
from examples.flask_shop.app import db
from relay.testing import DatabaseInUse


def test_the_one_connection_inside_a_transaction_is_refused_then_the_relay_runs_on_it(
    client, outbox_messages, outbox_relay
):
    user_id = sign_up(client, "ada@example.com")  # reloading the user left a transaction open
    with pytest.raises(DatabaseInUse, match="holds it inside a transaction"):
        outbox_messages()
    with pytest.raises(DatabaseInUse, match="db.session.commit"):
        outbox_relay()
    db.session.commit()

    [welcome] = outbox_messages()
    assert outbox_relay().sent_ids == [welcome.id]
    db.session.commit()
    check_out(client, user_id, "teapot")  # the database outlived the relay's connection
    db.session.commit()
    assert len(outbox_relay().sent_ids) == 1
    assert [m.status for m in outbox_messages()] == ["sent", "sent"]
"""

FLASK_SERVER_TESTS = """
import time

import pytest
import sqlalchemy as sa

from conftest import sign_up
from examples.flask_shop.app import User, db
from outbox.schema import messages
from relay.testing import RelayNotIdle


def test_signup_sends_welcome(client, outbox_messages, outbox_relay):
    sign_up(client, "ada@example.com")
    [message] = outbox_messages()
    assert outbox_relay().sent_ids == [message.id]
    assert [m.status for m in outbox_messages()] == ["sent"]


def test_rows_the_test_holds_locked_time_out_naming_them(client, outbox_messages, outbox_relay):
    sign_up(client, "ada@example.com")
    db.session.execute(sa.select(messages.c.id).with_for_update()).all()  # not committed
    with pytest.raises(RelayNotIdle) as raised:
        outbox_relay(timeout=2)
    assert "1 due message locked by another transaction" in str(raised.value)
    db.session.rollback()
    assert len(outbox_relay().sent_ids) == 1


def test_an_uncommitted_enqueue_is_not_sent_and_does_not_hold_the_relay(
    client, outbox_messages, outbox_relay
):
    db.session.add(User(email="ada@example.com"))
    db.session.flush()  # its welcome email is written, not committed
    began = time.monotonic()
    assert outbox_relay(timeout=20).sent_ids == []
    assert time.monotonic() - began < 15
    db.session.rollback()
"""

FASTAPI_CONFTEST = """
import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from examples.fastapi_shop.app import Base, create_app
from outbox import migrations
from outbox.sqlite import enable_savepoints


@pytest.fixture
def database(tmp_path):
    return tmp_path / "shop.db"


@pytest.fixture
def sync_engine(database):
    engine = sa.create_engine(f"sqlite:///{database}")
    enable_savepoints(engine)  # the tests' sessions enqueue too (the app's rules)
    migrations.upgrade(engine)
    Base.metadata.create_all(engine)
    yield engine
    engine.dispose()


@pytest.fixture
def app(sync_engine, database):
    return create_app(f"sqlite+aiosqlite:///{database}")


@pytest.fixture
def client(app):
    with TestClient(app) as client:
        yield client


@pytest.fixture
def outbox_engine(sync_engine):  # the plugin reads and relays through a sync engine
    return sync_engine
"""

FASTAPI_TESTS = """
from sqlalchemy.orm import sessionmaker

from examples.fastapi_shop.app import User, ob


def test_signup_then_checkout_each_relayed(client, outbox_messages, outbox_relay):
    answer = client.post("/signup", json={"email": "ada@example.com"})
    assert answer.status_code == 201, answer.text
    user_id = answer.json()["id"]
    [welcome] = outbox_messages()
    assert welcome.key == f"welcome:{user_id}"
    assert outbox_relay().sent_ids == [welcome.id]

    answer = client.post("/checkout", json={"user_id": user_id, "item": "teapot"})
    assert answer.status_code == 201, answer.text
    [confirmation] = outbox_relay().calls
    assert confirmation.id == answer.json()["outbox_id"]
    assert [m.status for m in outbox_messages()] == ["sent", "sent"]


def test_a_user_seeded_by_the_tests_own_session(client, sync_engine, outbox_messages, outbox_relay):
    Session = sessionmaker(sync_engine)
    ob.install(Session)  # the app's rules: a seeded user gets its welcome email too
    with Session() as session:  # open for the whole test, as a seeding fixture's would be
        session.add(user := User(email="ada@example.com"))
        session.commit()
        assert user.id  # reloaded: the session is inside a read transaction again

        answer = client.post("/checkout", json={"user_id": user.id, "item": "teapot"})
        assert answer.status_code == 201, answer.text
        welcome, confirmation = outbox_messages()
        assert confirmation.id == answer.json()["outbox_id"]
        assert sorted(outbox_relay().sent_ids) == [welcome.id, confirmation.id]
"""

FASTAPI_ASYNC_ENGINE_TESTS = """
import pytest
from sqlalchemy.ext.asyncio import create_async_engine


@pytest.fixture
def outbox_engine(database):  # overrides the conftest's: the app's own AsyncEngine
    return create_async_engine(f"sqlite+aiosqlite:///{database}")


def test_relay(client, outbox_relay):
    pass


def test_enqueued_messages(database, outbox_engine):
    from outbox.testing import enqueued_messages

    with pytest.raises(TypeError) as raised:
        enqueued_messages(outbox_engine)
    assert "not AsyncEngine" in str(raised.value)
    assert f"create_engine('sqlite:///{database}')" in str(raised.value)
"""


def run_inner(pytester, monkeypatch, url, **files):
    """Run the files' tests as the app's own suite, importing the examples from the repo."""
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (path, str(ROOT)) if p))
    monkeypatch.setenv("SHOP_DATABASE_URL", url)
    pytester.makepyfile(**files)
    return pytester.runpytest_subprocess(
        "-W", "error", "-p", "no:cacheprovider", "-p", "timeout", "--timeout", INNER_TIMEOUT
    )


def test_flask_app_context_pattern_on_a_sqlite_file(pytester, monkeypatch):
    result = run_inner(
        pytester,
        monkeypatch,
        "sqlite:///TMP/shop.db",
        conftest=FLASK_CONFTEST,
        test_shop=FLASK_TESTS,
    )
    result.assert_outcomes(passed=3)


def test_flask_app_context_pattern_on_sqlite_in_memory(pytester, monkeypatch):
    result = run_inner(
        pytester, monkeypatch, "sqlite://", conftest=FLASK_CONFTEST, test_shop=FLASK_MEMORY_TESTS
    )
    result.assert_outcomes(passed=1)


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
def test_flask_app_context_pattern_on_postgresql(pytester, monkeypatch, backend):
    result = run_inner(
        pytester,
        monkeypatch,
        backend.url,
        conftest=FLASK_CONFTEST,
        test_shop=FLASK_SERVER_TESTS,
    )
    result.assert_outcomes(passed=3)


def test_fastapi_testclient_on_aiosqlite_with_a_sync_engine_for_the_plugin(pytester, monkeypatch):
    result = run_inner(
        pytester, monkeypatch, "", conftest=FASTAPI_CONFTEST, test_shop=FASTAPI_TESTS
    )
    result.assert_outcomes(passed=2)


def test_an_async_engine_for_the_plugin_is_refused_saying_what_to_create(pytester, monkeypatch):
    result = run_inner(
        pytester,
        monkeypatch,
        "",
        conftest=FASTAPI_CONFTEST,
        test_async_engine=FASTAPI_ASYNC_ENGINE_TESTS,
    )
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*the outbox_engine fixture needs a sync sqlalchemy Engine, not AsyncEngine; for an "
            "app on an AsyncEngine, create a sync engine on the same database, e.g. "
            "sqlalchemy.create_engine('sqlite:///*/shop.db')*"
        ]
    )
