"""What wakes the overview's live counts before their next poll: on PostgreSQL, the NOTIFY a
transaction that enqueued sends on commit, heard by one listener per console process while
any live page is open (``relay.wakeup``'s, as the relay hears it). Elsewhere, and for what
sends no NOTIFY (a relay's sends), the poll."""

from __future__ import annotations

import asyncio
import threading

import sqlalchemy as sa

from relay.wakeup import Listener

__all__ = ["LiveWake"]


class LiveWake:
    """One :class:`asyncio.Event` per open live stream, set when the outbox is notified."""

    def __init__(self, engine: sa.Engine) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._events: set[asyncio.Event] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener: Listener | None = None

    @property
    def listening(self) -> bool:
        return self._listener is not None

    def open(self) -> asyncio.Event:
        """A new stream's event; the first starts the listener (PostgreSQL only)."""
        event = asyncio.Event()
        with self._lock:
            self._events.add(event)
            if self._listener is None and len(self._events) == 1:
                self._loop = asyncio.get_running_loop()
                self._listener = Listener.for_engine(self._engine, self._notified)
                if self._listener is not None:
                    self._listener.start()
        return event

    def close(self, event: asyncio.Event) -> None:
        """A stream ended; the last one stops the listener and frees its connection."""
        with self._lock:
            self._events.discard(event)
            if not self._events and self._listener is not None:
                self._listener.stop()
                self._listener = None

    def _notified(self) -> None:
        # the listener's thread: hand the wake-up to the event loop's own
        with self._lock:
            loop, events = self._loop, list(self._events)
        if loop is not None:
            for event in events:
                loop.call_soon_threadsafe(event.set)
