"""The fixtures of tests that run the relay for real, registered from ``tests/conftest.py``.

``moto`` is one moto server for the whole session (started by the first test that takes it),
emptied for every test that takes it: nothing sent, only the shop's sender verified.
``event_queue`` is a fresh SQS queue with its dead-letter queue, subscribed to a fresh SNS
topic on that moto server, for a :class:`~tests.support.ses.FaultServer` to publish SES events
to (``FaultServer(moto.url, plan, events=event_queue)``).
``relays`` starts relay processes with the fake sender on ``server_backend`` and kills what
still runs when the test ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.db import Backend
from tests.support.relays import Relays
from tests.support.ses import MotoSes
from tests.support.ses_events import EventQueue

__all__ = ["event_queue", "moto", "relays"]


@pytest.fixture(scope="session")
def _moto_server() -> Iterator[MotoSes]:
    """moto's server on a free local port, for the session."""
    server = MotoSes()
    yield server
    server.stop()


@pytest.fixture
def moto(_moto_server: MotoSes) -> MotoSes:
    """moto's SES (v1 and v2) as if started for this test: reset, the sender verified again."""
    _moto_server.reset()
    return _moto_server


@pytest.fixture
def event_queue(moto: MotoSes) -> EventQueue:
    """SES event publishing's destination as the README sets it up, on moto: an SNS topic, an
    SQS queue subscribed to it (SNS envelope, not raw), a dead-letter queue taking a message
    after 3 receives, and a 2 s visibility timeout so a message a consumer did not delete is
    seen again quickly. The ``moto`` reset of the next test removes them."""
    return EventQueue.create(moto.url)


@pytest.fixture
def relays(server_backend: Backend, tmp_path: Path) -> Iterator[Relays]:
    """Relay processes on ``server_backend`` sending through the fake sender, which records
    every send in ``tmp_path / "sent.log"``; whatever still runs is killed afterwards."""
    started = Relays(url=server_backend.url, workdir=tmp_path, record=tmp_path / "sent.log")
    yield started
    started.kill_all()
