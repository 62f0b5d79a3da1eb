"""The one-stage quantization of the qnn pipelines: PT2E whole in a ``quantize`` stage (a
torchao quantizer other than the presets), then ``normalize`` finds the quantizers in the
graph and puts markers in their place; ``quant_map``, ``qparams`` and ``marker_graph`` split
what it found. A model's own quantizers go through ``normalize`` alone. A built-in preset,
with its ``layer_overrides`` and LPBQ, quantizes in three parts instead (:mod:`.placement`,
:mod:`.values`); ``quantize`` runs a preset only in the tests' oracle
(``build_qnn_pipeline(..., one_stage_oracle=True)``), which the split must equal byte for
byte.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from graphbuild.engine.codecs import roundtrip
from graphbuild.frontend.capture import as_args
from graphbuild.frontend.devices import host_state
from graphbuild.frontend.programs import ProgramArtifact, strip_state
from graphbuild.quant.quantmap import QuantMap


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
