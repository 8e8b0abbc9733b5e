"""The bundled migrations on every backend: up, down, up again, no drift, host-app alembic,
async engines, and the same ``outbox/_migrations`` in the wheel and the sdist."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tarfile
import textwrap
import zipfile
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.util import coerce_resource_to_filename
from sqlalchemy.ext.asyncio import create_async_engine

from outbox import migrations
from outbox.schema import metadata
from tests.support.db import fresh_database

TABLES = {
    "outbox_messages",
    "outbox_attempts",
    "outbox_relays",
    "outbox_send_budget",
    "outbox_send_budget_lock",
    "outbox_events",
    "outbox_suppressions",
    "outbox_operator_actions",
    "outbox_intakes",
    "outbox_send_slots",
}


def outbox_tables(engine: sa.Engine) -> tuple[set[str], set[str]]:
    inspector = sa.inspect(engine)
    tables = set(inspector.get_table_names()) & TABLES
    views = set(inspector.get_view_names()) & migrations.VIEWS
    return tables, views


def made_on(obj: object, dialect: sa.Dialect) -> bool:
    """Whether the metadata makes ``obj`` on ``dialect`` (its ``ddl_if``, if any)."""
    cond = getattr(obj, "_ddl_if", None)
    if cond is None:
        return True
    if cond.dialect is not None:
        names = (cond.dialect,) if isinstance(cond.dialect, str) else cond.dialect
        if dialect.name not in names:
            return False
    return cond.callable_ is None or bool(cond.callable_(None, obj, None, dialect=dialect))


def drift(engine: sa.Engine) -> list:
    with engine.connect() as conn:
        ctx = MigrationContext.configure(
            conn,
            opts={
                "version_table": migrations.VERSION_TABLE,
                "include_name": lambda name, type_, parent: type_ != "table" or name in TABLES,
                # what the metadata makes on other databases only is not drift here
                "include_object": lambda obj, name, type_, reflected, other: (
                    reflected or made_on(obj, conn.dialect)
                ),
            },
        )
        return compare_metadata(ctx, metadata)


def test_upgrade_downgrade_upgrade_and_no_drift(engine):
    assert outbox_tables(engine) == (TABLES, set(migrations.VIEWS))
    assert drift(engine) == []
    migrations.downgrade(engine)
    assert outbox_tables(engine) == (set(), set())
    migrations.upgrade(engine)
    assert outbox_tables(engine) == (TABLES, set(migrations.VIEWS))
    assert drift(engine) == []
    applied, heads = migrations.current_heads(engine)
    assert applied == heads
    with engine.connect() as conn:
        for view in migrations.VIEWS - {"outbox_event_intake"}:
            assert conn.execute(sa.text(f"SELECT * FROM {view}")).fetchall() == []
        # The intake's health is one row, even before the first event.
        intake = conn.execute(sa.text("SELECT * FROM outbox_event_intake")).mappings().one()
        assert intake["events_24h"] == 0
        assert intake["newest_received_at"] is None


def test_status_check_constraint_refuses_unknown_status(engine):
    from datetime import UTC, datetime

    from outbox.schema import messages

    now = datetime.now(UTC)
    row = dict(
        idempotency_key="k",
        category="default",
        priority=0,
        status="bogus",
        payload={},
        recipients="a@example.com",
        recipient_count=1,
        subject="s",
        attempt_count=0,
        max_attempts=1,
        backoff_base=1.0,
        backoff_cap=1.0,
        ambiguity_policy="hold",
        next_attempt_at=now,
        created_at=now,
        updated_at=now,
    )
    # MariaDB reports a CHECK failure as error 4025, which PyMySQL maps to OperationalError.
    with (
        pytest.raises(sa.exc.DBAPIError, match="ck_outbox_messages_status"),
        engine.begin() as conn,
    ):
        conn.execute(messages.insert(), row)
    with engine.begin() as conn:
        conn.execute(messages.insert(), {**row, "status": "pending"})


HOST_ENV = """
from alembic import context
from sqlalchemy import create_engine, pool
import sqlalchemy as sa

from outbox.migrations import include_object

target = sa.MetaData()
sa.Table("host_widgets", target, sa.Column("id", sa.Integer, primary_key=True))

