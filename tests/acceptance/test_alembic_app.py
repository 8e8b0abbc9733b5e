"""A new app's alembic, set up exactly as the docs say (docs/guides/alembic.md), on every backend.

A real ``alembic init`` project in a temporary directory, driven through the venv's ``alembic``
executable in subprocesses. The settings, the env.py lines and the commands are taken from the
guide's "Inside your app's alembic" section itself, so what the docs tell a user is what
runs here. The project starts on a copy of the installed ``outbox`` package that holds only the
first outbox revision (an older release), then switches to the real install (``pip install
-U``): its new revision must arrive through a plain ``alembic upgrade heads``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

import outbox
from outbox import migrations

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guides" / "alembic.md"
ALEMBIC = str(Path(sys.executable).with_name("alembic"))
FIRST_RELEASE = "0001_outbox_initial.py"
TABLES_0001 = {"outbox_messages", "outbox_attempts", "outbox_relays"}
TABLES_0002 = {"outbox_send_budget", "outbox_send_budget_lock"}
TABLES_0003 = {"outbox_events", "outbox_suppressions", "outbox_operator_actions", "outbox_intakes"}
TABLES_0004 = {"outbox_send_slots"}
HEAD = migrations.shipped_revisions()[-1]  # the newest revision this release ships
VIEWS_0001 = {
    "outbox_status_summary",
    "outbox_lag",
    "outbox_unknown_outcomes",
    "outbox_failures",
    "outbox_relay_health",
}

MODELS = """\
import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "shop_orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    customer: Mapped[str] = mapped_column(sa.String(255))
"""

LATER_MODEL = """

class OrderLine(Base):
    __tablename__ = "shop_order_lines"
    id: Mapped[int] = mapped_column(primary_key=True)
    order_id: Mapped[int] = mapped_column(sa.ForeignKey("shop_orders.id"))
"""


# -- the guide's instructions ----------------------------------------------------------------


def readme_section() -> str:
    text = GUIDE.read_text()
    start = text.index("**Inside your app's alembic**")
    return text[start : text.index("\n## ", start)]


def code_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", readme_section(), flags=re.DOTALL)


def ini_settings() -> dict[str, list[str]]:
    """The guide's alembic.ini settings: each key with its lines (continuations included)."""
    (block,) = code_blocks("ini")
    settings: dict[str, list[str]] = {}
    key = None
    for line in block.splitlines():
        if not line.strip() or line.lstrip().startswith("#") or line.startswith("["):
            continue
        if line[0].isspace():
            assert key is not None, line
            settings[key].append(line)
        else:
            key = line.split("=")[0].strip()
            settings[key] = [line]
    return settings


def env_lines() -> tuple[list[str], list[str]]:
    """The guide's env.py additions: import lines, and keyword arguments of context.configure."""
    (block,) = code_blocks("python")
    imports = [line for line in block.splitlines() if line.startswith(("from ", "import "))]
    kwargs = re.findall(r"^\s+(\w+=\w+),\s*$", block, flags=re.MULTILINE)
    assert imports, block
    assert kwargs, block
    return imports, kwargs


def readme_commands() -> list[list[str]]:
    (block,) = code_blocks("bash")
    lines = [line.split("#")[0].strip() for line in block.splitlines()]
    return [shlex.split(line) for line in lines if line]


# -- the app's project -------------------------------------------------------------------------


