"""Value-independent clean-ups of the exported skeleton, for what QNN's tools read.

* :func:`split_sequences`: ``SplitToSequence`` -> ``SequenceAt`` (the exporter's ``chunk`` and
  ``split``) becomes one ``Split``. Sequences are no tensors: quantization tools (AIMET) cannot
  quantize or even simulate them, and QNN has no sequence ops.
* :func:`fold_constant_casts`: a ``Cast`` or ``CastLike`` of a ``Constant`` node becomes a
  ``Constant`` of the target type (also through an ``Expand``). The exporter writes numbers as
  float constants cast to the type they are used in (``arange``'s start and step); a float
  constant in the graph is one more tensor QNN would quantize. Casts to a float type are
  kept: QNN leaves a Cast's output unquantized, a float constant it would not.
* :func:`drop_zero_biases`: a Conv, ConvTranspose or Gemm given no bias in torch gets one from
  the exporter, zeros expanded to the weight's output channels (``Expand(CastLike(0),
  Shape(W)...)``); QNN refuses a bias computed in the graph (error 3110, and onnxruntime then
  fails the session even with CPU fallback). The input is dropped: the op has no bias.

Both read only the graph and constants the exporter wrote (code, not state), never a weight.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from graphbuild.onnx.naming import Namer

__all__ = ["FLOAT_TYPES", "drop_zero_biases", "fold_constant_casts", "split_sequences"]

#: The ONNX element types QNN counts as float (a Cast to one keeps its output unquantized).
FLOAT_TYPES = frozenset(
    {ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE}
)


def split_sequences(graph: ir.Graph) -> None:
    """Rewrite every ``SplitToSequence`` read only by constant-index ``SequenceAt`` into a
    ``Split``. Others are left as they are."""
    namer = Namer(graph)
    for node in list(graph):
        if node.op_type == "SplitToSequence" and node.domain == "":
            _split(graph, node, namer)


def _split(graph: ir.Graph, node: ir.Node, namer: Namer) -> bool:
    x = node.inputs[0]
    seq = node.outputs[0]
    readers = [u.node for u in seq.uses()]
    if x is None or seq.is_graph_output() or not readers:
        return False
    if any(r.op_type != "SequenceAt" or r.domain != "" for r in readers):
        return False
    axis_attr = node.attributes.get("axis")
    axis = axis_attr.as_int() if axis_attr is not None else 0
    sizes = _sizes(node, x, axis)
    if sizes is None:
        return False
    picks: dict[int, list[ir.Value]] = {}
    for reader in readers:
        index = _const_int(reader.inputs[1])
        if index is None or not -len(sizes) <= index < len(sizes):
            return False
        picks.setdefault(index % len(sizes), []).append(reader.outputs[0])
    split_const = ir.Value(
        name=namer.fresh(f"{seq.name}_sizes"),
        type=ir.TensorType(ir.DataType.INT64),
        shape=ir.Shape([len(sizes)]),
    )
    const = ir.node(
        "Constant",
        [],
        attributes={"value": ir.tensor(np.array(sizes, dtype=np.int64))},
        outputs=[split_const],
        name=namer.fresh(f"{node.name}_sizes"),
    )
    split = ir.node(
        "Split",
        [x, split_const],
        attributes={"axis": axis},
        num_outputs=len(sizes),
        name=node.name,
    )
    graph.insert_before(node, [const, split])
    for i, out in enumerate(split.outputs):
        taken = picks.get(i, [])
        if not taken:
            out.name = namer.fresh(f"{seq.name}_{i}")
            continue
        name = taken[0].name
        out.shape, out.type = taken[0].shape, taken[0].type
        for value in taken:
            reader = value.producer()
            value.replace_all_uses_with(out, replace_graph_outputs=True)
            if reader is not None:
                graph.remove(reader, safe=True)
            value.name = None
        out.name = name
    graph.remove(node, safe=True)
    return True


def _sizes(node: ir.Node, x: ir.Value, axis: int) -> list[int] | None:
    """The chunk sizes: the constant ``split`` input, or a scalar chunk length over the
    static size of ``axis``."""
    split = node.inputs[1] if len(node.inputs) > 1 else None
    if split is None:
        return None
    values = _const_array(split)
    if values is None:
        return None
    if values.ndim == 1:
        return [int(v) for v in values]
    if x.shape is None or not -len(x.shape) <= axis < len(x.shape):
        return None
    dim = x.shape[axis]
    if not isinstance(dim, int):
        return None
    chunk = int(values)
    count = math.ceil(dim / chunk)
    return [chunk] * (count - 1) + [dim - chunk * (count - 1)]


def _const_array(value: ir.Value | None) -> np.ndarray | None:
    """The numbers a value holds: an initializer with data or a ``Constant`` node's."""
    if value is None:
        return None
    try:
        tensor = ir.convenience.get_const_tensor(value)
    except ValueError:  # a Constant node of a shape the exporter never writes
        return None
    if tensor is None or isinstance(tensor, (ir.ExternalTensor, ir.StringTensor)):
        return None  # the skeleton's state references hold no data
    return tensor.numpy()


