"""The layout of the suite itself: shared test code lives in ``tests/support``.

No module under ``tests/`` imports a ``conftest`` or a test module (``tests.<...>.test_*``):
what tests share is a fixture or a function of ``tests.support``, so a test module can be read,
moved or deleted on its own.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent


def named_modules(node: ast.Import | ast.ImportFrom, package: str) -> Iterator[str]:
    """The dotted names an import statement may load, relative ones resolved against
    ``package``; ``from a import b`` names both ``a`` and ``a.b``."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:
        parts = package.split(".")
        anchor = ".".join(parts[: len(parts) - node.level + 1])
        base = f"{anchor}.{base}" if base else anchor
    yield base
    yield from (f"{base}.{alias.name}" for alias in node.names)


def forbidden(name: str) -> bool:
    """A conftest or a test module of this suite."""
    head, *rest = name.split(".")
    return head == "tests" and any(p == "conftest" or p.startswith("test_") for p in rest)


def bad_imports(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, module) of each import in ``source`` (the module ``module``) that loads a
    conftest or a test module, by line."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [n for n in named_modules(node, package) if forbidden(n)]
            if names:
                found.append((node.lineno, names[0]))
    return sorted(found)


def violations() -> list[str]:
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for line, name in bad_imports(path.read_text(), module, path.name == "__init__.py"):
            found.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    return found


def test_no_module_imports_a_conftest_or_another_test_module():
    found = violations()
    assert not found, "import from tests.support instead:\n" + "\n".join(found)


def test_the_check_sees_every_kind_of_import():
    source = "\n".join(
        [
            "import tests.conftest",  # 1
            "from tests.conftest import Order",
            "from tests.integration.test_enqueue import email",
            "from tests.integration import test_worker",
            "from .test_worker import settle",  # 5
            "from . import conftest",
            "def inner():",
            "    from tests.unit.test_message import make",
            "from tests.support.factories import email",
            "from tests.support import db",  # 10
            "from . import helpers",
            "import outbox.testing",
            "from relay import testing",
        ]
    )
    assert bad_imports(source, "tests.integration.test_x") == [
        (1, "tests.conftest"),
        (2, "tests.conftest"),
        (3, "tests.integration.test_enqueue"),
        (4, "tests.integration.test_worker"),
        (5, "tests.integration.test_worker"),
        (6, "tests.integration.conftest"),
        (8, "tests.unit.test_message"),
    ]
    assert bad_imports("from .test_b import x", "tests.unit", is_package=True) == [
        (1, "tests.unit.test_b")
    ]
