"""What the qnn pipelines write and report besides the model: the ``.encodings`` file, the
coverage report over the lowered graph's ``htp_view``, and the numerics check against the
quantized program's ``reference``. The presets' split computes its own encodings, coverage
and reference around these (:mod:`.values`).
"""

from __future__ import annotations

import json
from typing import Any

from graphbuild.engine.codecs import FileArtifact
from graphbuild.errors import ReportedWarning
from graphbuild.frontend.capture import as_args
from graphbuild.frontend.devices import to_device
from graphbuild.quant.quantmap import QuantMap, QuantValues


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
