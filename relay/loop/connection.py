"""The loop's own database connection: its transactions, the outage rule, the backoff."""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import sqlalchemy as sa
from sqlalchemy.pool import SingletonThreadPool, StaticPool

from relay.clock import DatabaseClock
from relay.config import RelayConfig
from relay.db import is_outage, retry_delay

__all__ = ["LoopConnection"]

_log = logging.getLogger("relay")


class LoopConnection:
    """One connection kept between passes (no pool checkout, no liveness ping per
    transaction), dropped after any error so the next transaction starts on a fresh one."""

    def __init__(
        self,
        engine: sa.Engine,
        config: RelayConfig,
        db_clock: DatabaseClock | None,
        rng: random.Random,
    ) -> None:
        self.engine = engine
        self.config = config
        self._db_clock = db_clock
        self._rng = rng
        self.conn: sa.Connection | None = None
        self.failures = 0  # database errors in a row
        self.sweep_from = 0.0  # monotonic: no sweep before (after a database outage)

    is_outage = staticmethod(is_outage)  # the loop's rule: try the whole pass again

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sa.Connection]:
        """One transaction on the loop's connection."""
        if self.conn is None:
            conn = self.engine.connect()
            try:
                _end_idle_transactions(conn, self.config.lease_seconds)
                if self._db_clock is not None:
                    self._db_clock.sample(conn)  # a new connection may be a new server
                    conn.commit()
            except BaseException:
                _discard(conn)
                raise
            self.conn = conn
        try:
            with self.conn.begin():
                yield self.conn
        except BaseException:
            self.drop()
            raise

    def drop(self) -> None:
        """Close the connection for good (it carries a session setting of its own, so it
        does not go back to the pool)."""
        conn, self.conn = self.conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                _discard(conn)
            with contextlib.suppress(Exception):
                conn.close()

    def guard(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn``; on a database error log it and return None (the loop backs off)."""
        try:
            result = fn()
        except sa.exc.DBAPIError as exc:
            self.failures += 1
            self.sweep_from = math.inf  # no sweep until reconnected and the others had time
            _log.warning(
                "database error: %s",
                exc.orig if exc.orig is not None else exc,
                extra={"action": "db_error", "failures": self.failures},
            )
            return None
        if self.failures:
            # back after an outage: the other relays are coming back too (each within one
            # backoff, at most a heartbeat interval), and need a moment to save and renew
            # what they hold before anyone sweeps it
            self.sweep_from = time.monotonic() + 2 * self.config.heartbeat_interval
        self.failures = 0
        return True if result is None else result

    def backoff(self) -> float:
        """At most a heartbeat interval: after an outage every relay is back within one,
        before anyone's sweep (which waits two) can take its sends."""
        cap = min(30.0, self.config.heartbeat_interval)
        return retry_delay(self.failures, self._rng, cap=cap)


def _discard(conn: sa.Connection) -> None:
    """Invalidate ``conn``, so its session settings never go back to the pool; except in a
    pool of one shared connection (``StaticPool``, ``SingletonThreadPool``: SQLite
    ``:memory:``, a test's database), where that would destroy the database it holds."""
    if not isinstance(conn.engine.pool, StaticPool | SingletonThreadPool):
        conn.invalidate()


def _end_idle_transactions(conn: sa.Connection, seconds: float) -> None:
    """Have the server end this session's transaction if it sits idle for ``seconds`` (the
    lease), so a relay frozen inside a transaction cannot keep its rows locked out of every
    other relay's sweep (docs/design.md, Decisions: "The server ends a frozen relay's
    transaction"). MySQL has no such setting: there ``wait_timeout`` is set to the lease,
    which a live loop never reaches."""
    timeout = max(1, math.ceil(seconds))
    if conn.dialect.name == "postgresql":
        conn.exec_driver_sql(
            f"SET idle_in_transaction_session_timeout = {max(1, int(seconds * 1000))}"
        )
    elif getattr(conn.dialect, "is_mariadb", False):
        conn.exec_driver_sql(f"SET SESSION idle_transaction_timeout = {timeout}")
    elif conn.dialect.name == "mysql":
        conn.exec_driver_sql(f"SET SESSION wait_timeout = {timeout}")
    conn.commit()
