"""The KV cache at a part graph's boundary: integer bytes with one encoding per tensor.

A runtime keeps a layer's KV cache as the integers the graph wrote and feeds them back as the
next step's past, so the past input and the new output of a layer's keys (and of its values)
share one encoding: the runtime copies bytes and never requantizes. This pass turns a lowered
part graph's float KV inputs and outputs into that form:

- ``past_key_<L>_in`` becomes an integer input followed by ``DequantizeLinear`` with the layer's
  key encoding; a Q/DQ pair the preset put on the float input is bypassed (the data is already
  on the KV grid);
- ``past_key_<L>_out`` becomes the integer output of ``QuantizeLinear`` with the same encoding,
  fed by what the preset's own Q/DQ pair on that output quantized (or the float tensor).

The encodings are symmetric: zero point 2^(bits-1), the cache's padding value.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from graphbuild.errors import ExportError
from graphbuild.onnx.bind import BoundModel

_KV = re.compile(r"(past_(?:key|value)_\d+)_(in|out)")
_DTYPES = {8: TensorProto.UINT8, 16: TensorProto.UINT16}
_NP = {8: np.uint8, 16: np.uint16}


def kv_encoding(max_abs: float, bits: int) -> tuple[float, int]:
    """(scale, zero point) of a symmetric unsigned grid that holds [-max_abs, max_abs]."""
    zero_point = 1 << (bits - 1)
    return max(float(max_abs), 1e-6) / (zero_point - 1), zero_point


def quantize_kv_io(
    bound: BoundModel, encodings: Mapping[str, Sequence[float]], bits: int
) -> BoundModel:
    """``bound`` with its KV inputs and outputs as ``bits``-bit integers (see the module's
    docstring); ``encodings`` maps ``past_key_<L>`` / ``past_value_<L>`` to (scale, zero point)."""
    model = onnx.ModelProto()
    model.CopyFrom(bound.model)
    graph = model.graph
    nodes = list(graph.node)
    consumers = _consumers(nodes)
    producers = {o: n for n in nodes for o in n.output}
    dropped: set[int] = set()
    first: list[onnx.NodeProto] = []  # the inputs' DequantizeLinear, before every reader
    last: list[onnx.NodeProto] = []  # the outputs' QuantizeLinear, after every producer
    for value in graph.input:
        m = _KV.fullmatch(value.name)
        if m is None or m.group(2) != "in":
            continue
        scale, zero_point = _encoding(encodings, m.group(1), value.name)
        name = value.name
        float_name = f"{name}_dequantized"
        # the preset's own Q -> DQ on this input: its consumers read the new float instead
        target = _bypassed_pair(name, consumers, nodes, dropped) or name
        for node in nodes:
            for i, inp in enumerate(node.input):
                if inp == target:
                    node.input[i] = float_name
        first.append(
            _qdq("DequantizeLinear", name, float_name, m.group(1), graph, scale, zero_point, bits)
        )
        value.type.tensor_type.elem_type = _DTYPES[bits]
    for value in graph.output:
        m = _KV.fullmatch(value.name)
        if m is None or m.group(2) != "out":
            continue
        scale, zero_point = _encoding(encodings, m.group(1), value.name)
        name = value.name
        source = _quantized_source(name, producers, consumers, dropped, nodes)
        float_name = f"{name}_float"
        if source is None:  # no Q/DQ: the float tensor under a new name feeds the Q
            producer = producers.get(name)
            if producer is None:
                raise ExportError(f"KV output {name} has no producing node")
            _rename_output(producer, name, float_name, nodes)
            source = float_name
        last.append(
            _qdq("QuantizeLinear", source, name, m.group(1), graph, scale, zero_point, bits)
        )
        value.type.tensor_type.elem_type = _DTYPES[bits]
    kept = [n for i, n in enumerate(nodes) if i not in dropped]
    del graph.node[:]
    graph.node.extend(first + kept + last)
    return BoundModel(model, bound.tensors, bound.digests)


def _encoding(encodings: Mapping[str, Sequence[float]], key: str, tensor: str) -> tuple[float, int]:
    try:
        scale, zero_point = encodings[key][:2]
    except KeyError:
        raise ExportError(f"no KV encoding for {tensor} ({key})") from None
    return float(scale), int(zero_point)


def _qdq(
    op: str,
    source: str,
    out: str,
    key: str,
    graph: onnx.GraphProto,
    scale: float,
    zero_point: int,
    bits: int,
) -> onnx.NodeProto:
    scale_name, zp_name = f"{key}_kv_scale", f"{key}_kv_zero_point"
    if not any(i.name == scale_name for i in graph.initializer):
        graph.initializer.append(numpy_helper.from_array(np.array(scale, np.float32), scale_name))
        graph.initializer.append(numpy_helper.from_array(np.array(zero_point, _NP[bits]), zp_name))
    return helper.make_node(op, [source, scale_name, zp_name], [out], name=f"{out}_{op}")


def _consumers(nodes: list[onnx.NodeProto]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        for name in node.input:
            out.setdefault(name, []).append(i)
    return out


def _bypassed_pair(
    name: str, consumers: dict[str, list[int]], nodes: list[onnx.NodeProto], dropped: set[int]
) -> str | None:
    """When ``name``'s one consumer is a QuantizeLinear whose one consumer is a
    DequantizeLinear, drop both and return the DQ's output (whose readers now read the KV's
    own dequantized value)."""
    users = consumers.get(name, [])
    if len(users) != 1 or nodes[users[0]].op_type != "QuantizeLinear":
        return None
    q = users[0]
    dq_users = consumers.get(nodes[q].output[0], [])
    if len(dq_users) != 1 or nodes[dq_users[0]].op_type != "DequantizeLinear":
        return None
    dropped.update((q, dq_users[0]))
    return nodes[dq_users[0]].output[0]


def _quantized_source(
    name: str,
    producers: dict[str, onnx.NodeProto],
    consumers: dict[str, list[int]],
    dropped: set[int],
    nodes: list[onnx.NodeProto],
) -> str | None:
    """When ``name`` is made by DequantizeLinear(QuantizeLinear(x)) used nowhere else, drop the
    pair and return ``x``."""
    dq = producers.get(name)
    if dq is None or dq.op_type != "DequantizeLinear" or consumers.get(name):
        return None
    q = producers.get(dq.input[0])
    if q is None or q.op_type != "QuantizeLinear" or len(consumers.get(dq.input[0], [])) != 1:
        return None
    dropped.update(i for i, n in enumerate(nodes) if n is dq or n is q)
    return q.input[0]


def _rename_output(
    producer: onnx.NodeProto, old: str, new: str, nodes: list[onnx.NodeProto]
) -> None:
    for i, out in enumerate(producer.output):
        if out == old:
            producer.output[i] = new
    for node in nodes:
        for i, inp in enumerate(node.input):
            if inp == old:
                node.input[i] = new
