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


def capture(model: torch.nn.Module, samples: Any, context: Any) -> ProgramArtifact:
    """The ``capture`` stage every target shares: one callable, so one cache entry per model
    and sample spec whichever target asks for it."""
    return capture_program(model, samples)
