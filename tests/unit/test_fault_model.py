"""docs/fault-model.md names the test that proves each row: every name must be a real test."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def defined_tests() -> set[str]:
    names: set[str] = set()
    for path in (ROOT / "tests").rglob("*.py"):
        names.update(re.findall(r"^\s*def (test_\w+)", path.read_text(), re.MULTILINE))
    return names


def test_every_test_the_fault_model_names_exists():
    text = (ROOT / "docs" / "fault-model.md").read_text()
    named = set(re.findall(r"\b(test_\w+)", text)) - {"test_ledger", "test_store_stateful"}
    named = {n for n in named if not n.endswith("_")}  # a prefix like `test_sigkill_...`
    assert len(named) > 50
    missing = sorted(n for n in named if n not in defined_tests() and not _is_module(n))
    assert missing == [], f"docs/fault-model.md names tests that do not exist: {missing}"


def _is_module(name: str) -> bool:
    return any(p.stem == name for p in (ROOT / "tests").rglob(f"{name}.py"))
