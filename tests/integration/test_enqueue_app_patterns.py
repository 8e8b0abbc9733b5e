"""Enqueue leaves no trace in the app's session: what apps, frameworks and libraries that look
at or steer a session see, with the real libraries, on SQLite, PostgreSQL and MariaDB.

Read/write routing (SQLAlchemy's ``get_bind`` recipe, advanced-alchemy's ``RoutingConfig``)
and ``ShardedSession`` route the row like the app's own INSERT; zope.sqlalchemy (Pyramid's
pyramid_tm) commits a session that only enqueued; listeners of every registration mode and
lifecycle events see only the app's objects; ``clear_mappers()``, ``session.info.clear()`` and
generic code over ``session.new`` meet nothing of ours; an AUTOCOMMIT connection is refused
before anything is written; the test-suite recipes that join an external transaction work.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import sqlalchemy as sa
import transaction
import zope.sqlalchemy
from sqlalchemy import event
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.ext.horizontal_shard import ShardedSession
from sqlalchemy.orm import Session, scoped_session, sessionmaker

from outbox import ConfigurationError, InvalidArgument, Outbox
from outbox.schema import messages, metadata
from outbox.sqlite import enable_savepoints
from tests.support.db import Base, Order, rows
from tests.support.factories import email

ROOT = Path(__file__).resolve().parents[2]

_READ_ONLY = {
    "postgresql": "SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY",
    "mysql": "SET SESSION TRANSACTION READ ONLY",
    "sqlite": "PRAGMA query_only = ON",
}


def order_ids(engine: sa.Engine) -> list[int]:
    with engine.connect() as conn:
        return list(conn.scalars(sa.select(Order.id).order_by(Order.id)))


def read_only_engine(url: str, name: str) -> sa.Engine:
    """A replica: the same database, every connection read only."""
    follower = sa.create_engine(url)  # SQLite: no BEGIN for its reads, no lock held after

    @event.listens_for(follower, "connect")
    def read_only(dbapi_connection, connection_record):
        cursor = dbapi_connection.cursor()
        cursor.execute(_READ_ONLY[name])
        cursor.close()
        dbapi_connection.commit()

    return follower


# -- 1. read/write routing ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "writes", [(sa.Update, sa.Delete), (sa.Insert, sa.Update, sa.Delete)], ids=["docs", "dml"]
)
def test_the_routing_recipe_puts_the_email_on_the_leader_with_the_order(backend, ob, writes):
    """SQLAlchemy's documented ``get_bind`` recipe: the leader for flushes and the DML it
    names (UPDATE and DELETE in its docs; some apps add INSERT); a read-only follower
    otherwise."""
    leader = backend.engine
    follower = read_only_engine(backend.url, backend.name)
    chosen: list[str] = []

    class RoutingSession(Session):
        def get_bind(self, mapper=None, clause=None, **kw):
            if self._flushing or isinstance(clause, writes):
                chosen.append("leader")
                return leader
            chosen.append("follower")
            return follower

    try:
        with sessionmaker(class_=RoutingSession).begin() as session:
            assert session.scalars(sa.select(Order)).all() == []  # a read: the follower
            session.add(Order(id=1, customer="ada"))
            result = ob.enqueue(session, email(1), key="k1")
        assert chosen[0] == "follower"
        assert [r.id for r in rows(leader)] == [result.id]
        assert order_ids(leader) == [1]
    finally:
        follower.dispose()


def _read_only_url(backend) -> str:
    url = sa.make_url(backend.url)
    if backend.name == "postgresql":
        return url.update_query_dict(
            {"options": "-c default_transaction_read_only=on"}
        ).render_as_string(hide_password=False)
    return url.update_query_dict(
        {"init_command": "SET SESSION TRANSACTION READ ONLY"}
    ).render_as_string(hide_password=False)


def test_advanced_alchemy_routing_writes_the_email_on_the_primary(server_backend, ob):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # its import on SQLAlchemy 2.1
        from advanced_alchemy.config import SQLAlchemySyncConfig
        from advanced_alchemy.config.routing import RoutingConfig
        from advanced_alchemy.routing import RoutingSyncSession

    config = SQLAlchemySyncConfig(
        routing_config=RoutingConfig(
            primary_connection_string=server_backend.url,
            read_replicas=[_read_only_url(server_backend)],
        )
    )
    try:
        with config.get_session() as session:
            assert isinstance(session, RoutingSyncSession)
            session.scalars(sa.select(Order)).all()  # a read first: the replica
            session.add(Order(id=1, customer="ada"))
            result = ob.enqueue(session, email(1), key="k1")
            session.commit()
    finally:
        config.create_session_maker().close_all()  # the primary's and the replica's engines
    assert [r.id for r in rows(server_backend.engine)] == [result.id]
    assert order_ids(server_backend.engine) == [1]


def test_bind_arguments_name_the_bind(engine, ob):
    session = Session(binds={Order: engine})  # no bind for the outbox table of its own
    with session.begin():
        session.add(Order(id=1, customer="ada"))
        ob.enqueue(session, email(1), key="k1", bind_arguments={"bind": engine})
    session.close()
    assert [r.idempotency_key for r in rows(engine)] == ["k1"]
    assert order_ids(engine) == [1]


def test_a_session_whose_binds_miss_the_outbox_table_is_told_how_to_bind_it(engine, ob):
    """``binds={Base: engine}`` binds the app's models only: the error says what to add."""
    with Session(binds={Base: engine}) as session:
        session.add(Order(id=1, customer="ada"))
        with pytest.raises(sa.exc.UnboundExecutionError) as info:
            ob.enqueue(session, email(1), key="k1")
        assert "outbox.schema.messages: engine" in str(info.value)
        assert "bind_arguments={'bind': engine}" in str(info.value)
    with Session(binds={Base: engine, messages: engine}) as session, session.begin():
        session.add(Order(id=1, customer="ada"))
        ob.enqueue(session, email(1), key="k1")
    assert [r.idempotency_key for r in rows(engine)] == ["k1"]


