"""Database backends for the test suite.

Every behaviour test takes the ``backend`` fixture (or ``engine``), parametrized over SQLite,
PostgreSQL and MySQL/MariaDB. Server URLs come from ``OUTBOX_TEST_POSTGRES_URL`` and
``OUTBOX_TEST_MYSQL_URL``; without them testcontainers starts a container when Docker is there.
A backend that cannot be reached skips locally and **fails when CI=true**.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from outbox import migrations
from outbox.schema import metadata as outbox_metadata
from outbox.sqlite import enable_savepoints

CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
BACKENDS = ("sqlite", "postgresql", "mysql")


class Base(DeclarativeBase):
    """The business tables of a tiny shop, standing in for the host app's models."""


class Order(Base):
    __tablename__ = "shop_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str] = mapped_column(sa.String(255))
    status: Mapped[str] = mapped_column(sa.String(20), default="new")


class User(Base):
    __tablename__ = "shop_users"
    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(sa.String(255))
    name: Mapped[str] = mapped_column(sa.String(255), default="")


@dataclass
class Backend:
    name: str
    url: str
    async_url: str
    engine: sa.Engine


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--ledger-messages",
        type=int,
        default=None,
        metavar="N",
        help="messages per delivery-ledger run in tests/reliability (default: each test's CI "
        "size; the xmin throughput pair never goes below its own). Raise --timeout with it.",
    )


def _unavailable(name: str, reason: str) -> None:
    message = f"{name} backend unavailable: {reason}"
    if CI:
        pytest.fail(message + " (CI=true: database tests must run, not skip)", pytrace=False)
    pytest.skip(message)


def _server_url(name: str, stack: ExitStack) -> str:
    env = {"postgresql": "OUTBOX_TEST_POSTGRES_URL", "mysql": "OUTBOX_TEST_MYSQL_URL"}[name]
    url = os.environ.get(env)
    if url:
        return url
    try:
        if name == "postgresql":
            from testcontainers.postgres import PostgresContainer

            pg = stack.enter_context(PostgresContainer("postgres:15", driver="psycopg"))
            return str(pg.get_connection_url())
        from testcontainers.mysql import MySqlContainer

        my = stack.enter_context(MySqlContainer("mariadb:10.11", dialect="pymysql"))
        return str(my.get_connection_url())
    except Exception as exc:
        _unavailable(name, f"{env} is not set and testcontainers failed ({exc.__class__.__name__})")
        raise


def async_url_for(url: str) -> str:
    u = sa.make_url(url)
    driver = {
        "sqlite": "aiosqlite",
        "postgresql": "psycopg",
        "mysql": "aiomysql",
        "mariadb": "aiomysql",
    }[u.get_backend_name()]
    return u.set(drivername=f"{u.get_backend_name()}+{driver}").render_as_string(
        hide_password=False
    )


def reset_database(engine: sa.Engine) -> None:
    """Drop everything in the test database, so each run starts from migrations."""
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.exec_driver_sql("DROP SCHEMA IF EXISTS public CASCADE")
            conn.exec_driver_sql("CREATE SCHEMA public")
            return
        inspector = sa.inspect(conn)
        for view in inspector.get_view_names():
            conn.exec_driver_sql(f"DROP VIEW IF EXISTS {view}")
        if engine.dialect.name in ("mysql", "mariadb"):
            conn.exec_driver_sql("SET FOREIGN_KEY_CHECKS = 0")
        for table in inspector.get_table_names():
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table}")
        if engine.dialect.name in ("mysql", "mariadb"):
            conn.exec_driver_sql("SET FOREIGN_KEY_CHECKS = 1")


@pytest.fixture(scope="session")
def _backends(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Backend]]:
    """Backends created lazily, once per session, migrated to head."""
    created: dict[str, Backend] = {}
    with ExitStack() as stack:

        class Lazy(dict[str, Backend]):
            def __missing__(self, name: str) -> Backend:
                if name == "sqlite":
                    path = Path(tmp_path_factory.mktemp("sqlite")) / "outbox.db"
                    url = f"sqlite:///{path}"
                else:
                    url = _server_url(name, stack)
                engine = sa.create_engine(url, pool_pre_ping=True)
                enable_savepoints(engine)
                try:
                    reset_database(engine)
                except sa.exc.OperationalError as exc:
                    _unavailable(name, str(exc.orig))
                migrations.upgrade(engine)
                Base.metadata.create_all(engine)
                backend = Backend(name, url, async_url_for(url), engine)
                self[name] = backend
                created[name] = backend
                return backend

        yield Lazy()
        for backend in created.values():
            backend.engine.dispose()


def _emptied(b: Backend) -> Iterator[Backend]:
    yield b
    with b.engine.begin() as conn:
        for table in (
            *reversed(Base.metadata.sorted_tables),
            *reversed(outbox_metadata.sorted_tables),
        ):
            conn.execute(table.delete())


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, _backends: dict[str, Backend]) -> Iterator[Backend]:
    """One migrated database per backend; every table emptied after each test."""
    yield from _emptied(_backends[request.param])


@pytest.fixture(params=("postgresql", "mysql"))
def server_backend(
    request: pytest.FixtureRequest, _backends: dict[str, Backend]
) -> Iterator[Backend]:
    """PostgreSQL and MariaDB only: for tests of real concurrency between connections."""
    yield from _emptied(_backends[request.param])


@pytest.fixture
def engine(backend: Backend) -> sa.Engine:
    return backend.engine
