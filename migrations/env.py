"""Alembic environment for running the outbox migrations on their own.

Used by ``outbox-relay migrate`` and :func:`outbox.migrations.upgrade`. A host app that already
uses alembic does not need this file: it adds the versions directory to its own
``version_locations`` (see docs/guides/alembic.md), and its own env.py runs these revisions.
"""

from alembic import context
from sqlalchemy import Connection, create_engine, pool

from outbox.schema import metadata

config = context.config
version_table = config.get_main_option("version_table") or "outbox_alembic_version"


def run_migrations_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=metadata,
        version_table=version_table,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    url = config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("no database URL: set sqlalchemy.url or pass a connection")
    engine = create_engine(url, poolclass=pool.NullPool)
    with engine.connect() as conn:
        _run(conn)
    engine.dispose()


def _run(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=version_table,
        transaction_per_migration=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
