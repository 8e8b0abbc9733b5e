"""docs/configuration.md names every option of every ``outbox-relay`` command with its
environment variable and default, read from the click commands themselves."""

from __future__ import annotations

import re
from pathlib import Path

import click
import pytest

from relay.cli import main

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
ROW = re.compile(r"^\| `(--[a-z0-9-]+)` \| (`OUTBOX_[A-Z0-9_]+`|-) \| `([^`]*)` \| .*\|$")


def documented() -> dict[str, dict[str, tuple[str, str]]]:
    """``{command: {flag: (env, default)}}`` from the tables under ``## outbox-relay CMD``."""
    tables: dict[str, dict[str, tuple[str, str]]] = {}
    command = None
    for line in DOC.read_text().splitlines():
        if line.startswith("## outbox-relay "):
            command = line.removeprefix("## outbox-relay ").strip()
            tables[command] = {}
        elif (match := ROW.match(line)) is not None:
            assert command is not None, f"a row outside a command section: {line}"
            flag, env, default = match.groups()
            assert flag not in tables[command], f"{command} {flag} documented twice"
            tables[command][flag] = (env.strip("`"), default)
    return tables


def rendered_default(param: click.Option) -> str:
    if param.required:
        return "(required)"
    default = param.default
    if param.is_flag and default is not True:
        return "off"
    if default is None or default == () or not isinstance(default, str | int | float):
        return "none"  # unset (click's sentinel) or no value
    return str(default)


def options(command: click.Command) -> dict[str, tuple[str, str]]:
    return {
        param.opts[0]: (param.envvar or "-", rendered_default(param))
        for param in command.params
        if isinstance(param, click.Option)
    }


def commands() -> dict[str, click.Command]:
    """Every command by the name its section has: a group's subcommands as ``group sub``."""
    found: dict[str, click.Command] = {}
    for name, command in main.commands.items():
        if isinstance(command, click.Group):
            found.update({f"{name} {sub}": c for sub, c in command.commands.items()})
        else:
            found[name] = command
    return found


def test_every_command_has_a_section():
    assert set(documented()) == set(commands())


@pytest.mark.parametrize("name", sorted(commands()))
def test_every_option_is_documented_with_its_variable_and_default(name):
    assert documented()[name] == options(commands()[name])


def test_every_relay_variable_is_outbox_prefixed_and_unique_per_command():
    for name, command in main.commands.items():
        envs = [env for env, _ in options(command).values() if env != "-"]
        assert all(env.startswith("OUTBOX_") for env in envs), name
        assert len(envs) == len(set(envs)), name
