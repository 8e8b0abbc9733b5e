"""The module map of docs/design.md against the code.

Every module under ``outbox/``, ``relay/`` and ``migrations/`` (the alembic scripts, once: the
walk does not follow the ``outbox/_migrations`` symlink) has a row in the map; every import of a
project module it makes (``import``, ``from ... import``, relative ones, inside functions and
under ``TYPE_CHECKING`` alike) is one its row allows, or a known exception listed under the map;
and the map itself keeps the layering rules the page states in words.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"
PACKAGES = ("outbox", "relay", "migrations")
MAP_HEADER = "| module | owns | may import |"
EXCEPTIONS_HEADER = "| module | imports | why |"
NAME = re.compile(r"`([A-Za-z_][\w.]*(?:\.\*)?)`")
# the senders the command line picks from; nothing else knows them by name
CONCRETE_SENDERS = ("relay.senders.console", "relay.senders.ses", "relay.senders.smtp")
COMMAND_LINE = (
    "relay.cli",
    "relay.cli.migrations",
    "relay.cli.process",
    "relay.cli.sendtest",
    "relay.cli.console",
    "relay.admin",
    "relay.admin.batches",
    "relay.admin.change",
    "relay.admin.inspect",
    "relay.admin.options",
    "relay.admin.output",
    "relay.admin.pruning",
    "relay.admin.suppressions",
    "relay.cli_options",
    # the console: the command line's peer (its actions run relay.admin's change code)
    "relay.console",
    "relay.console.actions",
    "relay.console.guard",
    "relay.console.live",
    "relay.console.masking",
    "relay.console.sanitize",
    "relay.console.ses_import",
    "relay.console.users",
    "relay.console.views",
)
PURE = ("relay.policy", "relay.pause", "relay.ratelimit", "relay.events")
SHARED_WITH_THE_RELAY = (
    "outbox.autocommit",
    "outbox.enqueue",
    "outbox.exceptions",
    "outbox.message",
    "outbox.migrations",
    "outbox.schema",
)
REVISIONS = "migrations.versions.*"
DISPATCH = "relay.loop.dispatch"
DATABASE = ("relay.loop.connection", "relay.db", "relay.clock")  # what opens or reads the database
MAINTENANCE = ("relay.loop.maintenance",)
MAINTENANCE_MAY = ("relay.store", "relay.policy", "relay.loop.announce", "relay.loop.connection")


@dataclass(frozen=True, kw_only=True, slots=True)
class Import:
    module: str
    path: Path
    line: int
    target: str

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: {self.module} imports {self.target}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def project_files() -> dict[str, Path]:
    files = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            files[module_name(path)] = path
    return files


FILES = project_files()


def resolve(base: str, names: list[str]) -> Iterator[str]:
    """What ``from base import names`` depends on: ``base.name`` where that is a module of
    its own, else ``base`` itself."""
    plain = False
    for name in names:
        if f"{base}.{name}" in FILES:
            yield f"{base}.{name}"
        else:
            plain = True
    if plain:
        yield base


def imports_of(module: str, path: Path, source: str | None = None) -> list[Import]:
    """The project modules ``module`` imports, anywhere in its file, in line order."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    text = path.read_text() if source is None else source
    found = []
    for node in ast.walk(ast.parse(text, str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [alias.name for alias in node.names]
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                if node.module:
                    base = f"{base}.{node.module}"
            else:
                base = node.module or ""
            targets = list(resolve(base, names))
        for target in targets:
            if target.split(".")[0] in PACKAGES:
                found.append(Import(module=module, path=path, line=node.lineno, target=target))
    return sorted(found, key=lambda i: (i.line, i.target))


def section(text: str, heading: str) -> list[str]:
    lines = text.splitlines()
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def table(lines: list[str], header: str) -> list[list[str]]:
    """The rows of the table under ``header``, each as its cells."""
    start = lines.index(header) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows


def names(cell: str) -> set[str]:
    return set(NAME.findall(cell))


def read_map() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """``(allowed, exceptions)``: per module (or ``dir.*`` pattern), the project modules its
    row allows, and the imports the page lists as known exceptions."""
    lines = section(DESIGN.read_text(), "## Module map")
    allowed: dict[str, set[str]] = {}
    for row in table(lines, MAP_HEADER):
        [module] = names(row[0])
        assert module not in allowed, f"{module} has two rows in the module map"
        allowed[module] = names(row[-1])
    exceptions: dict[str, set[str]] = {}
    for row in table(lines, EXCEPTIONS_HEADER):
        [module] = names(row[0])
        exceptions.setdefault(module, set()).update(names(row[1]))
    return allowed, exceptions


ALLOWED, EXCEPTIONS = read_map()


def row_of(module: str) -> str | None:
    if module in ALLOWED:
        return module
    pattern = module.rpartition(".")[0] + ".*"
    return pattern if pattern in ALLOWED else None


def test_every_module_has_a_row_and_every_row_a_module():
    unlisted = sorted(m for m in FILES if row_of(m) is None)
    assert unlisted == [], f"modules missing from the module map in docs/design.md: {unlisted}"
    rows = {row_of(m) for m in FILES}
    stale = sorted(set(ALLOWED) - rows)
    assert stale == [], f"module map rows naming no module: {stale}"


def test_every_project_import_is_one_its_row_allows():
    assert len(FILES) > 30
    refused = []
    for module, path in FILES.items():
        row = row_of(module)
        if row is None:
            continue  # reported by test_every_module_has_a_row_and_every_row_a_module
        allowed = ALLOWED[row] | EXCEPTIONS.get(module, set())
        refused += [
            str(i)
            for i in imports_of(module, path)
            if i.target != module and i.target not in allowed
        ]
    assert refused == [], (
        "imports the module map in docs/design.md does not allow (fix the import, or the "
        "map if the layering rules allow it):\n" + "\n".join(refused)
    )


def test_every_known_exception_is_still_an_import():
    made = {(i.module, i.target) for m, p in FILES.items() for i in imports_of(m, p)}
    gone = sorted(
        f"{module} -> {target}"
        for module, targets in EXCEPTIONS.items()
        for target in targets
        if (module, target) not in made
    )
    assert gone == [], f"known exceptions in docs/design.md that the code no longer has: {gone}"


def test_every_allowed_import_names_a_project_module():
    unknown = sorted(
        f"{module} -> {target}"
        for module, targets in ALLOWED.items()
        for target in targets
        if target not in FILES
    )
    assert unknown == [], f"the module map allows modules that do not exist: {unknown}"


def test_the_map_keeps_the_layering_rules():
    broken = []
    for module, targets in ALLOWED.items():
        for target in sorted(targets):
            side, package = module.split(".")[0], target.split(".")[0]
            if side == "outbox" and package == "relay":
                broken.append(f"{module} -> {target}: the app side never imports the relay")
            if side == "relay" and package == "outbox" and target not in SHARED_WITH_THE_RELAY:
                broken.append(f"{module} -> {target}: the relay reads only what both sides share")
            if target in CONCRETE_SENDERS and module != "relay.cli":
                broken.append(f"{module} -> {target}: only relay.cli picks a concrete sender")
            if target in COMMAND_LINE and module not in COMMAND_LINE:
                broken.append(f"{module} -> {target}: nothing below the command line imports it")
            if module in PURE and target not in ("outbox.schema", "relay.senders", "relay.pause"):
                broken.append(f"{module} -> {target}: a pure module imports only values")
            if (
                (module == "relay.store" or module.startswith("relay.store."))
                and package == "relay"
                and target not in (*PURE, "relay.clock")
                and not target.startswith("relay.store.")
            ):
                broken.append(
                    f"{module} -> {target}: the store uses only the pure modules and the "
                    "database's clock"
                )
            if (
                module.startswith("relay.senders")
                and target.startswith("relay.")
                and not (target.startswith("relay.senders") or target == "relay.pause")
            ):
                broken.append(f"{module} -> {target}: a sender only classifies")
            if module == REVISIONS and target not in ("outbox.exceptions", "outbox.lockwait"):
                broken.append(f"{module} -> {target}: a revision is frozen history")
            if module == DISPATCH and (target.startswith("relay.store") or target in DATABASE):
                broken.append(f"{module} -> {target}: dispatch never opens a transaction")
            if module in MAINTENANCE and target not in MAINTENANCE_MAY:
                broken.append(
                    f"{module} -> {target}: maintenance imports the store, the policy, the "
                    "announcements and the loop's connection only"
                )
    assert broken == [], "the module map breaks its layering rules:\n" + "\n".join(broken)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()

    def visit(node: str, trail: list[str]) -> list[str] | None:
        if node in trail:
            return [*trail[trail.index(node) :], node]
        if node in done:
            return None
        for nxt in sorted(graph.get(node, ())):
            if (cycle := visit(nxt, [*trail, node])) is not None:
                return cycle
        done.add(node)
        return None

    for start in sorted(graph):
        if (cycle := visit(start, [])) is not None:
            return cycle
    return None


def test_the_map_allows_no_cycle():
    graph = {m: {t for t in ALLOWED[r] if t != m} for m in FILES if (r := row_of(m))}
    cycle = find_cycle(graph)
    assert cycle is None, f"the module map allows a cycle: {' -> '.join(cycle or [])}"
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_pure_modules_touch_no_database():
    for module in PURE:
        tree = ast.parse(FILES[module].read_text())
        used = {
            alias.name.split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
        } | {
            (node.module or "").split(".")[0]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and not node.level
        }
        assert "sqlalchemy" not in used, f"{module} is pure but imports sqlalchemy"


def test_dispatch_touches_no_database():
    tree = ast.parse(FILES[DISPATCH].read_text())
    used = {alias.name for n in ast.walk(tree) if isinstance(n, ast.Import) for alias in n.names}
    used |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(u.split(".")[0] == "sqlalchemy" for u in used), "dispatch imports sqlalchemy"


def test_an_import_is_found_wherever_it_is_and_named_with_its_line():
    source = (
        "from typing import TYPE_CHECKING\n"
        "from relay import store\n"
        "from . import policy\n"
        "if TYPE_CHECKING:\n"
        "    from .worker import Relay\n"
        "def f():\n"
        "    import outbox.schema\n"
    )
    found = imports_of("relay.example", ROOT / "relay" / "example.py", source)
    assert [(i.line, i.target) for i in found] == [
        (2, "relay.store"),
        (3, "relay.policy"),
        (5, "relay.worker"),
        (7, "outbox.schema"),
    ]
    assert str(found[0]) == "relay/example.py:2: relay.example imports relay.store"