def run():
    engine = create_engine(context.config.get_main_option("sqlalchemy.url"),
                           poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(connection=connection, target_metadata=target,
                          include_object=include_object)
        with context.begin_transaction():
            context.run_migrations()

run()
"""

HOST_REVISION = """
from alembic import op
import sqlalchemy as sa

revision = "host_0001"
down_revision = None
branch_labels = ("host",)
depends_on = None

def upgrade():
    op.create_table("host_widgets", sa.Column("id", sa.Integer, primary_key=True))

def downgrade():
    op.drop_table("host_widgets")
"""


@pytest.fixture
def host_database(backend, tmp_path):
    """A fresh, empty database next to the backend's test database."""
    with fresh_database(backend, tmp_path, "host") as url:
        yield url


def test_host_app_alembic_runs_the_outbox_branch(host_database, tmp_path):
    """A host app adds our versions to version_locations and runs `alembic upgrade heads`."""
    (tmp_path / "alembic" / "versions").mkdir(parents=True)
    (tmp_path / "alembic" / "env.py").write_text(HOST_ENV)
    (tmp_path / "alembic" / "versions" / "host_0001.py").write_text(HOST_REVISION)
    (tmp_path / "alembic.ini").write_text(
        textwrap.dedent(f"""\
        [alembic]
        script_location = %(here)s/alembic
        path_separator = space
        version_locations = %(here)s/alembic/versions {migrations.versions_dir()}
        sqlalchemy.url = {host_database.replace("%", "%%")}
        """)
    )

    def alembic(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "alembic", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout + done.stderr

    head = migrations.shipped_revisions()[-1]
    assert head in alembic("heads")
    alembic("upgrade", "heads")
    engine = sa.create_engine(host_database)
    try:
        assert outbox_tables(engine) == (TABLES, set(migrations.VIEWS))
        assert "host_widgets" in sa.inspect(engine).get_table_names()
        with engine.connect() as conn:
            versions = {
                r[0] for r in conn.exec_driver_sql("SELECT version_num FROM alembic_version")
            }
        assert versions == {"host_0001", head}
        # The host's autogenerate sees no drift: our objects are hidden from it.
        assert "No new upgrade operations detected" in alembic("check")
        alembic("downgrade", "outbox@base")
        assert outbox_tables(engine) == (set(), set())
        assert "host_widgets" in sa.inspect(engine).get_table_names()
    finally:
        engine.dispose()


ROOT = Path(__file__).resolve().parents[2]
SHIPPED = {
    "outbox/_migrations/env.py",
    "outbox/_migrations/script.py.mako",
    *(f"outbox/_migrations/versions/{p.name}" for p in migrations.versions_dir().glob("*.py")),
}


def test_the_migrations_are_the_top_level_directory_the_package_links_to():
    """One copy, the top-level ``migrations/``; in the checkout ``outbox/_migrations`` is a
    relative symlink to it, so ``outbox:_migrations/versions`` names it in an editable install
    as it names the wheel's real directory."""
    link = ROOT / "outbox" / "_migrations"
    assert link.is_symlink()
    assert os.readlink(link) == "../migrations"
    assert migrations.migrations_dir() == ROOT / "migrations"
    versions = Path(coerce_resource_to_filename("outbox:_migrations/versions"))
    assert versions.resolve() == migrations.versions_dir() == ROOT / "migrations" / "versions"
    assert {"0001_outbox_initial.py", "0002_outbox_send_budget.py"} <= {
        p.name for p in migrations.versions_dir().glob("*.py")
    }


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, capture_output=True)


def build_wheel(source: Path, into: Path) -> Path:
    pip("wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(into), str(source))
    (wheel,) = into.glob("sqlalchemy_outbox-*.whl")
    return wheel


def installed_versions_dir(wheel: Path, target: Path) -> Path:
    """Install ``wheel`` into ``target`` and resolve ``outbox:_migrations/versions`` there the
    way alembic resolves a ``version_locations`` entry."""
    pip("install", "--no-deps", "-q", "--target", str(target), str(wheel))
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "from alembic.util import coerce_resource_to_filename as c;"
            "print(c('outbox:_migrations/versions'))",
        ],
        env={"PYTHONPATH": str(target)},
        capture_output=True,
        text=True,
        check=True,
        cwd=target.parent,
    )
    return Path(probe.stdout.strip())


