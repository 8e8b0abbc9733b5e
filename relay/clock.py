"""The clock every relay shares: the database's.

Relay hosts' clocks can be wrong by minutes (an NTP step, a VM resumed from a snapshot, a
container on a host whose clock drifts). Anything compared across relays (lease expiry, the
sweep's cut-off, heartbeats, the live-relay count, the shared send budget) is therefore
measured on the database's clock. Reading it on every use would cost a round trip per
statement, so :class:`DatabaseClock` reads it now and then and advances the reading with
``time.monotonic`` in between: a step of the host's wall clock never moves it, and the drift of
a monotonic clock over the resampling interval is microseconds. The error of a reading is at
most half the round trip of the query that took it, so each sample takes a few readings and
keeps the one with the shortest round trip (as NTP does): one stalled query cannot skew the
clock a relay books sends and sweeps with.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import sqlalchemy as sa

__all__ = ["RESAMPLE_SECONDS", "DatabaseClock", "read_database_time"]

RESAMPLE_SECONDS = 10.0  # how often the relay reads the database's clock again
_READINGS = 3  # per sample; the one with the shortest round trip is kept


def read_database_time(conn: sa.Connection) -> datetime:
    """The database server's current time, as an aware UTC datetime (one round trip).

    PostgreSQL: ``clock_timestamp()`` (``now()`` is the transaction's start); MySQL/MariaDB:
    ``UTC_TIMESTAMP(6)``; SQLite: its ``'now'``, which is the host's clock (SQLite has no
    server: every relay on it runs on that host)."""
    name = conn.dialect.name
    if name == "postgresql":
        value = conn.exec_driver_sql("SELECT clock_timestamp()").scalar_one()
    elif name in ("mysql", "mariadb"):
        value = conn.exec_driver_sql("SELECT UTC_TIMESTAMP(6)").scalar_one()
    else:
        text = conn.exec_driver_sql("SELECT strftime('%Y-%m-%d %H:%M:%f', 'now')").scalar_one()
        value = datetime.fromisoformat(str(text))
    if not isinstance(value, datetime):
        raise TypeError(f"the database returned {value!r} for its current time")
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class DatabaseClock:
    """``clock()`` is the database's time, advanced by the monotonic clock since the last
    reading. Call :meth:`sample` with a connection to take a reading; :meth:`stale` says when
    one is due. Thread-safe: send threads read it too."""

    def __init__(
        self,
        *,
        resample: float = RESAMPLE_SECONDS,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._resample = resample
        self._monotonic = monotonic
        self._lock = threading.Lock()
        self._anchor: tuple[datetime, float] | None = None  # (database time, monotonic time)
        self.error = 0.0  # seconds: at most this far from the database's clock (half a trip)

    @property
    def synced(self) -> bool:
        """True once a reading has been taken."""
        return self._anchor is not None

    def stale(self) -> bool:
        """True when no reading was taken, or the last is older than the resample interval."""
        anchor = self._anchor
        return anchor is None or self._monotonic() - anchor[1] >= self._resample

    def sample(self, conn: sa.Connection, readings: int = _READINGS) -> datetime:
        """Read the database's clock on ``conn`` ``readings`` times and anchor to the reading
        with the shortest round trip; returns that reading. ``error`` is then half its round
        trip."""
        best: tuple[float, datetime, float] | None = None
        for _ in range(max(1, readings)):
            before = self._monotonic()
            value = read_database_time(conn)
            after = self._monotonic()
            if best is None or after - before < best[0]:
                best = (after - before, value, (before + after) / 2)
        assert best is not None
        trip, value, mono = best
        with self._lock:
            self._anchor = (value, mono)
            self.error = trip / 2
        return value

    def __call__(self) -> datetime:
        anchor = self._anchor
        if anchor is None:
            raise RuntimeError("the database clock has not been read yet (call sample first)")
        at, mono = anchor
        return at + timedelta(seconds=self._monotonic() - mono)

    def to_monotonic(self, when: datetime) -> float:
        """The monotonic time at which this clock will read ``when``."""
        anchor = self._anchor
        if anchor is None:
            raise RuntimeError("the database clock has not been read yet (call sample first)")
        at, mono = anchor
        return mono + (when - at).total_seconds()
