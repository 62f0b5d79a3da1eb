"""The QNN pipelines: ``qnn/onnx`` (float ONNX + ``.encodings``), ``qnn/onnx_qdq`` and
``qnn/context`` (the QDQ model prepared on QNN's HTP backend: :mod:`.htp_stages`, which also
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
values; values enter at qparams, bind and encodings (DESIGN.md, invariant 5).
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from typing import Any

from graphbuild.engine.codecs import FileArtifact, roundtrip
from graphbuild.engine.pipeline import UNKEYED_INPUT, Pipeline
from graphbuild.errors import ConfigError, ReportedWarning
from graphbuild.frontend.capture import as_args, capture
from graphbuild.frontend.devices import host_state, model_tensors, to_device
from graphbuild.frontend.programs import ProgramArtifact, strip_state
from graphbuild.frontend.reference import reference_from_model
from graphbuild.quant.quantmap import QuantMap, QuantValues
from graphbuild.targets.base import Request, coerce_options
from graphbuild.targets.qnn.options import FORMATS, PRESET_PLACEMENTS, QnnOnnxOptions

# --------------------------------------------------------------------------- stages


def quantize(inputs: tuple, samples: Any, context: Any) -> ProgramArtifact:
    """PT2E calibration. A tensor whose calibration saw non-finite values stays float; the
    program's notes say which (the coverage report names them)."""
    from graphbuild.frontend.quantize import quantize as quantize_pt2e
    from graphbuild.targets.qnn.presets.lpbq_weights import NOTE as LPBQ_NOTE
    from graphbuild.targets.qnn.presets.quantizer import (  # registers the presets too
        is_preset_quantizer,
        lpbq_block_scale_bits,
        with_layer_overrides,
    )

    (captured,) = inputs
    state = host_state(context.input)
    calibration = context["calibration"] or []
    quantizer = with_layer_overrides(context["quantizer"], context["layer_overrides"])
    result = quantize_pt2e(
        captured.program,
        state,
        quantizer,
        calibration,
        as_args(samples),
        drop_non_finite=True,
    )
    notes: dict[str, Any] = {}
    if is_preset_quantizer(context["quantizer"]):
        notes["symmetric_when_signed"] = True  # AIMET's convention, which q/dq ops do not say
    block_scale_bits = lpbq_block_scale_bits(context["quantizer"])
    if block_scale_bits is not None:  # its blocked weights are LPBQ
        notes[LPBQ_NOTE] = block_scale_bits
    if result.left_float:
        notes["left_float"] = dict(sorted(result.left_float.items()))
    if result.degenerate:
        notes["degenerate"] = {k: list(v) for k, v in sorted(result.degenerate.items())}
    return ProgramArtifact(result.program, has_state=True, notes=notes)


def normalize(inputs: tuple, samples: Any, context: Any) -> tuple:
    """Markers in place of quantizers: (marker graph, quant map, values written into the
    graph itself: literal and constant scales of a pre-quantized model)."""
    from graphbuild.frontend.normalize import fixed_values, normalize_program

    (program,) = inputs
    marker, qmap = normalize_program(program.program)
    fixed = fixed_values(program.program, qmap)
    return roundtrip(ProgramArtifact(strip_state(marker))), qmap.to_json(), fixed


def normalize_quantized(inputs: tuple, samples: Any, context: Any) -> tuple:
    """normalize for a PT2E program: its values are calibrated, qparams reads them there.
    A QNN preset's quantizers are symmetric exactly when signed (AIMET's convention), which
    the graph's quantize ops do not say: the quantize stage notes it, the quant map records
    it."""
    from graphbuild.frontend.normalize import normalize_program
    from graphbuild.quant.lpbq import as_lpbq
    from graphbuild.targets.qnn.presets.lpbq_weights import NOTE as LPBQ_NOTE

    (program,) = inputs
    marker, qmap = normalize_program(program.program)
    if program.notes.get("symmetric_when_signed"):
        qmap = QuantMap(tuple(replace(s, symmetric=s.signed) for s in qmap))
    if program.notes.get(LPBQ_NOTE) is not None:  # an LPBQ preset: its blocked weights
        qmap = as_lpbq(qmap, int(program.notes[LPBQ_NOTE]))
    doc = qmap.to_json()
    for key in ("left_float", "degenerate"):
        if program.notes.get(key):
            doc[key] = dict(program.notes[key])
    return roundtrip(ProgramArtifact(strip_state(marker))), doc, {}


