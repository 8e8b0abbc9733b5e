"""The lease sweep: processing rows whose lease ran out (their holder died or hung), read
and settled by any replica."""

from __future__ import annotations

import random
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

import sqlalchemy as sa

from outbox.schema import AttemptOutcome, Status, messages
from relay.policy import Decision, LeaseExpired, decide
from relay.store.attempts import AttemptRecord, record_attempts
from relay.store.claims import _CLAIM_COLUMNS, Claim, _claim
from relay.store.finalize import apply_decision

__all__ = ["StaleLease", "settle_expired_leases", "sweep_candidates", "sweep_expired_leases"]

_m = messages


@dataclass(frozen=True, kw_only=True, slots=True)
class StaleLease:
    """A processing row whose lease ran out: its holder died or hung."""

    claim: Claim
    claimed_by: str | None
    send_started_at: datetime | None


def sweep_candidates(
    conn: sa.Connection, *, now: datetime, limit: int = 500, lock: bool = True
) -> list[StaleLease]:
    """The sweep's read: processing rows whose lease expired before ``now``, ``FOR UPDATE
    SKIP LOCKED`` (a sweep that waited on a locked row would stall its relay's loop).

    The guarded writes alone keep a sweep correct when its read is stale: ``lock=False``
    reads without locking, so tests can race holders between the read and the write.
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
    """The sweep's write: settle ``leases`` read at ``now``, in their order.

    Each is decided (released if its send never started, else per the ambiguity policy) and
    applied by its own guarded UPDATE (claim token, ``expired_before=now``), so a relay that
    renews its lease in between keeps its row and racing sweeps are harmless; a moved row
    whose send had started gets a ``lease_expired`` attempt under the claim that made it.
    Returns every lease with its decision and whether this call moved it. ``rng`` draws the
    retries' jitter.
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
    """Settle processing rows whose lease ran out before ``now``: :func:`sweep_candidates`
    then :func:`settle_expired_leases`. Returns the rows this call moved, with the decision
    applied.

    A row whose send never started goes back to pending/retrying with no attempt counted;
    one whose send may have begun goes to unknown_outcome (``hold``) or retrying
    (``resend``).
    """
    stale = sweep_candidates(conn, now=now, limit=limit)
    settled = settle_expired_leases(conn, stale, now=now, relay_id=relay_id, rng=rng)
    return [(lease, decision) for lease, decision, moved in settled if moved]