class Project:
    """An ``alembic init`` project of a small app, run as its developer runs it."""

    def __init__(self, root: Path, url: str) -> None:
        self.root = root
        self.url = url
        self.pythonpath: str | None = None
        root.mkdir()
        self.alembic("init", "alembic")
        (root / "shop").mkdir()
        (root / "shop" / "__init__.py").write_text("")
        (root / "shop" / "models.py").write_text(MODELS)

    @property
    def versions(self) -> Path:
        return self.root / "alembic" / "versions"

    def alembic(self, *args: str) -> str:
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        if self.pythonpath is not None:
            env["PYTHONPATH"] = os.pathsep.join(
                filter(None, [self.pythonpath, env.get("PYTHONPATH")])
            )
        done = subprocess.run(
            [ALEMBIC, *args],
            cwd=self.root,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, f"alembic {' '.join(args)}:\n{done.stdout}{done.stderr}"
        return done.stdout + done.stderr

    def configure_as_the_readme_says(self, *, hooks: bool = True) -> None:
        ini = self.root / "alembic.ini"
        lines = ini.read_text().splitlines()
        for key, setting in ini_settings().items():
            lines = set_option(lines, key, setting)
        lines = set_option(lines, "sqlalchemy.url", [f"sqlalchemy.url = {self.url_for_ini}"])
        ini.write_text("\n".join(lines) + "\n")

        env_py = self.root / "alembic" / "env.py"
        source = env_py.read_text()
        source = source.replace(
            "target_metadata = None",
            "from shop.models import Base\ntarget_metadata = Base.metadata",
        )
        imports, kwargs = env_lines()
        if not hooks:  # the guide's set-up without process_revision_directives
            imports = ["from outbox.migrations import include_object"]
            kwargs = [k for k in kwargs if k.startswith("include_object")]
        source = source.replace(
            "from alembic import context\n",
            "from alembic import context\n" + "\n".join(imports) + "\n",
        )
        calls = re.findall(r"context\.configure\(\n(\s+)", source)
        assert len(calls) == 2, "alembic init's env.py has an offline and an online configure"
        source = re.sub(
            r"context\.configure\(\n(\s+)",
            lambda m: "context.configure(\n" + "".join(f"{m[1]}{k},\n" for k in kwargs) + m[1],
            source,
        )
        env_py.write_text(source)

    @property
    def url_for_ini(self) -> str:
        return self.url.replace("%", "%%")

    def add_later_model(self) -> None:
        with (self.root / "shop" / "models.py").open("a") as f:
            f.write(LATER_MODEL)

    def new_revisions(self, known: set[Path]) -> list[Path]:
        """The revision files written since ``known``: exactly one is expected each time, here
        in the app's own versions directory (not in the outbox package's)."""
        return sorted(set(self.versions.glob("*.py")) - known)


def set_option(lines: list[str], key: str, setting: list[str]) -> list[str]:
    """Put ``setting`` where alembic init has ``key`` (set, or as a commented-out example), as
    the guide tells: change that line rather than add a second one. A key that alembic init
    does not mention at all goes right after ``[alembic]``."""
    pattern = re.compile(rf"^(# )?{re.escape(key)} =")
    found = [i for i, line in enumerate(lines) if pattern.match(line)]
    if found:
        at = found[-1]
        end = at + 1
        while end < len(lines) and lines[end][:1].isspace() and lines[end].strip():
            end += 1
        return [*lines[:at], *setting, *lines[end:]]
    at = lines.index("[alembic]") + 1
    return [*lines[:at], *setting, *lines[at:]]


# -- the database --------------------------------------------------------------------------


@pytest.fixture
def app_url(backend, tmp_path) -> Iterator[str]:
    """An empty database of the backend's kind, next to the backend's test database."""
    if backend.name == "sqlite":
        yield f"sqlite:///{tmp_path / 'app.db'}"
        return
    url = sa.make_url(backend.url)
    name = f"{url.database}_alembic_app"
    server = sa.create_engine(url, isolation_level="AUTOCOMMIT")
    force = " WITH (FORCE)" if backend.name == "postgresql" else ""
    with server.connect() as conn:
        conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name}{force}")
        conn.exec_driver_sql(f"CREATE DATABASE {name}")
    yield url.set(database=name).render_as_string(hide_password=False)
    with server.connect() as conn:
        conn.exec_driver_sql(f"DROP DATABASE IF EXISTS {name}{force}")
    server.dispose()


