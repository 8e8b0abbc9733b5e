"""Shared test support: database backends, factories, waiting and the fault servers.

Tests take these as fixtures (registered from ``tests/conftest.py`` through
``tests.support.fixtures``) or import the plain functions from the modules here; no test
module imports another test module or ``conftest``.
"""
