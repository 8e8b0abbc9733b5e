"""Low-latency wake-up on PostgreSQL: LISTEN for the outbox's NOTIFY on a dedicated connection.

Polling stays the fallback everywhere; this only shortens the wait. The listener reconnects
with backoff on its own and never stops the relay.
"""

from __future__ import annotations

import logging
import random
import threading
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from outbox.enqueue import NOTIFY_CHANNEL

__all__ = ["Listener"]

_log = logging.getLogger("relay")


class Listener:
    """Calls ``on_notify`` whenever a transaction that enqueued commits."""

    def __init__(self, params: dict[str, Any], on_notify: Callable[[], None]) -> None:
        self._params = params
        self._on_notify = on_notify
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="outbox-listen", daemon=True)

    @classmethod
    def for_engine(cls, engine: sa.Engine, on_notify: Callable[[], None]) -> Listener | None:
        """A listener for a PostgreSQL engine when psycopg is installed, else None."""
        if engine.dialect.name != "postgresql":
            return None
        try:
            import psycopg  # noqa: F401
        except ImportError:
            _log.info("psycopg not installed: polling only", extra={"action": "no_listen"})
            return None
        return cls(_connect_params(engine), on_notify)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        import psycopg

        failures = 0
        while not self._stop.is_set():
            try:
                with psycopg.connect(**self._params, autocommit=True) as conn:
                    conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                    failures = 0
                    self._on_notify()  # catch up on anything committed while disconnected
                    while not self._stop.is_set():
                        for _ in conn.notifies(timeout=1.0):
                            self._on_notify()
            except psycopg.Error as exc:
                failures += 1
                delay = min(30.0, 0.5 * 2.0 ** min(failures, 6)) * random.uniform(0.5, 1.0)
                _log.warning("LISTEN connection lost: %s", exc, extra={"action": "listen_error"})
                self._stop.wait(delay)


def _connect_params(engine: sa.Engine) -> dict[str, Any]:
    """The parameters the engine's own dialect connects with, as SQLAlchemy decodes the URL: a
    URL rendered back to a libpq URI keeps the query's ``+`` for a space, so ``options=-c
    timezone=...`` reached the server as ``+timezone`` and the listener never connected."""
    _, params = engine.dialect.create_connect_args(engine.url)
    params.pop("context", None)  # the psycopg dialect's adapters, not a libpq parameter
    return dict(params)