# -- 8. sharding ------------------------------------------------------------------------------


@pytest.fixture
def shards(tmp_path):
    engines = {}
    for name in ("eu", "us"):
        engine = sa.create_engine(f"sqlite:///{tmp_path / name}.db")
        enable_savepoints(engine)
        metadata.create_all(engine)
        Base.metadata.create_all(engine)
        engines[name] = engine
    yield engines
    for engine in engines.values():
        engine.dispose()


def sharded_session(shards) -> ShardedSession:
    def shard_chooser(mapper, instance, clause=None):
        return "eu" if instance.customer.endswith(".eu") else "us"

    return ShardedSession(
        shards=shards,
        shard_chooser=shard_chooser,
        identity_chooser=lambda *args, **kw: list(shards),
        execute_chooser=lambda context: list(shards),
    )


def test_a_sharded_session_writes_the_email_on_the_shard_it_names(shards, ob):
    with sharded_session(shards) as session:
        order = Order(id=1, customer="ada@example.eu")
        session.add(order)
        named = ob.enqueue(session, email(1), key="k1", bind_arguments={"shard_id": "eu"})
        followed = ob.enqueue(session, email(2), key="k2", bind_arguments={"instance": order})
        session.commit()
    assert [r.id for r in rows(shards["eu"])] == [named.id, followed.id]
    assert rows(shards["us"]) == []
    assert order_ids(shards["eu"]) == [1]


def test_a_sharded_session_without_a_shard_is_refused_naming_the_argument(shards, ob):
    with sharded_session(shards) as session:
        session.add(Order(id=1, customer="ada@example.eu"))
        with pytest.raises(InvalidArgument) as info:
            ob.enqueue(session, email(1), key="k1")
        assert info.value.field == "bind_arguments"
        assert "shard_id" in str(info.value)
        session.commit()
    assert rows(shards["eu"]) == rows(shards["us"]) == []


def test_rules_on_a_sharded_session_write_each_email_on_its_objects_shard(shards):
    ob = Outbox()
    ob.on_insert(Order, name="confirm")(lambda order: email(order.id))
    ob.install(ShardedSession)
    try:
        with sharded_session(shards) as session:
            session.add_all(
                [Order(id=1, customer="ada@example.eu"), Order(id=2, customer="bob@example.com")]
            )
            session.commit()
    finally:
        event.remove(ShardedSession, "after_flush", ob._after_flush)
    assert [r.idempotency_key for r in rows(shards["eu"])] == ["confirm:1"]
    assert [r.idempotency_key for r in rows(shards["us"])] == ["confirm:2"]


# -- 2. zope.sqlalchemy and Pyramid -------------------------------------------------------------