def schema(url: str) -> tuple[set[str], set[str], set[str]]:
    """(tables, views, alembic_version rows) of the app's database."""
    engine = sa.create_engine(url)
    try:
        inspector = sa.inspect(engine)
        tables = set(inspector.get_table_names())
        views = set(inspector.get_view_names())
        versions: set[str] = set()
        if "alembic_version" in tables:
            with engine.connect() as conn:
                versions = {
                    r[0] for r in conn.exec_driver_sql("SELECT version_num FROM alembic_version")
                }
        return tables, views, versions
    finally:
        engine.dispose()


@pytest.fixture
def older_release(tmp_path) -> Path:
    """A copy of the installed ``outbox`` package that ships only the first outbox revision: the
    release the app started on. Put first on PYTHONPATH, it is the installed package."""
    site = tmp_path / "older-release"
    shutil.copytree(
        Path(outbox.__file__).parent, site / "outbox", ignore=shutil.ignore_patterns("__pycache__")
    )
    for revision in (site / "outbox" / "_migrations" / "versions").glob("*.py"):
        if revision.name != FIRST_RELEASE:
            revision.unlink()
    return site


@pytest.fixture
def shipped_revisions() -> Iterator[None]:
    """The app's revisions must never land in the installed package's versions directory."""
    before = sorted(migrations.versions_dir().glob("*.py"))
    yield
    assert sorted(migrations.versions_dir().glob("*.py")) == before


# -- the tests -----------------------------------------------------------------------------


def test_readme_instructions_change_existing_lines_of_alembic_init(tmp_path):
    """The guide says which lines of alembic init's alembic.ini to change: they are there."""
    project = Project(tmp_path / "app", "sqlite://")
    ini = (project.root / "alembic.ini").read_text().splitlines()
    settings = ini_settings()
    assert set(settings) == {"path_separator", "revision_environment", "version_locations"}
    assert "path_separator = os" in ini  # set: the guide changes it (adding it again fails)
    assert "# revision_environment = false" in ini  # commented out: the guide sets it
    assert not [line for line in ini if line.startswith("version_locations")]
    section = readme_section()
    assert 'change "path_separator = os"' in section
    assert 'change "# revision_environment = false"' in section


def test_new_app_alembic_from_readme_then_an_outbox_upgrade(
    app_url, tmp_path, older_release, shipped_revisions
):
    """The guide's set-up and commands, word for word, on a fresh alembic init project."""
    project = Project(tmp_path / "app", app_url)
    project.configure_as_the_readme_says()
    commands = readme_commands()
    assert [c[:2] for c in commands] == [
        ["alembic", "upgrade"],
        ["alembic", "revision"],
        ["alembic", "upgrade"],
        ["alembic", "check"],
    ]
    upgrade, revision, _, check = (c[1:] for c in commands)

    # An app on the older release: the outbox tables and views of 0001 arrive.
    project.pythonpath = str(older_release)
    assert "outbox_0001 (outbox) (head)" in project.alembic("heads")
    project.alembic(*upgrade)
    tables, views, versions = schema(app_url)
    assert tables >= TABLES_0001
    assert not tables & (TABLES_0002 | TABLES_0003)
    assert views >= VIEWS_0001
    assert versions == {"outbox_0001"}

    # The app's first autogenerated revision: its table only, on a branch of its own.
    project.alembic(*revision)
    (first,) = project.new_revisions(set())
    text = first.read_text()
    assert "op.create_table('shop_orders'" in text
    assert "outbox" not in text  # neither drops nor creates ours, nor joins our branch
    assert re.search(r"^down_revision: .* = None$", text, flags=re.MULTILINE), text
    project.alembic(*upgrade)
    tables, _, versions = schema(app_url)
    assert "shop_orders" in tables
    first_id = first.name.split("_")[0]
    assert versions == {"outbox_0001", first_id}
    assert "No new upgrade operations detected" in project.alembic(*check)

    # pip install -U: the real install ships 0002 and later; a plain upgrade heads applies them.
    project.pythonpath = None
    assert f"{HEAD} (outbox) (head)" in project.alembic("heads")
    project.alembic(*upgrade)
    tables, views, versions = schema(app_url)
    assert tables >= TABLES_0001 | TABLES_0002 | TABLES_0003 | TABLES_0004
    assert views >= migrations.VIEWS
    assert versions == {HEAD, first_id}
    assert "No new upgrade operations detected" in project.alembic(*check)

    # A later app revision, with the same command: on top of the app's first, not of ours.
    project.add_later_model()
    project.alembic(*revision)
    (later,) = project.new_revisions({first})
    text = later.read_text()
    assert "op.create_table('shop_order_lines'" in text
    assert "outbox" not in text
    assert f"down_revision: Union[str, Sequence[str], None] = '{first_id}'" in text
    project.alembic(*upgrade)
    assert "No new upgrade operations detected" in project.alembic(*check)

    # A plain `alembic revision -m` (no autogenerate) lands on the app's head too.
    project.alembic("revision", "-m", "by hand")
    (by_hand,) = project.new_revisions({first, later})
    later_id = later.name.split("_")[0]
    assert f"= '{later_id}'" in by_hand.read_text()