def _const_int(value: ir.Value | None) -> int | None:
    array = _const_array(value)
    if array is None or array.size != 1:
        return None
    return int(array.reshape(-1)[0])


# ---------------------------------------------------------------------------- casts


def fold_constant_casts(graph: ir.Graph) -> None:
    """Fold ``Cast``/``CastLike`` of ``Constant`` nodes (and of an ``Expand`` of one) into
    constants of the target type."""
    namer = Namer(graph)
    for node in list(graph):
        if node.domain != "" or node.op_type not in ("Cast", "CastLike"):
            continue
        target = _target_type(node)
        src = node.inputs[0]
        if target is None or target in FLOAT_TYPES or src is None:
            continue  # a float result stays a Cast, whose output QNN does not quantize
        producer = src.producer()
        if producer is not None and producer.op_type == "Expand" and len(src.uses()) == 1:
            base = producer.inputs[0]
            array = _const_array(base)
            if array is None or base is None or len(base.uses()) != 1:
                continue
            folded = _constant(namer, node, array, target)
            producer.replace_input_with(0, folded.outputs[0])
            graph.insert_before(producer, folded)
            producer.outputs[0].type = ir.TensorType(target)
            _bypass(graph, node, src)
            continue
        array = _const_array(src)
        if array is None:
            continue
        folded = _constant(namer, node, array, target)
        graph.insert_before(node, folded)
        name = node.outputs[0].name
        _bypass(graph, node, folded.outputs[0])
        if not folded.outputs[0].is_graph_output():
            folded.outputs[0].name = name  # readers keep reading the name they read
    _drop_dead_constants(graph)


def _target_type(node: ir.Node) -> ir.DataType | None:
    if node.op_type == "Cast":
        to = node.attributes.get("to")
        return ir.DataType(to.as_int()) if to is not None else None
    like = node.inputs[1] if len(node.inputs) > 1 else None
    if like is None:
        return None
    if like.dtype is not None:
        return like.dtype
    array = _const_array(like)
    return ir.DataType.from_numpy(array.dtype) if array is not None else None


def _constant(namer: Namer, node: ir.Node, array: np.ndarray, dtype: ir.DataType) -> ir.Node:
    value = np.asarray(array).astype(dtype.numpy())
    out = ir.Value(
        name=namer.fresh(f"{node.outputs[0].name}_const"),
        type=ir.TensorType(dtype),
        shape=ir.Shape(list(value.shape)),
    )
    return ir.node(
        "Constant",
        [],
        attributes={"value": ir.tensor(value)},
        outputs=[out],
        name=namer.fresh(f"{node.name}_folded"),
    )


def _bypass(graph: ir.Graph, node: ir.Node, replacement: ir.Value) -> None:
    """Remove ``node``; its output's readers (and graph output) read ``replacement``."""
    out = node.outputs[0]
    name = out.name
    out.replace_all_uses_with(replacement, replace_graph_outputs=True)
    graph.remove(node, safe=True)
    out.name = None
    if replacement.is_graph_output():
        replacement.name = name


def drop_zero_biases(graph: ir.Graph) -> None:
    """Drop the bias input of every Conv, ConvTranspose and Gemm whose bias is an ``Expand``
    of a constant zero (through casts), and the nodes that computed it."""
    dropped = False
    for node in list(graph):
        if node.domain != "" or node.op_type not in ("Conv", "ConvTranspose", "Gemm"):
            continue
        if len(node.inputs) != 3 or not _expanded_zero(node.inputs[2]):
            continue
        node.resize_inputs(2)
        dropped = True
    if dropped:
        _drop_dead_nodes(graph)


def _expanded_zero(value: ir.Value | None) -> bool:
    node = value.producer() if value is not None else None
    if node is None or node.op_type != "Expand" or node.domain != "":
        return False
    source = node.inputs[0]
    while source is not None and source.producer() is not None:
        producer = source.producer()
        if producer.op_type not in ("Cast", "CastLike") or producer.domain != "":
            break
        source = producer.inputs[0]
    array = _const_array(source)
    return array is not None and array.size > 0 and not np.any(array)


def _drop_dead_nodes(graph: ir.Graph) -> None:
    """Remove default-domain nodes none of whose outputs is read or a graph output."""
    for node in reversed(list(graph)):
        if node.domain == "" and not any(o.uses() or o.is_graph_output() for o in node.outputs):
            graph.remove(node, safe=True)


def _drop_dead_constants(graph: ir.Graph) -> None:
    for node in reversed(list(graph)):
        if node.op_type == "Constant" and not any(
            o.uses() or o.is_graph_output() for o in node.outputs
        ):
            graph.remove(node, safe=True)