def test_zope_sqlalchemy_commits_a_session_that_only_enqueued(engine, ob):
    manager = transaction.TransactionManager()
    Sessions = scoped_session(sessionmaker(engine))
    zope.sqlalchemy.register(Sessions, transaction_manager=manager)
    with manager:
        result = ob.enqueue(Sessions(), email(1), key="resend:1")
    Sessions.remove()
    assert [r.id for r in rows(engine)] == [result.id]


def test_zope_sqlalchemy_aborts_the_email_with_the_transaction(engine, ob):
    manager = transaction.TransactionManager()
    Sessions = scoped_session(sessionmaker(engine))
    zope.sqlalchemy.register(Sessions, transaction_manager=manager)
    manager.begin()
    Sessions().add(Order(id=1, customer="ada"))
    ob.enqueue(Sessions(), email(1), key="k1")
    manager.abort()
    with manager:
        ob.enqueue(Sessions(), email(2), key="k2")
    Sessions.remove()
    assert [r.idempotency_key for r in rows(engine)] == ["k2"]
    assert order_ids(engine) == []


def test_a_read_only_zope_session_refuses_the_email_instead_of_dropping_it(engine, ob):
    manager = transaction.TransactionManager()
    session = sessionmaker(engine)()
    zope.sqlalchemy.register(
        session, initial_state=zope.sqlalchemy.datamanager.STATUS_READONLY,
        transaction_manager=manager,
    )  # fmt: skip
    with pytest.raises(ConfigurationError) as info, manager:
        ob.enqueue(session, email(1), key="k1")
    assert info.value.setting == "zope.sqlalchemy"
    session.close()
    assert rows(engine) == []


