"""The numerics check: onnxruntime against the quantized torch model, on the sample inputs.

Two comparisons. End to end: the ONNX model's outputs against torch's (SQNR, max error, and
the error in steps of the output's encoding). With 16-bit activations one step is so fine
that a one-ulp difference between two implementations of an op (a convolution summing in
another order) moves a value across a rounding boundary now and then, and the flipped step
travels on through every later layer: end to end, a deep model's outputs differ by a few
steps without any encoding being wrong. So, where the reference has the torch model's
quantized tensors (a program graphbuild quantized), the check also runs the ONNX model with
every quantized activation *forced* to torch's value ("teacher forcing"): then each op
computes from exactly torch's inputs, and each quantized tensor and output must land within
a step or two of torch's. That pins a wrong encoding, grid or op to the tensor where it is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
import torch
from onnx import helper

from graphbuild.frontend.reference import output_errors
from graphbuild.onnx.bind import BoundModel
from graphbuild.onnx.save import materialize

__all__ = ["TENSOR_PREFIX", "compare_outputs", "quantized_tensors", "run_onnx"]

#: reference keys of internal quantized tensors: ``tensor:<name>`` (the rest are outputs)
TENSOR_PREFIX = "tensor:"
_FORCED = "__onnx"
_DATA_MOVEMENT = {"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity"}
_QDQ = {"QuantizeLinear", "DequantizeLinear"}


def run_onnx(
    model: Any, args: tuple, extra: Mapping[str, np.ndarray] | None = None
) -> list[np.ndarray]:
    """Run an in-memory ModelProto in onnxruntime on torch/numpy positional inputs (and
    ``extra`` named ones)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    # as written: the optimizer would fuse Q/DQ into integer kernels (other numerics) and
    # its QDQ propagation rejects some valid int8/uint8 graphs
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    leaves = [a for a in torch.utils._pytree.tree_flatten(args)[0] if isinstance(a, torch.Tensor)]
    extra = dict(extra or {})
    names = [i.name for i in session.get_inputs() if i.name not in extra]
    feeds = {n: t.detach().cpu().numpy() for n, t in zip(names, leaves, strict=False)}
    feeds.update(extra)
    return session.run(None, feeds)


def quantized_tensors(
    program: torch.export.ExportedProgram, args: tuple
) -> tuple[dict[int, torch.Tensor], list[Any]]:
    """Run ``program`` (a PT2E-quantized program) once on ``args``: the dequantized value of
    every quantized activation, by qid (the numbering normalize gives its quantizers), and
    the program's user outputs in order."""
    from graphbuild.frontend.normalize import find_quantizers

    wanted: dict[torch.fx.Node, int] = {}
    for qid, match in enumerate(find_quantizers(program)):
        if match.input.op not in ("call_function", "placeholder"):
            continue  # weights and constants: the same in both models
        group = set(match.replaces)
        outs = [n for n in match.replaces if any(u not in group for u in n.users)]
        if outs:
            wanted[outs[0]] = qid
    values: dict[int, torch.Tensor] = {}

    class _Recorder(torch.fx.Interpreter):
        def run_node(self, node: torch.fx.Node) -> Any:
            result = super().run_node(node)
            if node in wanted:
                values[wanted[node]] = result.detach().float().contiguous()
            return result

    with torch.no_grad():
        results = _Recorder(program.graph_module).run(*_flat_inputs(program, args))
    specs = program.graph_signature.output_specs
    outputs = [r for r, s in zip(results, specs, strict=True) if s.kind.name == "USER_OUTPUT"]
    return values, outputs


def _flat_inputs(program: torch.export.ExportedProgram, args: tuple) -> list[Any]:
    """The graph module's placeholder values: state, constants, then the user inputs."""
    sig = program.graph_signature
    user = iter(a for a in torch.utils._pytree.tree_flatten(args)[0])
    out = []
    for spec in sig.input_specs:
        if spec.kind.name == "USER_INPUT":
            out.append(next(user))
        elif spec.target in program.state_dict:
            out.append(program.state_dict[spec.target])
        else:
            out.append(program.constants[spec.target])
    return out


