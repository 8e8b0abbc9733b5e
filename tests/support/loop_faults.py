"""Faults a test injects into an in-process relay's loop that a real server cannot be timed
to produce."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from datetime import datetime

import pytest
import sqlalchemy as sa

from relay.worker import Relay

__all__ = ["commit_unseen_once"]


def commit_unseen_once(relay: Relay, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the relay's next pass commit its claims and send-started marks, then see the
    connection drop, as when a server's answer to COMMIT is lost.

    That fault cannot be timed against a real server, so the relay's transaction is wrapped:
    the real COMMIT runs, then an OperationalError is raised, once, for the pass's exchange."""
    real_transaction, real_exchange = relay.connection.transaction, relay.producer.exchange
    state = {"exchange": False, "left": 1}

    @contextlib.contextmanager
    def transaction() -> Iterator[sa.Connection]:
        with real_transaction() as conn:
            yield conn
        if state["exchange"] and state["left"]:
            state["left"] = 0
            relay.connection.drop()
            raise sa.exc.OperationalError(
                "COMMIT", {}, ConnectionResetError("server closed the connection unexpectedly")
            )

    def exchange(now: datetime) -> bool:
        state["exchange"] = True
        try:
            return real_exchange(now)
        finally:
            state["exchange"] = False

    monkeypatch.setattr(relay.connection, "transaction", transaction)
    monkeypatch.setattr(relay.producer, "exchange", exchange)