def test_a_pyramid_view_that_only_enqueues_commits_its_email(engine, ob):
    """The Pyramid cookiecutter's wiring: pyramid_tm, one session per request registered with
    zope.sqlalchemy on the request's transaction manager."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # WebOb imports cgi
        from pyramid.config import Configurator
        from pyramid.response import Response
        from webtest import TestApp

    factory = sessionmaker(engine)

    def dbsession(request):
        session = factory()
        zope.sqlalchemy.register(session, transaction_manager=request.tm)
        return session

    def resend(request):
        number = int(request.matchdict["n"])
        ob.enqueue(request.dbsession, email(number), key=f"resend:{number}")
        if request.params.get("fail"):
            raise RuntimeError("the view failed after enqueueing")
        return Response("queued")

    with Configurator(settings={"tm.manager_hook": "pyramid_tm.explicit_manager"}) as config:
        config.include("pyramid_tm")
        config.add_request_method(dbsession, reify=True)
        config.add_route("resend", "/resend/{n}")
        config.add_view(resend, route_name="resend", request_method="POST")
        app = TestApp(config.make_wsgi_app())
    assert app.post("/resend/1").text == "queued"
    with pytest.raises(RuntimeError):
        app.post("/resend/2?fail=1")
    assert [r.idempotency_key for r in rows(engine)] == ["resend:1"]


# -- 3, 4. listeners of every registration mode, lifecycle events -------------------------------


def test_listeners_inserted_ahead_and_lifecycle_events_see_only_the_apps_objects(engine, ob):
    """An audit listener reading each new object's table, registered with ``insert=True`` on a
    Session subclass and on a sessionmaker, and lifecycle listeners: none meets an object of
    the outbox, and the commit goes through."""

    class AppSession(Session):
        pass

    Sessions = sessionmaker(engine, class_=AppSession)
    seen: list[tuple[str, str]] = []

    @event.listens_for(AppSession, "before_flush", insert=True)
    def audit(session, flush_context, instances):
        seen.extend(("before_flush", obj.__tablename__) for obj in session.new)

    @event.listens_for(Sessions, "before_commit", insert=True)
    def audit_commit(session):
        seen.extend(("before_commit", sa.inspect(o).mapper.local_table.name) for o in session.new)

    for name in ("after_attach", "transient_to_pending", "pending_to_transient"):

        def lifecycle(session, obj, name=name):
            seen.append((name, obj.__tablename__))

        event.listen(Sessions, name, lifecycle)

    with Sessions() as session:
        session.add(Order(id=1, customer="ada"))
        ob.enqueue(session, email(1), key="k1")
        session.rollback()
        session.add(Order(id=2, customer="bob"))
        ob.enqueue(session, email(2), key="k2")
        session.commit()
    assert seen == [
        ("after_attach", "shop_orders"),
        ("transient_to_pending", "shop_orders"),
        ("pending_to_transient", "shop_orders"),
        ("after_attach", "shop_orders"),
        ("transient_to_pending", "shop_orders"),
        ("before_commit", "shop_orders"),
        ("before_flush", "shop_orders"),
    ]
    assert [r.idempotency_key for r in rows(engine)] == ["k2"]
    assert order_ids(engine) == [2]


# -- 5. clear_mappers --------------------------------------------------------------------------


def test_enqueue_works_after_clear_mappers(tmp_path):
    """An imperative-mapping suite tears down with ``clear_mappers()``; enqueue does not map
    anything, so it keeps working (in a subprocess: clearing would unmap this suite's models)."""
    script = textwrap.dedent(
        f"""
        import sqlalchemy as sa
        from sqlalchemy.orm import Session, clear_mappers, registry
        from outbox import Email, Outbox
        from outbox.schema import metadata
        from outbox.sqlite import enable_savepoints

        engine = sa.create_engine("sqlite:///{tmp_path / "mappers.db"}")
        enable_savepoints(engine)
        metadata.create_all(engine)
        ob = Outbox()
        for n in range(2):
            mapping = registry()
            thing = type("Thing", (), {{}})
            column = sa.Column("id", sa.Integer, primary_key=True)
            mapping.map_imperatively(thing, sa.Table("things", mapping.metadata, column))
            with Session(engine) as session, session.begin():
                ob.enqueue(session, Email(sender="a@example.com", to=["b@example.com"],
                                          subject=f"n{{n}}", text="hi"), key=f"k{{n}}")
            clear_mappers()
        with engine.connect() as conn:
            print(sorted(conn.scalars(sa.text("SELECT idempotency_key FROM outbox_messages"))))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['k0', 'k1']"


# -- 6. generic code over the session ---------------------------------------------------------


def test_generic_code_over_the_sessions_new_objects_meets_only_the_apps(engine, Sessions, ob):
    with Sessions() as session, session.begin():
        ob.enqueue(session, email(1), key="k1")
        assert not session.new  # a service that only enqueues asserts it added nothing
        assert not session.info
        order = Order(id=1, customer="ada")
        session.add(order)
        ob.enqueue(session, email(2), key="k2")
        new = list(session.new)
        assert new == [order]
        session.flush()
        for obj in new:  # refresh each new object, and find it again by its type and key
            session.refresh(obj)
            assert session.get(type(obj), sa.inspect(obj).identity) is obj
    assert [r.idempotency_key for r in rows(engine)] == ["k1", "k2"]


def test_middleware_that_clears_session_info_loses_nothing(engine, Sessions, ob):
    with Sessions() as session:
        session.add(Order(id=1, customer="ada"))
        ob.enqueue(session, email(1), key="k1")
        session.info.clear()
        session.commit()
    assert [r.idempotency_key for r in rows(engine)] == ["k1"]
    assert order_ids(engine) == [1]


# -- 7. autocommit -----------------------------------------------------------------------------


_DRIVER_AUTOCOMMIT = {
    "postgresql": {"autocommit": True},
    "mysql": {"autocommit": True},
    "sqlite": {"isolation_level": None},  # and nobody emitting BEGIN (no enable_savepoints)
}


@pytest.mark.parametrize("where", ["engine", "connection", "session", "driver"])
def test_an_autocommit_connection_is_refused_before_anything_is_written(backend, ob, where):
    engine = backend.engine
    cleanup = []
    if where in ("engine", "driver"):
        if where == "engine":
            engine = sa.create_engine(backend.url, isolation_level="AUTOCOMMIT")
        else:
            engine = sa.create_engine(backend.url, connect_args=_DRIVER_AUTOCOMMIT[backend.name])
        cleanup.append(engine.dispose)
        session = Session(engine)
    elif where == "connection":
        conn = engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        cleanup.append(conn.close)
        session = Session(bind=conn)
    else:
        session = Session(engine)
        session.connection(execution_options={"isolation_level": "AUTOCOMMIT"})
    with session:
        with pytest.raises(ConfigurationError) as info:
            ob.enqueue(session, email(1))  # a generated key: MariaDB takes no savepoint
        assert info.value.setting == "isolation_level"
        assert "AUTOCOMMIT" in str(info.value)
        session.rollback()
    for close in cleanup:
        close()
    assert rows(backend.engine) == []


# -- 9. the test-suite recipes that join an external transaction --------------------------------


def test_the_restart_savepoint_recipe_knows_the_result_after_the_commit(engine, ob):
    """SQLAlchemy 1.x's recipe: a session on an outer transaction, a savepoint restarted after
    each one ends; the test's teardown rolls everything back."""
    conn = engine.connect()
    outer = conn.begin()
    session = Session(bind=conn)
    session.begin_nested()

    @event.listens_for(session, "after_transaction_end")
    def restart_savepoint(session, ended):
        if ended.nested and not ended._parent.nested:
            session.expire_all()
            session.begin_nested()

    session.add(Order(id=1, customer="ada"))
    result = ob.enqueue(session, email(1), key="k1")
    session.commit()
    assert (result.key, result.duplicate) == ("k1", False)
    assert session.scalar(sa.select(messages.c.id)) == result.id
    again = ob.enqueue(session, email(1), key="k1")
    assert (again.id, again.duplicate) == (result.id, True)
    session.close()
    outer.rollback()
    conn.close()
    assert rows(engine) == []


def test_the_create_savepoint_recipe_rolls_the_email_back_with_the_test(engine, ob):
    """SQLAlchemy 2's recipe: ``join_transaction_mode="create_savepoint"``."""
    with engine.connect() as conn:
        outer = conn.begin()
        session = Session(bind=conn, join_transaction_mode="create_savepoint")
        session.add(Order(id=1, customer="ada"))
        result = ob.enqueue(session, email(1), key="k1")
        session.commit()
        assert conn.scalar(sa.select(messages.c.id)) == result.id
        session.close()
        outer.rollback()
    assert rows(engine) == []


# -- a tenant's schema chosen by search_path ----------------------------------------------------


def test_a_tenants_search_path_holds_for_the_duplicate_found_outside_the_snapshot(
    postgres_backend, ob
):
    """At REPEATABLE READ a key committed after the caller's snapshot is looked up on a second
    connection: it must read the caller's tenant schema (``SET LOCAL search_path``), not the
    default one, where another row may have the same key."""
    engine = postgres_backend.engine
    tenant = "SET LOCAL search_path TO outbox_tenant_a"
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP SCHEMA IF EXISTS outbox_tenant_a CASCADE")
        conn.exec_driver_sql("CREATE SCHEMA outbox_tenant_a")
        conn.exec_driver_sql(tenant)
        metadata.create_all(conn)
    try:
        with Session(engine) as public, public.begin():
            ob.enqueue(public, email(1), key="other")
            theirs = ob.enqueue(public, email(1), key="welcome:42")  # the key, another tenant
        repeatable = engine.execution_options(isolation_level="REPEATABLE READ")
        with Session(repeatable) as session, session.begin():
            session.execute(sa.text(tenant))
            session.execute(sa.select(messages.c.id)).all()  # the snapshot is taken
            with Session(engine) as other, other.begin():
                other.execute(sa.text(tenant))
                winner = ob.enqueue(other, email(1), key="welcome:42")
            result = ob.enqueue(session, email(1), key="welcome:42")
        assert theirs.id != winner.id
        assert (result.id, result.duplicate) == (winner.id, True)
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql("DROP SCHEMA outbox_tenant_a CASCADE")


# -- a model on another bind ------------------------------------------------------------------


def test_flask_sqlalchemy_binds_put_a_rules_email_on_its_models_bind(tmp_path):
    """Flask-SQLAlchemy 3 with ``SQLALCHEMY_BINDS``: a model with ``__bind_key__`` lives on
    another database than the default one; the email a rule makes for it is written there,
    in its transaction, and an explicit enqueue follows it with ``{"instance": obj}``."""
    from flask import Flask
    from flask_sqlalchemy import SQLAlchemy

    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = f"sqlite:///{tmp_path / 'main.db'}"
    app.config["SQLALCHEMY_BINDS"] = {"shop": f"sqlite:///{tmp_path / 'shop.db'}"}
    db = SQLAlchemy(app)

    class ShopOrder(db.Model):
        __bind_key__ = "shop"
        id = sa.Column(sa.Integer, primary_key=True)
        customer = sa.Column(sa.String(255))

    ob = Outbox()
    ob.on_insert(ShopOrder, name="confirm")(lambda order: email(order.id))
    with app.app_context():
        for engine in db.engines.values():
            enable_savepoints(engine)
            metadata.create_all(engine)
        db.create_all()
        ob.install(db.session.session_factory)
        order = ShopOrder(id=1, customer="ada")
        db.session.add(order)
        ob.enqueue(db.session, email(2), key="explicit", bind_arguments={"instance": order})
        db.session.commit()
        shop, main = db.engines["shop"], db.engines[None]
        assert sorted(r.idempotency_key for r in rows(shop)) == ["confirm:1", "explicit"]
        assert rows(main) == []
        db.session.remove()
        for engine in db.engines.values():
            engine.dispose()


# -- SQLite that does not begin its own transactions --------------------------------------------


@pytest.mark.parametrize("then", ["rollback", "commit"])
def test_a_sqlite_engine_without_enable_savepoints_keeps_the_email_in_the_transaction(
    tmp_path, ob, then
):
    """sqlite3's legacy mode begins a transaction only before an INSERT: an email enqueued
    first would begin it with its SAVEPOINT, and RELEASE commit it alone; enqueue begins the
    transaction itself."""
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'legacy.db'}")
    metadata.create_all(engine)
    Base.metadata.create_all(engine)
    with Session(engine) as session:
        result = ob.enqueue(session, email(1), key="k1")
        again = ob.enqueue(session, email(1), key="k1")
        session.add(Order(id=1, customer="ada"))
        session.flush()
        getattr(session, then)()
    assert (again.id, again.duplicate) == (result.id, True)
    expected = ["k1"] if then == "commit" else []
    assert [r.idempotency_key for r in rows(engine)] == expected
    assert order_ids(engine) == ([1] if then == "commit" else [])
    engine.dispose()


def test_a_savepoint_on_a_sqlite_engine_without_enable_savepoints_is_refused(tmp_path, ob):
    """There a savepoint may have begun the transaction itself, and its RELEASE commit the
    email with everything else before the app decides."""
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'legacy.db'}")
    metadata.create_all(engine)
    with Session(engine) as session:
        with pytest.raises(ConfigurationError) as info, session.begin_nested():
            ob.enqueue(session, email(1), key="k1")
        assert info.value.setting == "enable_savepoints"
        session.rollback()
    assert rows(engine) == []
    engine.dispose()


