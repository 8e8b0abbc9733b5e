"""Start-up errors of every ``outbox-relay`` command, as a user meets them: real subprocesses.

Whatever is wrong before a command can start (the URL, its driver, the database, the schema,
a revision) is one ``Error:`` line on stderr naming the problem and the fix, exit code 2, no
traceback, nothing on stdout.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import sqlalchemy as sa

from relay.cli import main
from tests.support.relays import RELAY, clean_env

# Each command with arguments that make it go as far as its database. A new command must be
# added here, so that its start-up errors are checked too.
COMMAND_ARGS = {
    "run": ["--sender", "console", "--exit-when-idle", "--poll-interval", "0.1"],
    "migrate": [],
    "status": [],
    "list": [],
    "show": ["1"],
    "requeue": ["1"],
    "cancel": ["1"],
    "prune": ["--older-than", "30d"],
    "resolve": ["1", "--delivered"],
    "suppressions": ["list"],
    "events": ["--events-queue-url", "http://127.0.0.1:9/000000000000/q", "--exit-when-idle"],
    "doctor": ["--sender", "console"],
    "send-test": ["--to", "customer@example.com", "--from", "shop@example.com", "--wait", "0"],
    "ui": ["--trusted-header", "X-Forwarded-Email", "--trusted-proxy", "127.0.0.1"],
}
# doctor reports an unreachable database or a missing schema as a `fail` line (exit 1)
ADMIN = [name for name in COMMAND_ARGS if name not in ("run", "migrate", "doctor")]
# Blocks one driver's import, as if it were not installed (it is, for the other tests).
WITHOUT = "import sys; sys.modules[{module!r}] = None; from relay.cli import main; main()"


# commands without a database: their refusals are tested below and in test_alembic_app.py
NO_DATABASE = {"alembic-revision", "ui-user"}


def test_every_command_is_covered():
    assert set(main.commands) == set(COMMAND_ARGS) | NO_DATABASE


def test_alembic_revision_without_an_alembic_ini_is_one_line_naming_config(tmp_path):
    done = subprocess.run(
        [RELAY, "alembic-revision", "--config", str(tmp_path / "alembic.ini")],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        check=False,
    )
    line = refusal(done)
    assert "--config" in line
    assert "alembic.ini: no such file" in line


def cli(
    command: str, url: str, *, without: str | None = None, extra: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    program = [RELAY] if without is None else [sys.executable, "-c", WITHOUT.format(module=without)]
    return subprocess.run(
        [*program, command, *COMMAND_ARGS[command], *extra],
        env=clean_env(OUTBOX_DATABASE_URL=url),
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def refusal(done: subprocess.CompletedProcess[str]) -> str:
    """The one line of a refused start, after checking how it was refused."""
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("Error: ")
    return lines[0]


@pytest.mark.parametrize("command", COMMAND_ARGS)
@pytest.mark.parametrize(
    ("url", "without", "words"),
    [
        (
            "mysql://root@127.0.0.1/outbox",
            None,  # MySQLdb, SQLAlchemy's default MySQL driver, is not installed
            [
                "No module named 'MySQLdb'",
                "mysql+pymysql://",
                "pip install 'sqlalchemy-outbox[mysql]'",
            ],
        ),
        (
            "postgresql://postgres@127.0.0.1/outbox",
            "psycopg",  # SQLAlchemy's default PostgreSQL driver since 2.1
            ["the psycopg driver", "pip install 'sqlalchemy-outbox[postgres]'"],
        ),
        (
            "postgresql+psycopg2://postgres@127.0.0.1/outbox",
            "psycopg2",
            ["psycopg2", "use postgresql+psycopg://", "pip install 'sqlalchemy-outbox[postgres]'"],
        ),
        ("not a url", None, ["--database-url: not a database URL", "dialect+driver://"]),
        ("postgresql://h:port/db", None, ["--database-url: not a database URL", "'port'"]),
        ("oracel://scott@db/orcl", None, ["unknown database 'oracel'", "mysql+pymysql://"]),
        ("postgresql+pg9://h/db", None, ["postgresql has no driver named 'pg9'"]),
        # the app's own async URL, pasted: its connect fails outside an event loop
        ("sqlite+aiosqlite:///shop.db", None, ["is an async driver", "as sqlite://"]),
        (
            "postgresql+psycopg_async://postgres@127.0.0.1/outbox",
            None,
            ["is an async driver", "as postgresql+psycopg://"],
        ),
        ("mysql+aiomysql://root@127.0.0.1/outbox", None, ["async driver", "as mysql+pymysql://"]),
    ],
    ids=[
        "mysql-default-driver",
        "postgresql-default-driver",
        "psycopg2-missing",
        "malformed",
        "bad-port",
        "unknown-dialect",
        "unknown-driver",
        "aiosqlite",
        "psycopg-async",
        "aiomysql",
    ],
)
def test_an_unusable_url_is_one_line_naming_the_fix(command, url, without, words):
    line = refusal(cli(command, url, without=without))
    assert "--database-url" in line
    for word in words:
        assert word in line


@pytest.mark.parametrize("command", ["migrate", *ADMIN])
@pytest.mark.parametrize(
    "url",
    [
        "postgresql+psycopg://nobody:secret@127.0.0.1:1/outbox",
        "mysql+pymysql://nobody:secret@127.0.0.1:1/outbox",
    ],
    ids=["postgresql", "mariadb"],
)
def test_an_unreachable_database_is_one_line(command, url):
    line = refusal(cli(command, url))
    assert "cannot connect to " + url.replace("secret", "***") in line
    assert "Connection refused" in line or "111" in line
    assert "check --database-url" in line
    assert "secret" not in line


def test_a_missing_sqlite_file_is_refused_not_created(tmp_path):
    path = tmp_path / "typo.db"
    for command in ADMIN:
        line = refusal(cli(command, f"sqlite:///{path}"))
        assert f"the SQLite file {path} does not exist: check --database-url" in line
    assert not path.exists()


@pytest.fixture
def empty_url(backend, tmp_path):
    """A database of the backend's kind with no outbox schema, dropped afterwards."""
    if backend.name == "sqlite":
        (tmp_path / "empty.db").touch()  # an empty file is an empty SQLite database
        yield f"sqlite:///{tmp_path / 'empty.db'}"
        return
    url = sa.make_url(backend.url)
    name = f"{url.database}_empty"
    server = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    with server.connect() as conn:
        conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name}")
        conn.exec_driver_sql(f"CREATE DATABASE {name}")
    yield url.set(database=name).render_as_string(hide_password=False)
    with server.connect() as conn:
        force = " WITH (FORCE)" if backend.name == "postgresql" else ""
        conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name}{force}")
    server.dispose()


