"""Every SQL statement of the relay, each a function named by intent.

The rules that keep the relay safe live here:

* Every transition is **one conditional UPDATE** whose WHERE names the state it expects, and
  for a claimed row its id and ``claim_token``. Zero rows affected means another relay (or the
  sweep) moved the row first; the caller logs it and moves on. Nothing is load-mutate-saved.
* No function holds a transaction across a provider call: the caller runs them in short
  transactions (the relay loop, one per busy pass), never around a send.
* Sweeps and the expiry scan skip rows another transaction holds (``SKIP LOCKED``): a relay
  never waits on another relay's locks.
* MySQL/MariaDB report *matched* rows (``CLIENT_FOUND_ROWS``), so a guarded UPDATE's rowcount
  is reliable there too; MariaDB has no ``UPDATE ... RETURNING``, so the claim reads its rows
  back by claim token.
"""

from __future__ import annotations

import functools
import json
import logging
import random
import uuid
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.sql.dml import ReturningUpdate

from outbox.migrations import VIEWS
from outbox.schema import (
    CLAIMABLE,
    MAX_BACKOFF_SECONDS,
    TERMINAL,
    AmbiguityPolicy,
    AttemptOutcome,
    EventType,
    RelayState,
    Status,
    UTCDateTime,
    attempts,
    events,
    intakes,
    messages,
    relays,
    send_budget,
    send_budget_lock,
    suppressions,
)
from outbox.schema import metadata as _outbox_metadata
from relay.clock import read_database_time
from relay.policy import Action, Decision, LeaseExpired, MessageState, decide
from relay.ratelimit import Booking, merged

__all__ = [
    "MAX_RECONCILE_AFTER",
    "OUTBOX_TABLES",
    "RECEIVE_AFTER_HEARTBEAT",
    "AttemptRecord",
    "Claim",
    "Confirmed",
    "Expired",
    "Filter",
    "Reconciled",
    "RelayHolder",
    "StaleLease",
    "apply_decision",
    "attempted_by",
    "book_sends",
    "cancel",
    "cancel_many",
    "claim_batch",
    "count_due",
    "count_locked_due",
    "count_messages",
    "expire",
    "extend_lease",
    "fail",
    "finalize_sent",
    "finalize_sent_many",
    "get_message",
    "heartbeat_held",
    "hold_unknown",
    "list_messages",
    "live_heartbeats",
    "lock_send_budget",
    "mark_send_started",
    "mark_send_started_at",
    "message_ids",
    "missing_tables",
    "prune_batch",
    "prune_send_budget",
    "read_lag",
    "read_view",
    "recent_payloads",
    "reconcile_unknown",
    "record_attempts",
    "register",
    "release",
    "release_unsent",
    "release_unstarted",
    "requeue",
    "requeue_many",
    "resolve_confirmed",
    "schedule_retry",
    "send_bookings",
    "settle_expired_leases",
    "statuses_of",
    "stop_held",
    "suppressed_among",
    "sweep_candidates",
    "sweep_expired_leases",
]

_log = logging.getLogger("relay")