def test_readme_flags_for_an_env_py_without_the_revision_hook(tmp_path, shipped_revisions):
    """The guide's explicit flags do what the hook does, for an env.py without it."""
    url = f"sqlite:///{tmp_path / 'app.db'}"
    project = Project(tmp_path / "app", url)
    project.configure_as_the_readme_says(hooks=False)
    section = " ".join(readme_section().split())
    first_flags = re.search(r"`(--head base --version-path [^`]+)`", section)
    later_flags = re.search(r"`(--head \w+@head)`", section)
    assert first_flags
    assert later_flags
    project.alembic("upgrade", "heads")
    assert schema(url)[0] >= TABLES_0001 | TABLES_0002
    project.alembic("revision", "--autogenerate", "-m", "orders", *first_flags[1].split())
    (first,) = project.new_revisions(set())
    assert re.search(r"^down_revision: .* = None$", first.read_text(), flags=re.MULTILINE)
    project.alembic("upgrade", "heads")
    project.add_later_model()
    project.alembic("revision", "--autogenerate", "-m", "lines", *later_flags[1].split())
    (later,) = project.new_revisions({first})
    assert f"= '{first.name.split('_')[0]}'" in later.read_text()
    project.alembic("upgrade", "heads")
    assert "No new upgrade operations detected" in project.alembic("check")


