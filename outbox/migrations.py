"""Where the bundled alembic migrations live, and how to apply them.

Two ways to create the outbox schema:

* **Standalone** (sidecar / init container): ``outbox-relay migrate --database-url URL`` or
  :func:`upgrade`. Revisions are recorded in their own table, ``outbox_alembic_version``, so
  they never collide with the host app's ``alembic_version``.
* **Inside the host app's alembic**: in ``alembic.ini`` set ``path_separator = newline`` (in
  place of the ``os`` that ``alembic init`` writes: on POSIX that splits on ``:``, which would
  cut ``outbox:_migrations/versions`` in two) and list ``outbox:_migrations/versions`` after
  the app's own directory in ``version_locations``, and ``revision_environment = true`` (so a
  plain ``alembic revision`` runs env.py and its hook); then ``alembic upgrade heads``. The
  revisions carry the branch label ``outbox``. In the app's ``env.py``, pass
  :func:`include_object` (autogenerate and ``alembic check`` ignore the outbox schema) and
  :func:`process_revision_directives` (the app's new revisions go to the app's own directory
  and branch, never onto the outbox branch) to ``context.configure``.

* **On the app's own branch** (for deploy scripts that say ``alembic upgrade head`` and
  ``downgrade -1``): :func:`write_app_revision` (``outbox-relay alembic-revision``) writes a
  revision of the app's own, on its head, that applies the outbox revisions its history does
  not hold yet (:func:`run_outbox_revisions`); after upgrading sqlalchemy-outbox, run it again.
  Only :func:`include_object` goes into ``env.py``; ``version_locations`` stays the app's.

The migrations' one source is the top-level ``migrations/`` of the source tree. In a checkout
``outbox/_migrations`` is a relative symlink to it; the wheel and the sdist hold the files
there, so ``outbox:_migrations/versions`` names them in every install (editable, wheel, sdist).
Pick one way per database: both record what they applied, in different tables.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.operations.ops import MigrationScript
from alembic.runtime.migration import MigrationContext
from alembic.script import Script, ScriptDirectory
from alembic.util import CommandError, coerce_resource_to_filename, rev_id
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from outbox.schema import metadata

__all__ = [
    "BRANCH",
    "VERSION_TABLE",
    "VIEWS",
    "alembic_config",
    "current_heads",
    "downgrade",
    "include_object",
    "migrations_dir",
    "process_revision_directives",
    "run_outbox_revisions",
    "shipped_revisions",
    "upgrade",
    "versions_dir",
    "write_app_revision",
]

BRANCH = "outbox"
_APP_BRANCH = "app"  # the branch label process_revision_directives gives an app's first revision
VERSION_TABLE = "outbox_alembic_version"
VIEWS = frozenset(
    {
        "outbox_status_summary",
        "outbox_lag",
        "outbox_unknown_outcomes",
        "outbox_failures",
        "outbox_relay_health",
        "outbox_delivery_summary",
        "outbox_event_intake",
        "outbox_operator_log",
        "outbox_fairness",
    }
)


def migrations_dir() -> Path:
    """The alembic script directory, ``outbox/_migrations`` (what ``outbox:_migrations/versions``
    names), resolved: in a checkout, the top-level ``migrations/`` its symlink points to, so
    that it compares equal to a ``version_locations`` entry resolved the same way."""
    candidate = (Path(__file__).resolve().parent / "_migrations").resolve()
    if not (candidate / "env.py").is_file():
        raise FileNotFoundError(
            f"the outbox migrations are missing from this installation: {candidate} (in a "
            "checkout, outbox/_migrations is a symlink to migrations/: git's core.symlinks)"
        )
    return candidate


def versions_dir() -> Path:
    """The directory of revision files to add to a host app's ``version_locations``."""
    return migrations_dir() / "versions"


def alembic_config(url: str | None = None, *, connection: sa.Connection | None = None) -> Config:
    """An alembic ``Config`` for the standalone environment, bound to a URL or a connection."""
    cfg = Config()
    cfg.set_main_option("path_separator", "newline")  # a path may hold ':' or ' '; not this
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.set_main_option("version_locations", str(versions_dir()))
    cfg.set_main_option("version_table", VERSION_TABLE)
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def upgrade(bind: sa.Engine | sa.Connection | str, revision: str = "heads") -> None:
    """Apply the outbox migrations to ``bind`` up to ``revision``.

    ``bind`` is an Engine (one transaction, committed), a URL, or a Connection: inside its
    open transaction, which the caller commits, or else each revision committed on its own.
    Alembic is synchronous: with an AsyncEngine,
    ``async with engine.begin() as conn: await conn.run_sync(upgrade)``.
    """
    _run(bind, command.upgrade, revision, "upgrade")


