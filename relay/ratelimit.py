"""A send-rate limit in recipients per second, enforced over every sliding one-second window."""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable

__all__ = ["RateController", "SlidingWindowLimiter"]


class SlidingWindowLimiter:
    """Allows at most ``rate`` recipients in any window of ``window`` seconds.

    A token bucket would let twice the rate through in one second (a full bucket, then its
    refill); SES measures per second, so the relay keeps a log of recent sends instead.
    ``rate=None`` means no limit. Used from the relay's main thread only.
    """

    def __init__(
        self,
        rate: float | None,
        *,
        window: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.base_window = window
        self._clock = clock
        self._log: collections.deque[list[float]] = collections.deque()
        self._used = 0.0
        self.rate = rate

    @property
    def rate(self) -> float | None:
        return self._rate

    @rate.setter
    def rate(self, value: float | None) -> None:
        """A rate below one per window widens the window, so 0.25/s means one per 4 s."""
        self._rate = value
        self.window = self.base_window if not value or value >= 1 else self.base_window / value
        self._capacity = None if value is None else value * self.window / self.base_window

    def _trim(self, now: float) -> None:
        while self._log and self._log[0][0] <= now - self.window:
            self._used -= self._log.popleft()[1]

    def available(self) -> float:
        """How many recipients may be sent right now."""
        if self._capacity is None:
            return math.inf
        self._trim(self._clock())
        return max(0.0, self._capacity - self._used)

    def try_take(self, recipients: int) -> bool:
        """Take ``recipients`` if the window allows it now. A message with more recipients
        than the whole rate is let through alone in an otherwise empty window."""
        return self.take(recipients) is not None

    def take(self, recipients: int) -> list[float] | None:
        """Like :meth:`try_take`, returning a ticket for :meth:`started` (None if refused)."""
        if self._capacity is None:
            return [0.0, 0.0]
        now = self._clock()
        self._trim(now)
        if self._used + recipients > self._capacity and self._used > 0:
            return None
        ticket = [now, float(recipients)]
        self._log.append(ticket)
        self._used += recipients
        return ticket

    def started(self, ticket: list[float]) -> None:
        """The send behind ``ticket`` really starts now (a worker thread picked it up later
        than it was taken): count it from now, so the provider never sees more than the rate
        in any second. Safe from another thread; only ever makes the limit stricter."""
        ticket[0] = max(ticket[0], self._clock())

    def seconds_until_available(self) -> float:
        """How long until some capacity frees up (0 when there is some now)."""
        if self._capacity is None or self.available() >= 1:
            return 0.0
        return max(0.0, self._log[0][0] + self.window - self._clock()) if self._log else 0.0


class RateController:
    """Sets a relay's share of the send rate, and adapts it to throttling.

    The configured total is split evenly between the live relays (``set_replicas``, from the
    heartbeats in ``outbox_relays``), so N replicas together stay within it. A throttling
    answer halves this relay's rate; every second without one gives back 5% of its share
    (additive increase, multiplicative decrease).
    """

    DECREASE = 0.5
    RECOVERY_PER_SECOND = 0.05
    FLOOR = 0.05  # never below 5% of the share: throttling must not stop sending outright

    def __init__(
        self,
        limiter: SlidingWindowLimiter,
        total: float | None,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limiter = limiter
        self.total = total
        self.replicas = 1
        self.factor = 1.0
        self._clock = clock
        self._last = clock()
        self._apply()

    @property
    def share(self) -> float | None:
        return None if self.total is None else self.total / self.replicas

    def set_total(self, total: float | None) -> None:
        self.total = total
        self._apply()

    def set_replicas(self, replicas: int) -> None:
        self.replicas = max(1, replicas)
        self._apply()

    def on_throttle(self) -> None:
        self.factor = max(self.FLOOR, self.factor * self.DECREASE)
        self._last = self._clock()
        self._apply()

    def tick(self) -> None:
        now = self._clock()
        if self.factor < 1.0:
            self.factor = min(1.0, self.factor + self.RECOVERY_PER_SECOND * (now - self._last))
            self._apply()
        self._last = now

    def _apply(self) -> None:
        share = self.share
        self.limiter.rate = None if share is None else share * self.factor
