"""capture: ``torch.export`` of the model. Reads structure and sample specs, never weights."""

from __future__ import annotations

import contextlib
import functools
import inspect
import io
import sys
from collections.abc import Iterator
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
    with on_cpu(model), plain_outputs(model) as note:
        args = to_device(as_args(samples), "cpu")
        program = export_quietly(model, args, dynamic_shapes)
    strip_stack_traces(program)
    notes = {"model_outputs": note} if note else {}
    return roundtrip(ProgramArtifact(strip_state(program), has_state=False, notes=notes))


def is_transformers_model(model: Any) -> bool:
    """True for a transformers ``PreTrainedModel`` (never imports transformers: a model of
    it has imported it already)."""
    transformers = sys.modules.get("transformers")
    base = getattr(transformers, "PreTrainedModel", None) if transformers else None
    return base is not None and isinstance(model, base)


@contextlib.contextmanager
def plain_outputs(model: torch.nn.Module) -> Iterator[dict[str, Any]]:
    """While this lasts, a transformers model returns a tensor, as an export needs: it is
    called with ``use_cache=False`` (a ``DynamicCache`` in the outputs is no graph output,
    and a cache is what a prefill graph has no use for) and its ``ModelOutput`` is reduced to
    ``logits`` (or, lacking one, its first tensor field). Yields the note of what was done,
    filled in when the model is called: ``kept``, ``left_out`` (the other fields) and a
    ``summary``; empty for any other model, which is called as it is."""
    note: dict[str, Any] = {}
    if not is_transformers_model(model):
        yield note
        return
    own = model.__dict__.get("forward")  # a forward set on the instance, put back after
    original = model.forward
    signature = inspect.signature(original)
    uncached = "use_cache" in signature.parameters

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if uncached:
            kwargs["use_cache"] = False
        return _logits_of(original(*args, **kwargs), note, uncached)

    forward.__signature__ = signature  # type: ignore[attr-defined]  # torch.export names inputs by it
    model.forward = forward
    try:
        yield note
    finally:
        if own is None:
            del model.forward  # the class's forward again
        else:
            model.forward = own


def call_plainly(model: torch.nn.Module, args: tuple) -> Any:
    """``model(*args)`` as the export traces it (:func:`plain_outputs`): what the exported
    graph computes, for a reference to compare it with."""
    with plain_outputs(model):
        return model(*args)


def _logits_of(out: Any, note: dict[str, Any], uncached: bool) -> Any:
    """A ``ModelOutput`` reduced to its ``logits`` (or first tensor field); anything else as
    it is."""
    transformers = sys.modules.get("transformers")
    output_type = getattr(getattr(transformers, "utils", None), "ModelOutput", None)
    if output_type is None or not isinstance(out, output_type):
        return out
    fields = [name for name, value in out.items() if value is not None]
    kept = "logits" if "logits" in fields else None
    if kept is None:
        kept = next((n for n in fields if isinstance(out[n], torch.Tensor)), None)
    if kept is None:
        return out
    left_out = [name for name in fields if name != kept]
    how = "called with use_cache=False; " if uncached else ""
    note.update(
        kept=kept,
        left_out=left_out,
        summary=f"{type(out).__name__}: {how}the export's output is its '{kept}'"
        + (f" ({', '.join(left_out)} left out)" if left_out else ""),
    )
    # the same output type holding the kept field alone: the exported graph's output keeps the
    # field's name ("logits"), as the model's own pytree names it
    return type(out)(**{kept: out[kept]})


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
