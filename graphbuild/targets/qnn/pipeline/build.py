"""The QNN pipelines: ``qnn/onnx`` (float ONNX + ``.encodings``), ``qnn/onnx_qdq`` and
``qnn/context`` (the QDQ model prepared on QNN's HTP backend: :mod:`.htp`, which also
adds the HTP check to the others with ``check_htp``).

::

    capture -> [quantize] -> normalize -> marker_graph -> to_onnx -> lower_markers -> bind
                                 |                                      |            ^
                                 +-> quant_map -> qparams -> [weight_qparams] ------+
                                                    +---------------------> encodings
                                                    +-> coverage (HTP rules on the lowered
                                                        model against the quant map)
    lower_markers -> htp_view (the lowered graph as the rules see it) -> coverage

Structure (capture, normalize, to_onnx, lower_markers, htp_view) never reads weight or quantizer
values; values enter at qparams, bind and encodings (docs/design.md, invariant 5).

A built-in preset (with its ``layer_overrides`` and LPBQ) replaces ``[quantize] -> normalize``
by its split: structure, statistics, values (:mod:`.placement`). This module wires the stages;
they are in :mod:`.quantize` (the one-stage path: a model's own quantizers, another torchao
quantizer, and the presets' test oracle), :mod:`.placement`, :mod:`.values` and
:mod:`.site_rules` (a preset's split), :mod:`.lower` (the ONNX model),
:mod:`.outputs` (encodings, coverage, numerics) and :mod:`.htp`.
"""

from __future__ import annotations

import sys
from typing import Any

from graphbuild.engine.pipeline import UNKEYED_INPUT, Pipeline, StageRef
from graphbuild.errors import ConfigError
from graphbuild.frontend.capture import capture
from graphbuild.frontend.reference import reference_from_model
from graphbuild.targets.base import Request, coerce_options
from graphbuild.targets.qnn.options import ONNX_FORMATS, PRESET_PLACEMENTS, QnnOnnxOptions
from graphbuild.targets.qnn.pipeline.lower import (
    bind_model_weights,
    bind_program_weights,
    lower_onnx,
    lower_qdq,
    to_onnx,
    weight_digests,
    weight_qparams,
)
from graphbuild.targets.qnn.pipeline.outputs import (
    check_numerics_float,
    check_numerics_qdq,
    coverage,
    encodings,
    htp_view,
    reference_with_tensors,
)
from graphbuild.targets.qnn.pipeline.quantize import (
    marker_graph,
    normalize,
    normalize_quantized,
    qparams_from_model,
    qparams_from_program,
    quant_map,
    quantize,
)


