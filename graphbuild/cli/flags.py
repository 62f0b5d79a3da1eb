"""The switches targets add to ``graphbuild export``, read from their declarations.

A target declares its own flags (``Target.export_flags``: qnn's ``--check-htp`` and
``--strict-coverage``), so the command line names none. Each flag turns on one boolean option
of its target, as ``--set options.<option>=true`` does, after the ``--set`` pairs; with
another target that option is refused by the configuration as any unknown option is.

The flags are added when ``export`` parses its arguments or prints its help, not when the
application is assembled: reading the targets' declarations costs the other commands
(``graphbuild cache ...``) nothing.
"""

from __future__ import annotations

import inspect
from collections.abc import MutableMapping
from typing import Annotated, Any

import typer

from graphbuild.errors import ConfigError

__all__ = ["flag_parameters", "flag_sets"]

#: The parameter name of each flag (``check_htp`` for ``--check-htp``) -> the option it sets.
_OPTIONS: dict[str, str] = {}


def _declared() -> dict[str, tuple[str, str, list[str]]]:
    """Every registered target's flags: ``--name`` -> (option, help, targets). Two targets
    may declare one flag only for the same option."""
    from graphbuild.targets.registry import all_targets

    flags: dict[str, tuple[str, str, list[str]]] = {}
    for target in all_targets():
        for flag in target.export_flags:
            option, text, owners = flags.setdefault(flag.name, (flag.option, flag.help, []))
            if option != flag.option:
                raise ConfigError(
                    f"--{flag.name} is declared by targets {', '.join(owners)} for option "
                    f"'{option}' and by '{target.name}' for '{flag.option}': one flag, one option"
                )
            owners.append(target.name)
    return flags


def flag_parameters(taken: set[str]) -> list[Any]:
    """The targets' flags as parameters of a Typer command (made by Typer from a signature,
    as every other option is); ``taken``: the parameter names the command has already."""
    parameters = []
    for name, (option, text, owners) in _declared().items():
        param = name.replace("-", "_")
        if param in taken:
            raise ConfigError(
                f"target {', '.join(owners)} declares --{name}, which graphbuild export has "
                "already: give the flag another name"
            )
        _OPTIONS[param] = option
        flag = typer.Option(f"--{name}", help=f"{text.rstrip('.')} (target {', '.join(owners)}).")
        parameters.append(
            inspect.Parameter(
                param,
                inspect.Parameter.KEYWORD_ONLY,
                default=False,
                annotation=Annotated[bool, flag],
            )
        )
    if not parameters:
        return []

    def flags(**values: bool) -> None:
        """The targets' flags."""

    flags.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    flags.__annotations__ = {p.name: p.annotation for p in parameters}
    app = typer.Typer(add_completion=False)
    app.command()(flags)
    return list(typer.main.get_command(app).params)


def flag_sets(values: MutableMapping[str, Any]) -> list[str]:
    """Take the flags out of a command's parsed ``values`` and return the ``--set`` pairs they
    make, in the order the targets declare them."""
    return [
        f"options.{option}=true" for param, option in _OPTIONS.items() if values.pop(param, False)
    ]
