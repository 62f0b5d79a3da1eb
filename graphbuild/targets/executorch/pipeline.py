"""The ExecuTorch pipelines: ``executorch/xnnpack``, ``executorch/portable``, ``executorch/vgf``.

::

    capture ---------+-> [quantize] -> lower -> pte
    [capture_methods]+        |           +---> delegation
                              +-> reference -> check_numerics (with the pte
                                  [float_reference] -+       and the float model's outputs)

``capture`` is the front end's shared stage: the same cache entry as the QNN target's for the
same model and sample spec (with ``dynamic_dims`` it also reads them). ``capture_methods``
traces the other methods of a multi-method program. ``quantize`` runs the recipe's PT2E
quantizer (values enter there); without one, ``lower`` reads the model's weights itself. A
weights-only change reruns ``quantize`` (or ``lower``), never a capture; a recipe change reruns
from ``quantize``.

A torchao recipe (``int8da_int4w`` ...) transforms the model's source rather than the captured
graph, so it traces the transformed model in its own ``capture_transformed`` (every method,
on a zero-valued copy: structure only, keyed like a capture plus the recipe) and ``quantize``
runs the transform on the real weights and puts the results into those programs by name::

    capture_transformed -> quantize -> lower -> pte ...
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from graphbuild.engine.codecs import FileArtifact
from graphbuild.engine.pipeline import Pipeline
from graphbuild.errors import ConfigError
from graphbuild.frontend.capture import as_args, capture, capture_program
from graphbuild.frontend.devices import host_copy, host_state, model_tensors
from graphbuild.frontend.programs import (
    ProgramArtifact,
    with_state,
)
from graphbuild.frontend.reference import reference_from_model, reference_from_program
from graphbuild.targets.base import Request, coerce_options
from graphbuild.targets.executorch.options import FORMATS, ExecuTorchOptions
from graphbuild.targets.executorch.tools import EMULATION_LAYER, RUNTIME, VGF_TOOLS

#: State names of a method's program: the model is the ``model`` child of the method wrapper.
_METHOD_PREFIX = "model."


class _Method(torch.nn.Module):
    """``model.<name>`` as a module whose ``forward`` it is, for ``torch.export``."""

    def __init__(self, model: torch.nn.Module, name: str):
        super().__init__()
        self.model = model
        self._method = name

    def forward(self, *args: Any) -> Any:
        return getattr(self.model, self._method)(*args)


class _Prefixed(Mapping[str, torch.Tensor]):
    """``state`` under names with ``prefix`` (a method program's view of the model's state)."""

    def __init__(self, state: Mapping[str, torch.Tensor], prefix: str):
        self._state, self._prefix = state, prefix

    def __getitem__(self, name: str) -> torch.Tensor:
        if not name.startswith(self._prefix):
            raise KeyError(name)
        return self._state[name[len(self._prefix) :]]

    def __iter__(self) -> Iterator[str]:
        return (self._prefix + name for name in self._state)

    def __len__(self) -> int:
        return len(self._state)


# --------------------------------------------------------------------------- stages


def capture_dynamic(model: torch.nn.Module, samples: Any, context: Any) -> ProgramArtifact:
    """``capture`` with dynamic dimensions (``dynamic_dims``) on ``forward``'s inputs."""
    shapes = _dynamic_shapes(context["dynamic_dims"], len(as_args(samples)))
    return capture_program(model, samples, dynamic_shapes=shapes)


def capture_methods(model: torch.nn.Module, samples: Any, context: Any) -> tuple:
    """One structure-only program per extra method, in name order."""
    programs = []
    for name, args in context["methods"].items():
        if not callable(getattr(model, name, None)):
            raise ConfigError(f"the model has no method '{name}' (options.methods)")
        programs.append(capture_program(_Method(model, name), as_args(args)))
    return tuple(programs)


def capture_transformed(model: torch.nn.Module, samples: Any, context: Any) -> tuple:
    """Every method of the model as transformed by the torchao recipe, traced: one
    structure-only program per method, ``forward`` first. The transform runs on a copy whose
    parameters are zeros: the traced graph does not depend on their values (``quantize``
    computes those), only on the structure and the recipe."""
    from graphbuild.targets.executorch.recipes import apply_source_transform

    transformed = host_copy(model, values=False)
    apply_source_transform(transformed, context["recipe"])
    dims = context["dynamic_dims"]
    shapes = _dynamic_shapes(dims, len(as_args(samples))) if dims is not None else None
    programs = [capture_program(transformed, samples, dynamic_shapes=shapes)]
    for name, args in (context["methods"] or {}).items():
        if not callable(getattr(transformed, name, None)):
            raise ConfigError(f"the model has no method '{name}' (options.methods)")
        programs.append(capture_program(_Method(transformed, name), as_args(args)))
    return tuple(programs)


