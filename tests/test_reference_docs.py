"""The references cannot drift from the code: every command and option of the command line is
in docs/cli.md, every configuration key in docs/configuration.md, and every target option on
some page of the manual. A new flag or key fails here until its reference says what it does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import typer

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _commands() -> list[tuple[str, Any]]:
    from graphbuild.cli.app import app

    found: list[tuple[str, Any]] = []

    def walk(command: Any, path: str) -> None:
        found.append((path, command))
        for name, sub in getattr(command, "commands", {}).items():  # a group's subcommands
            walk(sub, f"{path} {name}")

    walk(typer.main.get_command(app), "graphbuild")
    return found


def _options(command: Any) -> list[str]:
    ctx = command.context_class(command)  # typer's own click
    return [o for p in command.get_params(ctx) for o in p.opts if o.startswith("--")]


def test_every_command_is_in_the_cli_reference() -> None:
    text = (DOCS / "cli.md").read_text()
    missing = [path for path, _ in _commands() if path != "graphbuild" and path not in text]
    assert not missing, f"docs/cli.md does not describe {missing}"


@pytest.mark.parametrize("path", [p for p, _ in _commands()])
def test_every_option_of_a_command_is_in_the_cli_reference(path: str) -> None:
    command = dict(_commands())[path]
    text = (DOCS / "cli.md").read_text()
    missing = [o for o in _options(command) if o not in ("--help",) and o not in text]
    assert not missing, f"docs/cli.md does not describe {path} {missing}"


def test_every_configuration_key_is_in_the_configuration_reference() -> None:
    from graphbuild.config import schema

    text = (DOCS / "configuration.md").read_text()
    missing = [k for k in schema._top_keys() if k not in text]
    assert not missing, f"docs/configuration.md does not describe {missing}"


def test_every_target_option_is_in_the_manual() -> None:
    from graphbuild.config import schema

    text = "".join(p.read_text() for p in DOCS.glob("*.md"))
    missing = sorted(k for k in schema._option_keys() if f"`{k}" not in text and k not in text)
    assert not missing, f"no page of docs/ describes the target options {missing}"