def downgrade(bind: sa.Engine | sa.Connection | str, revision: str = "base") -> None:
    """Revert the outbox migrations on ``bind`` down to ``revision`` (``base`` drops all)."""
    _run(bind, command.downgrade, revision, "downgrade")


def current_heads(bind: sa.Engine | sa.Connection) -> tuple[set[str], set[str]]:
    """(revisions applied in the database, head revisions shipped with this package)."""
    _refuse_other_binds(bind, "current_heads", accepted=(sa.Engine, sa.Connection))
    if isinstance(bind, sa.Connection):
        applied = _applied(bind)
    else:
        with bind.connect() as conn:
            applied = _applied(conn)
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


def process_revision_directives(
    context: MigrationContext, revision: object, directives: list[MigrationScript]
) -> None:
    """An alembic ``process_revision_directives`` hook for a host app whose
    ``version_locations`` include the outbox revisions.

    Without it, ``alembic revision`` builds on the only head there is before the app has one
    (``outbox@head``): the app's revision would join the outbox branch and be written into the
    installed package. With it, a revision asked for with the default ``--head head`` is based
    on the app's own head, or on ``base`` in the app's versions directory for its first one
    (labelled ``app``, so that ``alembic downgrade app@-1`` steps back the app's branch: a bare
    ``-1`` is alembic's pick of the two), so plain ``alembic revision --autogenerate -m ...``
    does the right thing. An explicit
    ``--head``/``--version-path`` is left alone; several app heads are left to alembic's own
    "multiple heads" error. An app with a hook of its own calls this one from it.
    """
    script = context.script
    if script is None:
        return
    ours = versions_dir()
    locations = [coerce_resource_to_filename(loc).resolve() for loc in script.version_locations]
    if ours not in locations:
        return
    app_locations = [loc for loc in locations if loc != ours]
    app_heads = [
        head.revision
        for head in script.get_revisions("heads")
        if head is not None and Path(head.path).resolve().parent != ours
    ]
    for directive in directives:
        if directive.head not in (None, "head"):  # the command line's default is None
            continue
        if len(app_heads) == 1:
            directive.head = app_heads[0]
        elif not app_heads:
            directive.head = "base"
            if not directive.branch_label:  # so that `alembic downgrade app@-1` names it
                directive.branch_label = _APP_BRANCH
            if directive.version_path is None and len(app_locations) == 1:
                directive.version_path = app_locations[0].as_posix()


def shipped_revisions() -> list[str]:
    """The outbox revisions this release ships, oldest first."""
    script = ScriptDirectory.from_config(alembic_config())
    return [rev.revision for rev in reversed(list(script.walk_revisions()))]


def run_outbox_revisions(
    revisions: Sequence[str], direction: Literal["upgrade", "downgrade"]
) -> None:
    """Run the outbox revisions' own ``upgrade`` (in order) or ``downgrade`` (in reverse)
    inside the migration alembic is running now: a revision of the app's that carries them
    (:func:`write_app_revision`) calls this from its ``upgrade`` and ``downgrade``."""
    script = ScriptDirectory.from_config(alembic_config())
    ordered = list(revisions) if direction == "upgrade" else list(reversed(revisions))
    for revision in ordered:
        found = script.get_revision(revision)
        if found is None:  # pragma: no cover - get_revision raises for an unknown id
            raise CommandError(f"no outbox revision {revision!r} in this release")
        getattr(found.module, direction)()


_CARRIES = "outbox_revisions"  # what a revision of the app's written here says it applies


def write_app_revision(config: Config, message: str = "outbox schema") -> Script | None:
    """Write, on the head of the app's alembic history (``config``: its ``alembic.ini``), a
    revision that applies the outbox revisions the history does not carry yet; None when it
    carries them all. The app keeps one branch: ``alembic upgrade head`` and ``downgrade -1``
    mean what they always did. Refused (``CommandError``) for a history that lists the outbox's
    versions directory (the branch way: use ``heads`` there), has several heads, or carries an
    outbox revision this release does not ship (an older sqlalchemy-outbox is installed)."""
    script = ScriptDirectory.from_config(config)
    ours = versions_dir()
    locations = [coerce_resource_to_filename(loc).resolve() for loc in script.version_locations]
    if ours in locations:
        raise CommandError(
            "this alembic history lists the outbox's versions directory in version_locations "
            "(the outbox as a branch of its own): keep using `alembic upgrade heads`, or remove "
            "it from version_locations before carrying the outbox on your branch"
        )
    carried: list[str] = []
    for revision in script.walk_revisions():
        carried += getattr(revision.module, _CARRIES, ())
    shipped = shipped_revisions()
    unknown = sorted(set(carried) - set(shipped))
    if unknown:
        raise CommandError(
            f"your history carries outbox revision(s) {', '.join(unknown)} that this "
            "sqlalchemy-outbox does not ship: install the release that wrote them, or newer"
        )
    missing = [r for r in shipped if r not in carried]
    if not missing:
        return None
    names = repr(tuple(missing))
    written = script.generate_revision(
        rev_id(),
        message,
        head="head",
        config=config,  # what `alembic revision` gives a template too
        imports=(
            "from outbox.migrations import run_outbox_revisions\n\n"
            "# the sqlalchemy-outbox revisions this one applies (outbox-relay alembic-revision)\n"
            f"{_CARRIES} = {names}"
        ),
        upgrades=f'run_outbox_revisions({_CARRIES}, "upgrade")',
        downgrades=f'run_outbox_revisions({_CARRIES}, "downgrade")',
    )
    if written is None or not _carries(Path(written.path), missing):
        if written is not None:
            Path(written.path).unlink()
        raise CommandError(
            "your script.py.mako does not write ${imports}, ${upgrades} and ${downgrades} into "
            "upgrade() and downgrade() (a multi-database template?): nothing was written; add "
            "a revision by hand whose upgrade() and downgrade() call "
            f"run_outbox_revisions({names}, 'upgrade' / 'downgrade')"
        )
    return written


