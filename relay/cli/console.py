"""``outbox-relay ui`` (the operator console, :mod:`relay.console`, served by uvicorn) and
``outbox-relay ui-user`` (its users file)."""

from __future__ import annotations

import ipaddress
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from outbox.exceptions import ConfigurationError
from relay.cli_options import StartupError, database_url, open_database, option

if TYPE_CHECKING:
    from types import ModuleType

_ROLES = ("viewer", "operator")  # relay.console.Role's values, known without importing it

__all__ = ["ui", "ui_user", "ui_user_add", "ui_user_remove"]

_users_file = option(
    "--users-file",
    env="OUTBOX_UI_USERS_FILE",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="The console's users and their hashed passwords (ui-user add writes it).",
)


_HEADER = re.compile(r"[A-Za-z0-9-]{1,64}")


def _console() -> ModuleType:
    """:mod:`relay.console`, whose web stack is the ``console`` extra: imported only by the
    commands that need it, so the rest of the command line never does."""
    try:
        import relay.console
    except ImportError as exc:
        raise StartupError(
            f"the console needs its extra ({exc.name} is missing): "
            "pip install 'sqlalchemy-outbox[console]'"
        ) from None
    return relay.console


def _networks(values: tuple[str, ...]) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
    found = []
    for value in (v for text in values for v in text.replace(",", " ").split()):
        try:
            found.append(ipaddress.ip_network(value, strict=False))
        except ValueError:
            raise StartupError(
                f"--trusted-proxy: {value!r} is not an address or network (10.0.0.5, 10.0.0.0/24)"
            ) from None
    return tuple(found)


def _secret(path: Path | None) -> bytes | None:
    if path is None:
        return None
    try:  # one open, no symlink: the mode checked is the file read
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as opened:
            mode = os.fstat(opened.fileno()).st_mode
            key = opened.read().strip()
    except OSError as exc:
        raise StartupError(f"--secret-key-file: {path}: {exc.strerror or exc}") from None
    if mode & 0o077:  # whoever reads the key can forge an operator's session
        raise StartupError(
            f"--secret-key-file: {path} has mode {mode & 0o777:o}: other users may read it; "
            "chmod 600 it"
        )
    if len(key) < 32:
        raise StartupError(f"--secret-key-file: {path} holds {len(key)} bytes; use at least 32")
    return key


@click.command()
@database_url
@option("--host", env="OUTBOX_UI_HOST", default="127.0.0.1", help="Address to listen on.")
@option(
    "--port",
    env="OUTBOX_UI_PORT",
    type=click.IntRange(1, 65535),
    default=8050,
    help="Port to listen on.",
)
@_users_file
@option(
    "--trusted-header",
    env="OUTBOX_UI_TRUSTED_HEADER",
    default=None,
    help="The header an authenticating proxy sets to the user's name (X-Forwarded-Email).",
)
@option(
    "--trusted-proxy",
    env="OUTBOX_UI_TRUSTED_PROXY",
    multiple=True,
    help="An address or network the trusted header is believed from (repeat, or separate "
    "with spaces).",
)
@option(
    "--operator",
    "operators",
    env="OUTBOX_UI_OPERATORS",
    multiple=True,
    help="A user the trusted header names who gets the operator role (the rest are viewers).",
)
@option(
    "--secret-key-file",
    env="OUTBOX_UI_SECRET_KEY_FILE",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="A file of at least 32 bytes that signs session cookies; the same for every replica "
    "[default: a random key: sessions end with the process].",
)
@option(
    "--insecure-cookies",
    env="OUTBOX_UI_INSECURE_COOKIES",
    is_flag=True,
    help="Let the session cookie travel over plain HTTP (a test bench only).",
)
def ui(
    database_url: str,
    host: str,
    port: int,
    users_file: Path | None,
    trusted_header: str | None,
    trusted_proxy: tuple[str, ...],
    operators: tuple[str, ...],
    secret_key_file: Path | None,
    insecure_cookies: bool,
) -> None:
    """Serve the operator console. It refuses to start without --users-file or
    --trusted-header: it shows recipients and bodies."""
    console = _console()
    import uvicorn  # the console's server, in the same extra

    if users_file is None and trusted_header is None:
        raise StartupError(
            "the console needs an authentication source: --users-file (OUTBOX_UI_USERS_FILE; "
            "add users with `outbox-relay ui-user add`) or --trusted-header with --trusted-proxy"
        )
    if trusted_header is not None and not _HEADER.fullmatch(trusted_header):
        raise StartupError(
            f"--trusted-header: {trusted_header!r} is not a header name (X-Forwarded-Email)"
        )
    proxies = _networks(trusted_proxy)
    if any(network.prefixlen == 0 for network in proxies):
        click.echo(
            "Warning: --trusted-proxy covers every address: anyone who reaches the console "
            "can send the trusted header and be whoever they name",
            err=True,
        )
    named = {o for text in operators for o in text.replace(",", " ").split()}
    auth = console.Auth(
        users_file=console.UsersFile(users_file) if users_file is not None else None,
        trusted_header=trusted_header,
        trusted_proxies=proxies,
        operators=frozenset(named),
    )
    try:
        key = _secret(secret_key_file)
        engine = open_database(database_url)
        app = console.create_app(
            engine, auth=auth, secret_key=key, secure_cookies=not insecure_cookies
        )
    except ConfigurationError as exc:
        raise StartupError(str(exc)) from None
    click.echo(f"console on http://{host}:{port}/", err=True)
    # the peer address is what the trusted header is believed from: never rewritten from
    # an X-Forwarded-For anyone can send
    uvicorn.run(app, host=host, port=port, proxy_headers=False, log_level="warning")


@click.group(name="ui-user")
def ui_user() -> None:
    """The console's users file: add, change or remove a user."""


@ui_user.command(name="add")
@_users_file
@click.argument("name")
@click.option(
    "--role",
    type=click.Choice(_ROLES),
    default="viewer",
    show_default=True,
    help="viewer: reads, addresses masked, no bodies; operator: acts and sees bodies.",
)
@click.option(
    "--password-stdin", is_flag=True, help="Read the password from standard input's first line."
)
def ui_user_add(users_file: Path | None, name: str, role: str, password_stdin: bool) -> None:
    """Add NAME, or change its role and password (asked for twice, not echoed)."""
    if users_file is None:
        raise StartupError("--users-file (OUTBOX_UI_USERS_FILE): which file to write")
    if password_stdin:
        password = sys.stdin.readline().rstrip("\r\n")
    else:
        password = str(click.prompt("Password", hide_input=True, confirmation_prompt=True))
    try:
        console = _console()
        new = console.add_user(users_file, name, console.Role(role), password)
    except ConfigurationError as exc:
        raise StartupError(str(exc)) from None
    click.echo(f"{'added' if new else 'changed'} {name} ({role}) in {users_file}")


@ui_user.command(name="remove")
@_users_file
@click.argument("name")
def ui_user_remove(users_file: Path | None, name: str) -> None:
    """Remove NAME: their session ends at their next request."""
    if users_file is None:
        raise StartupError("--users-file (OUTBOX_UI_USERS_FILE): which file to write")
    if not _console().remove_user(users_file, name):
        raise click.ClickException(f"{name} is not in {users_file}")
    click.echo(f"removed {name} from {users_file}")
