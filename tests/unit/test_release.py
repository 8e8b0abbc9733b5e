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


def test_dev_tools_are_a_dependency_group_not_a_published_extra():
    published = " ".join(
        dep for deps in PROJECT["project"]["optional-dependencies"].values() for dep in deps
    )
    dev = " ".join(PROJECT["dependency-groups"]["dev"])
    for tool in ("mypy", "ruff", "boto3-stubs", "pytest-cov", "pre-commit"):
        assert tool not in published, f"{tool} is in a published extra"
        assert tool in dev, f"{tool} is missing from the dev group"


def test_ci_installs_the_dev_group_and_runs_the_same_hooks_as_pre_commit():
    ci = (REPO / ".ci" / "run").read_text()
    hooks = (REPO / ".pre-commit-config.yaml").read_text()
    assert "--group dev" in ci
    assert "--cov-fail-under=" in ci
    for command in ("ruff check", "ruff format --check", "mypy"):
        assert command in ci
        assert f"entry: {command}" in hooks
