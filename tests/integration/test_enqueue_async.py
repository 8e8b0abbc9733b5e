"""Enqueue through AsyncSession (aiosqlite, psycopg async, aiomysql) and the same hooks."""

from __future__ import annotations

import asyncio

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import sessionmaker

from outbox import Email, HeaderInjection, InvalidKey, Outbox
from outbox.schema import messages
from outbox.sqlite import enable_savepoints
from tests.support.db import Order, User


def welcome(user: User) -> Email:
    return Email(
        sender="shop@example.com", to=[user.email], subject=f"Welcome {user.id}", text="Hello"
    )


def run(backend, scenario):
    async def main():
        engine = create_async_engine(backend.async_url)
        enable_savepoints(engine)
        try:
            return await scenario(engine)
        finally:
            await engine.dispose()

    return asyncio.run(main())


def keys(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return list(
            conn.execute(sa.select(messages.c.idempotency_key).order_by(messages.c.id)).scalars()
        )


def test_async_enqueue_commit_rollback_duplicate(backend):
    ob = Outbox()

    async def scenario(engine):
        Sessions = async_sessionmaker(engine, expire_on_commit=False)
        async with Sessions.begin() as session:
            session.add(Order(id=1, customer="ada"))
            first = await ob.enqueue_async(
                session, welcome(User(id=1, email="a@example.com")), key="k1"
            )
            again = await ob.enqueue_async(
                session, welcome(User(id=1, email="a@example.com")), key="k1"
            )
            session.add(Order(id=2, customer="ada"))
        async with Sessions() as session:
            session.add(Order(id=3, customer="bob"))
            await ob.enqueue_async(session, welcome(User(id=3, email="b@example.com")), key="k3")
            await session.rollback()
        return first, again

    first, again = run(backend, scenario)
    assert (again.id, again.duplicate, first.duplicate) == (first.id, True, False)
    assert keys(backend.engine) == ["k1"]
    with backend.engine.connect() as conn:
        assert conn.execute(sa.select(Order.id).order_by(Order.id)).scalars().all() == [1, 2]


def test_async_rules_through_async_sessionmaker(backend):
    ob = Outbox()
    ob.on_insert(User, name="welcome")(welcome)

    async def scenario(engine):
        Sessions = async_sessionmaker(engine)
        ob.install(Sessions)
        async with Sessions.begin() as session:
            session.add(User(id=7, email="g@example.com"))
        try:
            async with Sessions.begin() as session:
                session.add(User(id=8, email="h@example.com"))
                await session.flush()
                raise RuntimeError("abort")
        except RuntimeError:
            pass

    run(backend, scenario)
    assert keys(backend.engine) == ["welcome:7"]


def test_async_bad_input_keeps_the_session_usable(backend):
    ob = Outbox()

    async def scenario(engine):
        async with AsyncSession(engine) as session, session.begin():
            session.add(Order(id=1, customer="ada"))
            with pytest.raises(InvalidKey, match="key"):
                await ob.enqueue_async(session, welcome(User(id=1, email="a@example.com")), key="")
            with pytest.raises(HeaderInjection):
                Email(sender="shop@example.com", to=["a@example.com\n"], subject="x", text="y")
            await ob.enqueue_async(session, welcome(User(id=1, email="a@example.com")), key="ok")

    run(backend, scenario)
    assert keys(backend.engine) == ["ok"]


def test_async_duplicate_committed_after_the_snapshot(server_backend):
    """REPEATABLE READ through AsyncSession: another transaction commits the key after this
    one's snapshot was taken. The result is that row, as a duplicate, and the session commits."""
    ob = Outbox()
    Sessions = sessionmaker(server_backend.engine)
    user = User(id=1, email="a@example.com")

    async def scenario(engine):
        Snapshot = async_sessionmaker(engine.execution_options(isolation_level="REPEATABLE READ"))
        async with Snapshot.begin() as session:
            session.add(Order(id=1, customer="ada"))
            await session.execute(sa.text("SELECT count(*) FROM shop_users"))
            with Sessions.begin() as other:
                won = ob.enqueue(other, welcome(user), key="race")
            result = await ob.enqueue_async(session, welcome(user), key="race")
        return won, result

    won, result = run(server_backend, scenario)
    assert (result.id, result.duplicate) == (won.id, True)
    assert keys(server_backend.engine) == ["race"]
    with server_backend.engine.connect() as conn:
        assert conn.execute(sa.select(Order.id)).scalars().all() == [1]


def test_a_sync_enqueue_given_an_async_session_says_which_call_to_use(backend):
    """No coroutine is created and left unawaited (warnings are errors here), and the
    session's transaction is untouched: the right call then commits with it."""
    ob = Outbox()

    async def scenario(engine):
        async with async_sessionmaker(engine)() as session:
            session.add(Order(id=1, customer="ada"))
            with pytest.raises(TypeError, match=r"await ob\.enqueue_async\(session, email"):
                ob.enqueue(session, welcome(User(id=1, email="a@example.com")), key="k1")
            await ob.enqueue_async(session, welcome(User(id=1, email="a@example.com")), key="k1")
            await session.commit()

    run(backend, scenario)
    assert keys(backend.engine) == ["k1"]


def test_an_async_enqueue_given_a_sync_session_says_which_call_to_use(backend):
    ob = Outbox()
    with sessionmaker(backend.engine)() as session:
        session.add(Order(id=1, customer="ada"))
        with pytest.raises(TypeError, match=r"ob\.enqueue\(session, email"):
            asyncio.run(
                ob.enqueue_async(session, welcome(User(id=1, email="a@example.com")), key="k1")
            )
        ob.enqueue(session, welcome(User(id=1, email="a@example.com")), key="k1")
        session.commit()
    assert keys(backend.engine) == ["k1"]


@pytest.mark.parametrize("target", ["engine", "connection", "async_engine"])
def test_enqueue_given_an_engine_or_a_connection_asks_for_the_session(backend, target):
    ob = Outbox()
    email = welcome(User(id=1, email="a@example.com"))
    with backend.engine.connect() as conn:
        given = {
            "engine": backend.engine,
            "connection": conn,
            "async_engine": create_async_engine(backend.async_url),
        }[target]
        try:
            with pytest.raises(TypeError, match=r"pass the Session your change is made in, not "):
                ob.enqueue(given, email)
            with pytest.raises(TypeError, match=r"pass the AsyncSession .* not a sqlalchemy"):
                asyncio.run(ob.enqueue_async(given, email))
        finally:
            if target == "async_engine":
                asyncio.run(given.dispose())
    assert keys(backend.engine) == []


def test_enqueue_given_an_async_sessions_sync_session_outside_run_sync_says_what_to_do(backend):
    """``AsyncSession.sync_session`` is a Session, but on an async driver it runs only inside
    ``run_sync``: outside it the call is refused before anything runs (no MissingGreenlet, no
    coroutine left unawaited), and inside it, as in a rule, the same call works."""
    ob = Outbox()

    async def scenario(engine):
        async with async_sessionmaker(engine)() as session:
            session.add(Order(id=1, customer="ada"))
            email = welcome(User(id=1, email="a@example.com"))
            with pytest.raises(TypeError, match=r"outside `run_sync`.*enqueue_async\(session"):
                ob.enqueue(session.sync_session, email, key="k1")
            await session.run_sync(lambda sync_session: ob.enqueue(sync_session, email, key="k1"))
            await session.commit()

    run(backend, scenario)
    assert keys(backend.engine) == ["k1"]
