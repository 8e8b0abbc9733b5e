"""PostgreSQL NOTIFY wakes an idle relay: commit-to-send latency far below the poll interval."""

from __future__ import annotations

import statistics
import threading
import time

import sqlalchemy as sa
from sqlalchemy.orm import Session

from outbox import Email, Outbox
from relay.config import RelayConfig
from relay.senders import Accepted, OutgoingMessage
from relay.testing import FakeSender
from relay.wakeup import Listener
from relay.worker import Relay

POLL_INTERVAL = 5.0


def test_notify_wakes_the_relay_well_before_the_next_poll(postgres_backend):
    started: dict[int, float] = {}

    def record(message: OutgoingMessage):
        started[message.id] = time.monotonic()
        return Accepted(provider_message_id="x")

    config = RelayConfig(
        database_url=postgres_backend.url, poll_interval=POLL_INTERVAL, relay_id="w"
    )
    relay = Relay(engine=postgres_backend.engine, sender=FakeSender(record), config=config)
    listener = Listener.for_engine(postgres_backend.engine, relay.wake)
    assert listener is not None
    runner = threading.Thread(target=relay.run)
    listener.start()
    runner.start()
    ob = Outbox()
    latencies = []
    try:
        time.sleep(0.5)  # let the relay reach its idle wait and the listener its LISTEN
        for n in range(15):
            with Session(postgres_backend.engine) as session:
                result = ob.enqueue(
                    session,
                    Email(sender="a@example.com", to=["b@example.com"], subject=f"n{n}", text="t"),
                )
                session.commit()
                committed = time.monotonic()
            deadline = committed + POLL_INTERVAL
            while result.id not in started and time.monotonic() < deadline:
                time.sleep(0.001)
            assert result.id in started, "not sent before the poll interval passed"
            latencies.append(started[result.id] - committed)
            time.sleep(0.05)
    finally:
        relay.request_stop()
        listener.stop()
        runner.join(10)
    p50 = statistics.median(latencies)
    worst = max(latencies)
    print(
        f"\ncommit-to-send-start with NOTIFY: p50 {p50 * 1000:.1f} ms, "
        f"max {worst * 1000:.1f} ms (poll interval {POLL_INTERVAL:.0f} s)"
    )
    assert p50 < 0.1
    assert worst < POLL_INTERVAL / 5


def test_the_listener_connects_with_a_url_whose_options_hold_a_space(postgres_backend):
    """``?options=-c%20timezone%3D...`` (a session setting in the URL) used to be rendered back
    into a libpq URI with ``+`` for the space: the server refused ``+timezone``, the listener
    never connected, and the relay fell back to polling with a warning every backoff."""
    url = sa.make_url(postgres_backend.url).update_query_dict(
        {"options": "-c timezone=Asia/Kolkata"}
    )
    engine = sa.create_engine(url)
    woken = threading.Semaphore(0)
    listener = Listener.for_engine(engine, woken.release)
    assert listener is not None
    listener.start()
    try:
        assert woken.acquire(timeout=20), "the listener did not connect"  # its catch-up call
        with Session(engine) as session:
            Outbox().enqueue(
                session, Email(sender="a@example.com", to=["b@example.com"], subject="s", text="t")
            )
            session.commit()
        assert woken.acquire(timeout=20), "the commit's NOTIFY did not arrive"
    finally:
        listener.stop()
        engine.dispose()
