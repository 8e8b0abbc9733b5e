"""The grant scripts of examples/deploy given hostile names: role, user, database and host
names holding quotes, backticks, backslashes, spaces, semicolons, ``%`` and ``_`` (LIKE's
wildcards, which MariaDB reads in database names of database-level grants), and names left
empty (what envsubst pastes for an unset variable).

A name the script can carry is carried exactly: the role logs in, has its grants on the one
database named, none on a database its name would match as a LIKE pattern, and nothing its
name says as SQL was run. A name it cannot carry is refused before any user is made, with an
error naming the placeholder. Every role, user and database made here is named ``h2_<run>``
and dropped when its test ends.
"""

from __future__ import annotations

import base64
import shutil
import string
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox import migrations
from tests.support.db import Backend
from tests.support.relays import clean_env

DEPLOY = Path(__file__).resolve().parents[2] / "examples" / "deploy"
_RUN = uuid.uuid4().hex[:6]
P = f"h2_{_RUN}"  # every role, user and database of this module starts with this
INJECTED = f"{P}_injected"  # what a name spliced into SQL would create
PASSWORD = "pw'\\; x"
# serial: the test ids carry this process's random prefix, which pytest-xdist's workers would
# not agree on; and the MariaDB tests check the server's anonymous user, which is everyone's
pytestmark = pytest.mark.serial


def run(
    command: list[str], script: str | None = None, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command,
        input=script,
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(**env),
        check=False,
    )


# -- MariaDB -------------------------------------------------------------------------------


def mariadb_values(database: str, **changed: str) -> dict[str, str]:
    """The placeholders' values (what a user exports for envsubst), ``changed`` replaced."""
    b64 = base64.b64encode(PASSWORD.encode()).decode()
    values = {
        "RELAY_USER": f"{P}_relay",
        "APP_USER": f"{P}_app",
        "OPERATOR_USER": f"{P}_operator",
        "DB_NAME": database,
        "CLIENT_HOST": "%",
        "RELAY_PASSWORD_B64": b64,
        "APP_PASSWORD_B64": b64,
        "OPERATOR_PASSWORD_B64": b64,
    }
    return {**values, **changed}


