"""A send-rate limit in recipients per second, enforced over every sliding one-second window."""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable

__all__ = ["SlidingWindowLimiter"]


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
        self.rate = rate
        self.window = window
        self._clock = clock
        self._log: collections.deque[tuple[float, int]] = collections.deque()
        self._used = 0

    def _trim(self, now: float) -> None:
        while self._log and self._log[0][0] <= now - self.window:
            self._used -= self._log.popleft()[1]

    def available(self) -> float:
        """How many recipients may be sent right now."""
        if self.rate is None:
            return math.inf
        self._trim(self._clock())
        return max(0.0, self.rate - self._used)

    def try_take(self, recipients: int) -> bool:
        """Take ``recipients`` if the window allows it now. A message with more recipients
        than the whole rate is let through alone in an otherwise empty window."""
        if self.rate is None:
            return True
        now = self._clock()
        self._trim(now)
        if self._used + recipients > self.rate and self._used > 0:
            return False
        self._log.append((now, recipients))
        self._used += recipients
        return True

    def seconds_until_available(self) -> float:
        """How long until some capacity frees up (0 when there is some now)."""
        if self.rate is None or self.available() >= 1:
            return 0.0
        return max(0.0, self._log[0][0] + self.window - self._clock()) if self._log else 0.0
