"""The ONNX model of the qnn pipelines: the marker graph exported (``to_onnx``), its markers
lowered (``lower_markers``: ``.encodings`` names or Q/DQ in the HTP's forms), and the
weights bound into it (``bind``, keyed through ``weight_digests``; ``onnx`` binds only
after the weight scales, ``weight_qparams``). The presets' split binds with
:func:`~.values.bind_weights`.
"""

from __future__ import annotations

from typing import Any

from graphbuild.frontend.devices import host_state, model_tensors
from graphbuild.quant.quantmap import QuantMap, QuantValues


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


def weight_qparams(inputs: tuple, samples: Any, context: Any) -> dict:
    """The scales of weight quantizers only: in ``onnx`` the bound weights depend on these,
    so retuning an activation scale leaves bind clean."""
    qvalues, (qmap, _) = inputs
    params = {str(s["qid"]) for s in qmap["quantizers"] if s["param"] is not None}
    return {k: v for k, v in qvalues.items() if k.split(".")[0] in params}


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
