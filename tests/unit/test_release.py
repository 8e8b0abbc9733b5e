"""Release hygiene: one version source, and the licence the package metadata names."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import outbox

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def test_the_version_has_one_source_the_package_itself():
    assert "version" not in PROJECT["project"]
    assert PROJECT["project"]["dynamic"] == ["version"]
    assert PROJECT["tool"]["hatch"]["version"]["path"] == "outbox/__init__.py"
    assert importlib.metadata.version("sqlalchemy-outbox") == outbox.__version__


def test_the_licence_file_holds_the_licence_the_metadata_names():
    assert PROJECT["project"]["license"] == "MIT"
    assert (REPO / "LICENSE").read_text().startswith("MIT License\n")
    assert "LICENSE" in PROJECT["tool"]["hatch"]["build"]["targets"]["sdist"]["include"]