def marker_graph(inputs: tuple, samples: Any, context: Any) -> ProgramArtifact:
    """The marker graph alone: a new bit-width changes the quant map, not the graph, so the
    ONNX exporter behind this stage is cut off."""
    ((marker, _, _),) = inputs
    return marker


def quant_map(inputs: tuple, samples: Any, context: Any) -> tuple:
    """The quant map alone (and the graph's own quantizer values): what the value stages
    need, without loading a program. With ``lpbq`` the model's blocked int4 weight quantizers
    are written as LPBQ, as FastForward's export does with an ``LPBQProcessor``."""
    ((_, qmap, fixed),) = inputs
    if context["lpbq"]:
        from graphbuild.quant.lpbq import as_lpbq

        doc = dict(qmap)
        doc.update(as_lpbq(QuantMap.from_json(qmap)).to_json())
        qmap = doc
    return qmap, fixed


def qparams_from_model(inputs: tuple, samples: Any, context: Any) -> dict:
    """Scales and zero points of a pre-quantized model (its fake-quant state)."""
    from graphbuild.frontend.normalize import qvalues_from

    ((qmap, fixed),) = inputs
    values = qvalues_from(QuantMap.from_json(qmap), fixed, host_state(context.input))
    return values.to_tensors()


def qparams_from_program(inputs: tuple, samples: Any, context: Any) -> dict:
    """Scales and zero points calibrated by the quantize stage."""
    from graphbuild.frontend.normalize import collect_qvalues

    program, (qmap, _) = inputs
    return collect_qvalues(program.program, QuantMap.from_json(qmap)).to_tensors()


def weight_qparams(inputs: tuple, samples: Any, context: Any) -> dict:
    """The scales of weight quantizers only: in ``onnx`` the bound weights depend on these,
    so retuning an activation scale leaves bind clean."""
    qvalues, (qmap, _) = inputs
    params = {str(s["qid"]) for s in qmap["quantizers"] if s["param"] is not None}
    return {k: v for k, v in qvalues.items() if k.split(".")[0] in params}


def to_onnx(inputs: tuple, samples: Any, context: Any) -> Any:
    from graphbuild.onnx.skeleton import export_skeleton

    (marker,) = inputs
    return export_skeleton(
        marker.program,
        opset=context["opset"],
        input_names=context["input_names"],
        output_names=context["output_names"],
    )


def lower_onnx(inputs: tuple, samples: Any, context: Any) -> tuple:
    from graphbuild.onnx.lower import lower_markers

    skeleton, (qmap, _) = inputs
    lowered, names = lower_markers(skeleton, QuantMap.from_json(qmap), "onnx")
    return lowered, {str(q): n for q, n in sorted(names.items())}


def lower_qdq(inputs: tuple, samples: Any, context: Any) -> tuple:
    """Q/DQ in place of the markers, in the forms the HTP runs fully quantized."""
    from graphbuild.onnx.lower import lower_markers
    from graphbuild.targets.qnn.rewrites.qdq_forms import apply_htp_forms

    skeleton, (qmap, _) = inputs
    quant_map = QuantMap.from_json(qmap)
    lowered, names = lower_markers(skeleton, quant_map, "onnx_qdq")
    formed = apply_htp_forms(
        lowered, quant_map, matmul_int16_requantize=context["matmul_int16_requantize"]
    )
    return formed, {str(q): n for q, n in sorted(names.items())}


def weight_digests(inputs: tuple, samples: Any, context: Any) -> dict:
    """Digests of exactly the state tensors the lowered graph binds: bind keys on these
    rather than on the whole state, so a changed quantizer buffer does not re-bind weights."""
    from graphbuild.engine.fingerprint import tensor_digests
    from graphbuild.onnx.lower import QPARAMS_LOCATION, SOURCE_KEY
    from graphbuild.onnx.skeleton import STATE_LOCATION

    ((lowered, _),) = inputs
    state = model_tensors(context.input)  # hashed where they are (engine.fingerprint)
    names = set()
    for init in lowered.graph.initializer:
        location = {e.key: e.value for e in init.external_data}.get("location")
        meta = {p.key: p.value for p in init.metadata_props}
        if location == STATE_LOCATION:
            names.add(meta.get(SOURCE_KEY, init.name))
        elif location == QPARAMS_LOCATION and SOURCE_KEY in meta:  # state bound quantized
            names.add(meta[SOURCE_KEY])
    bound = [n for n in sorted(names) if n in state]
    digests = tensor_digests([state[n] for n in bound], reuse=True)  # input.state's, this run
    return {
        n: f"{state[n].dtype}{list(state[n].shape)}:{d}"
        for n, d in zip(bound, digests, strict=True)
    }