def build_qnn_pipeline(
    request: Request, fmt: str | None = None, *, one_stage_oracle: bool = False
) -> Pipeline:
    """The reference plan of docs/design.md for ``qnn/onnx`` and ``qnn/onnx_qdq``. ``fmt`` picks
    the ONNX flavour when a custom format builds on this pipeline (default: the request's).

    A built-in preset, with its ``layer_overrides`` and LPBQ, quantizes in three parts,
    structure, statistics and values (:mod:`.placement`, :mod:`.values`); any other quantizer
    runs PT2E as one ``quantize`` stage. ``one_stage_oracle=True`` is for tests only: it
    quantizes a preset in the one PT2E stage too, the oracle the split is checked against,
    byte for byte. No product path sets it."""
    fmt = fmt or request.format
    if fmt not in ONNX_FORMATS:
        raise ConfigError(
            f"unknown format '{fmt}' for this pipeline; known: {', '.join(ONNX_FORMATS)} "
            "(a custom format passes fmt= to build_qnn_pipeline; graphbuild.targets.qnn."
            "build_qnn_pipeline builds every format of the target)"
        )
    opts = coerce_options(QnnOnnxOptions, request.options, request.target)
    p = Pipeline(name=f"{request.target}/{request.format}")
    cap = p.register_stage(capture, "capture", reads=("input.structure", "samples.spec"))
    quantized = opts.quantizer is not None
    split = quantized and _splits(opts.quantizer) and not one_stage_oracle
    if split:
        from graphbuild.targets.qnn.pipeline import values

        parts = wire_split_quantization(p, cap)
        graph, qmap, qp = parts["marker_graph"], parts["quant_map"], parts["qparams"]
    else:
        source, graph, qmap, qp = _wire_normalize(p, cap, opts.quantizer is not None)
    onnx = p.register_stage(
        to_onnx, "to_onnx", reads=("ctx.opset", "ctx.input_names", "ctx.output_names")
    ).depends_on(graph)
    # a preset's ``onnx`` lowering reads which tensor each qid marks, not the grids
    marks = parts["quant_sites"] if split and fmt == "onnx" else qmap
    lower = p.register_stage(
        lower_onnx if fmt == "onnx" else lower_qdq,
        "lower_markers",
        reads=() if fmt == "onnx" else ("ctx.matmul_int16_requantize",),
    ).depends_on(onnx, marks)
    bind_values = qp
    if fmt == "onnx":  # only weight scales reach the float graph (snapped weights)
        bind_values = p.register_stage(weight_qparams, "weight_qparams", reads=())
        bind_values.depends_on(qp, qmap)
    if quantized and not split:
        bound = p.register_stage(
            bind_program_weights, "bind", reads=("ctx.fake_quantize_weights",)
        ).depends_on(lower, qmap, bind_values, source)
    else:
        weights = p.register_stage(weight_digests, "weight_digests", reads=("input.state",))
        weights.depends_on(lower)
        reads = (UNKEYED_INPUT, "ctx.fake_quantize_weights")
        # the model holds the weights: the cache keeps the output's digest, not its bytes
        if split:
            bound = p.register_stage(values.bind_weights, "bind", reads=reads, rematerialize=True)
            bound.depends_on(
                lower, qmap, bind_values, weights, parts["placement"], parts["fold_weights"]
            )
        else:
            bound = p.register_stage(bind_model_weights, "bind", reads=reads, rematerialize=True)
            bound.depends_on(lower, qmap, bind_values, weights)
    enc_reads = ("ctx.encodings_version", "ctx.model_name", "ctx.int32_bias", "ctx.quantizer")
    view = p.register_stage(htp_view, "htp_view", reads=()).depends_on(lower)
    if split:
        enc = p.register_stage(values.encodings, "encodings", reads=(*enc_reads, "ctx.range"))
        cov = p.register_stage(values.coverage, "coverage", reads=COVERAGE_READS).depends_on(
            lower,
            view,
            qmap,
            qp,
            parts["placement"],
            parts["weight_stats"],
            parts["calibrate"],
            parts["left_float"],
        )
    else:
        enc = p.register_stage(encodings, "encodings", reads=enc_reads)
        cov = p.register_stage(coverage, "coverage", reads=COVERAGE_READS).depends_on(
            lower, view, qmap, qp
        )
    enc.depends_on(qmap, qp, lower)
    p.reports["coverage"] = cov.name
    p.products = [bound.name, enc.name]
    p.output_files = frozenset({f"{request.model_name}.encodings"})
    ref = None
    if opts.check_numerics:
        floats = []
        if split:
            ref = p.register_stage(
                values.reference, "reference", reads=("input.state", "samples")
            ).depends_on(graph, qmap, qp, parts["placement"], parts["fold_weights"])
        elif quantized:
            ref = p.register_stage(reference_with_tensors, "reference", reads=("samples",))
            ref.depends_on(source)
        else:
            ref = p.register_stage(reference_from_model, "reference", reads=("input", "samples"))
        if quantized:  # what quantizing cost: the float model's outputs
            floats.append(
                p.register_stage(
                    reference_from_model, "float_reference", reads=("input", "samples")
                )
            )
        check = check_numerics_float if fmt == "onnx" else check_numerics_qdq
        check_stage = p.register_stage(check, "check_numerics", reads=("samples",))
        check_stage.depends_on(bound, enc, ref, lower, *floats)
        p.reports["numerics"] = "check_numerics"
    if opts.check_htp or fmt == "context":
        from graphbuild.targets.qnn.pipeline.htp import add_htp_stages

        if "float_reference" in p:  # the numerics check's
            ref = p.get_stage("float_reference")
        elif ref is None or opts.quantizer is not None:  # SQNR against the float model
            ref = p.register_stage(
                reference_from_model, "float_reference", reads=("input", "samples")
            )
        add_htp_stages(
            p,
            opts.htp_targets(),
            fmt=fmt,
            bound=bound,
            enc=enc,
            coverage=cov,
            reference=ref,
            model_name=request.model_name,
        )
    return p


#: what the coverage report reads of the options
COVERAGE_READS = ("ctx.quantizer", "ctx.strict_coverage", "ctx.layer_overrides")


