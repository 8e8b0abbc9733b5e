"""The claim: due rows taken under a fresh token and lease, the send-started mark, lease
renewal, and the expiry of rows that were never sent."""

from __future__ import annotations

import functools
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.sql.dml import ReturningUpdate

from outbox.schema import CLAIMABLE, AmbiguityPolicy, Status, UTCDateTime, messages, suppressions
from relay.clock import read_database_time
from relay.policy import MessageState
from relay.store.suppressions import suppressed_among

__all__ = [
    "MAX_SKIPPED_KEYS",
    "Claim",
    "Expired",
    "Taking",
    "Took",
    "claim_batch",
    "count_due",
    "count_locked_due",
    "expire",
    "extend_lease",
    "lock_batch",
    "lock_params",
    "lock_statement",
    "mark_send_started",
    "mark_send_started_at",
    "take_batch",
    "taking_of",
]

_m = messages
_CLAIM_COLUMNS = (
    _m.c.id,
    _m.c.idempotency_key,
    _m.c.category,
    _m.c.priority,
    _m.c.status,
    # cast to text in SQL so no driver decodes it: a garbage payload fails as invalid_payload
    # in the relay instead of breaking the claim that reads it
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
    _m.c.fair_at,
    _m.c.fairness_key,
    _m.c.lease_expires_at,
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
    fair_at: datetime  # its turn: the claim's order after priority
    fairness_key: str | None = None

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


def _policy(stored: str, reconcile_after: float | None) -> AmbiguityPolicy:
    """The row's policy: ``reconcile`` is stored as ``'hold'`` with ``reconcile_after`` set."""
    if reconcile_after is not None:
        return AmbiguityPolicy.RECONCILE
    return AmbiguityPolicy(stored)


def _claim(row: Any, claim_token: str, payload: Any, lease: datetime | None = None) -> Claim:
    """A :class:`Claim` from a row read with ``_CLAIM_COLUMNS`` (its lease ``lease`` when the
    row was read before the claim wrote it)."""
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
        lease_expires_at=row.lease_expires_at if lease is None else lease,
        fair_at=row.fair_at,
        fairness_key=row.fairness_key,
    )


_NOW = sa.bindparam("c_now", type_=UTCDateTime())
# Most held keys the claim leaves out by name: beyond, the rest are claimed and sent back (a
# longer list costs every claim more than the claims it saves, and PostgreSQL takes at most
# 65,535 parameters a statement)
MAX_SKIPPED_KEYS = 500
_LIMIT = sa.bindparam("c_limit", type_=sa.Integer())


def _literal(status: Status) -> sa.ColumnElement[str]:
    return sa.literal_column(f"'{status.value}'", sa.String)


# SQLite uses the partial claim index only if the query repeats its condition with literals;
# the status equality goes first, or it plans the IN as the range and sorts every due row.
_CLAIMABLE = _m.c.status.in_([_literal(s) for s in CLAIMABLE])
# What a claim writes; a due row past its expires_at is moved to expired instead.
_EXPIRED = sa.and_(_m.c.expires_at.is_not(None), _m.c.expires_at <= _NOW)
_CLAIM_VALUES: dict[str, Any] = {
    "status": sa.case((_EXPIRED, Status.EXPIRED.value), else_=Status.PROCESSING.value),
    "claim_token": sa.bindparam("c_token", type_=_m.c.claim_token.type),
    "claimed_by": sa.case(
        (_EXPIRED, _m.c.claimed_by), else_=sa.bindparam("c_relay", type_=_m.c.claimed_by.type)
    ),
    "claimed_at": sa.case((_EXPIRED, _m.c.claimed_at), else_=_NOW),
    "lease_expires_at": sa.case(
        (_EXPIRED, None), else_=sa.bindparam("c_lease", type_=UTCDateTime())
    ),
    "send_started_at": None,
    "updated_at": _NOW,
}


