"""The SES fixtures, registered from ``tests/conftest.py``.

``moto`` is one moto server for the whole session (started by the first test that takes it),
emptied for every test that takes it: nothing sent, only the shop's sender verified.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.ses import MotoSes

__all__ = ["moto"]


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
