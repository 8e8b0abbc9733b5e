"""The ``outbox-relay`` command line. Every option can also be set from an ``OUTBOX_*``
environment variable (shown in ``--help``)."""

from __future__ import annotations

import click
import sqlalchemy as sa
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, OperationalError

from outbox import migrations

__all__ = ["main"]


def _engine(url: str) -> sa.Engine:
    try:
        return sa.create_engine(url, pool_pre_ping=True)
    except (ArgumentError, NoSuchModuleError, ValueError) as exc:
        raise click.BadParameter(str(exc), param_hint="'--database-url'") from None


database_url = click.option(
    "--database-url",
    envvar="OUTBOX_DATABASE_URL",
    show_envvar=True,
    required=True,
    help="SQLAlchemy URL of the database holding the outbox tables.",
)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="sqlalchemy-outbox")
def main() -> None:
    """Deliver the outbox, and operate it."""


@main.command()
@database_url
@click.option(
    "--revision",
    envvar="OUTBOX_REVISION",
    show_envvar=True,
    default="heads",
    show_default=True,
    help="Target revision; 'heads' applies everything shipped with this version.",
)
def migrate(database_url: str, revision: str) -> None:
    """Create or upgrade the outbox tables and views (standalone alembic environment).

    Revisions are recorded in outbox_alembic_version. Apps that run the outbox migrations
    through their own alembic (version_locations) do not need this command.
    """
    engine = _engine(database_url)
    safe_url = engine.url.render_as_string(hide_password=True)
    try:
        migrations.upgrade(engine, revision)
        applied, heads = migrations.current_heads(engine)
    except OperationalError as exc:
        raise click.ClickException(f"cannot migrate {safe_url}: {exc.orig}") from None
    finally:
        engine.dispose()
    state = "up to date" if applied == heads else f"at {', '.join(sorted(applied)) or 'base'}"
    click.echo(f"outbox schema {state} on {safe_url} (revision {', '.join(sorted(applied))})")
