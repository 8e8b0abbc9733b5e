"""The suite's fixtures come from :mod:`tests.support.fixtures` and
:mod:`tests.support.relay_fixtures`; shared helpers live in :mod:`tests.support` and are
imported from there, never from here or from a test module."""

pytest_plugins = ["tests.support.fixtures", "tests.support.relay_fixtures"]