def test_the_revision_hook_leaves_an_explicit_head_and_several_app_heads_to_alembic(
    tmp_path, shipped_revisions
):
    """The hook only fills in what the user left to the default: a second app branch asked for
    with --head base stays a new base, and then a plain revision gets alembic's own error."""
    project = Project(tmp_path / "app", f"sqlite:///{tmp_path / 'app.db'}")
    project.configure_as_the_readme_says()
    project.alembic("upgrade", "heads")
    project.alembic("revision", "-m", "first")
    (first,) = project.new_revisions(set())
    project.alembic(
        "revision", "-m", "other", "--head", "base", "--version-path", "alembic/versions"
    )
    (other,) = project.new_revisions({first})
    for revision in (first, other):
        assert re.search(r"^down_revision: .* = None$", revision.read_text(), flags=re.MULTILINE)
    done = subprocess.run(
        [ALEMBIC, "revision", "-m", "third"],
        cwd=project.root,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode != 0
    assert "Multiple heads are present" in done.stderr
    assert project.new_revisions({first, other}) == []


def test_the_apps_first_revision_is_labelled_app_so_a_downgrade_can_name_its_branch(
    tmp_path, shipped_revisions
):
    """`alembic downgrade -1` with two branches is alembic's pick and stepped back the outbox's
    newest revision (dropping the send budget); `app@-1`, as the guide says, steps back the
    app's own revision and leaves the outbox schema alone."""
    url = f"sqlite:///{tmp_path / 'app.db'}"
    project = Project(tmp_path / "app", url)
    project.configure_as_the_readme_says()
    project.alembic("upgrade", "heads")
    project.alembic("revision", "--autogenerate", "-m", "orders")
    (first,) = project.new_revisions(set())
    assert re.search(r"^branch_labels: .* = \('app',\)$", first.read_text(), flags=re.MULTILINE)
    project.alembic("upgrade", "heads")
    project.add_later_model()
    project.alembic("revision", "--autogenerate", "-m", "lines")
    assert len(project.new_revisions({first})) == 1
    project.alembic("upgrade", "heads")
    assert "alembic downgrade app@-1" in " ".join(readme_section().split())
    project.alembic("downgrade", "app@-1")
    tables, _, versions = schema(url)
    assert "shop_order_lines" not in tables
    assert tables >= TABLES_0001 | TABLES_0002
    assert versions == {HEAD, first.name.split("_")[0]}


def outbox_relay_migrate(url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(Path(sys.executable).with_name("outbox-relay")), "migrate", "--database-url", url],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_database_migrated_standalone_is_handed_over_to_the_apps_alembic_as_it_says(
    app_url, tmp_path, shipped_revisions
):
    """`outbox-relay migrate` first, the app's alembic later: `alembic upgrade heads` used to
    fail in the DDL ("table outbox_messages already exists", a traceback); it now stops before
    creating anything, and the two steps it names hand the schema over."""
    migrate = outbox_relay_migrate(app_url)
    assert migrate.returncode == 0, migrate.stderr
    project = Project(tmp_path / "app", app_url)
    project.configure_as_the_readme_says()
    done = subprocess.run(
        [ALEMBIC, "upgrade", "heads"],
        cwd=project.root,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "Traceback" not in output
    assert (
        "FAILED: the outbox schema of this database was created by `outbox-relay migrate` (its "
        f"revisions are in outbox_alembic_version: {HEAD}); to carry it on in your alembic, "
        f"run `alembic stamp {HEAD}` (the outbox as a branch of its own) or `alembic stamp "
        "<your revision carrying them>` (on your branch: outbox-relay alembic-revision), drop "
        "the table outbox_alembic_version, then upgrade again"
    ) in output
    project.alembic("stamp", HEAD)
    engine = sa.create_engine(app_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE outbox_alembic_version")
    engine.dispose()
    project.alembic("upgrade", "heads")
    project.alembic("revision", "--autogenerate", "-m", "orders")
    project.alembic("upgrade", "heads")
    tables, _, versions = schema(app_url)
    assert tables >= TABLES_0001 | TABLES_0002 | {"shop_orders"}
    assert "outbox_alembic_version" not in tables
    assert HEAD in versions
    assert "No new upgrade operations detected" in project.alembic("check")


def test_outbox_relay_migrate_on_a_schema_the_apps_alembic_carries_says_to_use_alembic(
    app_url, tmp_path, shipped_revisions
):
    """The other way round: `outbox-relay migrate` used to fail with "table outbox_messages
    already exists" and nothing to do about it."""
    project = Project(tmp_path / "app", app_url)
    project.configure_as_the_readme_says()
    project.alembic("upgrade", "heads")
    migrate = outbox_relay_migrate(app_url)
    assert migrate.returncode == 2
    assert migrate.stderr == (
        "Error: --database-url: the outbox schema of this database is in your app's alembic "
        f"(its alembic_version holds {HEAD}): keep it up to date with `alembic upgrade "
        "heads`, not outbox-relay migrate\n"
    )
    project.alembic("upgrade", "heads")  # the app's alembic goes on as before
    assert schema(app_url)[2] == {HEAD}


def test_offline_upgrade_of_the_readme_set_up_writes_the_outbox_ddl(tmp_path, shipped_revisions):
    """`alembic upgrade heads --sql` has no database to look at: the check for a schema
    recorded elsewhere stands aside, and the outbox tables' DDL is printed."""
    project = Project(tmp_path / "app", f"sqlite:///{tmp_path / 'app.db'}")
    project.configure_as_the_readme_says()
    output = project.alembic("upgrade", "heads", "--sql")
    assert "CREATE TABLE outbox_messages" in output
    assert "INSERT INTO alembic_version (version_num) VALUES ('outbox_0001')" in output


# -- the outbox on the app's own branch (outbox-relay alembic-revision) ---------------------


def outbox_relay(project: Project, *args: str) -> subprocess.CompletedProcess[str]:
    """``outbox-relay`` run in the project's directory, with the project's PYTHONPATH."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    if project.pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [project.pythonpath, env.get("PYTHONPATH")])
        )
    return subprocess.run(
        [str(Path(sys.executable).with_name("outbox-relay")), *args],
        cwd=project.root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def configure_single_branch(project: Project) -> None:
    """alembic init's project with the app's url and models, and only include_object added."""
    ini = project.root / "alembic.ini"
    lines = set_option(
        ini.read_text().splitlines(), "sqlalchemy.url", [f"sqlalchemy.url = {project.url_for_ini}"]
    )
    ini.write_text("\n".join(lines) + "\n")
    env_py = project.root / "alembic" / "env.py"
    source = env_py.read_text().replace(
        "target_metadata = None", "from shop.models import Base\ntarget_metadata = Base.metadata"
    )
    source = source.replace(
        "from alembic import context\n",
        "from alembic import context\nfrom outbox.migrations import include_object\n",
    )
    source = re.sub(
        r"context\.configure\(\n(\s+)",
        lambda m: f"context.configure(\n{m[1]}include_object=include_object,\n{m[1]}",
        source,
    )
    env_py.write_text(source)


def test_the_outbox_on_the_apps_own_branch_upgrades_with_head_and_steps_back_with_minus_one(
    app_url, tmp_path, older_release, shipped_revisions
):
    """For deploy scripts that say `alembic upgrade head`: the outbox's revisions carried by
    revisions of the app's own, one branch, through an outbox upgrade and a `downgrade -1`."""
    project = Project(tmp_path / "app", app_url)
    configure_single_branch(project)

    # On the older release: one app revision carrying outbox_0001, on base.
    project.pythonpath = str(older_release)
    done = outbox_relay(project, "alembic-revision")
    assert done.returncode == 0, done.stderr
    (carrier,) = project.new_revisions(set())
    assert "outbox_revisions = ('outbox_0001',)" in carrier.read_text()
    assert "(revision " in done.stdout
    assert "outbox_0001" in done.stdout
    project.alembic("upgrade", "head")
    project.alembic("revision", "--autogenerate", "-m", "orders")
    (orders,) = project.new_revisions({carrier})
    assert "outbox" not in orders.read_text()  # include_object: the outbox is not the app's
    project.alembic("upgrade", "head")
    tables, views, versions = schema(app_url)
    assert tables >= TABLES_0001 | {"shop_orders"}
    assert not tables & (TABLES_0002 | TABLES_0003)
    assert views >= VIEWS_0001
    assert versions == {orders.name.split("_")[0]}, "one branch: one row"

    # pip install -U: the same command carries the new outbox revisions on the app's head.
    project.pythonpath = None
    done = outbox_relay(project, "alembic-revision", "-m", "outbox 0.2")
    assert done.returncode == 0, done.stderr
    (newer,) = project.new_revisions({carrier, orders})
    text = newer.read_text()
    later = tuple(migrations.shipped_revisions()[1:])
    assert f"outbox_revisions = {later!r}" in text
    assert f"= '{orders.name.split('_')[0]}'" in text  # on the app's head
    again = outbox_relay(project, "alembic-revision")
    assert again.returncode == 0, again.stderr
    assert "carries every outbox revision" in again.stdout
    assert project.new_revisions({carrier, orders, newer}) == []
    project.alembic("upgrade", "head")
    tables, views, _ = schema(app_url)
    assert tables >= TABLES_0001 | TABLES_0002 | TABLES_0003 | TABLES_0004
    assert views >= migrations.VIEWS
    assert "No new upgrade operations detected" in project.alembic("check")

    # downgrade -1 undoes exactly the newest revision: the outbox's 0002 and later
    project.alembic("downgrade", "-1")
    tables, _, versions = schema(app_url)
    assert tables >= TABLES_0001 | {"shop_orders"}
    assert not tables & (TABLES_0002 | TABLES_0003 | TABLES_0004)
    assert versions == {orders.name.split("_")[0]}
    project.alembic("upgrade", "head")
    assert schema(app_url)[0] >= TABLES_0003


def test_alembic_revision_refuses_a_history_that_carries_the_outbox_as_a_branch(tmp_path):
    project = Project(tmp_path / "app", f"sqlite:///{tmp_path / 'app.db'}")
    project.configure_as_the_readme_says()
    done = outbox_relay(project, "alembic-revision")
    assert done.returncode == 1
    (line,) = done.stderr.strip().splitlines()
    assert "lists the outbox's versions directory" in line
    assert "alembic upgrade heads" in line
    # and what the branch way's `upgrade head` says once the app has a revision of its own,
    # which the guide quotes
    project.alembic("revision", "-m", "first")
    failed = subprocess.run(
        [ALEMBIC, "upgrade", "head"], cwd=project.root, capture_output=True, text=True, check=False
    )
    assert failed.returncode != 0
    assert "Multiple head revisions are present" in failed.stderr
    readme = " ".join(GUIDE.read_text().split())
    assert "Multiple head revisions are present for given argument 'head'" in readme


def test_alembic_revision_refuses_a_template_that_would_drop_the_outbox_calls(tmp_path):
    """alembic's multi-database template renders upgrade_<engine>() bodies of its own: the
    revision would claim the outbox revisions and apply none (and a second run would say all
    is carried). Refused, nothing left behind."""
    root = tmp_path / "app"
    root.mkdir()
    done = subprocess.run(
        [ALEMBIC, "init", "-t", "multidb", "alembic"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    project = Project.__new__(Project)  # an existing directory: no second `alembic init`
    project.root, project.url, project.pythonpath = root, "sqlite://", None
    refused = outbox_relay(project, "alembic-revision")
    assert refused.returncode == 1, refused.stdout + refused.stderr
    (line,) = refused.stderr.strip().splitlines()
    assert "does not write ${imports}, ${upgrades} and ${downgrades}" in line
    assert list(project.versions.glob("*.py")) == []


def test_a_standalone_schema_moves_onto_the_apps_branch_and_migrate_then_refuses(tmp_path):
    """`outbox-relay migrate` first, then the app carries the outbox on its own branch: the
    upgrade stops naming the stamp that hands it over, which works; afterwards `migrate`
    refuses, naming alembic (it failed on "table outbox_messages already exists")."""
    url = f"sqlite:///{tmp_path / 'app.db'}"
    assert outbox_relay_migrate(url).returncode == 0
    project = Project(tmp_path / "app", url)
    configure_single_branch(project)
    assert outbox_relay(project, "alembic-revision").returncode == 0
    (carrier,) = project.new_revisions(set())
    failed = subprocess.run(
        [ALEMBIC, "upgrade", "head"], cwd=project.root, capture_output=True, text=True, check=False
    )
    assert failed.returncode != 0
    assert "`alembic stamp <your revision carrying them>`" in failed.stdout + failed.stderr
    project.alembic("stamp", carrier.name.split("_")[0])
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE outbox_alembic_version")
    engine.dispose()
    project.alembic("upgrade", "head")
    assert schema(url)[2] == {carrier.name.split("_")[0]}

    migrate = outbox_relay_migrate(url)
    assert migrate.returncode == 2
    assert "were created by your app's alembic" in migrate.stderr
    assert "`alembic upgrade head`" in migrate.stderr
