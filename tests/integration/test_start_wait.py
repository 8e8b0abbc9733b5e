"""The relay's wait for its database at start-up: each failed try backs off, and a stop ends
the wait at once, with no further try of the database."""

from __future__ import annotations

import itertools
import threading
import time

from relay.db import make_engine
from relay.testing import FakeSender
from tests.support.inprocess import relay_for
from tests.support.waiting import wait_for

REFUSED = "postgresql+psycopg://postgres@127.0.0.1:1/outbox"  # nothing listens on port 1


def test_a_stop_during_the_start_wait_ends_it_without_another_try():
    engine = make_engine(REFUSED)
    relay = relay_for(None, FakeSender(), engine=engine, url=REFUSED)
    tries: list[float] = []
    with_db = relay.connection.guard

    def counted(work, *args):
        if work == relay.registry.check_schema:
            tries.append(time.monotonic())
        return with_db(work, *args)

    relay.connection.guard = counted
    thread = threading.Thread(target=relay.run, name="relay-start-wait", daemon=True)
    try:
        thread.start()
        wait_for(lambda: len(tries) >= 3, timeout=20, what="three tries of the database")
        waiting_since = relay.waiting_at
        assert waiting_since is not None
        assert waiting_since >= tries[-1] - 0.5
        gaps = [later - earlier for earlier, later in itertools.pairwise(tries)]
        assert all(gap >= 0.05 for gap in gaps), f"the tries did not back off: {gaps}"
        asked = time.monotonic()
        relay.request_stop()
        thread.join(5)
        stopped = time.monotonic() - asked
    finally:
        relay.request_stop()
        thread.join(10)
        engine.dispose()
    assert not thread.is_alive()
    assert stopped < 1.0, f"the stop waited {stopped:.2f} s for the backoff"
    assert all(at <= asked for at in tries), "the database was tried again after the stop"
    assert relay.waiting_at is None
