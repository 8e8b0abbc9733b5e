"""An attack review's find in outbox.autocommit.in_autocommit: aiosqlite on a sqlite3 in
Python 3.12's ``autocommit=True`` mode was not seen as autocommit.

There ``isolation_level`` keeps its default "" (ignored), every statement commits by itself,
and ``commit()``/``rollback()`` do nothing. in_autocommit read ``.autocommit`` on the
dbapi_connection, but SQLAlchemy's aiosqlite adapter (and aiosqlite.Connection) don't expose
it, so it fell to ``isolation_level is None`` -> False. The enqueue then emitted BEGIN, whose
transaction the no-op COMMIT never ends: the app's rows commit, the email is lost silently.
This interpreter is 3.11, so the mode is simulated with a sqlite3.Connection factory (on
3.12 the app writes ``connect_args={"autocommit": True}``).
"""

from __future__ import annotations

import asyncio
import sqlite3

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from outbox import ConfigurationError
from outbox.autocommit import in_autocommit
from outbox.schema import metadata
from tests.support.db import Base, Order, rows
from tests.support.factories import email


class Py312Autocommit(sqlite3.Connection):
    """sqlite3.connect(autocommit=True) as Python 3.12 has it."""

    def __init__(self, *args, **kw):
        kw["isolation_level"] = None  # each statement commits by itself
        super().__init__(*args, **kw)

    autocommit = True
    isolation_level = property(lambda self: "", lambda self, value: None)

    def commit(self):  # 3.12: "If autocommit is True ... this method does nothing"
        pass

    def rollback(self):
        pass


def test_the_sync_driver_in_that_mode_is_seen(tmp_path):
    engine = sa.create_engine(
        f"sqlite:///{tmp_path / 's.db'}", connect_args={"factory": Py312Autocommit}
    )
    with engine.connect() as conn:
        assert in_autocommit(conn)
    engine.dispose()


def test_aiosqlite_in_that_mode_is_seen_and_the_enqueue_refused(tmp_path, ob):
    path = tmp_path / "a.db"
    sync = sa.create_engine(f"sqlite:///{path}")
    metadata.create_all(sync)
    Base.metadata.create_all(sync)

    async def scenario() -> tuple[bool, str]:
        engine = create_async_engine(
            f"sqlite+aiosqlite:///{path}", connect_args={"factory": Py312Autocommit}
        )
        try:
            async with AsyncSession(engine) as session:
                seen = await (await session.connection()).run_sync(in_autocommit)
                session.add(Order(id=1, customer="c"))
                await session.flush()
                try:
                    await ob.enqueue_async(session, email(1), key="k1")
                except ConfigurationError as exc:
                    return seen, exc.setting
                await session.commit()
                return seen, "not refused"
        finally:
            await engine.dispose()

    seen, outcome = asyncio.run(scenario())
    lost = rows(sync) == []
    sync.dispose()
    assert (seen, outcome, lost) == (True, "isolation_level", True)