def test_wheel_ships_the_migrations(tmp_path):
    wheel = build_wheel(ROOT, tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    assert names >= SHIPPED
    assert "outbox/py.typed" in names
    assert "relay/py.typed" in names
    assert not any(n.startswith(("tests/", "examples/", "migrations/")) for n in names)
    target = tmp_path / "site"
    versions = installed_versions_dir(wheel, target)
    assert versions == target / "outbox" / "_migrations" / "versions"
    assert {p.name for p in versions.glob("*.py")} == {
        p.name for p in migrations.versions_dir().glob("*.py")
    }


def test_sdist_ships_the_migrations_and_builds_a_wheel_with_them(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"from hatchling.build import build_sdist; build_sdist({str(tmp_path)!r})",
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    (sdist,) = tmp_path.glob("sqlalchemy_outbox-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
        archive.extractall(tmp_path / "unpacked", filter="data")
    assert names >= SHIPPED
    assert not any(n.startswith("migrations/") for n in names)
    (unpacked,) = (tmp_path / "unpacked").iterdir()
    wheel = build_wheel(unpacked, tmp_path / "from-sdist")
    assert set(zipfile.ZipFile(wheel).namelist()) >= SHIPPED
    versions = installed_versions_dir(wheel, tmp_path / "site")
    assert (versions / "0002_outbox_send_budget.py").is_file()


def test_an_async_engine_gets_a_type_error_saying_what_to_pass(backend):
    async def main() -> None:
        engine = create_async_engine(backend.async_url)
        try:
            for fn in (migrations.upgrade, migrations.downgrade, migrations.current_heads):
                for bind in (engine, engine.sync_engine):
                    with pytest.raises(TypeError, match=r"synchronous.*conn\.run_sync\("):
                        fn(bind)
            if backend.name != "postgresql":  # postgresql+psycopg is a sync URL as well
                with pytest.raises(TypeError, match="URL of the async driver"):
                    migrations.upgrade(backend.async_url)
            with pytest.raises(TypeError, match="takes a sqlalchemy Engine, a Connection or"):
                migrations.upgrade(None)
        finally:
            await engine.dispose()

    asyncio.run(main())


def test_an_async_engine_migrates_through_run_sync_as_the_error_says(backend):
    """The TypeError's advice, followed: down and up again on the async driver's connection."""

    async def main() -> tuple[set[str], set[str]]:
        engine = create_async_engine(backend.async_url)
        try:
            async with engine.begin() as conn:
                await conn.run_sync(migrations.downgrade)
            async with engine.connect() as conn:
                assert (
                    await conn.run_sync(lambda c: set(sa.inspect(c).get_table_names())) & TABLES
                    == set()
                )
            async with engine.begin() as conn:
                await conn.run_sync(migrations.upgrade)
            async with engine.connect() as conn:
                return await conn.run_sync(migrations.current_heads)
        finally:
            await engine.dispose()

    applied, heads = asyncio.run(main())
    assert applied == heads
    assert outbox_tables(backend.engine) == (TABLES, set(migrations.VIEWS))


def test_every_table_is_innodb_whatever_the_servers_default_engine(request, tmp_path):
    """On a MariaDB server whose ``default_storage_engine`` is Aria (or MyISAM), a table
    created without an engine is not transactional: an email would survive its rollback."""
    backend = request.getfixturevalue("_backends")["mysql"]
    with fresh_database(backend, tmp_path, "aria") as url:
        engine = sa.create_engine(url)

        @sa.event.listens_for(engine, "connect")
        def aria_by_default(dbapi_connection, connection_record):
            with dbapi_connection.cursor() as cursor:
                cursor.execute("SET SESSION default_storage_engine = 'Aria'")

        try:
            migrations.upgrade(engine)
            with engine.connect() as conn:
                engines = dict(
                    conn.execute(
                        sa.text(
                            "SELECT table_name, engine FROM information_schema.tables "
                            "WHERE table_schema = DATABASE() AND table_type = 'BASE TABLE'"
                        )
                    ).all()
                )
        finally:
            engine.dispose()
    tables = {t.name for t in metadata.sorted_tables}  # alembic's version table aside
    assert set(engines) >= tables
    assert {engines[name] for name in tables} == {"InnoDB"}, engines
