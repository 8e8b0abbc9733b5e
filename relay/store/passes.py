"""A busy pass's first statement: the last wave's sent saves and this pass's claim read.

On PostgreSQL both run as one statement (the finalize and its attempt rows as CTEs, the
claim's locking read as the main query), so a pass is two statements, this and the claim's
write (``claims.take_batch``). The two touch different rows: the finalize moves rows that
are ``processing`` under an earlier token, the read locks rows that are due (``pending``,
``retrying``), and both read the one snapshot of the statement. Elsewhere it is the save,
then :func:`~relay.store.claims.lock_batch`, as two statements.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from relay.store.claims import Taking, lock_batch, lock_params, lock_statement, taking_of
from relay.store.finalize import SentSave, save_sent, sent_ctes

__all__ = ["save_and_lock"]

_KIND = "kind"  # which part of the statement a row comes from: the claim's or the save's


@functools.cache
def _statement(skip: bool) -> sa.CompoundSelect[Any]:
    """The finalize's CTEs, then the claim's rows and the moved (id, token) pairs as one
    result, told apart by ``kind``."""
    read = lock_statement(skip)
    saved, written = sent_ctes()
    moved = [
        saved.c.id.label(c.name)
        if c.name == "id"
        else saved.c.token.label(c.name)
        if c.name == "claim_token"
        else sa.null().label(c.name)
        for c in read.selected_columns
    ]
    return sa.union_all(
        read.add_columns(sa.literal("claim").label(_KIND)),
        sa.select(*moved, sa.literal("saved").label(_KIND)),
    ).add_cte(saved, written)


def save_and_lock(
    conn: sa.Connection,
    sent: SentSave,
    *,
    relay_id: str,
    limit: int,
    now: datetime,
    lease_seconds: float,
    skip_keys: Sequence[str] = (),
) -> tuple[set[tuple[int, str]], Taking]:
    """``sent`` saved (:func:`~relay.store.finalize.save_sent`), then up to ``limit`` due
    rows read and locked (:func:`~relay.store.claims.lock_batch`): the (id, claim token)
    pairs moved to sent, and the claim to write."""
    if conn.dialect.name != "postgresql" or not sent.one_statement:
        moved = save_sent(conn, sent)
        taking = lock_batch(
            conn, relay_id=relay_id, limit=limit, now=now, lease_seconds=lease_seconds,
            skip_keys=skip_keys,
        )  # fmt: skip
        return moved, taking
    params = lock_params(relay_id, limit, now, lease_seconds, skip_keys)
    rows = conn.execute(_statement("c_skip" in params), {**params, **sent.params()}).all()
    moved = {(row.id, row.claim_token) for row in rows if row.kind == "saved"}
    return moved, taking_of([row for row in rows if row.kind == "claim"], params)
