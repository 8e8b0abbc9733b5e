"""The attempt log, ``outbox_attempts``: its rows appended, and read back by an operator
command that lost its COMMIT's answer."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import sqlalchemy as sa

from outbox.schema import AttemptOutcome, UTCDateTime, attempts

__all__ = ["ATTEMPT_FIELDS", "AttemptRecord", "attempted_by", "pg_rows", "record_attempts"]


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


ATTEMPT_FIELDS = (
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


# PostgreSQL: the rows as one JSON array of arrays (fields in ATTEMPT_FIELDS order), so one
# parameter and one statement text whatever the batch size, dumped by json.dumps
_INSERT_ATTEMPTS_PG = sa.text(
    f"INSERT INTO {attempts.name} ({', '.join(ATTEMPT_FIELDS)}) SELECT "
    + ", ".join(_pg_attempt_value(k, name) for k, name in enumerate(ATTEMPT_FIELDS))
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


def pg_rows(records: Iterable[AttemptRecord], stale: Sequence[str | None] = ()) -> str:
    """The rows as PostgreSQL's statements read them: one JSON array of arrays, fields in
    ``ATTEMPT_FIELDS`` order, then (when given) the outcome to record instead if the row's
    claim turns out gone (see ``finalize.finalize_sent_recorded``)."""
    rows: list[list[object]] = [
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
    for row, instead in zip(rows, stale, strict=False):
        row.append(instead)
    return json.dumps(rows)


def record_attempts(conn: sa.Connection, records: Iterable[AttemptRecord]) -> None:
    """Append attempt rows, in the finalize's transaction (stale or not): one INSERT on
    PostgreSQL, an executemany elsewhere."""
    if conn.dialect.name == "postgresql":
        rows = list(records)
        if rows:
            conn.execute(_INSERT_ATTEMPTS_PG, {"a_rows": pg_rows(rows)})
        return
    mapped = [{name: getattr(r, name) for name in ATTEMPT_FIELDS} for r in records]
    if mapped:
        conn.execute(sa.insert(attempts), mapped)


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
