"""Senders for the benchmarks: no network, but the full SES request is still built."""

from __future__ import annotations

import threading
import time

from relay.senders import Accepted, BaseSender, Outcome, OutgoingMessage
from relay.senders.ses import build_request

__all__ = ["AcceptingSender", "accepting_sender"]


class AcceptingSender(BaseSender):
    """Builds the ``SendEmail`` request, optionally sleeps ``latency`` seconds (a simulated
    provider call), records when each send started, and accepts."""

    name = "bench"

    def __init__(self, latency: float = 0.0, *, record: bool = False) -> None:
        self.latency = latency
        self.record = record
        self.started: dict[str, float] = {}  # key -> time.monotonic() at send start
        self.starts: list[float] = []
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)

    def send(self, message: OutgoingMessage) -> Outcome:
        began = time.monotonic()
        if self.record:
            with self._lock:
                self.started[message.key] = began
                self.starts.append(began)
                self._arrived.notify_all()
        request = build_request(message)
        if self.latency:
            time.sleep(self.latency)
        return Accepted(provider_message_id=f"bench-{message.id}-{len(request)}")

    def wait_for(self, key: str, timeout: float) -> float | None:
        """The monotonic time ``key``'s send started, waiting up to ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while key not in self.started:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._arrived.wait(left)
            return self.started[key]


def accepting_sender() -> AcceptingSender:
    """Factory for ``outbox-relay run --sender bench.senders:accepting_sender``."""
    return AcceptingSender()
