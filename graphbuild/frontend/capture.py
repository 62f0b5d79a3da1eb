"""capture: ``torch.export`` of the model. Reads structure and sample specs, never weights."""

from __future__ import annotations

import contextlib
import io
import sys
from typing import Any

import torch

from graphbuild.engine.codecs import roundtrip
from graphbuild.frontend.devices import on_cpu, to_device
from graphbuild.frontend.programs import ProgramArtifact, strip_stack_traces, strip_state


def as_args(samples: Any) -> tuple:
    """Sample inputs as a tuple of positional arguments."""
    if isinstance(samples, tuple):
        return samples
    if isinstance(samples, list):
        return tuple(samples)
    return (samples,)


def capture_program(
    model: torch.nn.Module, samples: Any, dynamic_shapes: Any = None
) -> ProgramArtifact:
    """Trace ``model`` on ``samples``; the artifact keeps the graph and constants, and
    placeholders for parameters and buffers (the graph does not depend on their values).

    A model off the CPU is traced on CPU stand-ins (``devices.on_cpu``), so the program is the
    same as the CPU model's, whatever device the model and the samples live on."""
    with on_cpu(model):
        args = to_device(as_args(samples), "cpu")
        program = export_quietly(model, args, dynamic_shapes)
    strip_stack_traces(program)
    return roundtrip(ProgramArtifact(strip_state(program), has_state=False))


def export_quietly(
    model: torch.nn.Module, args: tuple, dynamic_shapes: Any = None
) -> torch.export.ExportedProgram:
    """``torch.export.export``, except that the partial graph torch prints to stderr when a
    trace fails is not printed (twice, dozens of lines before the error): it stays on the
    exception as ``partial_fx_graph``. Anything else written to stderr meanwhile is passed on."""
    printed = io.StringIO()
    graph = None
    try:
        with contextlib.redirect_stderr(printed):
            return torch.export.export(model, args, dynamic_shapes=dynamic_shapes)
    except Exception as err:
        graph = getattr(err, "partial_fx_graph", None)
        raise
    finally:
        text = printed.getvalue()
        if graph is not None:
            text = text.replace(f"{graph}\n", "")
        if text:
            sys.stderr.write(text)


def dynamic_shapes_of(program: torch.export.ExportedProgram) -> tuple | None:
    """The ``dynamic_shapes`` that trace a program again with the same dynamic dimensions:
    one entry per user input, ``{dim: Dim(name, min, max)}`` for each dimension the program
    keeps symbolic (one ``Dim`` per symbol, so dimensions that must agree still do), None when
    every dimension is static. A re-export without it (after PT2E conversion) would
    specialise every dimension to the sample inputs' sizes."""
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    dims: dict[str, Any] = {}
    shapes: list[dict[int, Any] | None] = []
    for spec in program.graph_signature.input_specs:
        if spec.kind != torch.export.graph_signature.InputKind.USER_INPUT:
            continue
        value = placeholders[spec.arg.name].meta.get("val")
        entry = {}
        for index, size in enumerate(getattr(value, "shape", ())):
            if not isinstance(size, torch.SymInt):
                continue
            expr = size.node.expr
            if str(expr) not in dims:
                bounds = program.range_constraints.get(expr)
                if bounds is None or not expr.is_Symbol:
                    dims[str(expr)] = torch.export.Dim.AUTO  # derived: torch works it out
                else:
                    dims[str(expr)] = torch.export.Dim(
                        f"d_{expr}", min=_bound(bounds.lower), max=_bound(bounds.upper)
                    )
            entry[index] = dims[str(expr)]
        shapes.append(entry or None)
    return tuple(shapes) if dims else None


def _bound(value: Any) -> int | None:
    """A range constraint's bound as an int; None for an unbounded one."""
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        return None


def capture(model: torch.nn.Module, samples: Any, context: Any) -> ProgramArtifact:
    """The ``capture`` stage every target shares: one callable, so one cache entry per model
    and sample spec whichever target asks for it."""
    return capture_program(model, samples)
