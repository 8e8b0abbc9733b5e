"""The relay's database engine, configured for many replicas sharing one database."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

__all__ = ["CONNECT_TIMEOUT", "READ_COMMITTED", "make_engine"]

READ_COMMITTED = "READ COMMITTED"
CONNECT_TIMEOUT = 10  # seconds; see make_engine
_TIMEOUT_DRIVERS = frozenset({"psycopg", "psycopg2", "pymysql", "mysqldb"})


def make_engine(url: str | sa.URL, **options: Any) -> sa.Engine:
    """An engine for the relay (or any code running relay statements).

    On MySQL/MariaDB it runs at READ COMMITTED: under InnoDB's default REPEATABLE READ the claim
    takes next-key (gap) locks that ``SKIP LOCKED`` does not skip, so replicas would wait for,
    and deadlock with, each other. The level is set at connect time, so a lost connection
    fails like any other database error.

    A connection attempt gives up after ``CONNECT_TIMEOUT`` seconds unless the URL sets its own
    ``connect_timeout``: libpq would otherwise wait for the kernel (about two minutes on Linux)
    on a database host that drops packets, and the loop, stuck that long, would fail
    ``/healthz`` and get the relay restarted for an outage a restart cannot fix.
    """
    parsed = sa.make_url(url)
    if parsed.get_backend_name() in ("mysql", "mariadb"):
        options.setdefault("isolation_level", READ_COMMITTED)
    if parsed.get_driver_name() in _TIMEOUT_DRIVERS and "connect_timeout" not in parsed.query:
        options["connect_args"] = {
            "connect_timeout": CONNECT_TIMEOUT,
            **options.get("connect_args", {}),
        }
    options.setdefault("pool_pre_ping", True)
    options.setdefault("pool_recycle", 1800)
    return sa.create_engine(url, **options)
