"""What the operator commands share on the command line: durations, the message filters, who
is acting (``--actor``), and the database a command opens."""

from __future__ import annotations

import contextlib
import getpass
import re
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import click
import sqlalchemy as sa

from outbox.schema import Status, utcnow
from relay import store
from relay.cli_options import first_line, open_database, option

__all__ = ["DURATION", "KEEP", "actor", "database", "filters", "parse_duration", "to_filter"]

_DURATION_PARTS = re.compile(r"(\d+(?:\.\d+)?)\s*([smhdw])")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_LONGEST = timedelta(weeks=5217)  # about 100 years: longer than any message, and a valid date


def parse_duration(text: str) -> timedelta:
    """``90s``, ``15m``, ``12h``, ``30d``, ``2w`` or combinations such as ``1d12h``; a bare
    ``0`` is no time at all."""
    cleaned = text.strip().lower()
    if cleaned == "0":
        return timedelta(0)
    parts = _DURATION_PARTS.findall(cleaned)
    if not parts or _DURATION_PARTS.sub("", cleaned).strip():
        raise ValueError(f"{text!r} is not a duration such as 0, 90s, 15m, 12h, 30d or 2w")
    seconds = sum(float(n) * _UNITS[unit] for n, unit in parts)
    if seconds > _LONGEST.total_seconds():  # 'now' minus it must still be a date
        raise ValueError(f"{text!r} is too long a duration: at most 100 years (5217w)")
    return timedelta(seconds=seconds)


class _Duration(click.ParamType[timedelta]):
    name = "DURATION"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> timedelta:
        if isinstance(value, timedelta):
            return value
        try:
            return parse_duration(str(value))
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


DURATION = _Duration()


class _Keep(click.ParamType[timedelta | None]):
    """A duration, or ``never`` (None)."""

    name = "DURATION|never"

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> timedelta | None:
        if value is None or isinstance(value, timedelta):
            return value
        if str(value).strip().lower() == "never":
            return None
        return DURATION.convert(value, param, ctx)


KEEP = _Keep()


def filters(function: Callable[..., Any]) -> Callable[..., Any]:
    """The options that choose messages: ``--status``, ``--category``, ``--key``,
    ``--older-than``, ``--newer-than`` (:func:`to_filter` reads them)."""
    for decorator in reversed(
        [
            click.option(
                "--status",
                "statuses",
                multiple=True,
                type=click.Choice([s.value for s in Status]),
                help="Only messages in this status (repeatable).",
            ),
            click.option(
                "--category", "categories", multiple=True, help="Only this category (repeatable)."
            ),
            click.option("--key", help="Idempotency key; a trailing * matches a prefix."),
            click.option(
                "--older-than", type=DURATION, help="Created longer ago than this (e.g. 2h)."
            ),
            click.option("--newer-than", type=DURATION, help="Created within this (e.g. 30m)."),
        ]
    ):
        function = decorator(function)
    return function


def to_filter(
    ids: Sequence[int] = (),
    statuses: Sequence[str] = (),
    categories: Sequence[str] = (),
    key: str | None = None,
    older_than: timedelta | None = None,
    newer_than: timedelta | None = None,
) -> store.Filter:
    """The messages the ids and :func:`filters` options mean."""
    now = utcnow()
    if key is not None and not key.strip("*"):
        raise click.BadParameter("must not be empty", param_hint="'--key'")
    return store.Filter(
        ids=tuple(ids),
        statuses=tuple(statuses),
        categories=tuple(categories),
        key=key,
        created_before=None if older_than is None else now - older_than,
        created_after=None if newer_than is None else now - newer_than,
    )


@contextlib.contextmanager
def database(url: str) -> Iterator[sa.Engine]:
    """The engine for one command, connected and its schema checked (a start-up problem is
    one line, exit code 2); a database error later ends the command with one line."""
    engine = open_database(url)
    try:
        yield engine
    except sa.exc.DBAPIError as exc:
        raise click.ClickException(f"database error: {first_line(exc)}") from None
    finally:
        engine.dispose()


def _os_user() -> str:
    """The operator's name when ``--actor`` is not given: the OS user, as ``getpass`` finds
    it (``LOGNAME``, ``USER``, ..., then the password database); ``unknown`` in a container
    that has none."""
    try:
        return getpass.getuser() or "unknown"
    except (KeyError, OSError):
        return "unknown"


_ACTOR_LENGTH = 128  # "operator:" + it fits outbox_attempts.relay_id (255)


def _check_actor(ctx: click.Context, param: click.Parameter, value: str | None) -> str:
    if value is None:
        return _os_user()
    if not 1 <= len(value) <= _ACTOR_LENGTH or not value.isprintable() or value != value.strip():
        raise click.BadParameter(
            f"must be 1 to {_ACTOR_LENGTH} printable characters without surrounding spaces"
        )
    return value


actor = option(
    "--actor",
    callback=_check_actor,
    show_default=False,
    help="Who is acting, as the operators' log records it (default: the OS user).",
)
