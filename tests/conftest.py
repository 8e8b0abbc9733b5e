"""The suite's fixtures come from :mod:`tests.support.fixtures`; shared helpers live in
:mod:`tests.support` and are imported from there, never from here or from a test module."""

from __future__ import annotations

from tests.support.db import CI, Backend, Order, User
from tests.support.db import emptied as _emptied

__all__ = ["CI", "Backend", "Order", "User", "_emptied"]  # until every importer has moved

pytest_plugins = ["tests.support.fixtures", "tests.support.relay_fixtures"]