def apply_mariadb(admin: sa.URL, values: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``envsubst < grants-mariadb.sql | mariadb ...`` with ``values``."""
    script = string.Template((DEPLOY / "grants-mariadb.sql").read_text()).substitute(values)
    client = shutil.which("mariadb") or "mysql"
    command = [client, "--protocol=TCP", "-h", admin.host or "127.0.0.1"]
    command += ["-P", str(admin.port or 3306), "-u", admin.username or "root"]
    password = {"MYSQL_PWD": admin.password} if admin.password else {}
    return run(command, script, **password)


def mariadb_users(admin: sa.Engine) -> set[tuple[str, str]]:
    """(user, host) of every account this module may have made: its prefix, or anonymous."""
    query = "SELECT user, host FROM mysql.user WHERE user LIKE %s OR user = ''"
    with admin.connect() as conn:
        found = conn.exec_driver_sql(query, (P.replace("_", "\\_") + "%",)).all()
    return {(user, host) for user, host in found}


def mariadb_table_grants(admin: sa.Engine) -> set[tuple[str, str, str]]:
    """(user, database, table) of every table-level grant to those accounts."""
    query = "SELECT user, db, table_name FROM mysql.tables_priv WHERE user LIKE %s OR user = ''"
    with admin.connect() as conn:
        found = conn.exec_driver_sql(query, (P.replace("_", "\\_") + "%",)).all()
    return {(user, db, table) for user, db, table in found}


def drop_mariadb_users(admin: sa.Engine, users: set[tuple[str, str]]) -> None:
    with admin.begin() as conn:
        for user, host in users:
            conn.exec_driver_sql("DROP USER IF EXISTS %s@%s", (user, host))


@pytest.fixture
def mariadb(server_backend: Backend) -> Iterator[sa.Engine]:
    """The MariaDB server's admin engine; the accounts a test made are dropped afterwards
    (an anonymous one only if the test made it)."""
    admin = server_backend.engine
    before = mariadb_users(admin)
    assert not {u for u in before if u[0]}, f"left over from another run: {before}"
    try:
        yield admin
    finally:
        drop_mariadb_users(admin, mariadb_users(admin) - before)
    assert mariadb_users(admin) == before


@pytest.fixture
def databases(server_backend: Backend) -> Iterator[dict[str, str]]:
    """Two migrated databases on ``server_backend``'s server, {name: url}: the one the grants
    name, ``h2_<run>_a_1 %;-`` (spaces, wildcards, a semicolon, a dash), and one its name
    matches as a LIKE pattern, ``h2_<run>_aX1 %;-``."""
    url = sa.make_url(server_backend.url)
    names = [f"{P}_a_1 %;-", f"{P}_aX1 %;-"]
    server = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    quote = server.dialect.identifier_preparer.quote_identifier
    made: dict[str, str] = {}
    try:
        for name in names:
            with server.connect() as conn:
                conn.exec_driver_sql(f"CREATE DATABASE {quote(name)}")
            made[name] = url.set(database=name).render_as_string(hide_password=False)
            engine = sa.create_engine(made[name])
            try:
                migrations.upgrade(engine)
            finally:
                engine.dispose()
        yield made
    finally:
        force = " WITH (FORCE)" if server.dialect.name == "postgresql" else ""
        with server.connect() as conn:
            for name in made:
                conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {quote(name)}{force}")
        server.dispose()


def can(url: str, statement: str) -> bool:
    """Whether the account of ``url`` may run ``statement`` (False: refused for a privilege)."""
    engine = sa.create_engine(url)
    if engine.dialect.name != "postgresql":
        statement = statement.replace("%", "%%")  # pymysql formats the statement
    refusal: sa.exc.DBAPIError | None = None
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(statement)
    except sa.exc.DBAPIError as exc:
        refusal = exc
    finally:
        engine.dispose()
    if refusal is None:
        return True
    if engine.dialect.name == "postgresql":
        assert getattr(refusal.orig, "sqlstate", None) == "42501", refusal
    else:  # denied for a table, a column, the database
        assert refusal.orig.args[0] in (1142, 1143, 1044), refusal  # type: ignore[union-attr]
    return False


@pytest.mark.parametrize("server_backend", ["mysql"], indirect=True)
def test_mariadb_names_with_spaces_wildcards_and_semicolons_are_carried_exactly(
    server_backend: Backend, mariadb: sa.Engine, databases: dict[str, str]
) -> None:
    """User names with a space, ``%``, ``_`` and ``;``, and a database name with all of them:
    each user is made with exactly its name, granted on exactly that database, and nothing on
    the database its name matches as a LIKE pattern (``_`` -> ``X``)."""
    ours, other = databases
    users = {
        "RELAY_USER": f"{P}_re lay%_;",
        "APP_USER": f"{P}_a%p",
        "OPERATOR_USER": f"{P}_op_r -- x",
    }
    for _ in range(2):  # it must be re-runnable
        done = apply_mariadb(sa.make_url(server_backend.url), mariadb_values(ours, **users))
        assert done.returncode == 0, done.stderr[-3000:]
    assert mariadb_users(mariadb) == {(name, "%") for name in users.values()}
    granted = mariadb_table_grants(mariadb)
    assert {db for _, db, _ in granted} == {ours}
    assert {user for user, _, _ in granted} == set(users.values())

    def url_of(user: str, database: str) -> str:
        base = sa.make_url(databases[database])
        return base.set(username=user, password=PASSWORD).render_as_string(hide_password=False)

    relay, app = users["RELAY_USER"], users["APP_USER"]
    assert can(url_of(relay, ours), "SELECT COUNT(*) FROM outbox_messages")
    assert not can(url_of(relay, ours), "DELETE FROM outbox_messages")
    assert not can(url_of(app, ours), "SELECT COUNT(*) FROM outbox_attempts")
    # the LIKE pattern the name would be: nothing there, for anyone
    for user in users.values():
        assert not can(url_of(user, ours), f"SELECT COUNT(*) FROM `{other}`.outbox_messages")


# (placeholder, value): what each would do, pasted as it is
MARIADB_REFUSED = [
    ("RELAY_USER", f"{P}_relay\\"),  # escapes the literal's closing quote
    ("RELAY_USER", f"{P}_re\nlay"),  # a line break in an account name
    ("APP_USER", f"{P}_a`pp"),
    ("OPERATOR_USER", ""),  # unset: ''@'%', the anonymous user, granted the operator's rights
    ("DB_NAME", f"@DB@`.* TO {P}_relay -- "),  # ends the identifier: the whole database
    ("DB_NAME", ""),
    ("CLIENT_HOST", ""),
]
# a quote ends the literal the name is first read into: no check sees it, the statement that
# reads it fails. (A name crafted to end that literal and go on with SQL is SQL: the names are
# the choice of whoever runs the script as root, who gains nothing by it; docs/security.md.)
MARIADB_QUOTED = [
    ("RELAY_USER", f"{P}_o'brien"),
    ("APP_USER", f"{P}_a\\'pp"),
    # and grants everything on every database to the relay user (@DB@: the test database)
    (
        "DB_NAME",
        f"@DB@`.`outbox_messages` TO '{P}_app'@'%'; GRANT ALL ON *.* TO '{P}_relay'@'%'; -- ",
    ),
    ("CLIENT_HOST", "%'; CREATE USER '" + INJECTED + "'@'%"),
]


def reading_line(placeholder: str) -> int:
    """The line of grants-mariadb.sql that first reads ``placeholder``."""
    lines = (DEPLOY / "grants-mariadb.sql").read_text().splitlines()
    return 1 + next(n for n, line in enumerate(lines) if "${" + placeholder + "}" in line)


def refused(server_backend: Backend, mariadb: sa.Engine, placeholder: str, value: str) -> str:
    """Run the script with ``value`` for ``placeholder``: it must fail before any user is
    made; the client's error."""
    url = sa.make_url(server_backend.url)
    database = url.database or ""
    values = mariadb_values(database, **{placeholder: value.replace("@DB@", database)})
    done = apply_mariadb(url, values)
    output = done.stderr[-3000:]
    assert done.returncode != 0, output
    assert "ERROR" in done.stderr, output
    assert mariadb_users(mariadb) == set(), output  # refused before any user was made
    assert mariadb_table_grants(mariadb) == set()
    return done.stderr[done.stderr.index("ERROR") :]  # not the statement the client echoes


@pytest.mark.parametrize("server_backend", ["mysql"], indirect=True)
@pytest.mark.parametrize(("placeholder", "value"), MARIADB_REFUSED)
def test_mariadb_a_name_the_script_cannot_carry_is_refused_naming_its_placeholder(
    server_backend: Backend, mariadb: sa.Engine, placeholder: str, value: str
) -> None:
    error = refused(server_backend, mariadb, placeholder, value)
    assert f"{placeholder} refused" in error, error


@pytest.mark.parametrize("server_backend", ["mysql"], indirect=True)
@pytest.mark.parametrize(("placeholder", "value"), MARIADB_QUOTED)
def test_mariadb_a_name_with_a_quote_stops_the_script_at_the_line_reading_it(
    server_backend: Backend, mariadb: sa.Engine, placeholder: str, value: str
) -> None:
    error = refused(server_backend, mariadb, placeholder, value)
    assert f"at line {reading_line(placeholder)}:" in error, error


# -- PostgreSQL ----------------------------------------------------------------------------


def apply_postgresql(
    admin: sa.URL, database: str, roles: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """``psql -v ... -f grants-postgresql.sql`` connected to ``database`` (through PG*
    variables: no conninfo string to quote the name into)."""
    command = ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1"]
    for name, value in roles.items():
        command += ["-v", f"{name}={value}"]
    command += ["-f", str(DEPLOY / "grants-postgresql.sql")]
    env = {
        "PGHOST": admin.host or "127.0.0.1",
        "PGPORT": str(admin.port or 5432),
        "PGUSER": admin.username or "postgres",
        "PGDATABASE": database,
    }
    if admin.password:
        env["PGPASSWORD"] = admin.password
    return run(command, **env)


def pg_roles(admin: sa.Engine) -> set[str]:
    query = "SELECT rolname FROM pg_roles WHERE starts_with(rolname, %(p)s)"
    with admin.connect() as conn:
        return set(conn.exec_driver_sql(query, {"p": P}).scalars())


def drop_pg_roles(admin: sa.Engine, urls: list[str]) -> None:
    """Each role of this module, its privileges in every database of ``urls`` first."""
    roles = pg_roles(admin)
    if not roles:
        return
    quote = admin.dialect.identifier_preparer.quote_identifier
    names = ", ".join(quote(r) for r in sorted(roles))
    for url in urls:
        engine = sa.create_engine(url)
        try:
            with engine.begin() as conn:
                conn.exec_driver_sql(f"DROP OWNED BY {names}")
        finally:
            engine.dispose()
    with admin.begin() as conn:
        conn.exec_driver_sql(f"DROP ROLE {names}")


@pytest.fixture
def postgresql(server_backend: Backend, databases: dict[str, str]) -> Iterator[sa.Engine]:
    """The PostgreSQL server's admin engine; this module's roles dropped afterwards."""
    admin = server_backend.engine
    assert pg_roles(admin) == set(), "left over from another run"
    try:
        yield admin
    finally:
        drop_pg_roles(admin, [server_backend.url, *databases.values()])
    assert pg_roles(admin) == set()


def privilege(url: str, role: str, table: str, kind: str) -> bool:
    """has_table_privilege(role, table, kind) in the database of ``url``."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            query = "SELECT has_table_privilege(%(r)s, %(t)s, %(k)s)"
            return bool(conn.exec_driver_sql(query, {"r": role, "t": table, "k": kind}).scalar())
    finally:
        engine.dispose()


@pytest.mark.parametrize("server_backend", ["postgresql"], indirect=True)
def test_postgresql_hostile_role_and_database_names_are_values_not_sql(
    server_backend: Backend, postgresql: sa.Engine, databases: dict[str, str]
) -> None:
    ours, other = databases
    roles = {
        "relay_role": f"{P}_r\"e'; CREATE ROLE {INJECTED}; --",
        "relay_password": PASSWORD,
        "app_role": f"{P}_a`p p%_\\",
        "app_password": PASSWORD,
        "operator_role": f"{P}_O;p:'x\"",
        "operator_password": PASSWORD,
    }
    names = {roles["relay_role"], roles["app_role"], roles["operator_role"]}
    assert all(len(n.encode()) <= 63 for n in names)  # PostgreSQL's longest name
    url = sa.make_url(server_backend.url)
    for _ in range(2):  # it must be re-runnable
        done = apply_postgresql(url, ours, roles)
        assert done.returncode == 0, done.stderr[-3000:]
    assert pg_roles(postgresql) == names  # exactly those, and not INJECTED

    relay, app = roles["relay_role"], roles["app_role"]
    assert privilege(databases[ours], relay, "outbox_messages", "SELECT")
    assert not privilege(databases[ours], relay, "outbox_messages", "DELETE")
    assert privilege(databases[ours], app, "outbox_messages", "INSERT") is False  # columns only
    assert not privilege(databases[ours], app, "outbox_attempts", "SELECT")
    for role in names:
        for table in ("outbox_messages", "outbox_events"):
            assert not privilege(databases[other], role, table, "SELECT")
            assert not privilege(server_backend.url, role, table, "SELECT")
    login = sa.make_url(databases[ours]).set(username=relay, password=PASSWORD)
    assert can(login.render_as_string(hide_password=False), "SELECT COUNT(*) FROM outbox_events")


PG_REFUSED = [
    ("app_role", "public"),  # GRANT ... TO "public" is a grant to every role
    ("app_role", "pg_h2_x"),  # reserved prefix
    ("relay_role", ""),
]


@pytest.mark.parametrize("server_backend", ["postgresql"], indirect=True)
@pytest.mark.parametrize(("variable", "value"), PG_REFUSED)
def test_postgresql_a_reserved_or_empty_role_name_is_refused_and_grants_nothing(
    server_backend: Backend,
    postgresql: sa.Engine,
    databases: dict[str, str],
    variable: str,
    value: str,
) -> None:
    ours, _ = databases
    roles = {
        "relay_role": f"{P}_relay",
        "relay_password": PASSWORD,
        "app_role": f"{P}_app",
        "app_password": PASSWORD,
        variable: value,
    }
    done = apply_postgresql(sa.make_url(server_backend.url), ours, roles)
    assert done.returncode != 0, done.stderr[-3000:]
    engine = sa.create_engine(databases[ours])
    try:
        with engine.connect() as conn:
            granted = conn.exec_driver_sql(
                "SELECT grantee, table_name FROM information_schema.role_table_grants "
                "WHERE table_name LIKE 'outbox%%' AND grantee <> current_user"
            ).all()
            columns = conn.exec_driver_sql(
                "SELECT grantee FROM information_schema.column_privileges "
                "WHERE table_name LIKE 'outbox%%' AND grantee <> current_user"
            ).all()
    finally:
        engine.dispose()
    assert granted == [], done.stderr
    assert columns == [], done.stderr