def _splits(quantizer: Any) -> bool:
    """Whether ``quantizer`` is one of graphbuild's own presets (by name, unless a user
    registered another under it, or as a ``QnnQuantizer``, whose own ``layer_overrides`` the
    context carries): those quantize in three parts."""
    from graphbuild.frontend.presets import preset_entries

    if isinstance(quantizer, str):
        return quantizer in PRESET_PLACEMENTS and quantizer not in preset_entries()
    preset = sys.modules.get("graphbuild.targets.qnn.presets.quantizer")
    return (
        preset is not None
        and type(quantizer) is preset.QnnQuantizer
        and quantizer.preset in PRESET_PLACEMENTS
    )


def _wire_normalize(p: Pipeline, cap: Any, quantized: bool) -> tuple:
    """The one-stage path: ``quantize`` (PT2E whole, when a quantizer is configured), then
    ``normalize`` finds the quantizers in the graph; returns (source, marker_graph,
    quant_map, qparams)."""
    source = cap
    if quantized:
        source = p.register_stage(
            quantize,
            "quantize",
            reads=(
                "input.state",
                "ctx.quantizer",
                "ctx.layer_overrides",
                "registry.quantizer_presets",
                "ctx.calibration",
                "samples.spec",
                "samples.values",
            ),
        ).depends_on(cap)
    norm = p.register_stage(
        normalize_quantized if quantized else normalize,
        "normalize",
        reads=("registry.recognizers",),
    ).depends_on(source)
    qmap = p.register_stage(quant_map, "quant_map", reads=("ctx.lpbq",)).depends_on(norm)
    if quantized:
        qp = p.register_stage(qparams_from_program, "qparams", reads=()).depends_on(source, qmap)
    else:
        qp = p.register_stage(qparams_from_model, "qparams", reads=("input.state",))
        qp.depends_on(qmap)
    graph = p.register_stage(marker_graph, "marker_graph", reads=()).depends_on(norm)
    return source, graph, qmap, qp


def wire_split_quantization(p: Pipeline, cap: StageRef) -> dict[str, StageRef]:
    """Register the structure, statistics and value stages after ``cap``; returns the
    stages the rest of the pipeline builds on (``marker_graph``, ``quant_map``, ``quant_sites``,
    ``qparams``, ``placement``, ``fold_weights``, ``weight_stats``, ``calibrate``,
    ``left_float``)."""
    from graphbuild.targets.qnn.pipeline.placement import (
        calibrate,
        fold_source,
        fold_weights,
        left_float,
        marker_graph,
        place_quantizers,
        placement,
        weight_stats,
    )
    from graphbuild.targets.qnn.pipeline.values import qparams, quant_map, quant_sites

    place = p.register_stage(
        place_quantizers,
        "place_quantizers",
        reads=("ctx.quantizer_placement", "registry.quantizer_presets", "samples.spec"),
    ).depends_on(cap)
    layout = p.register_stage(placement, "placement", reads=()).depends_on(place)
    bn = p.register_stage(fold_source, "fold_source", reads=())
    bn.depends_on(cap, layout)
    folded = p.register_stage(fold_weights, "fold_weights", reads=("input.state",))
    folded.depends_on(bn, layout)
    weights = p.register_stage(
        weight_stats, "weight_stats", reads=("input.state", "ctx.weight_blocks")
    )
    weights.depends_on(layout, folded)
    acts = p.register_stage(
        calibrate,
        "calibrate",
        reads=(
            "input.state",
            "ctx.calibration",
            "ctx.statistics",
            "samples.spec",
            "samples.values",
        ),
    ).depends_on(place, folded)
    kept = p.register_stage(left_float, "left_float", reads=("ctx.layer_overrides",))
    kept.depends_on(layout, weights, acts)
    graph = p.register_stage(marker_graph, "marker_graph", reads=()).depends_on(place, kept)
    grids = ("ctx.quantizer", "ctx.layer_overrides")
    qmap = p.register_stage(quant_map, "quant_map", reads=grids).depends_on(layout, kept)
    sites = p.register_stage(quant_sites, "quant_sites", reads=()).depends_on(layout, kept)
    values = p.register_stage(qparams, "qparams", reads=(*grids, "ctx.range"))
    values.depends_on(layout, weights, acts, kept)
    return {
        "marker_graph": graph,
        "quant_map": qmap,
        "quant_sites": sites,
        "qparams": values,
        "placement": layout,
        "fold_weights": folded,
        "weight_stats": weights,
        "calibrate": acts,
        "left_float": kept,
    }


__all__ = ["QnnOnnxOptions", "build_qnn_pipeline"]
