"""Suppression at send: which of a wave's recipients ``outbox_suppressions`` holds."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from outbox.schema import suppressions

__all__ = ["suppressed_among"]


@functools.cache
def _suppressed_statement(pg: bool) -> sa.Select[Any]:
    """suppressed_among's SELECT, built once: one array on PostgreSQL (``= ANY``), so the
    text and its prepared plan do not change with the wave's size."""
    address = suppressions.c.address
    if pg:
        among = address == sa.any_(sa.bindparam("s_addresses", type_=postgresql.ARRAY(sa.String)))
    else:
        among = address.in_(sa.bindparam("s_addresses", expanding=True))
    return sa.select(address).where(among)


def suppressed_among(conn: sa.Connection, addresses: Iterable[str]) -> set[str]:
    """Which of ``addresses`` (lower-cased addr-specs) are suppressed: one primary-key lookup
    each, in one statement, for a whole wave before its send-started mark."""
    wanted = sorted(set(addresses))
    if not wanted:
        return set()
    stmt = _suppressed_statement(conn.dialect.name == "postgresql")
    return set(conn.execute(stmt, {"s_addresses": wanted}).scalars())
