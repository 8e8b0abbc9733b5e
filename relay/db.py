"""The relay's database engine, configured for many replicas sharing one database."""

from __future__ import annotations

import random
import re
from typing import Any

import sqlalchemy as sa

from outbox.autocommit import in_autocommit

__all__ = [
    "CONNECT_TIMEOUT",
    "READ_COMMITTED",
    "READ_TIMEOUT",
    "autocommits",
    "blames_the_row",
    "is_outage",
    "make_engine",
    "masked_url",
    "retry_delay",
]

READ_COMMITTED = "READ COMMITTED"
CONNECT_TIMEOUT = 10  # seconds; see make_engine
READ_TIMEOUT = 30  # seconds; see make_engine
_TIMEOUT_DRIVERS = frozenset({"psycopg", "psycopg2", "pymysql", "mysqldb"})
_READ_TIMEOUT_DRIVERS = frozenset({"pymysql", "mysqldb"})
# query parameters that carry a secret (libpq's password, sslpassword; drivers' passwd, ...)
_SECRET_PARAMETER = re.compile(r"pass|pwd|secret|token|key", re.IGNORECASE)


def make_engine(
    url: str | sa.URL, *, read_timeout: float | None = READ_TIMEOUT, **options: Any
) -> sa.Engine:
    """An engine for the relay (or any code running relay statements).

    On MySQL/MariaDB it runs at READ COMMITTED: under InnoDB's default REPEATABLE READ the claim
    takes next-key (gap) locks that ``SKIP LOCKED`` does not skip, so replicas would wait for,
    and deadlock with, each other. The level is set at connect time, so a lost connection
    fails like any other database error.

    A connection attempt gives up after ``CONNECT_TIMEOUT`` seconds unless the URL sets its own
    ``connect_timeout``: libpq would otherwise wait for the kernel (about two minutes on Linux)
    on a database host that drops packets, and the loop, stuck that long, would fail
    ``/healthz`` and get the relay restarted for an outage a restart cannot fix.

    On MySQL/MariaDB every read and write of a connection gives up after ``read_timeout``
    seconds (``READ_TIMEOUT``; None: never) unless the URL sets its own ``read_timeout`` and
    ``write_timeout``. The MySQL drivers bound only the TCP connect otherwise: a server that
    accepts and never sends its handshake, or a connection that goes silent mid-statement (a
    network that drops packets, a proxy that stops forwarding), would hold the loop forever,
    and with it the drain a SIGTERM asks for. The relay's statements take milliseconds; one
    cut short fails like a lost connection (the loop backs off and reconnects). An operator's
    command or a migration, whose statements may legitimately run long, passes None.
    """
    parsed = sa.make_url(url)
    if parsed.get_backend_name() in ("mysql", "mariadb"):
        options.setdefault("isolation_level", READ_COMMITTED)
    driver = parsed.get_driver_name()
    defaults: dict[str, Any] = {}
    if driver in _TIMEOUT_DRIVERS and "connect_timeout" not in parsed.query:
        defaults["connect_timeout"] = CONNECT_TIMEOUT
    if read_timeout is not None and driver in _READ_TIMEOUT_DRIVERS:
        for name in ("read_timeout", "write_timeout"):
            if name not in parsed.query:
                defaults[name] = read_timeout
    if defaults:
        options["connect_args"] = {**defaults, **options.get("connect_args", {})}
    options.setdefault("pool_pre_ping", True)
    options.setdefault("pool_recycle", 1800)
    return sa.create_engine(url, **options)


def autocommits(conn: sa.Connection) -> bool:
    """Whether every statement on ``conn`` commits by itself, so a transaction holds no lock
    from one statement to the next (:func:`outbox.autocommit.in_autocommit`). The relay's
    claim reads and locks rows, then writes them: it must not run so. Call it inside a
    transaction, after a statement."""
    return in_autocommit(conn)


def masked_url(url: str | sa.URL) -> str:
    """``url`` as it may be shown: its password and every query parameter that may carry a
    secret (``?password=``, ``?sslpassword=``, ``?passwd=``) replaced by ``***``."""
    parsed = sa.make_url(url)
    query = {
        name: "***" if _SECRET_PARAMETER.search(name) else value
        for name, value in parsed.query.items()
    }
    return parsed.set(query=query).render_as_string(hide_password=True).replace("%2A%2A%2A", "***")


def is_outage(exc: sa.exc.DBAPIError) -> bool:
    """A database error that says nothing about the statement (the server is gone, the
    connection broke, a deadlock or a lock wait ended the transaction): try it all again.
    The relay loop's rule: anything else is its statement's own fault."""
    return exc.connection_invalidated or isinstance(
        exc, sa.exc.OperationalError | sa.exc.InterfaceError | sa.exc.InternalError
    )


def blames_the_row(exc: sa.exc.DBAPIError) -> bool:
    """A value the database will not store (a data or integrity error on a live connection).
    The intake's rule: only such an error is an event's fault; anything else, a missing
    table or grant included, retries the whole batch, so a schema or permission mistake
    never sends good events to the dead-letter queue."""
    return not exc.connection_invalidated and isinstance(
        exc, sa.exc.DataError | sa.exc.IntegrityError
    )


def retry_delay(failures: int, rng: random.Random, *, cap: float = 30.0) -> float:
    """Jittered exponential wait after ``failures`` failures in a row, at most ``cap``
    seconds: replicas failing together do not retry in step."""
    return min(cap, 0.25 * 2.0 ** min(failures, 8)) * rng.uniform(0.5, 1.0)
