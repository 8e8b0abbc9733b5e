"""``outbox-relay migrate`` and ``outbox-relay alembic-revision``: the outbox schema, created
or upgraded in its own alembic environment, or carried on an app's own alembic branch."""

from __future__ import annotations

from pathlib import Path

import click
import sqlalchemy as sa
from alembic.util import CommandError

from outbox import migrations
from relay.cli_options import (
    StartupError,
    check_connection,
    database_url,
    first_line,
    open_engine,
    safe_url,
)

__all__ = ["alembic_revision", "migrate"]


@click.command()
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
    engine = open_engine(database_url)
    where = safe_url(engine)
    try:
        check_connection(engine)
        migrations.upgrade(engine, revision)
        applied, heads = migrations.current_heads(engine)
    except CommandError as exc:
        raise StartupError(
            f"--revision {revision!r}: {first_line(exc)}; use 'heads' (the default) or one of "
            f"{', '.join(_revisions())}"
        ) from None
    except sa.exc.DBAPIError as exc:
        raise click.ClickException(f"cannot migrate {where}: {first_line(exc)}") from None
    finally:
        engine.dispose()
    state = "up to date" if applied == heads else f"at {', '.join(sorted(applied)) or 'base'}"
    click.echo(f"outbox schema {state} on {where} (revision {', '.join(sorted(applied))})")


@click.command(name="alembic-revision")
@click.option(
    "--config",
    "-c",
    "config_file",
    default="alembic.ini",
    show_default=True,
    type=click.Path(dir_okay=False),
    help="Your app's alembic.ini.",
)
@click.option(
    "--message", "-m", default="outbox schema", show_default=True, help="The revision's message."
)
def alembic_revision(config_file: str, message: str) -> None:
    """Carry the outbox schema on your app's own alembic branch: write a revision on your head
    that applies the outbox revisions your history does not hold yet (run it again after
    upgrading sqlalchemy-outbox). `alembic upgrade head` and `downgrade -1` then work as
    before; put outbox.migrations.include_object in your env.py."""
    from alembic.config import Config

    if not Path(config_file).is_file():
        raise StartupError(f"--config: {config_file}: no such file (your app's alembic.ini)")
    try:
        written = migrations.write_app_revision(Config(config_file), message)
    except CommandError as exc:
        raise click.ClickException(first_line(exc)) from None
    if written is None:
        click.echo("your alembic history carries every outbox revision of this release")
        return
    carried = ", ".join(written.module.outbox_revisions)
    click.echo(f"wrote {written.path} (revision {written.revision}: {carried})")


def _revisions() -> list[str]:
    """The revision ids shipped with this release, oldest first."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(migrations.alembic_config())
    return [rev.revision for rev in reversed(list(script.walk_revisions()))]