_m = messages
_CLAIM_COLUMNS = (
    _m.c.id,
    _m.c.idempotency_key,
    _m.c.category,
    _m.c.priority,
    _m.c.status,
    # read as text, cast in SQL so no driver decodes it: a row edited into garbage (or JSON
    # too deep or too large for Python to decode) fails as invalid_payload in the relay, and
    # never breaks the claim that reads it
    sa.cast(_m.c.payload, sa.Text).label("payload"),
    _m.c.recipient_count,
    _m.c.claim_token,
    _m.c.attempt_count,
    _m.c.max_attempts,
    _m.c.backoff_base,
    _m.c.backoff_cap,
    _m.c.ambiguity_policy,
    _m.c.reconcile_after,
    _m.c.next_attempt_at,
    _m.c.lease_expires_at,
)
_NO_CLAIM = {"claim_token": None, "lease_expires_at": None}
# PostgreSQL: a batch of (id, claim token, provider id) as one row set, from three arrays
_BATCH = (
    sa.func.unnest(
        sa.bindparam("b_ids", type_=postgresql.ARRAY(sa.BigInteger)),
        sa.bindparam("b_tokens", type_=postgresql.ARRAY(sa.String)),
        sa.bindparam("b_provider_ids", type_=postgresql.ARRAY(sa.String)),
    )
    .table_valued(
        sa.column("id", sa.BigInteger),
        sa.column("token", sa.String),
        sa.column("provider_id", sa.String),
    )
    .render_derived()
    .alias("batch")
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Claim:
    """A message this relay holds under a lease, identified by (id, claim_token)."""

    id: int
    key: str
    category: str
    priority: int
    payload: Any
    recipient_count: int
    claim_token: str
    attempt_count: int
    max_attempts: int
    backoff_base: float
    backoff_cap: float
    ambiguity_policy: AmbiguityPolicy  # RECONCILE for a row stored 'hold' with a window
    next_attempt_at: datetime
    lease_expires_at: datetime

    @property
    def state(self) -> MessageState:
        return MessageState(
            attempt_count=self.attempt_count,
            max_attempts=self.max_attempts,
            backoff_base=self.backoff_base,
            backoff_cap=self.backoff_cap,
            ambiguity_policy=self.ambiguity_policy,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Expired:
    """A due message the claim found past its ``expires_at``: moved to expired, never sent."""

    id: int
    key: str
    category: str


@dataclass(frozen=True, kw_only=True, slots=True)
class AttemptRecord:
    """One row of ``outbox_attempts``: what one provider call (or sweep) found."""

    message_id: int
    claim_token: str | None
    relay_id: str | None
    started_at: datetime | None
    finished_at: datetime
    outcome: AttemptOutcome
    error_code: str | None = None
    error_message: str | None = None
    provider_message_id: str | None = None
    dropped_recipients: str | None = None  # suppressed addresses not sent to, comma-separated


def _policy(stored: str, reconcile_after: float | None) -> AmbiguityPolicy:
    """The row's policy: ``reconcile`` is stored as ``'hold'`` with ``reconcile_after`` set."""
    if reconcile_after is not None:
        return AmbiguityPolicy.RECONCILE
    return AmbiguityPolicy(stored)


def _claim(row: Any, claim_token: str, payload: Any) -> Claim:
    """A :class:`Claim` from a row read with ``_CLAIM_COLUMNS``."""
    return Claim(
        id=row.id,
        key=row.idempotency_key,
        category=row.category,
        priority=row.priority,
        payload=payload,
        recipient_count=row.recipient_count,
        claim_token=claim_token,
        attempt_count=row.attempt_count,
        max_attempts=row.max_attempts,
        backoff_base=row.backoff_base,
        backoff_cap=row.backoff_cap,
        ambiguity_policy=_policy(row.ambiguity_policy, row.reconcile_after),
        next_attempt_at=row.next_attempt_at,
        lease_expires_at=row.lease_expires_at,
    )


# -- claim -------------------------------------------------------------------------------


_NOW = sa.bindparam("c_now", type_=UTCDateTime())
_LIMIT = sa.bindparam("c_limit", type_=sa.Integer())


def _literal(status: Status) -> sa.ColumnElement[str]:
    return sa.literal_column(f"'{status.value}'", sa.String)


# The claim index is partial (claimable statuses only). SQLite uses a partial index only if the
# query repeats the index's own condition with literals, so the claim says both: the status
# equality first, or SQLite plans the IN as the index range and sorts every due row.
_CLAIMABLE = _m.c.status.in_([_literal(s) for s in CLAIMABLE])


def _due(status: Status) -> sa.Subquery:
    return (
        sa.select(_m.c.id, _m.c.priority, _m.c.next_attempt_at)
        .where(_m.c.status == _literal(status), _CLAIMABLE, _m.c.next_attempt_at <= _NOW)
        .order_by(_m.c.priority, _m.c.next_attempt_at, _m.c.id)
        .limit(_LIMIT)
        .with_for_update(skip_locked=True)
        .subquery()
    )


@dataclass(frozen=True, slots=True)
class _ClaimStatements:
    pick: sa.Select[Any]  # the due ids, locked (MySQL/MariaDB run it first)
    update: sa.Update
    update_returning: ReturningUpdate[Any]
    read_back: sa.Select[Any]  # the claimed rows, where UPDATE ... RETURNING is missing


@functools.cache
def _claim_statements(lock_first: bool) -> _ClaimStatements:
    """The claim's statements, built once (the values are bound parameters)."""
    pending, retrying = _due(Status.PENDING), _due(Status.RETRYING)
    merged = sa.union_all(sa.select(pending), sa.select(retrying)).subquery()
    pick = (
        sa.select(merged.c.id)
        .order_by(merged.c.priority, merged.c.next_attempt_at, merged.c.id)
        .limit(_LIMIT)
    )
    if lock_first:
        # Lock the picked rows first: an UPDATE with an IN (subquery) is not planned as a
        # range read of the claim index there.
        chosen: sa.ColumnElement[bool] = _m.c.id.in_(sa.bindparam("c_ids", expanding=True))
    else:
        chosen = _m.c.id.in_(sa.select(pick.subquery().c.id))
    token = sa.bindparam("c_token", type_=_m.c.claim_token.type)
    expired = sa.and_(_m.c.expires_at.is_not(None), _m.c.expires_at <= _NOW)
    update = (
        sa.update(_m)
        .where(chosen)
        .values(
            status=sa.case((expired, Status.EXPIRED.value), else_=Status.PROCESSING.value),
            claim_token=token,
            claimed_by=sa.case(
                (expired, _m.c.claimed_by),
                else_=sa.bindparam("c_relay", type_=_m.c.claimed_by.type),
            ),
            claimed_at=sa.case((expired, _m.c.claimed_at), else_=_NOW),
            lease_expires_at=sa.case(
                (expired, None), else_=sa.bindparam("c_lease", type_=UTCDateTime())
            ),
            send_started_at=None,
            updated_at=_NOW,
        )
    )
    read_back = sa.select(*_CLAIM_COLUMNS).where(chosen, _m.c.claim_token == token)
    return _ClaimStatements(
        pick=pick,
        update=update,
        update_returning=update.returning(*_CLAIM_COLUMNS),
        read_back=read_back,
    )


def claim_batch(
    conn: sa.Connection, *, relay_id: str, limit: int, now: datetime, lease_seconds: float
) -> tuple[list[Claim], list[Expired]]:
    """claim_batch -- Take up to ``limit`` due messages under a fresh claim token and lease.

    Due means pending or retrying with ``next_attempt_at`` passed, in (priority,
    next_attempt_at, id) order. Each status is read as its own range of the claim index, with
    ``FOR UPDATE SKIP LOCKED`` on PostgreSQL and MySQL/MariaDB, so replicas never wait on each
    other and never take the same row. Rows found past ``expires_at`` move to ``expired``
    in the same statement and are returned separately: they are never sent. The token is
    one per claim: rows are identified by (id, claim_token).
    """
    token = str(uuid.uuid4())
    params: dict[str, Any] = {
        "c_now": now,
        "c_limit": limit,
        "c_token": token,
        "c_relay": relay_id,
        "c_lease": now + timedelta(seconds=lease_seconds),
    }
    statements = _claim_statements(conn.dialect.name in ("mysql", "mariadb"))
    if conn.dialect.name in ("mysql", "mariadb"):
        params["c_ids"] = list(conn.execute(statements.pick, params).scalars())
        if not params["c_ids"]:
            return [], []
    if conn.dialect.update_returning:
        rows = conn.execute(statements.update_returning, params).all()
    else:
        conn.execute(statements.update, params)
        rows = conn.execute(statements.read_back, params).all()
    claims, gone = [], []
    for row in rows:
        if row.status == Status.EXPIRED.value:
            gone.append(Expired(id=row.id, key=row.idempotency_key, category=row.category))
            continue
        claims.append(_claim(row, token, row.payload))
    claims.sort(key=lambda c: (c.priority, c.next_attempt_at, c.id))
    return claims, gone


def _stamp_wave(
    conn: sa.Connection,
    ids: Sequence[int],
    claim_token: str,
    column: sa.Column[datetime],
    value: datetime,
) -> set[int]:
    """Set ``column = value`` on the rows of ``ids`` this claim still holds, in one statement;
    returns the ids it set. MySQL reports matched rows, so only a short count needs a read."""
    if not ids:
        return set()
    stamp, read = _stamp_statements(column.name, conn.dialect.name == "postgresql")
    params = {"w_ids": list(ids), "w_token": claim_token, "w_value": value}
    if conn.execute(stamp, params).rowcount == len(ids):
        return set(ids)
    return set(conn.execute(read, params).scalars())


def _id_among(name: str, pg: bool) -> sa.ColumnElement[bool]:
    """``id`` is one of the list bound as ``name``. PostgreSQL takes the list as one array
    (``= ANY``), so the statement's text, and psycopg's prepared statement, is the same
    whatever the list's length; elsewhere an expanding IN."""
    if pg:
        return _m.c.id == sa.any_(sa.bindparam(name, type_=postgresql.ARRAY(sa.BigInteger)))
    return _m.c.id.in_(sa.bindparam(name, expanding=True))


@functools.cache
def _stamp_statements(column_name: str, pg: bool) -> tuple[sa.Update, sa.Select[Any]]:
    """_stamp_wave's UPDATE and its read-back, built once per column and dialect kind."""
    column = _m.c[column_name]
    value = sa.bindparam("w_value", type_=UTCDateTime())
    guard = sa.and_(
        _id_among("w_ids", pg),
        _m.c.claim_token == sa.bindparam("w_token", type_=_m.c.claim_token.type),
        _m.c.status == Status.PROCESSING.value,
    )
    return sa.update(_m).where(guard).values({column: value}), sa.select(_m.c.id).where(
        guard, column == value
    )


def mark_send_started(
    conn: sa.Connection, *, ids: Sequence[int], claim_token: str, now: datetime
) -> set[int]:
    """mark_send_started -- Stamp ``send_started_at`` on a wave of claimed rows, in one statement.

    Only rows stamped here may be sent: a lease that expires while ``send_started_at`` is
    NULL is provably unsent, and the sweep returns it without consuming an attempt. Returns
    the ids stamped (all of them, unless a lease was already lost). The stamp is
    :func:`mark_send_started_at`'s.
    """
    return mark_send_started_at(conn, ids=ids, claim_token=claim_token, now=now)[0]


def mark_send_started_at(
    conn: sa.Connection, *, ids: Sequence[int], claim_token: str, now: datetime
) -> tuple[set[int], datetime]:
    """mark_send_started -- :func:`mark_send_started`, returning the stamp with the ids.

    The stamp is the later of ``now`` (the relay's estimate of the database's clock) and the
    database's own clock, read in the wave's transaction at the mark: on PostgreSQL by the
    UPDATE itself (``statement_timestamp()``, one reading for the wave) which returns it; on
    MariaDB by one query just before it (``UTC_TIMESTAMP(6)``); on SQLite the host's clock,
    in-process. ``send_started_at`` starts the reconcile policy's window, and an estimate
    that runs behind (an anchor taken before a host suspend, which stops the monotonic
    clock; a database clock stepped since the sample) would start it early by the skew and
    let the sweep requeue a send whose Send event is still on its way. The database's
    reading is taken before the COMMIT that lets the send begin, so it is never later than
    the send; a relay clock ahead of the database only starts the window late. The caller
    records the stamp as the attempt's ``started_at``, so the attempt row and the row name
    the same start.
    """
    if not ids:
        return set(), now
    if conn.dialect.name == "postgresql":  # the same clock, read by the UPDATE itself
        params = {"w_ids": list(ids), "w_token": claim_token, "w_value": now}
        rows = conn.execute(_MARK_PG, params).all()
        return {row.id for row in rows}, rows[0].send_started_at if rows else now
    stamp = max(now, read_database_time(conn))
    return _stamp_wave(conn, ids, claim_token, _m.c.send_started_at, stamp), stamp


# statement_timestamp(): one reading for the whole wave (clock_timestamp() moves row by row)
_MARK_PG = (
    sa.update(_m)
    .where(
        _id_among("w_ids", True),
        _m.c.claim_token == sa.bindparam("w_token", type_=_m.c.claim_token.type),
        _m.c.status == Status.PROCESSING.value,
    )
    .values(
        send_started_at=sa.func.greatest(
            sa.bindparam("w_value", type_=UTCDateTime()),
            sa.func.statement_timestamp(type_=UTCDateTime()),
        )
    )
    .returning(_m.c.id, _m.c.send_started_at)
)


def extend_lease(
    conn: sa.Connection, *, ids: Sequence[int], claim_token: str, until: datetime
) -> set[int]:
    """extend_lease -- Push out the lease of rows still being sent; returns the ids kept."""
    return _stamp_wave(conn, ids, claim_token, _m.c.lease_expires_at, until)


# -- finalize: one guarded UPDATE per row, each returning whether it applied -----------------


def _claimed(
    message_id: int, claim_token: str, expired_before: datetime | None
) -> sa.ColumnElement[bool]:
    guard = sa.and_(
        _m.c.id == message_id,
        _m.c.claim_token == claim_token,
        _m.c.status == Status.PROCESSING.value,
    )
    if expired_before is not None:
        guard = sa.and_(guard, _m.c.lease_expires_at < expired_before)
    return guard


def _transition(
    conn: sa.Connection,
    message_id: int,
    claim_token: str,
    values: dict[str, Any],
    expired_before: datetime | None,
    *also: sa.ColumnElement[bool],
) -> bool:
    guard = _claimed(message_id, claim_token, expired_before)
    stmt = sa.update(_m).where(guard, *also).values(**values)
    return conn.execute(stmt).rowcount == 1


def _attempted(
    now: datetime | sa.BindParameter[datetime], code: str | None, message: str | None
) -> dict[str, Any]:
    return {
        **_NO_CLAIM,
        "attempt_count": _m.c.attempt_count + 1,
        "last_attempt_at": sa.func.coalesce(_m.c.send_started_at, now),
        "last_error_code": code,
        "last_error_message": message,
        "updated_at": now,
    }


def finalize_sent(
    conn: sa.Connection,
    *,
    message_id: int,
    claim_token: str,
    provider_message_id: str | None,
    now: datetime,
) -> bool:
    """finalize_sent -- processing -> sent, for the holder of the claim only."""
    values = {
        **_attempted(now, None, None),
        "status": Status.SENT.value,
        "sent_at": now,
        "provider_message_id": provider_message_id,
    }
    return _transition(conn, message_id, claim_token, values, None)


_BATCH_NOW = sa.bindparam("b_now", type_=UTCDateTime())
_FINALIZE_SENT_BATCH = (
    sa.update(_m)
    .where(
        _m.c.id == _BATCH.c.id,
        _m.c.claim_token == _BATCH.c.token,
        _m.c.status == Status.PROCESSING.value,
    )
    .values(
        **_attempted(_BATCH_NOW, None, None),
        status=Status.SENT.value,
        sent_at=_BATCH_NOW,
        provider_message_id=_BATCH.c.provider_id,
    )
    .returning(_m.c.id, _BATCH.c.token)
)
_FINALIZE_SENT_EACH = (
    sa.update(_m)
    .where(
        _m.c.id == sa.bindparam("b_id"),
        _m.c.claim_token == sa.bindparam("b_token"),
        _m.c.status == Status.PROCESSING.value,
    )
    .values(
        **_attempted(_BATCH_NOW, None, None),
        status=Status.SENT.value,
        sent_at=_BATCH_NOW,
        provider_message_id=sa.bindparam("b_provider_id"),
    )
)


@functools.lru_cache(maxsize=64)
def _finalize_sent_by_case(size: int) -> sa.Update:
    """MySQL/MariaDB: the guarded finalize of ``size`` rows as one UPDATE. Each row's own
    token and provider id are picked by its id (``CASE id WHEN ...``), so every row keeps its
    own id + claim token + status guard; the ids must be distinct."""
    ids = [sa.bindparam(f"b_id{k}", type_=_m.c.id.type) for k in range(size)]

    def by_id(name: str, column: sa.Column[Any]) -> sa.Case[Any]:
        picks = [(ids[k], sa.bindparam(f"{name}{k}", type_=column.type)) for k in range(size)]
        return sa.case(*picks, value=_m.c.id)

    return (
        sa.update(_m)
        .where(
            _m.c.id.in_(ids),
            _m.c.claim_token == by_id("b_token", _m.c.claim_token),
            _m.c.status == Status.PROCESSING.value,
        )
        .values(
            **_attempted(_BATCH_NOW, None, None),
            status=Status.SENT.value,
            sent_at=_BATCH_NOW,
            provider_message_id=by_id("b_provider_id", _m.c.provider_message_id),
        )
    )


_CASE_ROWS = 64  # rows per statement of _finalize_sent_by_case (one plan per batch size)


def finalize_sent_many(
    conn: sa.Connection, items: Sequence[tuple[int, str, str | None]], *, now: datetime
) -> set[tuple[int, str]]:
    """finalize_sent for a batch: each row keeps its own id + claim token + status guard.
    ``items`` are (id, claim_token, provider_message_id); returns the (id, claim_token) pairs
    that moved to sent (an id can come twice: a swept row's late result beside its new one).

    PostgreSQL runs it as one ``UPDATE ... FROM unnest(...) RETURNING`` (one statement, one
    plan, whatever the batch size); MySQL/MariaDB as one UPDATE per ``_CASE_ROWS`` rows that
    picks each row's token and provider id by its id (the driver's executemany would send
    one UPDATE per row); SQLite as an executemany of the guarded UPDATE. When an id repeats,
    one statement per row."""
    if not items:
        return set()
    if conn.dialect.name == "postgresql":
        ids, tokens, provider_ids = (list(column) for column in zip(*items, strict=True))
        params = {"b_ids": ids, "b_tokens": tokens, "b_provider_ids": provider_ids, "b_now": now}
        return {(row[0], row[1]) for row in conn.execute(_FINALIZE_SENT_BATCH, params)}
    rows = [{"b_id": i, "b_token": t, "b_provider_id": p, "b_now": now} for i, t, p in items]
    if len({i for i, _t, _p in items}) < len(items):
        return {
            (i, t)
            for (i, t, _p), row in zip(items, rows, strict=True)
            if conn.execute(_FINALIZE_SENT_EACH, row).rowcount == 1
        }
    if conn.dialect.name in ("mysql", "mariadb"):
        matched = 0
        for start in range(0, len(items), _CASE_ROWS):
            chunk = items[start : start + _CASE_ROWS]
            picks: dict[str, Any] = {"b_now": now}
            for k, (i, t, p) in enumerate(chunk):
                picks.update({f"b_id{k}": i, f"b_token{k}": t, f"b_provider_id{k}": p})
            matched += conn.execute(_finalize_sent_by_case(len(chunk)), picks).rowcount
    else:
        matched = conn.execute(_FINALIZE_SENT_EACH, rows).rowcount
    if matched == len(items):
        return {(i, t) for i, t, _p in items}
    # Some guard failed (a stale claim): find which rows this statement moved.
    wanted = {i: (t, p) for i, t, p in items}
    moved = sa.select(_m.c.id, _m.c.provider_message_id).where(
        _m.c.id.in_(list(wanted)), _m.c.status == Status.SENT.value, _m.c.sent_at == now
    )
    return {
        (row.id, wanted[row.id][0])
        for row in conn.execute(moved)
        if row.provider_message_id == wanted[row.id][1]
    }


def schedule_retry(
    conn: sa.Connection,
    *,
    message_id: int,
    claim_token: str,
    next_attempt_at: datetime,
    code: str | None,
    message: str | None,
    now: datetime,
    expired_before: datetime | None = None,
) -> bool:
    """schedule_retry -- processing -> retrying at ``next_attempt_at``; one attempt counted."""
    values = {
        **_attempted(now, code, message),
        "status": Status.RETRYING.value,
        "next_attempt_at": next_attempt_at,
    }
    return _transition(conn, message_id, claim_token, values, expired_before)


def fail(
    conn: sa.Connection,
    *,
    message_id: int,
    claim_token: str,
    code: str | None,
    message: str | None,
    now: datetime,
) -> bool:
    """fail -- processing -> failed (permanent error, or attempts exhausted)."""
    values = {**_attempted(now, code, message), "status": Status.FAILED.value}
    return _transition(conn, message_id, claim_token, values, None)


def hold_unknown(
    conn: sa.Connection,
    *,
    message_id: int,
    claim_token: str,
    code: str | None,
    message: str | None,
    now: datetime,
    expired_before: datetime | None = None,
) -> bool:
    """hold_unknown -- processing -> unknown_outcome: the send may have happened.

    ``claimed_by``, ``claimed_at`` and ``send_started_at`` stay for reconciliation. The
    claim/relay never picks this row again; only an operator's ``requeue`` does.
    """
    values = {**_attempted(now, code, message), "status": Status.UNKNOWN_OUTCOME.value}
    return _transition(conn, message_id, claim_token, values, expired_before)


_PREVIOUS_STATUS = sa.case(
    (_m.c.attempt_count == 0, Status.PENDING.value), else_=Status.RETRYING.value
)


def release(
    conn: sa.Connection,
    *,
    message_id: int,
    claim_token: str,
    now: datetime,
    code: str | None = None,
    message: str | None = None,
    expired_before: datetime | None = None,
    next_attempt_at: datetime | None = None,
) -> bool:
    """release -- processing -> its previous status (pending if never attempted, else
    retrying), with no attempt counted and ``next_attempt_at`` unchanged, or moved to the
    given time (a message of a paused scope steps back in line until its probe).

    A sweep (``expired_before`` given) releases only a row whose send has not started: its
    read may be stale, and a late holder may have stamped ``send_started_at`` since. Then
    this affects no row, and the next sweep sees the started send and treats it as ambiguous.
    """
    values: dict[str, Any] = {
        **_NO_CLAIM,
        "status": _PREVIOUS_STATUS,
        "send_started_at": None,
        "updated_at": now,
    }
    if code is not None:
        values["last_error_code"] = code
        values["last_error_message"] = message
    if next_attempt_at is not None:
        values["next_attempt_at"] = next_attempt_at
    if expired_before is None:
        return _transition(conn, message_id, claim_token, values, None)
    unstarted = _m.c.send_started_at.is_(None)
    return _transition(conn, message_id, claim_token, values, expired_before, unstarted)


def release_unstarted(
    conn: sa.Connection,
    *,
    ids: Sequence[int],
    claim_token: str,
    now: datetime,
    next_attempt_at: datetime | None = None,
) -> int:
    """release_unstarted -- Give back rows of a claim whose send never started (not marked),
    in one statement; returns how many went back. ``next_attempt_at`` moves them back in
    line."""
    if not ids:
        return 0
    stmt = _release_statement(ids, claim_token, now, next_attempt_at).where(
        _m.c.send_started_at.is_(None)
    )
    return int(conn.execute(stmt).rowcount)


def release_unsent(
    conn: sa.Connection,
    *,
    ids: Sequence[int],
    claim_token: str,
    now: datetime,
    next_attempt_at: datetime | None = None,
) -> int:
    """release_unsent -- Give back rows of a claim that its holder never handed to a send
    (drain, a pause), marked or not, in one statement; returns how many went back.

    Unlike :func:`release_unstarted` this does not require ``send_started_at IS NULL``: after
    a commit that applied unseen, a row carries the send-started mark although its holder
    never sent it, and only the holder knows that. Guarded by the claim token, so a row swept
    and claimed by another relay is never touched. ``next_attempt_at`` moves the rows back in
    line (a paused scope's messages wait for its probe)."""
    if not ids:
        return 0
    stmt = _release_statement(ids, claim_token, now, next_attempt_at)
    return int(conn.execute(stmt).rowcount)


def _release_statement(
    ids: Sequence[int], claim_token: str, now: datetime, next_attempt_at: datetime | None
) -> sa.Update:
    later = {} if next_attempt_at is None else {"next_attempt_at": next_attempt_at}
    return (
        sa.update(_m)
        .where(
            _m.c.id.in_(ids),
            _m.c.claim_token == claim_token,
            _m.c.status == Status.PROCESSING.value,
        )
        .values(**_NO_CLAIM, **later, status=_PREVIOUS_STATUS, send_started_at=None, updated_at=now)
    )


_ATTEMPT_FIELDS = (
    "message_id",
    "claim_token",
    "relay_id",
    "started_at",
    "finished_at",
    "outcome",
    "error_code",
    "error_message",
    "provider_message_id",
    "dropped_recipients",
)


def _pg_attempt_value(index: int, name: str) -> str:
    """Field ``index`` of one JSON attempt row, as its column's type."""
    kind = attempts.c[name].type
    if isinstance(kind, UTCDateTime):
        return f"CAST(attempt ->> {index} AS TIMESTAMP WITH TIME ZONE)"
    if isinstance(kind, sa.BigInteger | sa.Integer):
        return f"CAST(attempt ->> {index} AS BIGINT)"
    return f"attempt ->> {index}"


# PostgreSQL: the attempt rows arrive as one JSON array of arrays (one per row, fields in
# _ATTEMPT_FIELDS order), unnested into one INSERT: one parameter and one statement text
# whatever the batch size, and the rows are dumped by json.dumps instead of one array
# dumper per column
_INSERT_ATTEMPTS_PG = sa.text(
    f"INSERT INTO {attempts.name} ({', '.join(_ATTEMPT_FIELDS)}) SELECT "
    + ", ".join(_pg_attempt_value(k, name) for k, name in enumerate(_ATTEMPT_FIELDS))
    + " FROM json_array_elements(CAST(:a_rows AS JSON)) AS attempt"
)


def _utc_text(value: datetime | None) -> str | None:
    """A timestamp as ISO 8601 text with its offset; naive ones refused, as UTCDateTime
    does."""
    if value is None:
        return None
    if value.tzinfo is None or value.utcoffset() is None:
        raise ValueError(f"naive datetime {value!r}: outbox timestamps must be timezone-aware")
    return value.astimezone(UTC).isoformat()  # an offset with seconds is not ISO 8601 text


def record_attempts(conn: sa.Connection, records: Iterable[AttemptRecord]) -> None:
    """record_attempts -- Append attempt rows (in the finalize's transaction, stale or not):
    one ``INSERT ... SELECT FROM json_array_elements(...)`` on PostgreSQL, an executemany
    elsewhere."""
    if conn.dialect.name == "postgresql":
        rows = [
            [
                r.message_id,
                r.claim_token,
                r.relay_id,
                _utc_text(r.started_at),
                _utc_text(r.finished_at),
                r.outcome,
                r.error_code,
                r.error_message,
                r.provider_message_id,
                r.dropped_recipients,
            ]
            for r in records
        ]
        if rows:
            conn.execute(_INSERT_ATTEMPTS_PG, {"a_rows": json.dumps(rows)})
        return
    mapped = [{name: getattr(r, name) for name in _ATTEMPT_FIELDS} for r in records]
    if mapped:
        conn.execute(sa.insert(attempts), mapped)


def apply_decision(
    conn: sa.Connection,
    claim: Claim,
    decision: Decision,
    now: datetime,
    *,
    expired_before: datetime | None = None,
) -> bool:
    """Apply a policy decision to ``claim`` through its guarded transition; False if the
    claim no longer holds the row (stale: another relay or the sweep moved it)."""
    id_, token, code, text = claim.id, claim.claim_token, decision.code, decision.message
    match decision.action:
        case Action.SENT:
            return finalize_sent(
                conn,
                message_id=id_,
                claim_token=token,
                provider_message_id=decision.provider_message_id,
                now=now,
            )
        case Action.RETRY:
            assert decision.next_attempt_at is not None
            return schedule_retry(
                conn,
                message_id=id_,
                claim_token=token,
                next_attempt_at=decision.next_attempt_at,
                code=code,
                message=text,
                now=now,
                expired_before=expired_before,
            )
        case Action.FAIL:
            return fail(conn, message_id=id_, claim_token=token, code=code, message=text, now=now)
        case Action.HOLD:
            return hold_unknown(
                conn,
                message_id=id_,
                claim_token=token,
                code=code,
                message=text,
                now=now,
                expired_before=expired_before,
            )
        case Action.RELEASE:
            return release(
                conn,
                message_id=id_,
                claim_token=token,
                code=code,
                message=text,
                now=now,
                expired_before=expired_before,
                next_attempt_at=decision.next_attempt_at,
            )
    raise AssertionError(decision.action)


# -- sweep and expiry --------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class StaleLease:
    """A processing row whose lease ran out: its holder died or hung."""

    claim: Claim
    claimed_by: str | None
    send_started_at: datetime | None


def sweep_candidates(
    conn: sa.Connection, *, now: datetime, limit: int = 500, lock: bool = True
) -> list[StaleLease]:
    """sweep_expired_leases (read) -- Processing rows whose lease expired before ``now``,
    locked for this sweep (``FOR UPDATE SKIP LOCKED``).

    The caller decides per row (released if the send never started, else per the ambiguity
    policy) and applies it with the row's own claim token and ``expired_before=now``, so a
    relay that renews its lease in between keeps its row, and racing sweeps are harmless.
    A row another transaction holds (its relay finalizing it, or frozen mid-transaction) is
    skipped, not waited for: a sweep that waited would stall its relay's whole loop.

    The guarded writes alone keep a sweep correct when its read is stale: ``lock=False``
    reads without locking (no waiting, no skipping), which lets tests race holders against a
    sweep between its read and its write.
    """
    stmt = (
        sa.select(*_CLAIM_COLUMNS, _m.c.claimed_by, _m.c.send_started_at)
        .where(_m.c.status == Status.PROCESSING.value, _m.c.lease_expires_at < now)
        .order_by(_m.c.lease_expires_at)
        .limit(limit)
    )
    rows = conn.execute(stmt.with_for_update(skip_locked=True) if lock else stmt).all()
    return [
        StaleLease(
            claim=_claim(row, row.claim_token, None),
            claimed_by=row.claimed_by,
            send_started_at=row.send_started_at,
        )
        for row in rows
    ]


def settle_expired_leases(
    conn: sa.Connection,
    leases: Iterable[StaleLease],
    *,
    now: datetime,
    relay_id: str,
    rng: random.Random,
) -> list[tuple[StaleLease, Decision, bool]]:
    """sweep_expired_leases (write) -- Settle ``leases`` that :func:`sweep_candidates` read
    at ``now``, in their order.

    Each is decided (released if the send never started, else per the ambiguity policy) and
    applied by its own guarded UPDATE (claim token, and ``expired_before=now``); a moved row
    whose send had started gets a ``lease_expired`` attempt under the claim that made it.
    Returns every lease with its decision and whether this call moved the row. ``rng`` draws
    the retries' jitter.
    """
    settled: list[tuple[StaleLease, Decision, bool]] = []
    for lease in leases:
        started = lease.send_started_at is not None
        decision = decide(LeaseExpired(send_started=started), lease.claim.state, now, rng)
        moved = apply_decision(conn, lease.claim, decision, now, expired_before=now)
        settled.append((lease, decision, moved))
    record_attempts(
        conn,
        (
            AttemptRecord(
                message_id=lease.claim.id,
                claim_token=lease.claim.claim_token,
                relay_id=lease.claimed_by,
                started_at=lease.send_started_at,
                finished_at=now,
                outcome=AttemptOutcome.LEASE_EXPIRED,
                error_code=decision.code,
                error_message=f"swept by {relay_id}",
            )
            for lease, decision, moved in settled
            if moved and lease.send_started_at is not None
        ),
    )
    return settled


def sweep_expired_leases(
    conn: sa.Connection, *, now: datetime, relay_id: str, rng: random.Random, limit: int = 500
) -> list[tuple[StaleLease, Decision]]:
    """sweep_expired_leases -- Settle processing rows whose lease ran out before ``now``.

    A row whose send never started goes back to pending/retrying with no attempt counted; one
    whose send may have begun goes to unknown_outcome (policy ``hold``) or retrying
    (``resend``), with a ``lease_expired`` attempt recorded under the claim that made it. Each
    row is moved by its own guarded UPDATE (claim token, and lease still expired), so a relay
    that renews its lease in between keeps its row, and racing sweeps are harmless. Returns
    the rows this call moved, with the decision applied. ``rng`` draws the retries' jitter.
    The read is :func:`sweep_candidates`, the write :func:`settle_expired_leases`.
    """
    stale = sweep_candidates(conn, now=now, limit=limit)
    settled = settle_expired_leases(conn, stale, now=now, relay_id=relay_id, rng=rng)
    return [(lease, decision) for lease, decision, moved in settled if moved]


def expire(conn: sa.Connection, *, now: datetime, limit: int = 1000) -> list[Expired]:
    """expire -- pending/retrying rows past ``expires_at`` -> expired (never sent).

    Due rows are expired by the claim itself; this catches the ones not due yet. Rows a claim
    holds locked are skipped (the claim expires them).
    """
    candidates = conn.execute(
        sa.select(_m.c.id, _m.c.idempotency_key, _m.c.category)
        .where(
            _m.c.status.in_([Status.PENDING.value, Status.RETRYING.value]),
            _m.c.expires_at.is_not(None),
            _m.c.expires_at <= now,
        )
        .limit(limit)
        .with_for_update(skip_locked=True)
    ).all()
    if not candidates:
        return []
    conn.execute(
        sa.update(_m)
        .where(
            _m.c.id.in_([c.id for c in candidates]),
            _m.c.status.in_([Status.PENDING.value, Status.RETRYING.value]),
        )
        .values(status=Status.EXPIRED.value, updated_at=now)
    )
    return [Expired(id=c.id, key=c.idempotency_key, category=c.category) for c in candidates]


# -- suppression at send -----------------------------------------------------------------


@functools.cache
def _suppressed_statement(pg: bool) -> sa.Select[Any]:
    """suppressed_among's SELECT, built once: on PostgreSQL the addresses are one array
    (``= ANY``), so the text and its prepared plan are the same whatever the wave's size."""
    address = suppressions.c.address
    if pg:
        among = address == sa.any_(sa.bindparam("s_addresses", type_=postgresql.ARRAY(sa.String)))
    else:
        among = address.in_(sa.bindparam("s_addresses", expanding=True))
    return sa.select(address).where(among)


def suppressed_among(conn: sa.Connection, addresses: Iterable[str]) -> set[str]:
    """suppressed_among -- Which of ``addresses`` (lower-cased addr-specs) are in
    ``outbox_suppressions``: one primary-key lookup per address, in one statement, for a whole
    wave before its send-started mark."""
    wanted = sorted(set(addresses))
    if not wanted:
        return set()
    stmt = _suppressed_statement(conn.dialect.name == "postgresql")
    return set(conn.execute(stmt, {"s_addresses": wanted}).scalars())


# -- reconcile: requeue an ambiguous send once the event intake flowed past its window ----


@dataclass(frozen=True, kw_only=True, slots=True)
class Reconciled:
    """An unknown_outcome row :func:`reconcile_unknown` requeued."""

    id: int
    category: str
    send_started_at: datetime  # the ambiguous attempt's start (the database's clock)
    reconcile_after: float


def _plus_seconds(
    dialect: str, at: sa.ColumnElement[Any], seconds: sa.ColumnElement[Any]
) -> sa.ColumnElement[Any]:
    """``at + seconds`` (a column of seconds), computed by the database, in the form its
    timestamps are stored in so a comparison with another timestamp column can use that
    column's index. SQLite stores text and its date functions keep milliseconds only
    (parsing and formatting each cut up to one): its sum is put 3 ms later, so it is never
    earlier than the true one (late by less than 3 ms, never early)."""
    if dialect == "postgresql":
        interval = sa.func.make_interval(0, 0, 0, 0, 0, 0, seconds, type_=sa.Interval())
        return at + interval
    if dialect in ("mysql", "mariadb"):
        micros = sa.cast(sa.func.round(seconds * 1_000_000), sa.BigInteger())
        return sa.func.timestampadd(sa.literal_column("MICROSECOND"), micros, at)
    modifier = sa.literal("+") + sa.cast(seconds + 0.003, sa.Text()) + sa.literal(" seconds")
    return sa.func.strftime("%Y-%m-%d %H:%M:%f", at, modifier)


# The longest reconcile window a row may have, as Category allows it (30 days): a row whose
# reconcile_after is not in (0, this] was edited in the database, and waits for a human.
MAX_RECONCILE_AFTER = MAX_BACKOFF_SECONDS
# No timestamp the relay reads for a window is this late (the latest one MariaDB stores is
# 9999-12-31, and a window added to it overflows): a later one was edited, and proves nothing.
_FAR = datetime(9000, 1, 1, tzinfo=UTC)


def _usable_window() -> sa.ColumnElement[bool]:
    """The row's window is one the database can add: ``reconcile_after`` in (0, 30 days]
    (PostgreSQL's NaN compares greater than every number, so ``<=`` refuses it; MariaDB
    stores no NaN or infinity; SQLite stores NaN as NULL, and infinity fails ``<=``), and a
    start before :data:`_FAR`. A negative window would end before the send began."""
    window = _m.c.reconcile_after
    return sa.and_(
        window > 0,
        window <= MAX_RECONCILE_AFTER,
        _m.c.send_started_at < sa.literal(_FAR, UTCDateTime()),
    )


def _window_end(dialect: str) -> sa.ColumnElement[Any]:
    """``send_started_at + reconcile_after`` seconds, computed by the database (each row has
    its own window); never earlier than the true end (:func:`_plus_seconds`). NULL for a
    window :func:`_usable_window` refuses: inside a CASE, so the database never computes it
    (a WHERE's conditions run in any order), and one edited row cannot fail the statement
    that reads every row."""
    end = _plus_seconds(dialect, _m.c.send_started_at, _m.c.reconcile_after)
    return sa.case((_usable_window(), end), else_=sa.null())


# SQS's longest visibility timeout (12 hours): an outbox_intakes row outside [0, this] is not
# a queue's, and proves nothing
_MAX_VISIBILITY_SECONDS = 12 * 3600.0


# How long after its last committed heartbeat a replica may still have been handed a message:
# the heartbeat is read before its batch commits, and the intake beats again before any
# receive that would start later than a minute after it (``relay.intake.Intake.step``); one
# long poll (20 s) and the answer's way back fit in the rest.
RECEIVE_AFTER_HEARTBEAT = 120.0


def _plus_visibility(
    dialect: str,
    at: sa.ColumnElement[Any],
    visibility: sa.ColumnElement[Any],
    extra: float = 0.0,
) -> sa.ColumnElement[Any]:
    """``at`` plus a visibility timeout in seconds, plus ``extra``; NULL, inside a CASE, for
    a timeout that is not a queue's (outside [0, 12 h]) or a time past :data:`_FAR`, so
    nothing compared with it holds."""
    return sa.case(
        (
            sa.and_(
                visibility >= 0,
                visibility <= _MAX_VISIBILITY_SECONDS,
                at < sa.literal(_FAR, UTCDateTime()),
            ),
            _plus_seconds(dialect, at, visibility + extra if extra else visibility),
        ),
        else_=sa.null(),
    )


def _drained_after(dialect: str, event: sa.FromClause, db_now: datetime) -> sa.ColumnElement[bool]:
    """Every intake replica of the queue that recorded ``event`` vouches that nothing older
    than it is left there: each either found the queue empty (``caught_up_at``, the
    database's clock) more than its visibility timeout after ``event`` was committed, or is
    dead, and at least one found it so.

    SQS standard queues keep no order: while a backlog drains, an event of later mail can be
    committed before an ambiguous send's own, which is still waiting in the queue, or was
    taken by another replica that has not committed it yet (it is slow, or died with it).
    A replica's ``caught_up_at`` is written only after an empty long poll while nothing it
    was handed can still be hidden unapplied; the visibility timeout's margin after the
    event covers a message it took and dropped just before. A replica that never says so
    may hold the row's own event: unless it is dead, a replica ``i`` having found the queue
    empty more than :data:`RECEIVE_AFTER_HEARTBEAT` plus both visibility timeouts after its
    last heartbeat (whatever it took has come back by then, and ``i`` found none of it),
    the proof waits for it. A replica long gone is dead by the same rule.

    Only rows of the recording replica's queue (``queue_url`` through ``event.intake_id``)
    count, each with its own visibility timeout (which the intake passes on each receive);
    an event recorded without an ``intake_id``, or by a replica whose row was since taken by
    a process started after the event, proves nothing. A ``caught_up_at`` later than the
    database's clock ``db_now`` (written before the clock was stepped back) counts for
    nothing.

    What remains: a message received ``maxReceiveCount`` times (replicas dying with it in
    hand, again and again) goes to the dead-letter queue, where no replica reads it, and the
    queue is then truly empty; the dead-letter queue's alarm is the operator's signal, and
    a resend shows as ``duplicate_send`` once the event is replayed. Two live processes
    under one ``intake_id`` share one row, so one of them goes unseen. A database clock
    stepped forward makes a silent replica look dead early."""
    recorder = intakes.alias("recorder")
    queue = (
        sa.select(recorder.c.queue_url)
        .where(
            recorder.c.intake_id == event.c.intake_id,
            recorder.c.started_at <= event.c.received_at,
        )
        .correlate_except(recorder)
        .scalar_subquery()
    )
    now = sa.literal(db_now, UTCDateTime())
    vouching = intakes.alias("vouching")
    j = intakes.alias("peer")
    i = intakes.alias("witness")

    def found_empty_after(row: sa.FromClause) -> sa.ColumnElement[bool]:
        return sa.and_(
            row.c.caught_up_at <= now,
            row.c.caught_up_at
            > _plus_visibility(dialect, event.c.received_at, row.c.visibility_timeout),
        )

    reach = RECEIVE_AFTER_HEARTBEAT
    dead = sa.exists().where(
        i.c.queue_url == j.c.queue_url,
        i.c.caught_up_at <= now,
        i.c.caught_up_at
        > _plus_visibility(dialect, j.c.heartbeat_at, i.c.visibility_timeout, reach),
        i.c.caught_up_at
        > _plus_visibility(dialect, j.c.heartbeat_at, j.c.visibility_timeout, reach),
    )
    vouched = sa.case((found_empty_after(j), 1), else_=0) == 1
    one = sa.exists().where(vouching.c.queue_url == queue, found_empty_after(vouching))
    silent = sa.exists().where(j.c.queue_url == queue, ~vouched, ~dead)
    return sa.and_(event.c.intake_id.is_not(None), one, ~silent)


def _reconcilable(dialect: str, db_now: datetime) -> list[sa.ColumnElement[bool]]:
    """An unknown_outcome row of the reconcile policy, with no event matched to it, never
    requeued by a reconcile before, whose window the intake provably flowed past: an event
    committed (``received_at``, the database's clock) after the attempt's start plus the
    window, about mail SES took (``mail_at``, SES's clock) after it too. Both clocks must
    have passed the window: a relay's clock plays no part, and an intake that replays an old
    backlog (recent ``received_at``, old ``mail_at``) proves nothing about this send.

    Only an event of the stream that would have named this send proves that stream flows:
    a Send event (SES publishes one for every send it accepts, at once; a Delivery waits on
    the receiving server, which may defer it for hours) that the intake matched to one of
    our rows by its tags (``message_id`` and ``claim_token`` set: the claim token was one of
    that row's attempts). Identity notifications carry no tags, another deployment's events
    on a shared topic and forged ones match none of our claim tokens: none of them says
    anything about whether this send's own event would have arrived. And every live replica
    of the queue that recorded that event must have found it empty after the event committed
    (:func:`_drained_after`): an unordered backlog commits later mail's events before this
    send's own, and a replica may hold this send's own event in flight. ``db_now`` is the
    database's clock, read by the sweep."""
    end = _window_end(dialect)
    event = events.alias("flowing")
    flowed = sa.exists().where(
        event.c.event_type == EventType.SEND.value,
        event.c.message_id.is_not(None),
        event.c.claim_token.is_not(None),
        event.c.received_at > end,
        event.c.mail_at > end,
        _drained_after(dialect, event, db_now),
    )
    matched = sa.exists().where(events.c.message_id == _m.c.id)
    requeued = sa.exists().where(
        attempts.c.message_id == _m.c.id,
        attempts.c.outcome == AttemptOutcome.RECONCILE_REQUEUED.value,
    )
    # SES answered one of its sends with a MessageId (a stale:accepted saved after the
    # sweep took the row, or any attempt that names one): a requeue can only send it twice
    answered = sa.exists().where(
        attempts.c.message_id == _m.c.id, attempts.c.provider_message_id.is_not(None)
    )
    return [
        _m.c.status == Status.UNKNOWN_OUTCOME.value,
        _m.c.reconcile_after.is_not(None),
        _m.c.send_started_at.is_not(None),
        _usable_window(),
        ~matched,
        ~requeued,
        ~answered,
        flowed,
    ]


def _alone(conn: sa.Connection, update: sa.Update, message_id: int, what: str) -> bool:
    """Run one row's guarded ``update`` on its own: whether it moved the row. A value the
    database refuses for this row (a data or integrity error: a row edited into something
    it cannot compute or store) is rolled back alone, in a savepoint where the backend's
    transaction would not survive it, and logged: the row stays as it is, for a human, and
    the other rows of the pass are still settled. Anything else (a lost connection, a
    deadlock, a missing grant) raises, for the caller to retry the pass."""
    try:
        if conn.dialect.name == "sqlite":  # a failed statement leaves its transaction usable
            return bool(conn.execute(update).rowcount == 1)
        with conn.begin_nested():
            return bool(conn.execute(update).rowcount == 1)
    except (sa.exc.DataError, sa.exc.IntegrityError) as exc:
        if exc.connection_invalidated:
            raise
        _log.error(
            "reconcile: the database refused to %s a row; left for an operator: %s",
            what,
            exc.orig if exc.orig is not None else exc,
            extra={"action": "reconcile_refused", "message_id": message_id},
        )
        return False


def _requeued_values(now: datetime) -> dict[str, Any]:
    """What a requeue writes (the operator's and the reconcile's): pending, due now, a fresh
    attempt budget, no claim, no send-started mark."""
    return {
        **_NO_CLAIM,
        "status": Status.PENDING.value,
        "attempt_count": 0,
        "next_attempt_at": now,
        "send_started_at": None,
        "updated_at": now,
    }


def reconcile_unknown(
    conn: sa.Connection, *, now: datetime, relay_id: str, limit: int = 100, lock: bool = True
) -> list[Reconciled]:
    """reconcile_unknown -- Requeue, once, ambiguous sends of the reconcile policy that no
    provider event named while the event intake provably flowed past their window.

    A row qualifies if it is ``unknown_outcome`` with ``reconcile_after`` set, no event in
    ``outbox_events`` is matched to it, no ``reconcile:requeued`` attempt exists for it (a
    row requeued once that comes back ambiguous stays for a human), and the intake's proof
    exists (:func:`_reconcilable`): one of our Send events with ``received_at`` and
    ``mail_at`` both later than ``send_started_at`` (kept by :func:`hold_unknown`) plus the
    window, recorded by a replica of a queue every live replica of which found it empty a
    visibility timeout after it committed. Without events and ``outbox_intakes`` rows
    nothing qualifies, ever.

    At most ``limit`` rows a call, oldest attempt first, read ``FOR UPDATE SKIP LOCKED``
    (``lock=False`` reads without locking, so tests can race two reconciles). Each is
    requeued by its own guarded UPDATE that repeats every condition and names the
    attempt's ``send_started_at``, so racing replicas requeue a row once, a stale read never
    requeues a later ambiguous attempt, and an event matched in between wins. A requeued row
    gets a ``reconcile:requeued`` attempt row. Runs in the caller's transaction; ``now`` is
    the database's clock.
    """
    if conn.execute(sa.select(sa.func.max(events.c.received_at))).scalar() is None:
        return []  # no intake has ever committed an event: never requeue
    where = _reconcilable(conn.dialect.name, read_database_time(conn))
    stmt = (
        sa.select(_m.c.id, _m.c.category, _m.c.send_started_at, _m.c.reconcile_after)
        .where(*where)
        .order_by(_m.c.send_started_at, _m.c.id)
        .limit(limit)
    )
    rows = conn.execute(stmt.with_for_update(skip_locked=True) if lock else stmt).all()
    done: list[Reconciled] = []
    for row in rows:
        guard = (_m.c.id == row.id, _m.c.send_started_at == row.send_started_at, *where)
        update = sa.update(_m).where(*guard).values(_requeued_values(now))
        if not _alone(conn, update, row.id, "requeue"):
            continue  # moved by an event, an operator or another relay since the read
        done.append(
            Reconciled(
                id=row.id,
                category=row.category,
                send_started_at=row.send_started_at,
                reconcile_after=row.reconcile_after,
            )
        )
    record_attempts(
        conn,
        (
            AttemptRecord(
                message_id=r.id,
                claim_token=None,
                relay_id=relay_id,
                started_at=None,
                finished_at=now,
                outcome=AttemptOutcome.RECONCILE_REQUEUED,
                error_code="reconcile_requeued",
                error_message=(
                    f"no event for the attempt started {r.send_started_at.isoformat()} while "
                    f"the intake flowed {r.reconcile_after:g}s past it; requeued by {relay_id}"
                ),
            )
            for r in done
        ),
    )
    return done


@dataclass(frozen=True, kw_only=True, slots=True)
class Confirmed:
    """An unknown_outcome row :func:`resolve_confirmed` settled as sent."""

    id: int
    category: str
    provider_message_id: str


_confirming = attempts.alias("confirming")
# an attempt of the row that carries SES's MessageId and began no earlier than the row's
# ambiguous attempt: SES's answer to that very call (its ``stale:`` form, saved after the
# claim was gone) or to a later one
_CONFIRMS = (
    _confirming.c.message_id == _m.c.id,
    _confirming.c.provider_message_id.is_not(None),
    _confirming.c.started_at >= _m.c.send_started_at,
)


def resolve_confirmed(
    conn: sa.Connection, *, now: datetime, relay_id: str, limit: int = 100, lock: bool = True
) -> list[Confirmed]:
    """resolve_confirmed -- unknown_outcome -> sent, for ambiguous sends of the reconcile
    policy that SES itself answered with its MessageId after all.

    A relay frozen past its lease finishes its call when it thaws: the sweep has already
    held the row, so the relay's ``accepted`` is saved as ``stale:accepted`` with SES's
    MessageId, under the claim of the attempt that was held. That is SES's own word that it
    took the send, as good as its Send event: the row is sent, with that id and the time
    the answer came (``sent_at``), a ``reconciled`` attempt row recording it. Leaving it for
    a human would leave a sent message looking unsent, one operator requeue away from a
    second copy; :func:`reconcile_unknown` never requeues a row with such an attempt.

    Only rows of the reconcile policy (its sweep's index reads them; a hold row is the
    operator's by that policy's choice, and its ``show`` lists the attempt). Each row moves
    by its own guarded UPDATE naming the ambiguous attempt's start, so racing replicas
    resolve it once. Runs in the caller's transaction; ``now`` is the database's clock.
    """
    where = (
        _m.c.status == Status.UNKNOWN_OUTCOME.value,
        _m.c.reconcile_after.is_not(None),
        _m.c.send_started_at.is_not(None),
    )
    stmt = (
        sa.select(_m.c.id, _m.c.category, _m.c.send_started_at)
        .where(*where, sa.exists().where(*_CONFIRMS))
        .order_by(_m.c.send_started_at, _m.c.id)
        .limit(limit)
    )
    rows = conn.execute(stmt.with_for_update(skip_locked=True) if lock else stmt).all()
    done: list[tuple[Confirmed, str | None]] = []
    for row in rows:
        answer = (
            sa.select(
                _confirming.c.provider_message_id,
                _confirming.c.claim_token,
                _confirming.c.finished_at,
            )
            .where(_m.c.id == row.id, *_CONFIRMS)
            .order_by(_confirming.c.id.desc())
            .limit(1)
        )
        found = conn.execute(answer).first()
        if found is None:
            continue
        update = (
            sa.update(_m)
            .where(_m.c.id == row.id, _m.c.send_started_at == row.send_started_at, *where)
            .values(
                status=Status.SENT.value,
                provider_message_id=found.provider_message_id,
                sent_at=found.finished_at,
                claim_token=None,
                lease_expires_at=None,
                last_error_code=None,
                last_error_message=None,
                updated_at=now,
            )
        )
        if not _alone(conn, update, row.id, "resolve"):
            continue  # moved by an event, an operator or another relay since the read
        confirmed = Confirmed(
            id=row.id, category=row.category, provider_message_id=found.provider_message_id
        )
        done.append((confirmed, found.claim_token))
    record_attempts(
        conn,
        (
            AttemptRecord(
                message_id=c.id,
                claim_token=token,
                relay_id=relay_id,
                started_at=None,
                finished_at=now,
                outcome=AttemptOutcome.RECONCILED,
                provider_message_id=c.provider_message_id,
                error_code="provider_answered",
                error_message=(
                    f"SES answered the held attempt with {c.provider_message_id} after its "
                    f"claim was gone; resolved sent by {relay_id}"
                ),
            )
            for c, token in done
        ),
    )
    return [c for c, _ in done]


# -- operator transitions ----------------------------------------------------------------


_REQUEUEABLE = (Status.UNKNOWN_OUTCOME.value, Status.FAILED.value)
_CANCELLABLE = (Status.PENDING.value, Status.RETRYING.value)


def _change_many(
    conn: sa.Connection, ids: Sequence[int], allowed: Sequence[str], values: dict[str, Any]
) -> list[int]:
    """One guarded, set-based UPDATE of the rows among ``ids`` still in an ``allowed`` status;
    the ids it changed, ascending. RETURNING says which where the database has it; MariaDB
    locks the rows first (``FOR UPDATE``), so none can move between its SELECT and UPDATE. A
    relay's claim skips rows locked here (``SKIP LOCKED``) and never waits for them."""
    if not ids:
        return []
    guard = (_m.c.id.in_(ids), _m.c.status.in_(allowed))
    if conn.dialect.update_returning:
        changed = conn.execute(sa.update(_m).where(*guard).values(**values).returning(_m.c.id))
        return sorted(changed.scalars())
    locked = sorted(conn.execute(sa.select(_m.c.id).where(*guard).with_for_update()).scalars())
    if locked:
        conn.execute(sa.update(_m).where(_m.c.id.in_(locked), guard[1]).values(**values))
    return locked


def requeue_many(conn: sa.Connection, *, ids: Sequence[int], now: datetime) -> list[int]:
    """requeue -- unknown_outcome/failed -> pending, due now, with a fresh attempt budget; the
    ids requeued (the others had moved on)."""
    return _change_many(conn, ids, _REQUEUEABLE, _requeued_values(now))


def cancel_many(conn: sa.Connection, *, ids: Sequence[int], now: datetime) -> list[int]:
    """cancel -- pending/retrying -> cancelled; a row being sent cannot be cancelled. The ids
    cancelled (the others had been claimed or had moved on)."""
    values = {"status": Status.CANCELLED.value, "updated_at": now}
    return _change_many(conn, ids, _CANCELLABLE, values)


def attempted_by(
    conn: sa.Connection,
    *,
    ids: Sequence[int],
    relay_id: str,
    outcome: AttemptOutcome,
    since: datetime,
) -> list[int]:
    """The ids among ``ids`` with an attempt row by ``relay_id`` with ``outcome``, finished at
    or after ``since``: how an operator command learns whether a batch's COMMIT landed."""
    stmt = sa.select(attempts.c.message_id).where(
        attempts.c.message_id.in_(ids),
        attempts.c.relay_id == relay_id,
        attempts.c.outcome == outcome,
        attempts.c.finished_at >= since,
    )
    return sorted(set(conn.execute(stmt).scalars()))


def requeue(conn: sa.Connection, *, message_id: int, now: datetime) -> bool:
    """requeue -- :func:`requeue_many` for one message."""
    return requeue_many(conn, ids=[message_id], now=now) == [message_id]


def cancel(conn: sa.Connection, *, message_id: int, now: datetime) -> bool:
    """cancel -- :func:`cancel_many` for one message."""
    return cancel_many(conn, ids=[message_id], now=now) == [message_id]


@dataclass(frozen=True, kw_only=True, slots=True)
class Filter:
    """Which messages an operator command means. Empty fields match everything."""

    ids: tuple[int, ...] = ()
    statuses: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    key: str | None = None  # exact, or a prefix when it ends with '*'
    created_before: datetime | None = None
    created_after: datetime | None = None
    changed_before: datetime | None = None


def _where(f: Filter) -> list[sa.ColumnElement[bool]]:
    clauses: list[sa.ColumnElement[bool]] = []
    if f.ids:
        clauses.append(_m.c.id.in_(f.ids))
    if f.statuses:
        clauses.append(_m.c.status.in_(f.statuses))
    if f.categories:
        clauses.append(_m.c.category.in_(f.categories))
    if f.key is not None:
        if f.key.endswith("*"):
            prefix = f.key[:-1].replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            clauses.append(_m.c.idempotency_key.like(prefix + "%", escape="\\"))
        else:
            clauses.append(_m.c.idempotency_key == f.key)
    if f.created_before is not None:
        clauses.append(_m.c.created_at < f.created_before)
    if f.created_after is not None:
        clauses.append(_m.c.created_at >= f.created_after)
    if f.changed_before is not None:
        clauses.append(_m.c.updated_at < f.changed_before)
    return clauses


_LIST_COLUMNS = (
    _m.c.id,
    _m.c.status,
    _m.c.category,
    _m.c.priority,
    _m.c.idempotency_key,
    _m.c.recipients,
    _m.c.subject,
    _m.c.attempt_count,
    _m.c.next_attempt_at,
    _m.c.created_at,
    _m.c.updated_at,
    _m.c.last_error_code,
)


def list_messages(
    conn: sa.Connection, f: Filter, *, limit: int, after_id: int | None = None
) -> list[Any]:
    """list_messages -- One page of messages matching ``f``, by id (keyset paging)."""
    stmt = sa.select(*_LIST_COLUMNS).where(*_where(f)).order_by(_m.c.id).limit(limit)
    if after_id is not None:
        stmt = stmt.where(_m.c.id > after_id)
    return list(conn.execute(stmt).all())


def count_messages(conn: sa.Connection, f: Filter) -> int:
    """count_messages -- How many messages match ``f``."""
    stmt = sa.select(sa.func.count()).select_from(_m).where(*_where(f))
    return int(conn.execute(stmt).scalar_one())


def message_ids(conn: sa.Connection, f: Filter) -> list[int]:
    """message_ids -- Every id matching ``f``, in order (for a bulk operator command)."""
    return list(conn.execute(sa.select(_m.c.id).where(*_where(f)).order_by(_m.c.id)).scalars())


def get_message(
    conn: sa.Connection, message_id: int
) -> tuple[sa.Row[Any] | None, list[sa.Row[Any]]]:
    """get_message -- A message row and all its attempts, oldest first."""
    row = conn.execute(sa.select(_m).where(_m.c.id == message_id)).one_or_none()
    history = conn.execute(
        sa.select(attempts).where(attempts.c.message_id == message_id).order_by(attempts.c.id)
    ).all()
    return row, list(history)


def recent_payloads(conn: sa.Connection, *, limit: int = 1000) -> list[Any]:
    """recent_payloads -- The payloads of the newest ``limit`` messages, newest first: where
    ``doctor`` finds the From addresses and configuration sets in use (read backwards along
    the primary key, so its cost does not grow with the table)."""
    stmt = sa.select(_m.c.payload).order_by(_m.c.id.desc()).limit(limit)
    return list(conn.execute(stmt).scalars())


def live_heartbeats(conn: sa.Connection, *, since: datetime) -> tuple[int, int]:
    """live_heartbeats -- How many relays (``running``) and event intakes beat since
    ``since``: whether a test message can be sent and its events seen."""
    running = conn.execute(
        sa.select(sa.func.count())
        .select_from(relays)
        .where(relays.c.state == RelayState.RUNNING.value, relays.c.heartbeat_at >= since)
    ).scalar_one()
    taking = conn.execute(
        sa.select(sa.func.count()).select_from(intakes).where(intakes.c.heartbeat_at >= since)
    ).scalar_one()
    return int(running), int(taking)


_IDS_PER_STATEMENT = 10_000  # PostgreSQL takes at most 65,535 parameters in one statement


def statuses_of(conn: sa.Connection, ids: Sequence[int]) -> dict[int, str]:
    """statuses_of -- The current status of each existing id, read ``_IDS_PER_STATEMENT`` ids
    a statement, so an operator may give any number of ids."""
    found: dict[int, str] = {}
    for start in range(0, len(ids), _IDS_PER_STATEMENT):
        chunk = ids[start : start + _IDS_PER_STATEMENT]
        rows = conn.execute(sa.select(_m.c.id, _m.c.status).where(_m.c.id.in_(chunk))).all()
        found.update((row.id, row.status) for row in rows)
    return found


def prune_batch(conn: sa.Connection, *, before: datetime, limit: int) -> int:
    """prune -- Delete up to ``limit`` finished messages (and their attempts) created and last
    changed before ``before``. unknown_outcome rows are never pruned: they await an operator.
    """
    old = Filter(statuses=TERMINAL, created_before=before, changed_before=before)
    ids = list(
        conn.execute(
            sa.select(_m.c.id)
            .where(*_where(old))
            .order_by(_m.c.id)
            .limit(limit)
            .with_for_update(skip_locked=True)
        ).scalars()
    )
    if not ids:
        return 0
    conn.execute(sa.delete(attempts).where(attempts.c.message_id.in_(ids)))
    result = conn.execute(sa.delete(_m).where(_m.c.id.in_(ids), _m.c.status.in_(TERMINAL)))
    return int(result.rowcount)


_COUNT, _SECONDS, _TIME = sa.Integer(), sa.Float(), UTCDateTime()
_VIEW_TYPES: dict[str, dict[str, sa.types.TypeEngine[Any]]] = {
    "outbox_status_summary": {
        "message_count": _COUNT,
        "oldest_created_at": _TIME,
        "oldest_next_attempt_at": _TIME,
    },
    "outbox_lag": {"due_count": _COUNT, "oldest_due_at": _TIME, "lag_seconds": _SECONDS},
    "outbox_unknown_outcomes": {
        "id": _COUNT,
        "claimed_at": _TIME,
        "send_started_at": _TIME,
        "attempt_count": _COUNT,
        "updated_at": _TIME,
    },
    "outbox_failures": {"message_count": _COUNT, "newest_at": _TIME, "newest_message_id": _COUNT},
    "outbox_relay_health": {
        "pid": _COUNT,
        "started_at": _TIME,
        "heartbeat_at": _TIME,
        "heartbeat_age_seconds": _SECONDS,
    },
}


OUTBOX_TABLES = tuple(sorted(_outbox_metadata.tables))


def missing_tables(conn: sa.Connection) -> list[str]:
    """The outbox tables the database lacks (all of them if it was never migrated)."""
    present = set(sa.inspect(conn).get_table_names())
    return [name for name in OUTBOX_TABLES if name not in present]


def read_view(conn: sa.Connection, name: str) -> list[dict[str, Any]]:
    """The rows of one of the operator views (``outbox_status_summary``, ``outbox_lag``, ...),
    typed alike on every backend: timestamps aware in UTC (SQLite gives text, MariaDB naive
    UTC, PostgreSQL the session's zone), ages in seconds as floats (PostgreSQL and MariaDB
    give ``Decimal``), counts and ids as ints."""
    if name not in VIEWS:
        raise ValueError(f"not an outbox view: {name}")
    stmt = sa.text(f"SELECT * FROM {name}").columns(**_VIEW_TYPES.get(name, {}))
    return [dict(row._mapping) for row in conn.execute(stmt)]


_LAG = sa.text("SELECT category, due_count, lag_seconds FROM outbox_lag")


def read_lag(conn: sa.Connection) -> Sequence[sa.Row[Any]]:
    """read_lag -- Each category's ``category``, ``due_count`` and ``lag_seconds``, as
    ``outbox_lag`` has them (the metrics' gauges)."""
    return conn.execute(_LAG).all()


# -- what is left (relay.testing's report when the relay was not idle) ---------------------


def _due_at(now: datetime) -> sa.Select[Any]:
    return sa.select(_m.c.id).where(
        _m.c.status.in_([s.value for s in CLAIMABLE]), _m.c.next_attempt_at <= now
    )


def count_due(conn: sa.Connection, *, now: datetime) -> int:
    """count_due -- How many messages are due at ``now`` (claimable, ``next_attempt_at`` past)."""
    return len(conn.execute(_due_at(now)).all())


def count_locked_due(conn: sa.Connection, *, now: datetime) -> int:
    """count_locked_due -- How many due messages another transaction holds locked: the due
    ones ``FOR UPDATE SKIP LOCKED`` does not return (PostgreSQL, MariaDB)."""
    due = _due_at(now)
    every = set(conn.execute(due).scalars())
    free = set(conn.execute(due.with_for_update(skip_locked=True)).scalars()) if every else set()
    return len(every - free)


# -- relays ------------------------------------------------------------------------------


_LIVE_STATES = (RelayState.RUNNING, RelayState.PAUSED, RelayState.DRAINING)


def register(
    conn: sa.Connection,
    *,
    relay_id: str,
    host: str,
    pid: int,
    now: datetime,
    dead_after: float,
    unseen: Collection[datetime] = (),
) -> RelayHolder | None:
    """register -- Announce a relay, unless a live relay already holds its id.

    The row of a dead relay is taken over: one that stopped, or whose last heartbeat is more
    than ``dead_after`` seconds before ``now`` (both on the database's clock). Returns None
    once registered, or the live holder (its row left as it is). The takeover is one guarded
    UPDATE, so of two relays starting with the same id at once only one takes a dead row;
    two inserting a new id at once make the later insert fail on the key (an
    ``IntegrityError``: look again).

    ``unseen``: the ``started_at`` values of earlier registers of this very process (``host``,
    ``pid``) whose commit it did not see (the connection was lost or timed out at COMMIT). A
    row that carries one of them is this process's own, and is taken over like a dead one:
    otherwise the relay would take its own live row for another relay's and stop.
    """
    values = {
        "host": host,
        "pid": pid,
        "started_at": now,
        "heartbeat_at": now,
        "state": RelayState.RUNNING.value,
    }
    dead = sa.or_(
        relays.c.state.not_in(_LIVE_STATES),
        relays.c.heartbeat_at < now - timedelta(seconds=dead_after),
        sa.false()
        if not unseen
        else sa.and_(
            relays.c.host == host, relays.c.pid == pid, relays.c.started_at.in_(list(unseen))
        ),
    )
    take = sa.update(relays).where(relays.c.relay_id == relay_id, dead).values(values)
    taken = conn.execute(take)
    if taken.rowcount == 1:
        return None
    holder = conn.execute(
        sa.select(relays.c.host, relays.c.pid, relays.c.heartbeat_at, relays.c.state).where(
            relays.c.relay_id == relay_id
        )
    ).one_or_none()
    if holder is not None:
        return RelayHolder(
            host=holder.host, pid=holder.pid, heartbeat_at=holder.heartbeat_at, state=holder.state
        )
    conn.execute(sa.insert(relays).values(relay_id=relay_id, **values))
    return None


@dataclass(frozen=True, kw_only=True, slots=True)
class RelayHolder:
    """The live relay that holds a relay id (see :func:`register`)."""

    host: str
    pid: int
    heartbeat_at: datetime
    state: str  # as read: a relay of another release may write a state this one lacks


def _held(relay_id: str, host: str, pid: int, started_at: datetime) -> sa.ColumnElement[bool]:
    """The row this relay registered, and not one another relay with its id took over since."""
    return sa.and_(
        relays.c.relay_id == relay_id,
        relays.c.host == host,
        relays.c.pid == pid,
        relays.c.started_at == started_at,
    )


def heartbeat_held(
    conn: sa.Connection,
    *,
    relay_id: str,
    host: str,
    pid: int,
    started_at: datetime,
    now: datetime,
    state: RelayState,
) -> bool:
    """heartbeat -- The relay is alive, in ``state``, on the row it registered at
    ``started_at``. False if that row is gone or was taken over (this relay looked dead)."""
    stmt = (
        sa.update(relays)
        .where(_held(relay_id, host, pid, started_at))
        .values(heartbeat_at=now, state=state)
    )
    return conn.execute(stmt).rowcount == 1


def stop_held(
    conn: sa.Connection, *, relay_id: str, host: str, pid: int, started_at: datetime, now: datetime
) -> None:
    """stop -- The relay exited cleanly (its own row only: never a successor's)."""
    conn.execute(
        sa.update(relays)
        .where(_held(relay_id, host, pid, started_at))
        .values(heartbeat_at=now, state=RelayState.STOPPED.value)
    )


# -- the shared send budget (--max-send-rate) ---------------------------------------------
#
# Relays book every send in outbox_send_budget before starting it, one relay at a time under
# the lock of outbox_send_budget_lock's one row, inside the transaction that marks the wave;
# relay/ratelimit.py decides when each may start. None of this runs without a send limit.

_budget = send_budget
_LOCK_BUDGET = sa.update(send_budget_lock).where(send_budget_lock.c.id == 1).values(id=1)
_BOOKINGS = (
    sa.select(_budget.c.reserved_at, _budget.c.recipients, _budget.c.occupied_until)
    .where(_budget.c.occupied_until > sa.bindparam("since", type_=UTCDateTime()))
    .order_by(_budget.c.reserved_at, _budget.c.id)
)


def _seed_budget_lock(dialect: str) -> sa.Insert:
    """The lock's row, inserted unless it exists (another relay may insert it at once)."""
    if dialect == "postgresql":
        return postgresql.insert(send_budget_lock).values(id=1).on_conflict_do_nothing()
    if dialect == "sqlite":
        return sqlite.insert(send_budget_lock).values(id=1).on_conflict_do_nothing()
    return sa.insert(send_budget_lock).values(id=1).prefix_with("IGNORE")


def lock_send_budget(conn: sa.Connection) -> None:
    """lock_send_budget -- Hold the budget's lock until this transaction ends, so bookings are
    made one relay at a time, each seeing all the bookings committed before it.

    An UPDATE of the lock's row (a row lock on PostgreSQL and MySQL/MariaDB, the write lock on
    SQLite), which the migration inserts; if it is missing (the table emptied), it is put
    back first."""
    if conn.execute(_LOCK_BUDGET).rowcount == 1:
        return
    conn.execute(_seed_budget_lock(conn.dialect.name))
    conn.execute(_LOCK_BUDGET)


def send_bookings(conn: sa.Connection, *, since: datetime) -> list[Booking]:
    """send_bookings -- The bookings whose hold on the budget ends after ``since``, in start
    order. Read under :func:`lock_send_budget` (at READ COMMITTED, each statement sees what
    was committed before it)."""
    return [
        Booking(start=row.reserved_at, recipients=row.recipients, until=row.occupied_until)
        for row in conn.execute(_BOOKINGS, {"since": since})
    ]


def book_sends(conn: sa.Connection, *, relay_id: str, bookings: Sequence[Booking]) -> None:
    """book_sends -- Record this relay's new bookings (sends with the same start and hold as
    one row), under :func:`lock_send_budget`."""
    rows = [
        {
            "relay_id": relay_id,
            "reserved_at": b.start,
            "recipients": b.recipients,
            "occupied_until": b.until,
        }
        for b in merged(bookings)
    ]
    if rows:
        conn.execute(sa.insert(_budget), rows)


def prune_send_budget(conn: sa.Connection, *, before: datetime) -> int:
    """prune_send_budget -- Delete bookings whose hold ended before ``before``: they can no
    longer affect a new one."""
    result = conn.execute(sa.delete(_budget).where(_budget.c.occupied_until < before))
    return int(result.rowcount)