def quantize_source(inputs: tuple, samples: Any, context: Any) -> tuple:
    """The torchao recipe on the model's weights (a CPU copy of the module tree; the model is
    not touched), its quantized tensors put into every transformed program by name."""
    from graphbuild.targets.executorch.recipes import apply_source_transform

    ((forward, *methods),) = inputs
    transformed = host_copy(context.input)
    apply_source_transform(transformed, context["recipe"])
    state = model_tensors(transformed)
    out = [ProgramArtifact(with_state(forward.program, state), True)]
    for program in methods:
        method_state = _Prefixed(state, _METHOD_PREFIX)
        out.append(ProgramArtifact(with_state(program.program, method_state), True))
    return tuple(out)


def quantize(inputs: tuple, samples: Any, context: Any) -> tuple:
    """PT2E quantization of every method with the recipe's quantizer (or the user's):
    ``forward`` calibrated on the calibration batches (the sample inputs when there are
    none), the other methods on their own sample inputs."""
    from graphbuild.frontend.quantize import quantize_program
    from graphbuild.targets.executorch.recipes import recipe_quantizer

    def quantizer() -> Any:  # one instance per program: quantizers keep per-graph state
        return context["quantizer"] or recipe_quantizer(context["recipe"], context["format"])

    state = host_state(context.input)
    forward = inputs[0].program
    out = [
        _quantized(
            quantize_program,
            forward,
            state,
            quantizer(),
            context["calibration"] or [as_args(samples)],
            as_args(samples),
        )
    ]
    methods = inputs[1] if len(inputs) > 1 else ()
    for (_, args), program in zip((context["methods"] or {}).items(), methods, strict=True):
        method_state = _Prefixed(state, _METHOD_PREFIX)
        out.append(
            _quantized(
                quantize_program,
                program.program,
                method_state,
                quantizer(),
                [as_args(args)],
                as_args(args),
            )
        )
    return tuple(out)


def _quantized(quantize_program: Any, program: Any, state: Any, *args: Any) -> ProgramArtifact:
    return ProgramArtifact(quantize_program(program, state, *args, fold_quantize=True), True)


def lower_float(inputs: tuple, samples: Any, context: Any) -> tuple:
    """The captured programs with the model's weights, lowered: (``.pte`` file, summary)."""
    state = host_state(context.input)
    programs = {"forward": with_state(inputs[0].program, state)}
    methods = inputs[1] if len(inputs) > 1 else ()
    for name, program in zip(context["methods"] or {}, methods, strict=True):
        programs[name] = with_state(program.program, _Prefixed(state, _METHOD_PREFIX))
    return _lower(programs, context)


def lower_quantized(inputs: tuple, samples: Any, context: Any) -> tuple:
    """The quantized programs, lowered: (``.pte`` file, delegation summary)."""
    ((forward, *methods),) = inputs
    programs = {"forward": forward.program}
    programs.update(
        (name, p.program) for name, p in zip(context["methods"] or {}, methods, strict=True)
    )
    return _lower(programs, context)


def _lower(programs: dict[str, Any], context: Any) -> tuple:
    from graphbuild.targets.executorch.lowering import lower_to_pte

    pte, summary = lower_to_pte(programs, context["format"], context["constant_methods"])
    return FileArtifact(f"{context['model_name']}.pte", pte), summary


def quantized_forward(inputs: tuple, samples: Any, context: Any) -> ProgramArtifact:
    """The quantized ``forward`` alone: what the numerics reference runs."""
    ((forward, *_),) = inputs
    return forward


def pte(inputs: tuple, samples: Any, context: Any) -> FileArtifact:
    """The ``.pte`` file alone (the product placed in the output directory)."""
    ((file, _),) = inputs
    return file


def delegation(inputs: tuple, samples: Any, context: Any) -> dict:
    """What the delegate runs and what is left to portable kernels, by operator."""
    ((_, summary),) = inputs
    return summary


def check_numerics(inputs: tuple, samples: Any, context: Any) -> dict:
    """Run the ``.pte``'s ``forward`` in ExecuTorch's runtime on the sample inputs; compare
    with torch: the float model, or under a quantizing recipe the quantized program (what the
    runtime should reproduce) and the float model (the error quantization costs)."""
    from graphbuild.targets.executorch.runtime import compare_pte

    file, reference, *floats = inputs
    return compare_pte(file.data, reference, as_args(samples), *floats)


def check_numerics_vulkan(inputs: tuple, samples: Any, context: Any) -> dict:
    """:func:`check_numerics` for a VGF ``.pte``: the runtime runs it in a fresh process on a
    Vulkan device with Arm's ML extensions (the emulation layer's, when no device has them)."""
    from graphbuild.targets.executorch.runtime import compare_pte, run_pte_on_vulkan

    file, reference, *floats = inputs
    return compare_pte(file.data, reference, as_args(samples), *floats, run=run_pte_on_vulkan)