def test_a_database_without_the_schema_names_migrate(empty_url):
    for command in ADMIN:
        line = refusal(cli(command, empty_url))
        assert "has no outbox schema" in line, command
        assert "run `outbox-relay migrate --database-url ...` with the same URL first" in line
    line = refusal(cli("run", empty_url))  # the relay refuses at once, before any send
    assert (
        "lacks the outbox tables outbox_attempts, outbox_events, outbox_intakes, outbox_messages"
        in line
    )
    assert "outbox-relay migrate --database-url" in line


def test_a_database_with_part_of_the_schema_names_what_is_missing(empty_url):
    engine = sa.create_engine(empty_url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("CREATE TABLE outbox_messages (id INTEGER PRIMARY KEY)")
    finally:
        engine.dispose()
    line = refusal(cli("status", empty_url))
    missing = "outbox_attempts, outbox_events, outbox_intakes, outbox_operator_actions"
    assert f"lacks the outbox tables {missing}," in line
    assert "outbox_messages," not in line
    assert "outbox-relay migrate" in line


def test_an_unknown_revision_is_one_line_listing_the_known_ones(empty_url):
    line = refusal(cli("migrate", empty_url, extra=("--revision", "bogus")))
    assert "--revision 'bogus'" in line
    assert "Can't locate revision" in line
    assert (
        "use 'heads' (the default) or one of outbox_0001, outbox_0002, outbox_0003, "
        "outbox_0004, outbox_0005" in line
    )
