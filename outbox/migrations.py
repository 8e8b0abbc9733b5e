"""Where the bundled alembic migrations live, and how to apply them.

Two ways to create the outbox schema:

* **Standalone** (sidecar / init container): ``outbox-relay migrate --database-url URL`` or
  :func:`upgrade`. Revisions are recorded in their own table, ``outbox_alembic_version``, so
  they never collide with the host app's ``alembic_version``.
* **Inside the host app's alembic**: add the versions directory to ``version_locations``
  (``outbox:_migrations/versions`` for an installed package, or :func:`versions_dir`) and run
  ``alembic upgrade heads``; the revisions carry the branch label ``outbox``.

Pick one per database: both record what they applied, in different tables.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from outbox.schema import metadata

__all__ = [
    "BRANCH",
    "VERSION_TABLE",
    "alembic_config",
    "current_heads",
    "downgrade",
    "include_object",
    "migrations_dir",
    "upgrade",
    "versions_dir",
]

BRANCH = "outbox"
VERSION_TABLE = "outbox_alembic_version"
VIEWS = frozenset(
    {
        "outbox_status_summary",
        "outbox_lag",
        "outbox_unknown_outcomes",
        "outbox_failures",
        "outbox_relay_health",
    }
)


def migrations_dir() -> Path:
    """The alembic script directory: inside the installed wheel, or the source checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "_migrations", here.parent / "migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise FileNotFoundError("the outbox migrations are missing from this installation")


def versions_dir() -> Path:
    """The directory of revision files to add to a host app's ``version_locations``."""
    return migrations_dir() / "versions"


def alembic_config(url: str | None = None, *, connection: sa.Connection | None = None) -> Config:
    """An alembic ``Config`` for the standalone environment, bound to a URL or a connection."""
    cfg = Config()
    cfg.set_main_option("path_separator", "os")
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.set_main_option("version_locations", str(versions_dir()))
    cfg.set_main_option("version_table", VERSION_TABLE)
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def upgrade(bind: sa.Engine | str, revision: str = "heads") -> None:
    """Apply the outbox migrations to ``bind`` (an Engine or a URL) up to ``revision``."""
    _run(bind, command.upgrade, revision)


def downgrade(bind: sa.Engine | str, revision: str = "base") -> None:
    """Revert the outbox migrations on ``bind`` down to ``revision`` (``base`` drops all)."""
    _run(bind, command.downgrade, revision)


def current_heads(bind: sa.Engine) -> tuple[set[str], set[str]]:
    """(revisions applied in the database, head revisions shipped with this package)."""
    with bind.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        applied = set(ctx.get_current_heads())
    heads = set(ScriptDirectory.from_config(alembic_config()).get_heads())
    return applied, heads


def include_object(
    obj: Any, name: str | None, type_: str, reflected: bool, compare_to: Any
) -> bool:
    """An alembic ``include_object`` hook that hides the outbox schema from a host app's
    autogenerate, so it neither drops our tables nor reports them as drift."""
    if type_ == "table":
        return not (name in metadata.tables or name == VERSION_TABLE or name in VIEWS)
    table = getattr(obj, "table", None)
    return not (table is not None and table.name in metadata.tables)


def _run(bind: sa.Engine | str, fn: Any, revision: str) -> None:
    engine = sa.create_engine(bind) if isinstance(bind, str) else bind
    try:
        with engine.begin() as conn:
            fn(alembic_config(connection=conn), revision)
    finally:
        if isinstance(bind, str):
            engine.dispose()