def _dynamic_shapes(dims: list, inputs: int) -> tuple:
    """torch.export's ``dynamic_shapes`` from canonical ``dynamic_dims``; one ``Dim`` per name."""
    if len(dims) != inputs:
        raise ConfigError(f"dynamic_dims has {len(dims)} entries; forward takes {inputs} inputs")
    named: dict[str, Any] = {}
    shapes = []
    for entry in dims:
        if entry is None:
            shapes.append(None)
            continue
        spec = {}
        for dim, name, low, high in entry:
            if name not in named:
                named[name] = torch.export.Dim(name, min=low, max=high)
            spec[dim] = named[name]
        shapes.append(spec)
    return tuple(shapes)


# --------------------------------------------------------------------------- wiring


def build_executorch_pipeline(request: Request, fmt: str | None = None) -> Pipeline:
    """The ExecuTorch pipeline for ``request`` in format ``fmt`` (default: the request's)."""
    from graphbuild.targets.executorch.lowering import require_format

    fmt = fmt or request.format
    if fmt not in FORMATS:
        raise ConfigError(
            f"unknown format '{fmt}' for target executorch; known: {', '.join(FORMATS)}"
        )
    require_format(fmt)
    opts = coerce_options(ExecuTorchOptions, request.options, request.target)
    if opts.source_transform and fmt != "xnnpack":
        raise ConfigError(
            f"recipe '{opts.recipe}' lowers through XNNPACK only (its dynamically quantized "
            f"linear); use --format xnnpack, or a PT2E recipe (int8_static, int8_dynamic) "
            f"for {fmt}"
        )
    p = Pipeline(name=f"{request.target}/{fmt}")
    lower_reads = ("ctx.format", "ctx.model_name", "ctx.methods", "ctx.constant_methods")
    if fmt == "vgf":  # the TOSA serializer and Arm's model converter compile the delegate
        lower_reads += VGF_TOOLS
    if opts.source_transform:
        cap = p.register_stage(
            capture_transformed,
            "capture_transformed",
            reads=(
                "input.structure",
                "samples.spec",
                "ctx.recipe",
                "ctx.methods",
                "ctx.dynamic_dims",
            ),
        )
        source = p.register_stage(
            quantize_source, "quantize", reads=("input.state", "ctx.recipe")
        ).depends_on(cap)
        low = p.register_stage(lower_quantized, "lower", reads=lower_reads).depends_on(source)
    else:
        source, low = _capture_and_lower(p, opts, lower_reads)
    out = p.register_stage(pte, "pte", reads=()).depends_on(low)
    summary = p.register_stage(delegation, "delegation", reads=()).depends_on(low)
    p.products = [out.name]
    p.output_files = frozenset({f"{request.model_name}.pte"})
    p.reports["delegation"] = summary.name
    if opts.check_numerics:
        if fmt == "vgf":
            check = p.register_stage(
                check_numerics_vulkan, "check_numerics", reads=("samples", RUNTIME, EMULATION_LAYER)
            )
        else:
            check = p.register_stage(check_numerics, "check_numerics", reads=("samples", RUNTIME))
        if opts.quantized:
            forward = p.register_stage(quantized_forward, "quantized_forward", reads=())
            forward.depends_on(source)
            ref = p.register_stage(reference_from_program, "reference", reads=("samples",))
            ref.depends_on(forward)
            floats = p.register_stage(
                reference_from_model, "float_reference", reads=("input", "samples")
            )
            check.depends_on(out, ref, floats)
        else:
            ref = p.register_stage(reference_from_model, "reference", reads=("input", "samples"))
            check.depends_on(out, ref)
        p.reports["numerics"] = check.name
    return p


def _capture_and_lower(p: Pipeline, opts: ExecuTorchOptions, lower_reads: tuple) -> tuple:
    """The shared ``capture`` (and ``capture_methods``), the PT2E ``quantize`` when the recipe
    quantizes, and ``lower``: (the quantize stage or None, the lower stage)."""
    if opts.dynamic_dims is None:
        cap = p.register_stage(capture, "capture", reads=("input.structure", "samples.spec"))
    else:
        cap = p.register_stage(
            capture_dynamic,
            "capture",
            reads=("input.structure", "samples.spec", "ctx.dynamic_dims"),
        )
    captures = [cap]
    if opts.methods:
        captures.append(
            p.register_stage(
                capture_methods, "capture_methods", reads=("input.structure", "ctx.methods")
            )
        )
    if not opts.quantized:
        low = p.register_stage(lower_float, "lower", reads=("input.state", *lower_reads))
        return None, low.depends_on(*captures)
    source = p.register_stage(
        quantize,
        "quantize",
        reads=(
            "input.state",
            "ctx.recipe",
            "ctx.format",
            "ctx.quantizer",
            "registry.quantizer_presets",
            "ctx.calibration",
            "ctx.methods",
            "samples.spec",
            "samples.values",
        ),
    ).depends_on(*captures)
    low = p.register_stage(lower_quantized, "lower", reads=lower_reads).depends_on(source)
    return source, low
