"""The test databases: which backends run, the tiny shop's models, and reading outbox rows.

Server URLs come from ``OUTBOX_TEST_POSTGRES_URL`` and ``OUTBOX_TEST_MYSQL_URL``; without them
testcontainers starts a container when Docker is there. Under pytest-xdist each worker uses a
database of its own next to the configured one (``outbox_test`` -> ``outbox_test_gw0``),
created when missing. A backend that cannot be reached skips locally and **fails when
CI=true**. The fixtures built on these live in :mod:`tests.support.fixtures`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from outbox.schema import attempts, messages
from outbox.schema import metadata as outbox_metadata

__all__ = [
    "BACKENDS",
    "CI",
    "Backend",
    "Base",
    "Order",
    "User",
    "async_url_for",
    "attempt_rows",
    "emptied",
    "fresh_database",
    "reset_database",
    "row",
    "rows",
    "server_url",
    "statuses",
    "unavailable",
    "worker_database",
]

CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
BACKENDS = ("sqlite", "postgresql", "mysql")


class Base(DeclarativeBase):
    """The business tables of a tiny shop, standing in for the host app's models."""


class Order(Base):
    """A shop order: what an app enqueues an email beside."""

    __tablename__ = "shop_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str] = mapped_column(sa.String(255))
    status: Mapped[str] = mapped_column(sa.String(20), default="new")


class User(Base):
    """A shop user: the address a welcome email goes to."""

    __tablename__ = "shop_users"
    id: Mapped[int] = mapped_column(primary_key=True)
    email: Mapped[str] = mapped_column(sa.String(255))
    name: Mapped[str] = mapped_column(sa.String(255), default="")


@dataclass(frozen=True, kw_only=True)
class Backend:
    """One migrated test database: its backend name, sync and async URLs, and an engine."""

    name: str
    url: str
    async_url: str
    engine: sa.Engine


def unavailable(name: str, reason: str) -> None:
    """Skip the test for an unreachable backend; fail it instead when CI=true."""
    message = f"{name} backend unavailable: {reason}"
    if CI:
        pytest.fail(message + " (CI=true: database tests must run, not skip)", pytrace=False)
    pytest.skip(message)


def server_url(name: str, stack: ExitStack) -> str:
    """The URL of the ``postgresql`` or ``mysql`` test database: from the environment (a
    pytest-xdist worker's own, see :func:`worker_database`), else a container entered on
    ``stack`` (each worker starts its own)."""
    env = {"postgresql": "OUTBOX_TEST_POSTGRES_URL", "mysql": "OUTBOX_TEST_MYSQL_URL"}[name]
    url = os.environ.get(env)
    if url:
        return worker_database(name, url)
    try:
        if name == "postgresql":
            from testcontainers.postgres import PostgresContainer

            pg = stack.enter_context(PostgresContainer("postgres:15", driver="psycopg"))
            return str(pg.get_connection_url())
        from testcontainers.mysql import MySqlContainer

        my = stack.enter_context(MySqlContainer("mariadb:10.11", dialect="pymysql"))
        return str(my.get_connection_url())
    except Exception as exc:
        unavailable(name, f"{env} is not set and testcontainers failed ({exc.__class__.__name__})")
        raise


def worker_database(name: str, url: str) -> str:
    """In a pytest-xdist worker, the URL of its own database next to ``url``'s (of the
    ``name`` backend), created if missing (``outbox_test`` -> ``outbox_test_gw0``), so workers
    never share tables; ``url`` itself outside xdist. A server that cannot be reached skips,
    or fails when CI=true."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return url
    configured = sa.make_url(url)
    database = f"{configured.database}_{worker}"
    server = sa.create_engine(configured, isolation_level="AUTOCOMMIT", poolclass=sa.pool.NullPool)
    try:
        with server.connect() as conn:
            if server.dialect.name == "postgresql":
                found = conn.execute(
                    sa.text("SELECT 1 FROM pg_database WHERE datname = :name"), {"name": database}
                ).scalar()
                if not found:
                    conn.exec_driver_sql(f'CREATE DATABASE "{database}"')
            else:  # the character set .ci/run creates outbox_test with
                conn.exec_driver_sql(
                    f"CREATE DATABASE IF NOT EXISTS `{database}` CHARACTER SET utf8mb4"
                )
    except sa.exc.OperationalError as exc:
        unavailable(name, str(exc.orig))
    finally:
        server.dispose()
    return configured.set(database=database).render_as_string(hide_password=False)


def async_url_for(url: str) -> str:
    """``url`` with the async driver of its backend."""
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


def emptied(backend: Backend) -> Iterator[Backend]:
    """Yield ``backend``, then delete every row of the shop's and the outbox's tables."""
    yield backend
    with backend.engine.begin() as conn:
        for table in (
            *reversed(Base.metadata.sorted_tables),
            *reversed(outbox_metadata.sorted_tables),
        ):
            conn.execute(table.delete())


@contextmanager
def fresh_database(backend: Backend, folder: Path, suffix: str) -> Iterator[str]:
    """The URL of a new, empty database of ``backend``'s kind, dropped afterwards: on a server
    ``<test database>_<suffix>`` (next to this run's own database, not a shared name), on
    SQLite ``<suffix>.db`` in ``folder``."""
    if backend.name == "sqlite":
        yield f"sqlite:///{folder / f'{suffix}.db'}"
        return
    url = sa.make_url(backend.url)
    server = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    name = f"{url.database}_{suffix}"
    with server.connect() as conn:
        conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name}")
        conn.exec_driver_sql(f"CREATE DATABASE {name}")
    try:
        yield url.set(database=name).render_as_string(hide_password=False)
    finally:
        force = " WITH (FORCE)" if backend.name == "postgresql" else ""
        with server.connect() as conn:
            conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name}{force}")
        server.dispose()


def rows(engine: sa.Engine) -> list[sa.Row[Any]]:
    """Every outbox message row, by id."""
    with engine.connect() as conn:
        return list(conn.execute(sa.select(messages).order_by(messages.c.id)))


def row(engine: sa.Engine, message_id: int, *, payload: bool = False) -> sa.Row[Any]:
    """One message's row; its payload column (which a test may have made unreadable) only
    with ``payload``."""
    columns = [c for c in messages.c if payload or c.name != "payload"]
    with engine.connect() as conn:
        return conn.execute(sa.select(*columns).where(messages.c.id == message_id)).one()


def statuses(engine: sa.Engine) -> dict[int, str]:
    """{message id: status} of every message."""
    with engine.connect() as conn:
        return {
            id_: status for id_, status in conn.execute(sa.select(messages.c.id, messages.c.status))
        }


def attempt_rows(engine: sa.Engine, message_id: int | None = None) -> list[sa.Row[Any]]:
    """The attempt rows, by id: all of them, or those of ``message_id``."""
    query = sa.select(attempts).order_by(attempts.c.id)
    if message_id is not None:
        query = query.where(attempts.c.message_id == message_id)
    with engine.connect() as conn:
        return list(conn.execute(query))
