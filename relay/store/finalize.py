"""The transitions that end a claim: processing -> sent, retrying, failed, unknown_outcome,
or back to its previous status, each one guarded UPDATE; and ``apply_decision``, which picks
the one a policy decision names."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from outbox.schema import AttemptOutcome, Status, UTCDateTime, attempts, messages
from relay.policy import Action, Decision
from relay.store.attempts import ATTEMPT_FIELDS, AttemptRecord, pg_rows, record_attempts
from relay.store.claims import Claim

__all__ = [
    "SentSave",
    "apply_decision",
    "due_at",
    "fail",
    "finalize_sent",
    "finalize_sent_many",
    "finalize_sent_recorded",
    "hold_unknown",
    "release",
    "release_unsent",
    "release_unstarted",
    "save_sent",
    "schedule_retry",
    "sent_ctes",
]

_m = messages
_NO_CLAIM = {"claim_token": None, "lease_expires_at": None}


def due_at(at: datetime) -> dict[str, Any]:
    """``next_attempt_at = at``, and the row's turn moved with it if it came sooner: a turn is
    never before its row is due, so the claim's index scan meets no row that is not due before
    every due row with an earlier turn. A keyed row keeps its later turn."""
    value = sa.literal(at, UTCDateTime())
    return {
        "next_attempt_at": at,
        "fair_at": sa.case((_m.c.fair_at > value, _m.c.fair_at), else_=value),
    }


def _requeued_values(now: datetime) -> dict[str, Any]:
    """What a requeue writes (the operator's and the reconcile's): pending, due now, a fresh
    attempt budget, no claim, no send-started mark."""
    return {
        **_NO_CLAIM,
        **due_at(now),
        "status": Status.PENDING.value,
        "attempt_count": 0,
        "send_started_at": None,
        "updated_at": now,
    }


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
    """processing -> sent, for the holder of the claim only."""
    values = {
        **_attempted(now, None, None),
        "status": Status.SENT.value,
        "sent_at": now,
        "provider_message_id": provider_message_id,
    }
    return _transition(conn, message_id, claim_token, values, None)


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
    """MySQL/MariaDB: the guarded finalize of ``size`` distinct rows as one UPDATE, each row's
    token and provider id picked by its id (``CASE id WHEN ...``)."""
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
    """:func:`finalize_sent` for a batch of (id, claim_token, provider_message_id), each row
    with its own guard; returns the (id, claim_token) pairs moved to sent (an id can come
    twice: a swept row's late result beside its new one).

    PostgreSQL: one ``UPDATE ... FROM unnest(...) RETURNING``; MySQL/MariaDB: one UPDATE per
    ``_CASE_ROWS`` rows (the driver's executemany sends one per row); SQLite: an executemany.
    A repeated id: one statement per row."""
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
    # some guard failed (a stale claim): find which rows this statement moved
    wanted = {i: (t, p) for i, t, p in items}
    moved = sa.select(_m.c.id, _m.c.provider_message_id).where(
        _m.c.id.in_(list(wanted)), _m.c.status == Status.SENT.value, _m.c.sent_at == now
    )
    return {
        (row.id, wanted[row.id][0])
        for row in conn.execute(moved)
        if row.provider_message_id == wanted[row.id][1]
    }


# PostgreSQL: the batch finalize and its attempt rows as one statement. The attempt rows
# come as one JSON array (attempts.pg_rows); a row whose 11th field is set records that
# outcome instead of its own unless the finalize moved its (id, claim token) to sent.
_SAVED = _FINALIZE_SENT_BATCH.cte("saved")
_ROWS = (
    sa.func.json_array_elements(sa.cast(sa.bindparam("a_rows", type_=sa.Text()), postgresql.JSON))
    .table_valued("value")
    .alias("attempt")
)


def _field(index: int) -> sa.ColumnElement[str]:
    return _ROWS.c.value.op("->>", return_type=sa.Text())(sa.literal_column(str(index)))


def _attempt_value(index: int, name: str) -> sa.ColumnElement[Any]:
    kind = attempts.c[name].type
    if isinstance(kind, UTCDateTime):
        return sa.cast(_field(index), postgresql.TIMESTAMP(timezone=True))
    if isinstance(kind, sa.BigInteger | sa.Integer):
        return sa.cast(_field(index), sa.BigInteger)
    return _field(index)


_STALE = len(ATTEMPT_FIELDS)
_KEPT = sa.exists().where(
    _SAVED.c.id == _attempt_value(0, "message_id"), _SAVED.c.token == _field(1)
)
_WRITTEN = (
    sa.insert(attempts)
    .from_select(
        list(ATTEMPT_FIELDS),
        sa.select(
            *(
                sa.case((_field(_STALE).is_not(None) & ~_KEPT, _field(_STALE)), else_=_field(k))
                if name == "outcome"
                else _attempt_value(k, name)
                for k, name in enumerate(ATTEMPT_FIELDS)
            )
        ).select_from(_ROWS),
    )
    .cte("written")
)
_FINALIZE_SENT_RECORDED = sa.select(_SAVED.c.id, _SAVED.c.token).add_cte(_SAVED, _WRITTEN)


def sent_ctes() -> tuple[sa.CTE, sa.CTE]:
    """PostgreSQL: :func:`finalize_sent_recorded`'s two CTEs, for a statement that runs them
    (the first's rows are the pairs moved: ``id``, ``token``), bound by
    :meth:`SentSave.params`."""
    return _SAVED, _WRITTEN


@dataclasses.dataclass(frozen=True, slots=True)
class SentSave:
    """A pass's sent decisions and attempt rows, for :func:`finalize_sent_recorded` (or
    for the pass's claim read, which runs them in its own statement on PostgreSQL:
    ``relay.store.passes``)."""

    items: Sequence[tuple[int, str, str | None]]
    records: Sequence[tuple[AttemptRecord, bool]]
    now: datetime

    @property
    def one_statement(self) -> bool:
        """Whether PostgreSQL runs it as the one CTE statement (both parts non-empty)."""
        return bool(self.items and self.records)

    def params(self) -> dict[str, Any]:
        """The CTE statement's parameters."""
        ids, tokens, provider_ids = (list(c) for c in zip(*self.items, strict=True))
        stale = [
            AttemptOutcome(r.outcome).stale.value if guarded else None
            for r, guarded in self.records
        ]
        return {
            "b_ids": ids,
            "b_tokens": tokens,
            "b_provider_ids": provider_ids,
            "b_now": self.now,
            "a_rows": pg_rows([r for r, _guarded in self.records], stale),
        }


def save_sent(conn: sa.Connection, save: SentSave) -> set[tuple[int, str]]:
    """:func:`finalize_sent_recorded` of ``save``."""
    return finalize_sent_recorded(conn, save.items, save.records, now=save.now)


def finalize_sent_recorded(
    conn: sa.Connection,
    items: Sequence[tuple[int, str, str | None]],
    records: Sequence[tuple[AttemptRecord, bool]],
    *,
    now: datetime,
) -> set[tuple[int, str]]:
    """:func:`finalize_sent_many` and :func:`record_attempts` in one: ``items`` moved to
    sent under their guards, and the attempt ``records`` appended, each one marked True
    recorded in its outcome's ``stale:`` form unless its (message id, claim token) was moved.
    Returns the pairs moved. On PostgreSQL one statement (the pass's save is one round trip
    fewer); elsewhere the two, in the caller's transaction either way, so neither is ever
    written without the other."""
    if conn.dialect.name != "postgresql" or not items or not records:
        sent = finalize_sent_many(conn, items, now=now)
        record_attempts(
            conn,
            [
                dataclasses.replace(r, outcome=AttemptOutcome(r.outcome).stale)
                if guarded and (r.message_id, r.claim_token) not in sent
                else r
                for r, guarded in records
            ],
        )
        return sent
    params = SentSave(items, records, now).params()
    return {(row[0], row[1]) for row in conn.execute(_FINALIZE_SENT_RECORDED, params)}


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
    """processing -> retrying at ``next_attempt_at``; one attempt counted."""
    values = {
        **_attempted(now, code, message),
        **due_at(next_attempt_at),
        "status": Status.RETRYING.value,
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
    """processing -> failed (permanent error, or attempts exhausted)."""
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
    """processing -> unknown_outcome: the send may have happened.

    ``claimed_by``, ``claimed_at`` and ``send_started_at`` stay for reconciliation; only an
    operator's ``requeue`` (or the reconcile policy) takes the row back.
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
    """processing -> its previous status (pending if never attempted, else retrying), no
    attempt counted; ``next_attempt_at`` unchanged, or moved to the given time (a paused
    scope's message steps back in line until its probe).

    A sweep (``expired_before`` given) releases only a row whose send has not started: a late
    holder may have stamped it since the sweep's read, and the next sweep then treats it as
    ambiguous.
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
        values.update(due_at(next_attempt_at))
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
    """Give back rows of a claim whose send never started (not marked), in one statement;
    how many went back. ``next_attempt_at`` moves them back in line."""
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
    """Give back rows of a claim its holder never handed to a send (drain, a pause), marked
    or not, in one statement; how many went back.

    Unlike :func:`release_unstarted`, marked rows too: a commit that applied unseen leaves the
    mark on rows never sent, and only the holder knows it. The claim token keeps a row swept
    and claimed by another relay out of reach.
    """
    if not ids:
        return 0
    stmt = _release_statement(ids, claim_token, now, next_attempt_at)
    return int(conn.execute(stmt).rowcount)


def _release_statement(
    ids: Sequence[int], claim_token: str, now: datetime, next_attempt_at: datetime | None
) -> sa.Update:
    later = {} if next_attempt_at is None else due_at(next_attempt_at)
    return (
        sa.update(_m)
        .where(
            _m.c.id.in_(ids),
            _m.c.claim_token == claim_token,
            _m.c.status == Status.PROCESSING.value,
        )
        .values(**_NO_CLAIM, **later, status=_PREVIOUS_STATUS, send_started_at=None, updated_at=now)
    )


def apply_decision(
    conn: sa.Connection,
    claim: Claim,
    decision: Decision,
    now: datetime,
    *,
    expired_before: datetime | None = None,
) -> bool:
    """Apply a policy decision to ``claim`` through its guarded transition; False if the
    claim no longer holds the row (another relay or the sweep moved it)."""
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
