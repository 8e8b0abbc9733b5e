"""Clocks a test moves by hand, for code that takes its clock as an argument."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

__all__ = ["Clock", "Monotonic"]


class Clock:
    """A wall clock (aware datetimes) that moves only when the test says: from ``now``, or
    from the time it was made."""

    def __init__(self, now: datetime | None = None) -> None:
        self.now = now if now is not None else datetime.now(UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock ``seconds`` on."""
        self.now += timedelta(seconds=seconds)

    def later(self, seconds: float) -> Clock:
        """Another clock, ``seconds`` ahead of this one."""
        return Clock(self.now + timedelta(seconds=seconds))


class Monotonic:
    """A monotonic clock (float seconds) that moves only when the test says, or by ``step``
    per reading."""

    def __init__(self, start: float = 500.0, step: float = 0.0) -> None:
        self.now = start
        self.step = step

    def __call__(self) -> float:
        value = self.now
        self.now += self.step
        return value
