"""relay.clock.DatabaseClock: the database's time, read now and then and carried forward on
the monotonic clock, so the relay host's wall clock never enters anything shared."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from relay.clock import RESAMPLE_SECONDS, DatabaseClock, read_database_time
from relay.config import RelayConfig
from relay.testing import FakeSender
from relay.worker import Relay
from tests.support.hand_clocks import Monotonic


@pytest.fixture
def conn():
    engine = sa.create_engine("sqlite://")
    with engine.connect() as connection:
        yield connection
    engine.dispose()


def test_before_its_first_reading_the_clock_refuses_to_guess():
    clock = DatabaseClock(monotonic=Monotonic())
    assert not clock.synced
    assert clock.stale()
    with pytest.raises(RuntimeError, match="not been read"):
        clock()
    with pytest.raises(RuntimeError, match="not been read"):
        clock.to_monotonic(datetime.now(UTC))


def test_a_reading_is_the_database_time_carried_forward_by_the_monotonic_clock(conn):
    mono = Monotonic()
    clock = DatabaseClock(monotonic=mono)
    reading = clock.sample(conn)
    assert clock.synced
    assert reading.tzinfo is UTC
    assert abs(reading - datetime.now(UTC)) < timedelta(seconds=1)
    assert clock() == reading
    mono.now += 7.25
    assert clock() == reading + timedelta(seconds=7.25)
    assert clock.to_monotonic(reading + timedelta(seconds=10)) == pytest.approx(510.0)


def test_the_reading_is_anchored_halfway_through_its_round_trip(conn):
    mono = Monotonic(start=100.0, step=2.0)  # before: 100, after: 102
    clock = DatabaseClock(monotonic=mono)
    reading = clock.sample(conn)
    mono.step = 0.0
    mono.now = 105.0
    assert clock() == reading + timedelta(seconds=4)  # anchored at 101


def test_a_step_of_the_wall_clock_does_not_move_it(conn, monkeypatch):
    mono = Monotonic()
    clock = DatabaseClock(monotonic=mono)
    reading = clock.sample(conn)

    class SteppedBack(datetime):
        @classmethod
        def now(cls, tz=None):
            return datetime.fromtimestamp(0, tz)

    monkeypatch.setattr("time.time", lambda: 0.0)
    monkeypatch.setattr("relay.clock.datetime", SteppedBack)
    mono.now += 1
    assert clock() == reading + timedelta(seconds=1)


def test_it_asks_to_be_read_again_after_the_resample_interval(conn):
    mono = Monotonic()
    clock = DatabaseClock(resample=5.0, monotonic=mono)
    clock.sample(conn)
    mono.now += 4.9
    assert not clock.stale()
    mono.now += 0.1
    assert clock.stale()
    clock.sample(conn)
    assert not clock.stale()
    assert RESAMPLE_SECONDS > 0


def test_read_database_time_on_sqlite_is_aware_utc(conn):
    value = read_database_time(conn)
    assert value.tzinfo is UTC
    assert abs(value - datetime.now(UTC)) < timedelta(seconds=1)


def test_a_relay_without_a_clock_uses_the_databases(tmp_path):
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'outbox.db'}")
    config = RelayConfig(database_url=str(engine.url), relay_id="clock-test")
    relay = Relay(engine=engine, sender=FakeSender(), config=config)
    try:
        assert isinstance(relay.clock, DatabaseClock)
    finally:
        relay.dispatch.pool.shutdown()
        engine.dispose()


class Stalling(Monotonic):
    """The first reading's round trip takes ``stall`` seconds (a stalled statement); the
    others are quick."""

    def __init__(self, stall: float) -> None:
        super().__init__(start=100.0)
        self.calls = 0
        self.stall = stall

    def __call__(self) -> float:
        self.calls += 1
        if self.calls == 2:  # the "after" of the first reading
            self.now += self.stall
        else:
            self.now += 0.001
        return self.now


def test_a_stalled_reading_is_not_the_one_kept(conn):
    """One slow round trip would put the anchor up to half of it off the database's clock,
    enough to crowd a second of the send budget: the quickest of the readings is kept."""
    mono = Stalling(stall=0.3)
    clock = DatabaseClock(monotonic=mono)
    clock.sample(conn)
    assert mono.calls == 6  # three readings
    assert clock.error == pytest.approx(0.0005)
    assert clock.error < 0.01
