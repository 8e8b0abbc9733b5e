"""The public API is a decision: these lists change only on purpose.

On top of the lists, every module of ``outbox`` and ``relay`` says what it offers: its
public names, the ones it defines at top level without a leading underscore, are exactly its
``__all__``; a package's ``__init__`` may list names it imports (a re-export), and every name
listed exists. A new module is found by walking the packages, so it is held to the rule too.
"""

from __future__ import annotations

import ast
import importlib
import pathlib
import pkgutil
from collections.abc import Iterable
from types import ModuleType

import pytest

PACKAGES = ("outbox", "relay")
# Files under the packages that are not modules of theirs: none. The alembic scripts, which
# alembic runs itself, are the top-level migrations/; the walk (rglob) does not follow the
# outbox/_migrations symlink to them.
NOT_MODULES: tuple[str, ...] = ()

EXPORTS = {
    "outbox": [
        "NOTIFY_CHANNEL",
        "AmbiguityPolicy",
        "Attachment",
        "AttemptOutcome",
        "Category",
        "ConfigurationError",
        "DeliveryStatus",
        "Email",
        "EnqueueError",
        "EnqueueResult",
        "HeaderInjection",
        "InvalidAddress",
        "InvalidArgument",
        "InvalidEmail",
        "InvalidKey",
        "MessageTooLarge",
        "Outbox",
        "OutboxError",
        "RecipientCountError",
        "RelayState",
        "Status",
        "UnknownCategory",
    ],
    "outbox.sqlite": ["enable_savepoints"],
    "outbox.signals": ["duplicate_skipped", "enqueued"],
    "relay.senders": [
        "Accepted",
        "Ambiguous",
        "BaseSender",
        "Disabled",
        "Outcome",
        "OutgoingMessage",
        "Permanent",
        "Sender",
        "Transient",
        "as_sender",
    ],
    "relay.policy": [
        "THROTTLE_FLOOR_SECONDS",
        "Action",
        "Decision",
        "LeaseExpired",
        "MessageState",
        "backoff_seconds",
        "decide",
    ],
    "relay.testing": [
        "DatabaseInUse",
        "FakeSender",
        "DEFAULT_TIMEOUT",
        "LOCK_WAIT",
        "RelayNotIdle",
        "read_deliveries",
        "run_until_idle",
        "sender_from_env",
    ],
    "relay.worker": ["STUCK_RETRY", "Relay"],
    "relay.db": [
        "CONNECT_TIMEOUT",
        "READ_COMMITTED",
        "READ_TIMEOUT",
        "autocommits",
        "blames_the_row",
        "is_outage",
        "make_engine",
        "masked_url",
        "retry_delay",
    ],
    "relay.http": ["Server", "start_http_server"],
    "relay.metrics": [
        "BUILT_IN_CATEGORIES",
        "CLAIM_BUCKETS",
        "FUTURE_TOLERANCE_SECONDS",
        "OTHER_KEYS",
        "SEND_BUCKETS",
        "TOP_KEYS",
        "UNKEYED",
        "IntakeMetrics",
        "RelayMetrics",
    ],
    "relay.events": ["MAX_BODY_BYTES", "SesEvent", "parse", "recorded_status"],
}


@pytest.mark.parametrize("module", sorted(EXPORTS))
def test_exports(module):
    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == sorted(EXPORTS[module])
    for name in mod.__all__:
        assert hasattr(mod, name), f"{module}.{name} is exported but missing"


def _walk() -> list[str]:
    names = []
    for package in PACKAGES:
        path = importlib.import_module(package).__path__
        names += [package, *(found.name for found in pkgutil.walk_packages(path, f"{package}."))]
    return sorted(names)


MODULES = _walk()


def _top_level(body: Iterable[ast.stmt]) -> Iterable[ast.stmt]:
    """A module's top-level statements, those inside its ifs and trys included."""
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _top_level([*node.body, *node.orelse])
        elif isinstance(node, ast.Try):
            handlers = [stmt for handler in node.handlers for stmt in handler.body]
            yield from _top_level([*node.body, *handlers, *node.orelse, *node.finalbody])


def _defines(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.Assign):
        targets = node.targets
    elif isinstance(node, ast.AnnAssign | ast.AugAssign):
        targets = [node.target]
    else:
        return []
    return [
        name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name)
    ]


def _imports(node: ast.stmt) -> list[str]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        return [alias.asname or alias.name.split(".")[0] for alias in node.names]
    return []


def _source(module: ModuleType) -> ast.Module:
    assert module.__file__ is not None
    return ast.parse(pathlib.Path(module.__file__).read_text(encoding="utf-8"))


def test_the_walk_finds_every_file_of_the_packages():
    root = pathlib.Path(importlib.import_module(PACKAGES[0]).__path__[0]).parent
    files = {
        path.relative_to(root).as_posix() for p in PACKAGES for path in (root / p).rglob("*.py")
    }
    walked = {
        pathlib.Path(str(importlib.import_module(name).__file__)).relative_to(root).as_posix()
        for name in MODULES
    }
    assert sorted(files - walked) == sorted(f for f in files if f.startswith(NOT_MODULES))
    for excluded in NOT_MODULES:
        assert any(f.startswith(excluded) for f in files), f"{excluded} is excluded but gone"


@pytest.mark.parametrize("name", MODULES)
def test_a_modules_public_names_are_its_all(name):
    module = importlib.import_module(name)
    assert isinstance(getattr(module, "__all__", None), list), f"{name} has no __all__"
    statements = list(_top_level(_source(module).body))
    defined = {n for node in statements for n in _defines(node) if not n.startswith("_")}
    imported = {n for node in statements for n in _imports(node)}
    reexported = [n for n in module.__all__ if n in imported and n not in defined]
    assert sorted(module.__all__) == sorted([*defined, *reexported])
    if not hasattr(module, "__path__"):
        assert reexported == [], f"{name} is not a package: it lists only names it defines"
    for attribute in module.__all__:
        assert hasattr(module, attribute), f"{name}.{attribute} is exported but missing"


def test_statuses_are_the_documented_list():
    from outbox import Status

    assert [s.value for s in Status] == [
        "pending",
        "retrying",
        "processing",
        "sent",
        "failed",
        "unknown_outcome",
        "cancelled",
        "expired",
    ]
