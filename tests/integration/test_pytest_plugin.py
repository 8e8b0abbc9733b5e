"""The ``outbox`` pytest plugin (``outbox.testing``, entry point ``pytest11``) as a host app
uses it: a tiny app and its test written from the plugin's documentation, run by pytest in a
subprocess that finds the plugin only through the installed entry point."""

from __future__ import annotations

from sqlalchemy.orm import sessionmaker

from outbox import Email, Outbox, Status
from outbox.testing import EnqueuedMessage, enqueued_messages
from relay.senders import Permanent
from relay.testing import FakeSender, run_until_idle
from tests.conftest import User

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
    statuses = {m.key: m.status for m in enqueued_messages(backend.engine)}
    assert sorted(sender.sent_ids) == sorted(m.id for m in enqueued_messages(backend.engine))
    assert sorted(statuses.values()) == [Status.FAILED, Status.SENT]
    assert run_until_idle(backend.engine).sent_ids == []
