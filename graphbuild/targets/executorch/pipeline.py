"""The ExecuTorch pipelines: ``executorch/xnnpack``, ``executorch/portable``, ``executorch/vgf``.

::

    capture -> [quantize] -> lower -> pte
                  |            +----> delegation
                  +-> reference -> check_numerics (with the pte)

``capture`` is the front end's shared stage: the same cache entry as the QNN target's for the
same model and sample spec. ``quantize`` runs the recipe's PT2E quantizer (values enter
there); without one, ``lower`` reads the model's weights itself. A weights-only change reruns
``quantize`` (or ``lower``), never ``capture``; a recipe change reruns from ``quantize``.
"""

from __future__ import annotations

from typing import Any

from graphbuild.engine.codecs import FileArtifact
from graphbuild.engine.pipeline import Pipeline
from graphbuild.frontend.capture import as_args, capture
from graphbuild.frontend.devices import host_state
from graphbuild.frontend.programs import ProgramArtifact, with_state
from graphbuild.frontend.reference import reference_from_model, reference_from_program
from graphbuild.targets.base import Request, coerce_options
from graphbuild.targets.executorch.options import FORMATS, ExecuTorchOptions


def quantize(inputs: tuple, samples: Any, context: Any) -> ProgramArtifact:
    """PT2E quantization with the recipe's quantizer (or the user's), calibrated on the
    calibration batches (the sample inputs when there are none)."""
    from graphbuild.frontend.quantize import quantize_program
    from graphbuild.targets.executorch.recipes import recipe_quantizer

    (captured,) = inputs
    quantizer = context["quantizer"] or recipe_quantizer(context["recipe"], context["format"])
    calibration = context["calibration"] or [as_args(samples)]
    program = quantize_program(
        captured.program,
        host_state(context.input),
        quantizer,
        calibration,
        as_args(samples),
        fold_quantize=True,
    )
    return ProgramArtifact(program, has_state=True)


def lower_float(inputs: tuple, samples: Any, context: Any) -> tuple:
    """The captured program with the model's weights, lowered: (``.pte`` file, summary)."""
    (captured,) = inputs
    program = with_state(captured.program, host_state(context.input))
    return _lower(program, context)


def lower_quantized(inputs: tuple, samples: Any, context: Any) -> tuple:
    """The quantized program, lowered: (``.pte`` file, delegation summary)."""
    (quantized,) = inputs
    return _lower(quantized.program, context)


def _lower(program: Any, context: Any) -> tuple:
    from graphbuild.targets.executorch.lowering import lower_to_pte

    pte, summary = lower_to_pte(program, context["format"])
    return FileArtifact(f"{context['model_name']}.pte", pte), summary


def pte(inputs: tuple, samples: Any, context: Any) -> FileArtifact:
    """The ``.pte`` file alone (the product placed in the output directory)."""
    ((file, _),) = inputs
    return file


def delegation(inputs: tuple, samples: Any, context: Any) -> dict:
    """What the delegate runs and what is left to portable kernels, by operator."""
    ((_, summary),) = inputs
    return summary


def check_numerics(inputs: tuple, samples: Any, context: Any) -> dict:
    """Run the ``.pte`` in ExecuTorch's runtime on the sample inputs; compare with torch."""
    from graphbuild.targets.executorch.runtime import compare_pte

    file, reference = inputs
    return compare_pte(file.data, reference, as_args(samples))


def build_executorch_pipeline(request: Request, fmt: str | None = None) -> Pipeline:
    """The ExecuTorch pipeline for ``request`` in format ``fmt`` (default: the request's)."""
    from graphbuild.errors import ConfigError
    from graphbuild.targets.executorch.lowering import require_format

    fmt = fmt or request.format
    if fmt not in FORMATS:
        raise ConfigError(
            f"unknown format '{fmt}' for target executorch; known: {', '.join(FORMATS)}"
        )
    require_format(fmt)
    opts = coerce_options(ExecuTorchOptions, request.options, request.target)
    if opts.check_numerics and fmt == "vgf":
        raise ConfigError(
            "check_numerics runs the .pte here, and the VGF delegate needs a Vulkan device with "
            "Arm's ML extensions: export vgf without check_numerics, or check the xnnpack format"
        )
    p = Pipeline(name=f"{request.target}/{fmt}")
    cap = p.register_stage(capture, "capture", reads=("input.structure", "samples.spec"))
    lower_reads = ("ctx.format", "ctx.model_name")
    if opts.quantized:
        source = p.register_stage(
            quantize,
            "quantize",
            reads=(
                "input.state",
                "ctx.recipe",
                "ctx.format",
                "ctx.quantizer",
                "ctx.calibration",
                "samples.spec",
                "samples.values",
            ),
        ).depends_on(cap)
        low = p.register_stage(lower_quantized, "lower", reads=lower_reads).depends_on(source)
    else:
        source = cap
        low = p.register_stage(lower_float, "lower", reads=("input.state", *lower_reads))
        low.depends_on(cap)
    out = p.register_stage(pte, "pte", reads=()).depends_on(low)
    summary = p.register_stage(delegation, "delegation", reads=()).depends_on(low)
    p.products = [out.name]
    p.reports["delegation"] = summary.name
    if opts.check_numerics:
        if opts.quantized:
            ref = p.register_stage(reference_from_program, "reference", reads=("samples",))
            ref.depends_on(source)
        else:
            ref = p.register_stage(reference_from_model, "reference", reads=("input", "samples"))
        check = p.register_stage(check_numerics, "check_numerics", reads=("samples",))
        check.depends_on(out, ref)
        p.reports["numerics"] = check.name
    return p
