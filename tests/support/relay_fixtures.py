"""The fixtures of tests that run the relay for real, registered from ``tests/conftest.py``.

``moto`` is one moto server for the whole session (started by the first test that takes it),
emptied for every test that takes it: nothing sent, only the shop's sender verified.
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

__all__ = ["moto", "relays"]


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
def relays(server_backend: Backend, tmp_path: Path) -> Iterator[Relays]:
    """Relay processes on ``server_backend`` sending through the fake sender, which records
    every send in ``tmp_path / "sent.log"``; whatever still runs is killed afterwards."""
    started = Relays(url=server_backend.url, workdir=tmp_path, record=tmp_path / "sent.log")
    yield started
    started.kill_all()
