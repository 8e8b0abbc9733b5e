"""Pieces shared by the ``outbox-relay`` commands: options with ``OUTBOX_*`` variables, and
the engine they open."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
import sqlalchemy as sa
from sqlalchemy.exc import ArgumentError, NoSuchModuleError

from relay import store
from relay.config import URL_FORMS
from relay.db import make_engine, masked_url

__all__ = [
    "StartupError",
    "check_connection",
    "check_file_exists",
    "check_schema",
    "database_url",
    "first_line",
    "open_database",
    "open_engine",
    "option",
    "safe_url",
    "warn_secret_flag",
]

_F = TypeVar("_F", bound=Callable[..., Any])


def option(name: str, *decls: str, env: str | None = None, **kw: Any) -> Callable[[_F], _F]:
    """A click option also read from ``OUTBOX_<NAME>`` (shown in ``--help``), or from ``env``
    where two commands' flags of one setting have different names; ``decls`` as click's
    (the parameter's name, say)."""
    env = env or "OUTBOX_" + name.lstrip("-").replace("-", "_").upper()
    kw.setdefault("show_default", True)
    return click.option(name, *decls, envvar=env, show_envvar=True, **kw)


def warn_secret_flag(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
    """A secret given as a flag is in the process list (``ps``) for every user of the
    machine: say so once, on stderr, and go on."""
    if not value or param.name is None:
        return value
    if ctx.get_parameter_source(param.name) is not click.core.ParameterSource.COMMANDLINE:
        return value
    flag = param.opts[0]
    if flag == "--database-url":
        try:
            if masked_url(value) == sa.make_url(value).render_as_string(hide_password=False):
                return value  # nothing secret in it
        except ArgumentError:
            return value  # not a URL: its own error comes later
    envvar = param.envvar if isinstance(param.envvar, str) else "its variable"
    click.echo(
        f"Warning: {flag} holds a password on the command line, where other users of this "
        f"machine can read it (ps); set {envvar} instead",
        err=True,
    )
    return value


database_url = option(
    "--database-url",
    required=True,
    show_default=False,
    callback=warn_secret_flag,
    help="SQLAlchemy URL of the database holding the outbox tables.",
)


class StartupError(click.ClickException):
    """What a command needs before it can start is wrong (its URL, driver, database or
    schema): one ``Error:`` line saying what and what to do, exit code 2, no usage text."""

    exit_code = 2


# the URL form and the extra that installs the driver this project is tested with
_SUPPORTED = {
    "postgresql": ("postgresql+psycopg", "psycopg", "postgres"),
    "mysql": ("mysql+pymysql", "pymysql", "mysql"),
    "mariadb": ("mariadb+pymysql", "pymysql", "mysql"),
}


def first_line(error: BaseException) -> str:
    """A driver's message without its hints and caret lines (psycopg adds both)."""
    orig = getattr(error, "orig", None) or error
    return (str(orig).strip().splitlines() or [type(orig).__name__])[0].strip()


def safe_url(engine: sa.Engine) -> str:
    return masked_url(engine.url)


def open_engine(url: str, *, read_timeout: float | None = None) -> sa.Engine:
    """The relay's engine for ``url``. It does not connect; a URL that cannot work (malformed,
    unknown dialect, driver not installed) is a :class:`StartupError` naming the fix.
    ``read_timeout``: see :func:`relay.db.make_engine`; the long-running commands (``run``,
    ``events``) pass ``READ_TIMEOUT``, an operator's command or a migration None."""
    try:
        parsed = sa.make_url(url)
    except (ArgumentError, ValueError) as exc:
        raise StartupError(
            f"--database-url: not a database URL ({exc}): expected "
            f"dialect+driver://user:password@host:port/database, such as {URL_FORMS}"
        ) from None
    try:
        engine = make_engine(parsed, read_timeout=read_timeout)
    except NoSuchModuleError:
        raise StartupError(_unknown_dialect(parsed)) from None
    except ImportError as exc:
        raise StartupError(_missing_driver(parsed, exc)) from None
    if engine.dialect.is_async:  # its connect would fail outside an event loop (MissingGreenlet)
        engine.dispose()
        raise StartupError(_async_driver(parsed))
    return engine


def _async_driver(url: sa.URL) -> str:
    backend = url.get_backend_name()
    form = "sqlite" if backend == "sqlite" else _SUPPORTED.get(backend, (URL_FORMS,))[0]
    return (
        f"--database-url: {url.drivername}:// is an async driver; the relay and its commands "
        f"use a sync one: the same database as {form}://..."
    )


def _unknown_dialect(url: sa.URL) -> str:
    backend, _, driver = url.drivername.partition("+")
    if backend in _SUPPORTED or backend == "sqlite":
        return f"--database-url: {backend} has no driver named {driver!r}: use {URL_FORMS}"
    return f"--database-url: unknown database {backend!r}: use {URL_FORMS}"


def _missing_driver(url: sa.URL, exc: ImportError) -> str:
    backend, driver = url.get_backend_name(), url.get_driver_name()
    why = f"the {driver} driver for {url.drivername}:// is not installed ({exc})"
    if backend not in _SUPPORTED:
        return f"--database-url: {why}: install it, or use {URL_FORMS}"
    form, tested, extra = _SUPPORTED[backend]
    install = f"pip install 'sqlalchemy-outbox[{extra}]'"
    if driver == tested:
        return f"--database-url: {why}: {install}"
    return f"--database-url: {why}: use {form}://... and {install}"


def check_connection(engine: sa.Engine) -> None:
    """Connect once, so an unreachable database or a refused login is one line at start."""
    try:
        with engine.connect():
            pass
    except sa.exc.DBAPIError as exc:
        check = (
            "its directory must exist and be writable"
            if engine.dialect.name == "sqlite"
            else "the database server must be running and accept this login"
        )
        raise StartupError(
            f"cannot connect to {safe_url(engine)}: {first_line(exc)}; check --database-url "
            f"({check})"
        ) from None


def check_file_exists(engine: sa.Engine) -> None:
    """Refuse a SQLite file that does not exist, instead of letting the connection create an
    empty one at a mistyped path (``migrate`` creates it, so it does not call this)."""
    url = engine.url
    if engine.dialect.name != "sqlite" or url.database in (None, "", ":memory:"):
        return
    if url.query.get("uri") or url.database.startswith("file:"):
        return  # a SQLite URI filename: its mode and path are the driver's to read
    if not Path(url.database).exists():
        raise StartupError(
            f"the SQLite file {url.database} does not exist: check --database-url, or create "
            "the schema there with `outbox-relay migrate --database-url ...`"
        )


def check_schema(engine: sa.Engine) -> None:
    """Refuse, before any command reads or writes, a database without the outbox tables."""
    with engine.connect() as conn:
        missing = store.missing_tables(conn)
    if not missing:
        return
    what = (
        "has no outbox schema"
        if set(missing) == set(store.OUTBOX_TABLES)
        else f"lacks the outbox tables {', '.join(missing)} (migrated by an older release?)"
    )
    raise StartupError(
        f"the database at {safe_url(engine)} {what}: run `outbox-relay migrate "
        "--database-url ...` with the same URL first"
    )


def open_database(url: str, *, read_timeout: float | None = None) -> sa.Engine:
    """The engine of an operator command: connected once and its schema checked, so every
    start-up problem is one line with exit code 2 instead of a traceback mid-command."""
    engine = open_engine(url, read_timeout=read_timeout)
    try:
        check_file_exists(engine)
        check_connection(engine)
        check_schema(engine)
    except BaseException:
        engine.dispose()
        raise
    return engine
