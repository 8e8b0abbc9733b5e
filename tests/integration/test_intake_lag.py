"""The intake's lag gauge believes an event's own time only up to a minute past its receipt, on
SQLite, PostgreSQL and MariaDB: SES's clock and the database's differ by well under that, so a
later stamp is forged (anyone who may publish to the topic can write one) and must not make an
intake that is an hour behind read as one with no lag."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta

import pytest

from relay.clock import read_database_time
from relay.events import parse
from relay.intake import Effect, apply_events
from relay.metrics import FUTURE_TOLERANCE_SECONDS, _read_intake
from tests.support.db import Backend
from tests.support.sqs import ses_event, sns_body


def receive(backend: Backend, *, at: datetime, now: datetime) -> None:
    """An untagged Delivery of other mail that happened at ``at``, received at ``now``."""
    event = ses_event(
        "delivery", provider_id=f"ses-{uuid.uuid4()}", mail_at=at - timedelta(seconds=1), at=at
    )
    with backend.engine.begin() as conn:
        [done] = apply_events(conn, [parse(sns_body(event))], now=now)
    assert done.effect is Effect.UNMATCHED


def lag(backend: Backend) -> float | None:
    with backend.engine.connect() as conn:
        return _read_intake(conn).lag_seconds


def test_an_event_stamped_within_the_tolerance_counts_and_one_beyond_it_does_not(
    backend: Backend,
) -> None:
    with backend.engine.connect() as conn:
        now = read_database_time(conn)
    receive(backend, at=now - timedelta(minutes=30), now=now)
    assert lag(backend) == pytest.approx(1800, abs=30)
    # a day ahead: forged; the honest newest event still says where the intake is
    receive(backend, at=now + timedelta(days=1), now=now)
    assert lag(backend) == pytest.approx(1800, abs=30)
    # SES's clock a little ahead of the database's: believed, the lag reads as none
    receive(backend, at=now + timedelta(seconds=FUTURE_TOLERANCE_SECONDS - 20), now=now)
    assert lag(backend) == 0.0


def test_forged_events_alone_leave_no_lag_rather_than_none(backend: Backend) -> None:
    """With only future-stamped events received, nothing says how far behind the intake is:
    no reading, never a lag of zero."""
    with backend.engine.connect() as conn:
        now = read_database_time(conn)
    receive(backend, at=now + timedelta(seconds=FUTURE_TOLERANCE_SECONDS + 120), now=now)
    assert lag(backend) is None
    receive(backend, at=now - timedelta(minutes=10), now=now)
    assert lag(backend) == pytest.approx(600, abs=30)