def bind_model_weights(inputs: tuple, samples: Any, context: Any) -> Any:
    """Put the model's current weights (and quantizer values) into the lowered skeleton.
    What it reads of the model is keyed through ``weight_digests``, whose digests also let
    ``bind`` take the tensors whose inputs did not change from its previous call."""
    from graphbuild.onnx.bind import bind

    (lowered, _), (qmap, _), qvalues, digests = inputs
    return bind(
        lowered,
        host_state(context.input),
        QuantMap.from_json(qmap),
        QuantValues.from_tensors(qvalues),
        fake_quantize_weights=context["fake_quantize_weights"],
        state_digests={name: d.rpartition(":")[2] for name, d in digests.items()},
    )


def bind_program_weights(inputs: tuple, samples: Any, context: Any) -> Any:
    """Put the quantize stage's weights (BatchNorm folded by PT2E) into the skeleton."""
    from graphbuild.onnx.bind import bind

    (lowered, _), (qmap, _), qvalues, program = inputs
    state = dict(program.program.state_dict)
    state.update(program.program.constants)
    return bind(
        lowered,
        state,
        QuantMap.from_json(qmap),
        QuantValues.from_tensors(qvalues),
        fake_quantize_weights=context["fake_quantize_weights"],
    )


def encodings(inputs: tuple, samples: Any, context: Any) -> FileArtifact:
    quantizer = context["quantizer"]
    return write_encodings(inputs, context, "min_max" if isinstance(quantizer, str) else None)


def write_encodings(inputs: tuple, context: Any, quant_scheme: str | None) -> FileArtifact:
    """The encodings file from (quant map, qparams, (lowered model, names)); ``quant_scheme``
    goes into ``quantizer_args`` (None: unknown, as for a model's own quantizers)."""
    from graphbuild.targets.qnn.encodings import build_encodings, dumps_encodings

    (qmap, _), qvalues, (lowered, names) = inputs
    doc = build_encodings(
        QuantMap.from_json(qmap),
        QuantValues.from_tensors(qvalues),
        {int(q): n for q, n in names.items()},
        context["encodings_version"],
        model=lowered,
        int32_bias=context["int32_bias"],
        quant_scheme=quant_scheme,
    )
    return FileArtifact(f"{context['model_name']}.encodings", dumps_encodings(doc).encode())


def coverage(inputs: tuple, samples: Any, context: Any) -> dict:
    """Which tensors QNN HTP runs quantized the export leaves float, and why; with
    ``strict_coverage`` any is an error."""
    import warnings

    from graphbuild.targets.qnn.presets.quantizer import is_preset_quantizer, preset_bits
    from graphbuild.targets.qnn.reports.coverage import check_coverage, coverage_report

    (lowered, names), structure, (qmap, _), qvalues = inputs
    quantizer = context["quantizer"]
    preset = None
    if is_preset_quantizer(quantizer):
        preset = quantizer if isinstance(quantizer, str) else quantizer.preset
    report = coverage_report(
        lowered,
        QuantMap.from_json(qmap),
        {int(q): n for q, n in names.items()},
        QuantValues.from_tensors(qvalues),
        preset_bits(preset) if preset else None,
        qmap.get("left_float"),
        preset,
        qmap.get("degenerate"),
        context["layer_overrides"],
        structure,
    )
    for entry in report["degenerate"]:
        warnings.warn(
            f"coverage: '{entry['tensor']}': {entry['why']}", ReportedWarning, stacklevel=2
        )
    for entry in report["htp_defects"]:
        warnings.warn(
            f"coverage: '{entry['tensor']}': {entry['reason']}; reproduced by "
            f"{entry['reproduction']}",
            ReportedWarning,
            stacklevel=2,
        )
    if context["strict_coverage"]:
        check_coverage(report)
    return report


def htp_view(inputs: tuple, samples: Any, context: Any) -> dict:
    """Structure: the lowered graph as the HTP rules see it, which the coverage report
    applies the rules of the export's bit-widths to (a retune reuses it)."""
    from graphbuild.targets.qnn.reports.coverage import coverage_structure

    ((lowered, _),) = inputs
    return coverage_structure(lowered)


def reference_with_tensors(inputs: tuple, samples: Any, context: Any) -> dict:
    """The quantized program's outputs on the sample inputs, and its quantized activations
    (``tensor:<qid>``) for the forced comparison of ``check_numerics``."""
    from graphbuild.frontend.reference import outputs_dict
    from graphbuild.targets.qnn.reports.numerics import TENSOR_PREFIX, quantized_tensors

    (program,) = inputs
    tensors, outputs = quantized_tensors(program.program, to_device(as_args(samples), "cpu"))
    reference = outputs_dict(outputs)
    reference.update({f"{TENSOR_PREFIX}{qid}": value for qid, value in tensors.items()})
    return reference


