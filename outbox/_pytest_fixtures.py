"""The fixtures of the ``outbox`` pytest plugin, :mod:`outbox.testing` (which imports them
from here when pytest is importable, so that module imports without pytest)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest
import sqlalchemy as sa

from outbox.schema import messages

if TYPE_CHECKING:
    from outbox.testing import EnqueuedMessage

__all__ = ["outbox_engine", "outbox_messages", "outbox_relay"]


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
    """The ``outbox_engine`` fixture's value, checked, and a SQLite file database switched to
    WAL now, before the test's sessions can hold it (see :func:`relay.testing.run_until_idle`)."""
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
    """A function returning the outbox rows committed since the test started, oldest first."""
    from outbox.testing import enqueued_messages

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