def _due(status: Status, skip: bool) -> sa.Subquery:
    due = sa.and_(_m.c.status == _literal(status), _CLAIMABLE, _m.c.next_attempt_at <= _NOW)
    if skip:  # the keys a limit holds (a key in the list: not claimed; no key: claimed)
        held = _m.c.fairness_key.in_(sa.bindparam("c_skip", expanding=True))
        due = sa.and_(due, sa.or_(_m.c.fairness_key.is_(None), sa.not_(held)))
    return (
        sa.select(_m.c.id, _m.c.priority, _m.c.fair_at)
        .where(due)
        .order_by(_m.c.priority, _m.c.fair_at, _m.c.id)
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
def _claim_statements(lock_first: bool, skip: bool) -> _ClaimStatements:
    """The claim's statements, built once (the values are bound parameters)."""
    pending, retrying = _due(Status.PENDING, skip), _due(Status.RETRYING, skip)
    merged = sa.union_all(sa.select(pending), sa.select(retrying)).subquery()
    pick = (
        sa.select(merged.c.id)
        .order_by(merged.c.priority, merged.c.fair_at, merged.c.id)
        .limit(_LIMIT)
    )
    if lock_first:
        # an UPDATE with IN (subquery) is not planned as a range read of the index there
        chosen: sa.ColumnElement[bool] = _m.c.id.in_(sa.bindparam("c_ids", expanding=True))
    else:
        chosen = _m.c.id.in_(sa.select(pick.subquery().c.id))
    update = sa.update(_m).where(chosen).values(_CLAIM_VALUES)
    token = _CLAIM_VALUES["claim_token"]
    read_back = sa.select(*_CLAIM_COLUMNS).where(chosen, _m.c.claim_token == token)
    return _ClaimStatements(
        pick=pick,
        update=update,
        update_returning=update.returning(*_CLAIM_COLUMNS),
        read_back=read_back,
    )


def _claim_params(
    relay_id: str, limit: int, now: datetime, lease_seconds: float, skip_keys: Sequence[str]
) -> tuple[str, dict[str, Any]]:
    """A fresh claim token, and the claim's parameters under it."""
    token = str(uuid.uuid4())
    params: dict[str, Any] = {
        "c_now": now,
        "c_limit": limit,
        "c_token": token,
        "c_relay": relay_id,
        "c_lease": now + timedelta(seconds=lease_seconds),
    }
    if skip_keys := list(skip_keys)[:MAX_SKIPPED_KEYS]:
        params["c_skip"] = skip_keys
    return token, params


def claim_batch(
    conn: sa.Connection,
    *,
    relay_id: str,
    limit: int,
    now: datetime,
    lease_seconds: float,
    skip_keys: Sequence[str] = (),
) -> tuple[list[Claim], list[Expired]]:
    """Take up to ``limit`` due messages under one fresh claim token and lease.

    Due: pending or retrying with ``next_attempt_at`` passed, in (priority, fair_at, id)
    order (``fair_at``, the row's turn, is never before it is due: keys are served in turn,
    see :mod:`outbox.fairness`), each status read as its own range of the claim index with
    ``FOR UPDATE SKIP LOCKED``. Rows past ``expires_at`` move to expired in the same
    statement and come back apart: they are never sent. Rows of ``skip_keys`` (keys at their
    limit) are left alone.
    """
    token, params = _claim_params(relay_id, limit, now, lease_seconds, skip_keys)
    statements = _claim_statements(conn.dialect.name in ("mysql", "mariadb"), "c_skip" in params)
    if conn.dialect.name in ("mysql", "mariadb"):
        params["c_ids"] = list(conn.execute(statements.pick, params).scalars())
        if not params["c_ids"]:
            return [], []
    if conn.dialect.update_returning:
        rows = conn.execute(statements.update_returning, params).all()
    else:
        conn.execute(statements.update, params)
        rows = conn.execute(statements.read_back, params).all()
    return _claims_of([(row, row.status == Status.EXPIRED.value) for row in rows], token, None)


def _claims_of(
    rows: Sequence[tuple[Any, bool]], token: str, lease: datetime | None
) -> tuple[list[Claim], list[Expired]]:
    """The claims among ``rows`` (each with whether it expired), in the claim's order, and
    the expired ones apart."""
    claims, gone = [], []
    for row, expired in rows:
        if expired:
            gone.append(Expired(id=row.id, key=row.idempotency_key, category=row.category))
            continue
        claims.append(_claim(row, token, row.payload, lease))
    claims.sort(key=lambda c: (c.priority, c.fair_at, c.id))
    return claims, gone


def _id_among(name: str, pg: bool) -> sa.ColumnElement[bool]:
    """``id`` is in the list bound as ``name``: one array on PostgreSQL (``= ANY``), so the
    text and its prepared plan do not change with the list's length; elsewhere an IN."""
    if pg:
        return _m.c.id == sa.any_(sa.bindparam(name, type_=postgresql.ARRAY(sa.BigInteger)))
    return _m.c.id.in_(sa.bindparam(name, expanding=True))


@dataclass(frozen=True, kw_only=True, slots=True)
class Taking:
    """A claim read and locked by :func:`lock_batch`, written by :func:`take_batch` in the
    same transaction (``written``: already written, off PostgreSQL)."""

    claims: list[Claim]
    expired: list[Expired]
    token: str
    ids: list[int]  # every row locked, the expired among them
    params: dict[str, Any]
    written: bool


# PostgreSQL: the claim's rows read and locked, nothing written yet; `expired` as the claim's
# own CASE decides it, from the same parameter


@functools.cache
def lock_statement(skip: bool) -> sa.Select[Any]:
    """PostgreSQL: :func:`lock_batch`'s read (``skip``: with the held keys' parameter)."""
    pick = _claim_statements(False, skip).pick
    return sa.select(*_CLAIM_COLUMNS, _EXPIRED.label("expired")).where(
        _m.c.id.in_(sa.select(pick.subquery().c.id))
    )


# PostgreSQL: the claim and the send-started mark of the rows sent at once, one write a row,
# with the suppression screen of the wave in the same statement. The mark is the later of the
# relay's now and the database's clock, as mark_send_started_at.
# By id alone: the rows are this transaction's since lock_batch read them claimable, so no
# status guard is needed, and one (status IN pending, retrying) is the claim index's own
# predicate, which stale statistics let the planner read whole for 50 ids.
# The screen: the wave's (message id, address key) pairs; the list's addresses among them come
# back, and an id to mark whose every address is listed is barred, never marked (it fails
# unsent, as SuppressionFilter.apply decides from the same addresses).
_S_IDS = sa.bindparam("s_ids", type_=postgresql.ARRAY(sa.BigInteger))
_S_ADDRESSES = sa.bindparam("s_addresses", type_=postgresql.ARRAY(sa.String))


def _take_pg() -> sa.CompoundSelect[Any]:
    wanted = (
        sa.func.unnest(_S_IDS, _S_ADDRESSES)
        .table_valued(sa.column("id", sa.BigInteger), sa.column("address", sa.String))
        .render_derived(name="wanted")
    )
    listed = (
        sa.select(suppressions.c.address)
        .where(suppressions.c.address == sa.any_(_S_ADDRESSES))
        .cte("listed")
    )
    barred = (
        sa.select(wanted.c.id)
        .select_from(wanted.outerjoin(listed, listed.c.address == wanted.c.address))
        .group_by(wanted.c.id)
        .having(sa.func.bool_and(listed.c.address.is_not(None)))
        .cte("barred")
    )
    mark = sa.and_(
        sa.not_(_EXPIRED), _id_among("c_mark", True), _m.c.id.not_in(sa.select(barred.c.id))
    )
    took = (
        sa.update(_m)
        .where(_id_among("c_ids", True))
        .values(
            {
                **_CLAIM_VALUES,
                "send_started_at": sa.case(
                    (
                        mark,
                        sa.func.greatest(_NOW, sa.func.statement_timestamp(type_=UTCDateTime())),
                    ),
                    else_=None,
                ),
            }
        )
        .returning(_m.c.id, _m.c.send_started_at)
        .cte("took")
    )
    return sa.union_all(
        sa.select(took.c.id, took.c.send_started_at, sa.null().label("address")),
        sa.select(sa.null(), sa.null(), listed.c.address),
    )


_TAKE_PG = _take_pg()


def lock_batch(
    conn: sa.Connection,
    *,
    relay_id: str,
    limit: int,
    now: datetime,
    lease_seconds: float,
    skip_keys: Sequence[str] = (),
) -> Taking:
    """:func:`claim_batch`'s rows, as it picks them, in two steps of one transaction so that
    a message sent at once is written once, not claimed and then marked: on PostgreSQL this
    reads and locks them (``FOR UPDATE SKIP LOCKED``) and writes nothing; the claims it
    returns hold only once :func:`take_batch` has written them, before anything is done in
    their name. Elsewhere it is :func:`claim_batch` itself."""
    if conn.dialect.name != "postgresql":
        claims, expired = claim_batch(
            conn, relay_id=relay_id, limit=limit, now=now, lease_seconds=lease_seconds,
            skip_keys=skip_keys,
        )  # fmt: skip
        token = claims[0].claim_token if claims else ""
        ids = [c.id for c in claims] + [e.id for e in expired]
        return Taking(claims=claims, expired=expired, token=token, ids=ids, params={}, written=True)
    token, params = _claim_params(relay_id, limit, now, lease_seconds, skip_keys)
    return taking_of(conn.execute(lock_statement("c_skip" in params), params).all(), params)


def taking_of(rows: Sequence[Any], params: dict[str, Any]) -> Taking:
    """The :class:`Taking` of the rows :func:`lock_statement` read under ``params``."""
    token = params["c_token"]
    claims, gone = _claims_of([(row, row.expired) for row in rows], token, params["c_lease"])
    ids = [row.id for row in rows]
    return Taking(claims=claims, expired=gone, token=token, ids=ids, params=params, written=False)


def lock_params(
    relay_id: str, limit: int, now: datetime, lease_seconds: float, skip_keys: Sequence[str]
) -> dict[str, Any]:
    """:func:`lock_statement`'s parameters, under a fresh claim token (``c_token``)."""
    return _claim_params(relay_id, limit, now, lease_seconds, skip_keys)[1]


class Took(NamedTuple):
    """What :func:`take_batch` did: the ids it marked, their mark, and the screen's
    addresses that the suppression list holds."""

    stamped: set[int]
    at: datetime
    suppressed: set[str]


def take_batch(
    conn: sa.Connection,
    taking: Taking,
    *,
    mark: Sequence[int],
    now: datetime,
    screen: Sequence[tuple[int, Sequence[str]]] = (),
) -> Took:
    """Write ``taking``'s claim, with the send-started mark of ``mark`` (some of its claims'
    ids), after screening the wave against the suppression list.

    ``screen`` is the wave about to be sent, as (message id, its recipients' address keys),
    the new claims' and earlier ones'. An id of ``mark`` whose every address is listed is
    barred: not marked, it fails unsent (``SuppressionFilter.apply``, from the addresses
    returned). On PostgreSQL all of it is one statement, where :func:`lock_batch` wrote
    nothing; elsewhere the claim is written already, and this is the lookup
    (:func:`~relay.store.suppressions.suppressed_among`), then :func:`mark_send_started_at`.
    """
    if taking.written or not taking.ids:
        suppressed = suppressed_among(conn, (a for _id, keys in screen for a in keys))
        barred = _barred(screen, suppressed)
        ids = [i for i in mark if i not in barred]
        return Took(
            *mark_send_started_at(conn, ids=ids, claim_token=taking.token, now=now), suppressed
        )
    pairs = [(id_, a) for id_, keys in screen for a in keys]
    params = {
        **taking.params,
        "c_ids": taking.ids,
        "c_mark": list(mark),
        "s_ids": [id_ for id_, _a in pairs],
        "s_addresses": [a for _id, a in pairs],
    }
    stamped: dict[int, datetime] = {}
    suppressed = set()
    for row in conn.execute(_TAKE_PG, params):
        if row.address is not None:
            suppressed.add(row.address)
        elif row.send_started_at is not None:
            stamped[row.id] = row.send_started_at
    return Took(set(stamped), next(iter(stamped.values()), now), suppressed)


def _barred(screen: Sequence[tuple[int, Sequence[str]]], suppressed: set[str]) -> set[int]:
    """The ids of ``screen`` whose every address is suppressed (none, with no list hit)."""
    if not suppressed:
        return set()
    return {id_ for id_, keys in screen if keys and all(a in suppressed for a in keys)}


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


def mark_send_started(
    conn: sa.Connection, *, ids: Sequence[int], claim_token: str, now: datetime
) -> set[int]:
    """Stamp ``send_started_at`` on a wave of claimed rows, in one statement; the ids stamped.

    Only a stamped row may be sent: a lease that expires while the stamp is NULL is provably
    unsent, and the sweep returns it without using an attempt.
    """
    return mark_send_started_at(conn, ids=ids, claim_token=claim_token, now=now)[0]


def mark_send_started_at(
    conn: sa.Connection, *, ids: Sequence[int], claim_token: str, now: datetime
) -> tuple[set[int], datetime]:
    """:func:`mark_send_started`, returning the stamp with the ids.

    The stamp is the later of ``now`` (the relay's estimate) and the database's clock, read
    in the wave's transaction: by the UPDATE itself on PostgreSQL, one query before it on
    MySQL/MariaDB, the host's clock on SQLite. The caller records it as the attempt's
    ``started_at``. Why: docs/design.md, "Decisions" (the send-started mark on the database's
    clock).
    """
    if not ids:
        return set(), now
    if conn.dialect.name == "postgresql":
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
    """Push out the lease of rows still being sent; returns the ids kept."""
    return _stamp_wave(conn, ids, claim_token, _m.c.lease_expires_at, until)


def expire(conn: sa.Connection, *, now: datetime, limit: int = 1000) -> list[Expired]:
    """pending/retrying rows past ``expires_at`` -> expired (never sent).

    The claim expires the due ones; this catches those not due yet, skipping rows a claim
    holds locked.
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


def _due_at(now: datetime) -> sa.Select[Any]:
    return sa.select(_m.c.id).where(
        _m.c.status.in_([s.value for s in CLAIMABLE]), _m.c.next_attempt_at <= now
    )


def count_due(conn: sa.Connection, *, now: datetime) -> int:
    """How many messages are due at ``now`` (claimable, ``next_attempt_at`` past)."""
    return len(conn.execute(_due_at(now)).all())


def count_locked_due(conn: sa.Connection, *, now: datetime) -> int:
    """How many due messages another transaction holds locked: the due ones ``FOR UPDATE SKIP
    LOCKED`` does not return (PostgreSQL, MariaDB). For relay.testing's not-idle report."""
    due = _due_at(now)
    every = set(conn.execute(due).scalars())
    free = set(conn.execute(due.with_for_update(skip_locked=True)).scalars()) if every else set()
    return len(every - free)