def check_numerics_float(inputs: tuple, samples: Any, context: Any) -> dict:
    """``onnx``: put Q/DQ back from the ``.encodings`` file alone, run it in onnxruntime on
    the sample inputs, and compare with the quantized torch model (and, after a quantize
    stage, with the float model)."""
    return _check_numerics(inputs, samples, reinsert=True)


def check_numerics_qdq(inputs: tuple, samples: Any, context: Any) -> dict:
    """``onnx_qdq``: run the Q/DQ model as written and compare with the torch model (and,
    after a quantize stage, with the float model)."""
    return _check_numerics(inputs, samples, reinsert=False)


def _check_numerics(inputs: tuple, samples: Any, *, reinsert: bool) -> dict:
    from graphbuild.targets.qnn.reports.numerics import compare_outputs

    bound, enc_file, reference, (_, names), *floats = inputs
    doc = json.loads(enc_file.data)
    qids = {int(q): n for q, n in names.items()}
    return compare_outputs(
        bound,
        doc,
        reference,
        as_args(samples),
        reinsert=reinsert,
        names=qids,
        float_reference=floats[0] if floats else None,
    )


# --------------------------------------------------------------------------- wiring


def build_qnn_pipeline(
    request: Request, fmt: str | None = None, *, split: bool | None = None
) -> Pipeline:
    """The reference plan of DESIGN.md for ``qnn/onnx`` and ``qnn/onnx_qdq``. ``fmt`` picks
    the ONNX flavour when a custom format builds on this pipeline (default: the request's).

    A built-in preset quantizes in three parts, structure, statistics and values
    (``targets.qnn.quantization``); any other quantizer runs PT2E as one ``quantize`` stage.
    ``split=False`` builds the one stage for a preset too: the reference the split is
    checked against, byte for byte."""
    fmt = fmt or request.format
    if fmt not in FORMATS:
        raise ConfigError(
            f"unknown format '{fmt}' for target qnn; known: {', '.join(FORMATS)} "
            "(a custom format passes fmt= to build_qnn_pipeline)"
        )
    opts = coerce_options(QnnOnnxOptions, request.options, request.target)
    p = Pipeline(name=f"{request.target}/{request.format}")
    cap = p.register_stage(capture, "capture", reads=("input.structure", "samples.spec"))
    quantized = opts.quantizer is not None
    # layer_overrides change where quantizers sit: PT2E in one stage
    default_split = _splits(opts.quantizer) and not opts.layer_overrides
    split = quantized and (default_split if split is None else split)
    if split:
        from graphbuild.targets.qnn import quantization

        parts = quantization.wire_split_quantization(p, cap)
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
            bound = p.register_stage(
                quantization.bind_weights, "bind", reads=reads, rematerialize=True
            )
            bound.depends_on(
                lower, qmap, bind_values, weights, parts["placement"], parts["fold_weights"]
            )
        else:
            bound = p.register_stage(bind_model_weights, "bind", reads=reads, rematerialize=True)
            bound.depends_on(lower, qmap, bind_values, weights)
    enc_reads = ("ctx.encodings_version", "ctx.model_name", "ctx.int32_bias", "ctx.quantizer")
    view = p.register_stage(htp_view, "htp_view", reads=()).depends_on(lower)
    if split:
        enc = p.register_stage(quantization.encodings, "encodings", reads=(*enc_reads, "ctx.range"))
        cov = p.register_stage(quantization.coverage, "coverage", reads=COVERAGE_READS).depends_on(
            lower, view, qmap, qp, parts["placement"], parts["weight_stats"], parts["calibrate"]
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
                quantization.reference, "reference", reads=("input.state", "samples")
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
        from graphbuild.targets.qnn.htp_stages import add_htp_stages

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
    registered another under it, or as a ``QnnQuantizer``): those quantize in three parts."""
    from graphbuild.frontend.presets import preset_entries

    if isinstance(quantizer, str):
        return quantizer in PRESET_PLACEMENTS and quantizer not in preset_entries()
    preset = sys.modules.get("graphbuild.targets.qnn.presets.quantizer")
    return (
        preset is not None
        and type(quantizer) is preset.QnnQuantizer
        and quantizer.preset in PRESET_PLACEMENTS
        and not getattr(quantizer, "layer_overrides", None)
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


__all__ = ["FORMATS", "QnnOnnxOptions", "build_qnn_pipeline"]
