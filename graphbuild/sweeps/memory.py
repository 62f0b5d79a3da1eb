"""A sweep over a model in memory: the model, its sample inputs and calibration sets given as
Python objects rather than named in a config file.

The variants are still configurations (the sweep's axes are config keys): each in-memory
calibration set stands in the configuration as a placeholder spec that names no module
(``(in memory):set0``), which :class:`~.builds.VariantBuilds` answers with the batches held
here instead of importing anything. A model in memory lives in this process only, so such a
sweep runs its jobs here (``jobs=1``): worker processes and Ray tasks build their variants from
a config file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from graphbuild.errors import ArgumentTypeError

__all__ = ["MEMORY", "InMemory", "in_memory"]

#: The module part of an in-memory calibration set's placeholder spec: not a module name, so
#: nothing can ever import it.
MEMORY = "(in memory)"


@dataclass
class InMemory:
    """The model, its sample inputs, and the calibration sets by placeholder spec."""

    model: Any
    samples: Any
    calibrations: dict[str, list[Any]] = field(default_factory=dict)

    def calibration(self, spec: str | None) -> list[Any] | None:
        """The batches of the in-memory set ``spec`` stands for; None for any other spec."""
        return self.calibrations.get(spec) if spec else None


def in_memory(
    model: Any,
    samples: Any = None,
    calibration: Any = None,
    calibrations: Mapping[str, Any] | None = None,
) -> tuple[InMemory, str | None, dict[str, str]]:
    """The sweep's in-memory inputs, the placeholder spec of the default ``calibration`` (None
    when there is none) and the calibration sets as the sweep's ``[sweep.calibrations]`` table
    takes them (name -> spec: a placeholder for a set in memory, a spec string as given).

    ``model``: a ``torch.nn.Module``, or a factory called once here that returns one or a
    ``(module, sample_inputs)`` tuple. A calibration set: a list of batches or a function that
    returns them. A wrong type is an :class:`ArgumentTypeError` naming the argument."""
    model, samples = _model_and_samples(model, samples)
    memory = InMemory(model, samples)
    default = None
    if calibration is not None:
        default = _hold(memory, _batches(calibration, "calibration"))
    table: dict[str, str] = {}
    for name, value in (calibrations or {}).items():
        if isinstance(value, str):
            table[name] = value
        else:
            table[name] = _hold(memory, _batches(value, f"calibrations[{name!r}]"))
    return memory, default, table


def _hold(memory: InMemory, batches: list[Any]) -> str:
    spec = f"{MEMORY}:set{len(memory.calibrations)}"
    memory.calibrations[spec] = batches
    return spec


def _model_and_samples(model: Any, samples: Any) -> tuple[Any, Any]:
    import torch

    made = model
    if not isinstance(model, torch.nn.Module) and callable(model):
        made = model()
        if (
            isinstance(made, (tuple, list))
            and len(made) == 2
            and isinstance(made[0], torch.nn.Module)
        ):
            made, built_samples = made
            samples = built_samples if samples is None else samples
    if not isinstance(made, torch.nn.Module):
        raise ArgumentTypeError(
            f"model must be a torch.nn.Module or a function returning one (or a (module, "
            f"sample_inputs) tuple), got {_kind(made)}"
        )
    if samples is None:
        raise ArgumentTypeError(
            "a sweep over a model in memory needs its sample inputs: give samples=(...), or a "
            "model factory that returns (module, sample_inputs)"
        )
    return made, samples


def _batches(value: Any, what: str) -> list[Any]:
    import torch

    if callable(value) and not isinstance(value, torch.Tensor):
        value = value()
    if isinstance(value, (str, bytes, Mapping, torch.Tensor)) or not isinstance(value, Iterable):
        raise ArgumentTypeError(
            f"{what} must be a list of batches (each a tuple of positional inputs or a "
            f"tensor) or a function returning one, got {_kind(value)}"
        )
    return list(value)


def _kind(value: Any) -> str:
    if isinstance(value, Callable):  # type: ignore[arg-type]
        return f"function {getattr(value, '__qualname__', type(value).__name__)}"
    return type(value).__name__