def _carries(path: Path, revisions: list[str]) -> bool:
    """Whether the revision file at ``path`` says it carries ``revisions`` and both its
    ``upgrade`` and ``downgrade`` run them: a template that dropped a slot would otherwise
    write a revision claiming them that applies nothing."""
    tree = ast.parse(path.read_text())
    declared = [
        node.value
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == _CARRIES for t in node.targets)
    ]
    if len(declared) != 1 or ast.literal_eval(declared[0]) != tuple(revisions):
        return False
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    for direction in ("upgrade", "downgrade"):
        function = functions.get(direction)
        if function is None or not any(_runs(node, direction) for node in ast.walk(function)):
            return False
    return True


def _runs(node: ast.AST, direction: str) -> bool:
    """``node`` is ``run_outbox_revisions(outbox_revisions, "<direction>")``."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "run_outbox_revisions"
        and len(node.args) == 2
        and isinstance(node.args[0], ast.Name)
        and node.args[0].id == _CARRIES
        and isinstance(node.args[1], ast.Constant)
        and node.args[1].value == direction
    )


def _applied(conn: sa.Connection) -> set[str]:
    ctx = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
    return set(ctx.get_current_heads())


def _run(
    bind: sa.Engine | sa.Connection | str,
    fn: Callable[[Config, str], None],
    revision: str,
    name: str,
) -> None:
    _refuse_other_binds(bind, name, accepted=(sa.Engine, sa.Connection, str))
    if isinstance(bind, sa.Connection):
        fn(alembic_config(connection=bind), revision)
        return
    engine = sa.create_engine(bind) if isinstance(bind, str) else bind
    try:
        with engine.begin() as conn:
            fn(alembic_config(connection=conn), revision)
    finally:
        if isinstance(bind, str):
            engine.dispose()


_KINDS: dict[type, str] = {
    sa.Engine: "a sqlalchemy Engine",
    sa.Connection: "a Connection",
    str: "a database URL",
}


def _refuse_other_binds(bind: object, name: str, accepted: tuple[type, ...]) -> None:
    """Alembic is synchronous: an AsyncEngine, its ``sync_engine`` (which cannot connect outside
    SQLAlchemy's greenlet) or an async driver's URL, or any other object, gets a TypeError saying
    what to pass instead of an error from deep inside alembic."""
    asynchronous = _async_kind(bind)
    if asynchronous is None and isinstance(bind, accepted):
        return
    call = f"outbox.migrations.{name}()"
    if asynchronous is not None:
        raise TypeError(
            f"{call} runs alembic, which is synchronous: it cannot take {asynchronous}. Run it "
            f"on the async engine's connection: `async with engine.begin() as conn: "
            f"await conn.run_sync(outbox.migrations.{name})`"
            + (", or pass a URL with a sync driver" if str in accepted else "")
        )
    kinds = [_KINDS[kind] for kind in accepted]
    wanted = ", ".join(kinds[:-1]) + " or " + kinds[-1]
    raise TypeError(f"{call} takes {wanted}, not {type(bind).__name__}")


def _async_kind(bind: object) -> str | None:
    """How to name ``bind`` in the error if it is asynchronous, else None."""
    if isinstance(bind, AsyncEngine | AsyncConnection):
        return f"an {type(bind).__name__}"
    if isinstance(bind, sa.Engine) and bind.dialect.is_async:
        return f"an Engine of the async driver {bind.dialect.driver} (such as .sync_engine)"
    if isinstance(bind, str):
        dialect = sa.make_url(bind).get_dialect()
        if dialect.is_async:
            return f"a URL of the async driver {dialect.driver}"
    return None
