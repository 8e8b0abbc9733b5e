"""Maintenance: the sweep of expired leases, the reconcile of ambiguous sends, the expiry.

Every replica runs them; their guarded writes make racing ones harmless. Each service's
``run_once(conn, now)`` runs its statements in the caller's transaction and returns what
changed; ``announce`` logs and signals it once that transaction committed.
"""

from __future__ import annotations

import logging
import random
import time
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from relay import store
from relay.loop.announce import announce_expired, announce_reconciled, announce_swept
from relay.loop.connection import LoopConnection
from relay.policy import Decision

__all__ = ["Expire", "Maintenance", "Reconcile", "Sweep"]

_log = logging.getLogger("relay")  # reconcile_failed

_Swept = list[tuple[store.StaleLease, Decision]]


class Sweep:
    """Settle the sends whose lease ran out (their relay died or hung)."""

    interval = 1.0  # seconds between sweeps

    def __init__(self, source: Any, relay_id: str, rng: random.Random) -> None:
        self._source, self.relay_id, self._rng = source, relay_id, rng

    def run_once(self, conn: sa.Connection, now: datetime) -> _Swept:
        return store.sweep_expired_leases(conn, now=now, relay_id=self.relay_id, rng=self._rng)

    def announce(self, swept: _Swept) -> None:
        announce_swept(self._source, swept)


class Reconcile:
    """Settle the reconcile policy's ambiguous sends: those SES answered with its MessageId
    after all become sent; those no event named while the intake flowed past their window
    are requeued, once (docs/design.md, Decisions: "The reconcile policy requeues only on
    proof that the event would have come")."""

    interval = 5.0  # seconds between passes; a reconcile window is minutes

    def __init__(self, source: Any, relay_id: str) -> None:
        self._source, self.relay_id = source, relay_id

    def run_once(
        self, conn: sa.Connection, now: datetime
    ) -> tuple[list[store.Confirmed], list[store.Reconciled]]:
        confirmed = store.resolve_confirmed(conn, now=now, relay_id=self.relay_id)
        requeued = store.reconcile_unknown(conn, now=now, relay_id=self.relay_id)
        return confirmed, requeued

    def announce(self, changed: tuple[list[store.Confirmed], list[store.Reconciled]]) -> None:
        announce_reconciled(self._source, *changed)


class Expire:
    """Expire rows past ``expires_at`` that are not due yet (due ones the claim expires)."""

    interval = 30.0  # seconds between scans

    def __init__(self, source: Any) -> None:
        self._source = source

    def run_once(self, conn: sa.Connection, now: datetime) -> list[store.Expired]:
        return store.expire(conn, now=now)

    def announce(self, expired: list[store.Expired]) -> None:
        announce_expired(self._source, expired)


class Maintenance:
    """Runs each service when its interval has passed, in a transaction of its own, always
    after the pass saved what finished (so a relay never sweeps its own finished sends)."""

    def __init__(
        self, source: Any, relay_id: str, connection: LoopConnection, rng: random.Random
    ) -> None:
        self._connection = connection
        self.sweep = Sweep(source, relay_id, rng)
        self.reconcile = Reconcile(source, relay_id)
        self.expire = Expire(source)
        self.services = (self.sweep, self.reconcile, self.expire)
        self._last_sweep = -float("inf")  # monotonic
        self._last_reconcile = -float("inf")
        self._last_expire = 0.0

    def tick(self, now: datetime) -> bool:
        """Sweep (and reconcile) when due, then expire; True if anything changed."""
        busy = self._sweep(now)
        self._expire(now)
        return busy

    def _sweep(self, now: datetime) -> bool:
        mono = time.monotonic()
        if mono - self._last_sweep < Sweep.interval or mono < self._connection.sweep_from:
            return False
        self._last_sweep = mono
        with self._connection.transaction() as conn:
            swept = self.sweep.run_once(conn, now)
        self.sweep.announce(swept)
        return self._reconcile(now) or bool(swept)

    def _reconcile(self, now: datetime) -> bool:
        """A statement error is logged and tried again next interval: a broken reconcile
        must not stop sending."""
        mono = time.monotonic()
        if mono - self._last_reconcile < Reconcile.interval:
            return False
        self._last_reconcile = mono
        try:
            with self._connection.transaction() as conn:
                changed = self.reconcile.run_once(conn, now)
        except sa.exc.DBAPIError as exc:
            if self._connection.is_outage(exc):
                raise
            _log.error(
                "reconcile failed: %s",
                exc.orig if exc.orig is not None else exc,
                extra={"action": "reconcile_failed"},
            )
            return False
        self.reconcile.announce(changed)
        return bool(changed[0] or changed[1])

    def _expire(self, now: datetime) -> None:
        if time.monotonic() - self._last_expire < Expire.interval:
            return
        with self._connection.transaction() as conn:
            gone = self.expire.run_once(conn, now)
        self._last_expire = time.monotonic()
        self.expire.announce(gone)