def compare_outputs(
    bound: BoundModel,
    encodings: Mapping[str, Any],
    reference: Mapping[str, torch.Tensor],
    args: tuple,
    *,
    reinsert: bool,
    names: Mapping[int, str] | None = None,
    float_reference: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Per output: max abs error, SQNR and error in output quantization steps, end to end,
    and (where the reference holds quantized tensors) with them forced to torch's values;
    per quantized tensor, the largest error in steps under forcing. With ``reinsert``, Q/DQ
    are put back into the float model from the encodings document alone before running it
    (the ``onnx`` format's contract). ``names`` (qid -> ONNX tensor) places the reference's
    quantized tensors (``tensor:<qid>``) in the model. With ``float_reference`` (the float
    model's outputs, when ``reference`` is the quantized program) each output also has
    ``max_abs_error_vs_float`` and ``sqnr_db_vs_float``: what quantizing cost, which a
    sweep over presets compares; ``reference`` says what the plain figures measure against."""
    from graphbuild.targets.qnn.encodings import insert_fake_quant, read_encodings

    model = materialize(bound)
    table = read_encodings(encodings)
    if reinsert:
        model = insert_fake_quant(model, encodings, table=table)
    refs = [t for k, t in sorted(reference.items()) if not k.startswith(TENSOR_PREFIX)]
    internal = {
        names[int(k[len(TENSOR_PREFIX) :])]: t
        for k, t in reference.items()
        if k.startswith(TENSOR_PREFIX) and names and int(k[len(TENSOR_PREFIX) :]) in names
    }
    names = [o.name for o in model.graph.output]
    producer = {o: n for n in model.graph.node for o in n.output}
    steps = [_output_step(producer, name, table) for name in names]
    floats = [t for _, t in sorted((float_reference or {}).items())]
    if floats and len(floats) != len(refs):
        floats = []  # another set of outputs than the program's: nothing to compare
    outputs = []
    results = run_onnx(model, args)
    for i, (ref, got, name, step) in enumerate(zip(refs, results, names, steps, strict=True)):
        errors = output_errors(ref.numpy(), got)
        err = errors["max_abs_error"]
        row = {
            "name": name,
            **errors,
            "output_step": step,
            "max_error_steps": err / step if step else None,
        }
        if floats:
            vs_float = output_errors(floats[i].numpy(), got)
            row.update({f"{k}_vs_float": v for k, v in vs_float.items()})
        outputs.append(row)
    against = "quantized program" if float_reference is not None else "torch model"
    report: dict[str, Any] = {
        "reference": against,
        "outputs": outputs,
        "encodings_reinserted": reinsert,
    }
    if internal:
        report["forced"] = _forced_check(model, table, internal, refs, args, outputs)
    return report


def _output_step(
    producer: Mapping[str, onnx.NodeProto], name: str, table: Mapping[str, Any]
) -> float | None:
    """The step of the encoding that holds a graph output: its own, or that of the tensor a
    chain of Q/DQ and data-movement ops (a final ``view``) carries to it."""
    seen: set[str] = set()
    while name not in table and name in producer and name not in seen:
        seen.add(name)
        node = producer[name]
        if node.op_type not in _DATA_MOVEMENT | _QDQ or not node.input:
            break
        name = node.input[0]
    enc = table.get(name)
    return float(np.max(enc.scale)) if enc is not None and enc.scale.size == 1 else None


def _forced_check(
    model: onnx.ModelProto,
    table: Mapping[str, Any],
    internal: Mapping[str, torch.Tensor],
    refs: list[torch.Tensor],
    args: tuple,
    outputs: list[dict[str, Any]],
) -> dict[str, Any]:
    """Run ``model`` with every quantized activation that torch computed forced to torch's
    value; compare the quantized tensors (in integer steps) and the outputs."""
    forced = _force(model, table, internal)
    feeds = {name: internal[name].numpy() for name in forced}
    results = run_onnx(forced_model(model, forced), args, feeds)
    n_out = len(outputs)
    worst, worst_name = 0.0, None
    for name, value in zip(forced, results[n_out:], strict=True):
        enc = table[name]
        diff = float(np.max(np.abs(_grid(value, enc) - _grid(internal[name].numpy(), enc))))
        if diff > worst or worst_name is None:
            worst, worst_name = diff, name
    for out, ref, got in zip(outputs, refs, results[:n_out], strict=True):
        err = float(np.max(np.abs(ref.numpy() - np.asarray(got).reshape(ref.shape))))
        out["forced_max_error_steps"] = err / out["output_step"] if out["output_step"] else None
    return {"tensors": len(forced), "max_error_steps": worst, "worst": worst_name}


def _force(
    model: onnx.ModelProto, table: Mapping[str, Any], internal: Mapping[str, torch.Tensor]
) -> list[str]:
    """The encoded activations that can be forced: produced by a node, not a graph output,
    with a torch value of the shape ONNX declares."""
    produced = {o for n in model.graph.node for o in n.output}
    outputs = {o.name for o in model.graph.output}
    declared = _declared_shapes(model)
    return [
        name
        for name in sorted(internal)
        if name in table
        and name in produced
        and name not in outputs
        and table[name].scale.size == 1
        and tuple(internal[name].shape) == declared.get(name, tuple(internal[name].shape))
    ]


def _declared_shapes(model: onnx.ModelProto) -> dict[str, tuple[int, ...]]:
    """The static shapes ONNX declares for its values."""
    shapes = {}
    for vi in (*model.graph.value_info, *model.graph.output):
        dims = vi.type.tensor_type.shape.dim
        if dims and all(d.HasField("dim_value") for d in dims):
            shapes[vi.name] = tuple(d.dim_value for d in dims)
    return shapes


def forced_model(model: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """A copy of ``model`` where each tensor in ``names`` is a graph input (torch's value)
    and what the model computes for it is an extra graph output ``<name>__onnx``."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    wanted = set(names)
    for node in graph.node:
        for i, o in enumerate(node.output):
            if o in wanted:
                node.output[i] = o + _FORCED
    for name in names:
        graph.input.append(helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
        graph.output.append(
            helper.make_tensor_value_info(name + _FORCED, onnx.TensorProto.FLOAT, None)
        )
    return out


def _grid(value: np.ndarray, enc: Any) -> np.ndarray:
    """Integer grid positions of ``value`` under a per-tensor encoding."""
    scale = float(np.asarray(enc.scale).reshape(-1)[0])
    zero = float(np.asarray(enc.zero_point).reshape(-1)[0])
    q = np.round(np.asarray(value, dtype=np.float64) / scale) + zero
    return np.clip(q, enc.qmin, enc.qmax)
