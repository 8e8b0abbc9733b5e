"""The relay's database engine, configured for many replicas sharing one database."""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

__all__ = ["READ_COMMITTED", "make_engine"]

READ_COMMITTED = "READ COMMITTED"


def make_engine(url: str | sa.URL, **options: Any) -> sa.Engine:
    """An engine for the relay (or any code running relay statements).

    On MySQL/MariaDB it runs at READ COMMITTED: under InnoDB's default REPEATABLE READ the claim
    takes next-key (gap) locks that ``SKIP LOCKED`` does not skip, so replicas would wait for,
    and deadlock with, each other. The level is set at connect time, so a lost connection
    fails like any other database error.
    """
    if sa.make_url(url).get_backend_name() in ("mysql", "mariadb"):
        options.setdefault("isolation_level", READ_COMMITTED)
    options.setdefault("pool_pre_ping", True)
    options.setdefault("pool_recycle", 1800)
    return sa.create_engine(url, **options)