def test_an_aiosqlite_engine_in_autocommit_is_refused(tmp_path, ob):
    path = tmp_path / "auto.db"
    sync = sa.create_engine(f"sqlite:///{path}")
    metadata.create_all(sync)

    async def scenario() -> str:
        engine = create_async_engine(
            f"sqlite+aiosqlite:///{path}", connect_args={"isolation_level": None}
        )
        try:
            async with AsyncSession(engine) as session:
                try:
                    await ob.enqueue_async(session, email(1), key="k1")
                except ConfigurationError as exc:
                    await session.rollback()
                    return exc.setting
                return "not refused"
        finally:
            await engine.dispose()

    assert asyncio.run(scenario()) == "isolation_level"
    assert rows(sync) == []
    sync.dispose()


# -- rules installed on an async_sessionmaker with the app's own sync class ---------------------


def test_install_keeps_the_apps_own_sync_session_class(backend):
    """SQLAlchemy's way to route an AsyncSession: ``AppAsyncSession.sync_session_class =
    RoutingSession``. Installing the rules must listen on that class, not replace it."""
    leader = create_async_engine(backend.async_url)
    enable_savepoints(leader)
    chosen: list[str] = []

    class RoutingSession(Session):
        def get_bind(self, mapper=None, clause=None, **kw):
            chosen.append("leader")
            return leader.sync_engine

    class AppAsyncSession(AsyncSession):
        sync_session_class = RoutingSession

    ob = Outbox()
    ob.on_insert(Order, name="confirm")(lambda order: email(order.id))
    Sessions = async_sessionmaker(class_=AppAsyncSession)
    ob.install(Sessions)

    async def scenario() -> None:
        try:
            async with Sessions.begin() as session:
                assert isinstance(session.sync_session, RoutingSession)
                session.add(Order(id=1, customer="ada"))
        finally:
            await leader.dispose()
            event.remove(RoutingSession, "after_flush", ob._after_flush)

    asyncio.run(scenario())
    assert "leader" in chosen
    assert [r.idempotency_key for r in rows(backend.engine)] == ["confirm:1"]
