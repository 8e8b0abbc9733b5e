"""A pytest plugin for testing apps that use the outbox (registered as ``outbox`` through the
``pytest11`` entry point, so it is active wherever sqlalchemy-outbox is installed).

Tell it which database your app writes to, by overriding one fixture in your ``conftest.py``::

    @pytest.fixture
    def outbox_engine(engine):          # a sync Engine on the app's database
        return engine

Then, in a test::

    def test_signup_sends_welcome(client, outbox_messages, outbox_relay):
        client.post("/signup", json={"email": "ada@example.com"})

        [message] = outbox_messages()   # what this test enqueued (committed), oldest first
        assert message.key == "welcome:1"
        assert message.email.to == ("ada@example.com",)

        sender = outbox_relay()         # run the relay in-process until idle, fake sender
        assert sender.sent_ids == [message.id]
        assert outbox_messages()[0].status == "sent"

Each test that uses ``outbox_messages`` or ``outbox_relay`` starts with an **empty outbox**:
before the test's other fixtures run, the plugin deletes every outbox message (with its
attempts) and every provider event from the ``outbox_engine``'s database, so the relay never
sends an earlier test's mail, and empties it again at the end of the session. It refuses (a
usage error naming the database) one whose outbox holds mail enqueued before the session
began, unless ``outbox_empty_database = true`` is set in the pytest configuration; mark a test
``@pytest.mark.outbox_keep`` to keep what is there. ``outbox_messages()`` sees only committed
rows (it reads through its own connection) created after the test started.
``sender.sent_ids`` are the messages the fake sender accepted; ``sender.called_ids`` every
call, refused ones too. Outcomes to script failures with are in :mod:`relay.senders`
(``from relay.senders import Transient, Permanent, Accepted``).
``outbox_relay(sender=None, *, timeout=30, **settings)`` returns the
:class:`relay.testing.FakeSender` it used; pass ``sender=FakeSender(outcomes=[...])`` to script
failures. Past ``timeout`` it stops the relay and raises :class:`relay.testing.RelayNotIdle`
saying what was left and why (most often a session of the test left inside a transaction; see
:func:`relay.testing.run_until_idle` for what is done about it on each database). Outside
pytest, the same two things are :func:`enqueued_messages` and
:func:`relay.testing.run_until_idle`. ``outbox_engine`` must be a sync Engine: an app on an
AsyncEngine creates one on the same database with a sync driver.

Importing this module needs no pytest: the fixtures are defined only where pytest can be
imported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from outbox.message import Email
from outbox.schema import Status, attempts, events, messages

__all__ = ["EnqueuedMessage", "empty_outbox", "enqueued_messages"]


@dataclass(frozen=True, slots=True)
class EnqueuedMessage:
    """One outbox row as a test sees it: its id, idempotency key, category, status, the
    :class:`~outbox.Email` decoded from its payload, and its fairness key (None: none)."""

    id: int
    key: str
    category: str
    status: Status
    email: Email
    fairness_key: str | None = None


def enqueued_messages(engine: sa.Engine, *, after_id: int = 0) -> list[EnqueuedMessage]:
    """Committed outbox rows with an id above ``after_id``, oldest first, read through a
    connection of their own. ``engine`` is a sync Engine (for an app on an AsyncEngine, one on
    the same database with a sync driver). On an in-memory SQLite database, whose one
    connection the app's session may hold inside a transaction, that is refused
    (:class:`relay.testing.DatabaseInUse`): its uncommitted rows would look committed."""
    from relay.testing import (
        _refuse_held_connection,
        _refuse_private_memory_database,
        _require_sync_engine,
    )

    _require_sync_engine(engine, "enqueued_messages")
    _refuse_private_memory_database(engine, "enqueued_messages")
    _refuse_held_connection(engine, "enqueued_messages")
    query = (
        sa.select(
            messages.c.id,
            messages.c.idempotency_key,
            messages.c.category,
            messages.c.status,
            messages.c.payload,
            messages.c.fairness_key,
        )
        .where(messages.c.id > after_id)
        .order_by(messages.c.id)
    )
    with engine.connect() as conn:
        rows = conn.execute(query).all()
    return [
        EnqueuedMessage(
            id=row.id,
            key=row.idempotency_key,
            category=row.category,
            status=Status(row.status),
            email=Email.from_payload(row.payload),
            fairness_key=row.fairness_key,
        )
        for row in rows
    ]


def empty_outbox(engine: sa.Engine, *, after_id: int | None = None) -> None:
    """Delete every outbox message, its attempts and every provider event on ``engine``'s
    database, in one transaction: a test database's outbox as a new one. With ``after_id``,
    only the messages with a higher id, and their attempts and events. Suppressions, the
    relays' rows and the operators' log are kept."""
    with engine.begin() as conn:
        if after_id is None:
            for table in (attempts, events, messages):  # attempts reference messages
                conn.execute(sa.delete(table))
            return
        conn.execute(sa.delete(attempts).where(attempts.c.message_id > after_id))
        conn.execute(sa.delete(events).where(events.c.message_id > after_id))
        conn.execute(sa.delete(messages).where(messages.c.id > after_id))


try:
    import pytest
except ModuleNotFoundError as missing:  # outside pytest: enqueued_messages alone
    if missing.name != "pytest":
        raise
    _PYTEST = False
else:
    _PYTEST = True

if _PYTEST:
    __all__ += [
        "outbox_engine",
        "outbox_messages",
        "outbox_relay",
        "pytest_addoption",
        "pytest_configure",
        "pytest_sessionfinish",
    ]

    _USES_OUTBOX = frozenset({"outbox_messages", "outbox_relay"})
    _EMPTY_ANY = "outbox_empty_database"
    _session: dict[str, Any] = {"started": None, "engines": {}}

    def pytest_addoption(parser: pytest.Parser) -> None:
        parser.addini(
            _EMPTY_ANY,
            type="bool",
            default=False,
            help="let the outbox fixtures empty an outbox that holds messages from before "
            "this test session (by default they refuse: it may not be a test database)",
        )

    def pytest_configure(config: pytest.Config) -> None:
        config.addinivalue_line(
            "markers",
            "outbox_keep: do not empty the outbox before this test (the outbox plugin does "
            "for every test that uses outbox_messages or outbox_relay)",
        )
        _session["started"] = datetime.now(UTC)

    def pytest_sessionfinish(session: pytest.Session) -> None:
        """Leave each outbox as this session found it, so the next session finds no message
        from before it: the messages it saw enqueued are deleted."""
        for engine, first in _session["engines"].values():
            # the database may be gone with its fixture: nothing to leave then
            with contextlib.suppress(Exception):
                empty_outbox(engine, after_id=first)
        _session["engines"] = {}

    def _check_once(engine: sa.Engine, config: pytest.Config) -> int:
        """The id above which the fixtures may delete messages on this database: checked
        once a session. An outbox holding messages enqueued before the session began is a
        development or shared database, not the test database the fixtures are meant for: it
        is refused unless ``outbox_empty_database = true`` (then emptied once). The messages
        there when first checked (a wider-scoped fixture's) are never deleted; ids only
        grow, whatever the app's clock says."""
        key = engine.url.render_as_string(hide_password=False)
        if key in _session["engines"]:
            return int(_session["engines"][key][1])
        started = _session["started"] or datetime.now(UTC)
        with engine.connect() as conn:
            older = conn.execute(
                sa.select(sa.func.count())
                .select_from(messages)
                .where(messages.c.created_at < started - timedelta(seconds=1))
            ).scalar_one()
        if older and not config.getini(_EMPTY_ANY):
            where = engine.url.render_as_string(hide_password=True)
            raise pytest.UsageError(
                f"the outbox of {where} holds {older} message(s) enqueued before this test "
                "session, and the outbox fixtures empty it before each test: point "
                "outbox_engine at a test database, or set outbox_empty_database = true in "
                "your pytest configuration to let them"
            )
        if older:
            empty_outbox(engine)
        first = _last_id(engine)
        _session["engines"][key] = (engine, first)
        return first

    @pytest.fixture(autouse=True)
    def _outbox_starts_empty(request: pytest.FixtureRequest) -> None:
        """Empty the outbox of what this session enqueued before a test that uses the outbox
        fixtures. Autouse, so it runs before the test's own function-scoped fixtures, which
        may enqueue and commit (mail a wider-scoped fixture enqueued after the first check is
        emptied too)."""
        if not _USES_OUTBOX & set(request.fixturenames):
            return
        engine = _prepared(request.getfixturevalue("outbox_engine"))
        first = _check_once(engine, request.config)
        if request.node.get_closest_marker("outbox_keep") is not None:
            return
        empty_outbox(engine, after_id=first)

    def _last_id(engine: sa.Engine) -> int:
        with engine.connect() as conn:
            return int(conn.execute(sa.select(sa.func.max(messages.c.id))).scalar() or 0)

    @pytest.fixture
    def outbox_engine() -> sa.Engine:
        """The sync Engine of your app's database. Override it in your ``conftest.py``."""
        raise pytest.UsageError(
            "the outbox fixtures need your database: define a fixture named `outbox_engine` "
            "returning a sync sqlalchemy Engine on it (in conftest.py)"
        )

    def _prepared(engine: object) -> sa.Engine:
        """The ``outbox_engine`` fixture's value, checked, and a SQLite file database switched
        to WAL now, before the test's sessions can hold it (see
        :func:`relay.testing.run_until_idle`)."""
        from relay.testing import (
            _refuse_held_connection,
            _refuse_private_memory_database,
            _require_sync_engine,
            _use_wal,
        )

        try:
            _require_sync_engine(engine, "the outbox_engine fixture")
            assert isinstance(engine, sa.Engine)
            _refuse_private_memory_database(engine, "the outbox_engine fixture")
        except (TypeError, ValueError) as exc:
            raise pytest.UsageError(str(exc)) from None
        _refuse_held_connection(engine, "the outbox fixtures")
        _use_wal(engine)
        return engine

    @pytest.fixture
    def outbox_messages(outbox_engine: sa.Engine) -> Callable[[], list[EnqueuedMessage]]:
        """A function returning the outbox rows committed since the test started, oldest
        first."""
        engine = _prepared(outbox_engine)
        start = _last_id(engine)
        return lambda: enqueued_messages(engine, after_id=start)

    @pytest.fixture
    def outbox_relay(outbox_engine: sa.Engine) -> Callable[..., Any]:
        """A function running the relay in-process until idle (by default against a fresh,
        accepting :class:`relay.testing.FakeSender`) and returning that sender. After
        ``timeout`` seconds (30 by default) it stops the relay and raises
        :class:`relay.testing.RelayNotIdle`, saying what was left and why."""
        from relay.testing import DEFAULT_TIMEOUT, FakeSender, run_until_idle

        engine = _prepared(outbox_engine)

        def run(
            sender: FakeSender | None = None, *, timeout: float = DEFAULT_TIMEOUT, **settings: Any
        ) -> FakeSender:
            return run_until_idle(engine, sender, timeout=timeout, **settings)

        return run
