"""The suite's fixtures, registered from ``tests/conftest.py``.

Every behaviour test takes ``backend`` (or ``engine``), parametrized over SQLite, PostgreSQL
and MySQL/MariaDB; ``server_backend`` runs on the two servers only. Each database is created
once per session (per pytest-xdist worker), migrated to head, and emptied after every test.
A test marked ``serial`` never runs beside other workers: under xdist it skips (fails when
CI=true); ``.ci/run`` runs them in a second pytest without ``-n``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from outbox import Outbox, migrations
from outbox.sqlite import enable_savepoints
from tests.support.db import (
    BACKENDS,
    CI,
    Backend,
    Base,
    async_url_for,
    emptied,
    reset_database,
    server_url,
    unavailable,
)

__all__ = [
    "backend",
    "engine",
    "postgres_backend",
    "pytest_addoption",
    "pytest_runtest_setup",
    "server_backend",
]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--ledger-messages",
        type=int,
        default=None,
        metavar="N",
        help="messages per delivery-ledger run in tests/reliability (default: each test's CI "
        "size; the xmin throughput pair never goes below its own). Raise --timeout with it.",
    )


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A ``serial`` test (it restarts a database server, say) is refused in a pytest-xdist
    worker: the other workers share those servers."""
    if item.get_closest_marker("serial") and hasattr(item.config, "workerinput"):
        reason = "marked serial: run it without -n (-m serial), never beside other workers"
        if CI:
            pytest.fail(f"{reason} (CI=true: it must run, not skip)", pytrace=False)
        pytest.skip(reason)


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
                    url = server_url(name, stack)
                engine = sa.create_engine(url, pool_pre_ping=True)
                enable_savepoints(engine)
                try:
                    reset_database(engine)
                except sa.exc.OperationalError as exc:
                    unavailable(name, str(exc.orig))
                migrations.upgrade(engine)
                Base.metadata.create_all(engine)
                backend = Backend(name=name, url=url, async_url=async_url_for(url), engine=engine)
                self[name] = backend
                created[name] = backend
                return backend

        yield Lazy()
        for backend in created.values():
            backend.engine.dispose()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, _backends: dict[str, Backend]) -> Iterator[Backend]:
    """One migrated database per backend; every table emptied after each test."""
    yield from emptied(_backends[request.param])


@pytest.fixture(params=("postgresql", "mysql"))
def server_backend(
    request: pytest.FixtureRequest, _backends: dict[str, Backend]
) -> Iterator[Backend]:
    """PostgreSQL and MariaDB only: for tests of real concurrency between connections."""
    yield from emptied(_backends[request.param])


@pytest.fixture
def postgres_backend(_backends: dict[str, Backend]) -> Iterator[Backend]:
    """PostgreSQL only: for LISTEN/NOTIFY and what else only it has."""
    yield from emptied(_backends["postgresql"])


@pytest.fixture
def engine(backend: Backend) -> sa.Engine:
    """The ``backend``'s engine."""
    return backend.engine


@pytest.fixture
def ob() -> Outbox:
    """An Outbox with the default categories."""
    return Outbox()


@pytest.fixture
def Sessions(engine: sa.Engine) -> sessionmaker[Session]:
    """Sessions on the ``backend``'s engine."""
    return sessionmaker(engine)
