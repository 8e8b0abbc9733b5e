"""Pieces shared by the ``outbox-relay`` commands: options with ``OUTBOX_*`` variables, and
the engine they open."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click
import sqlalchemy as sa
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from relay.db import make_engine

__all__ = ["database_url", "open_engine", "option"]

F = TypeVar("F", bound=Callable[..., Any])


def option(name: str, **kw: Any) -> Callable[[F], F]:
    """A click option also read from ``OUTBOX_<NAME>`` (shown in ``--help``)."""
    env = "OUTBOX_" + name.lstrip("-").replace("-", "_").upper()
    kw.setdefault("show_default", True)
    return click.option(name, envvar=env, show_envvar=True, **kw)


database_url = option(
    "--database-url",
    required=True,
    show_default=False,
    help="SQLAlchemy URL of the database holding the outbox tables.",
)


def open_engine(url: str) -> sa.Engine:
    """The relay's engine for ``url``; a bad URL is a usage error naming ``--database-url``."""
    try:
        return make_engine(url)
    except (ArgumentError, NoSuchModuleError, ValueError) as exc:
        raise click.BadParameter(str(exc), param_hint="'--database-url'") from None
