"""The part graphs run in onnxruntime, through the same generation protocol as the torch parts.

:func:`onnx_caller` makes a :data:`~.runner.Caller` over a directory of part graphs: the runner
keeps the KV cache in float on each tensor's grid, and the caller hands a graph its integer
past (exact, the values being on the grid) and turns its integer new entries back into floats.
Each graph's KV encodings are read from the graph itself, so the check needs nothing but the
files a runtime would get.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from graphbuild.targets.qnn.llm.plan import LlmPlan
from graphbuild.targets.qnn.llm.runner import Caller, KvEncoding

_KV = re.compile(r"(past_(?:key|value)_\d+)_kv_(scale|zero_point)")


def kv_encodings(model: onnx.ModelProto) -> dict[str, KvEncoding]:
    """The KV encodings a part graph declares (its ``past_*_kv_scale`` / ``_zero_point``)."""
    found: dict[str, dict[str, Any]] = {}
    for init in model.graph.initializer:
        m = _KV.fullmatch(init.name)
        if m is not None:
            found.setdefault(m.group(1), {})[m.group(2)] = numpy_helper.to_array(init)
    out = {}
    for name, parts in found.items():
        zp = parts["zero_point"]
        out[name] = KvEncoding(float(parts["scale"]), int(zp), bits=zp.dtype.itemsize * 8)
    return out


def onnx_caller(
    directory: Path,
    plan: LlmPlan,
    providers: list[Any] | None = None,
    session_factory: Callable[[Path], Any] | None = None,
) -> tuple[Caller, dict[str, KvEncoding]]:
    """A caller running the part graphs in ``directory`` with onnxruntime, and the KV
    encodings they declare (for the runner to keep its cache on their grids).
    ``session_factory`` opens a graph's ``InferenceSession`` from its path where
    ``providers`` cannot say how (a plugin execution provider: QNN's HTP, say)."""
    import onnxruntime as ort

    sessions: dict[tuple[int, str], Any] = {}
    encodings: dict[str, KvEncoding] = {}
    options = ort.SessionOptions()
    options.log_severity_level = 3
    for spec in plan.specs:
        for kind in ("prompt", "token"):
            path = directory / f"{plan.graph_name(spec.index, kind)}.onnx"
            encodings.update(kv_encodings(onnx.load(os.fspath(path), load_external_data=False)))
            sessions[spec.index, kind] = (
                session_factory(path)
                if session_factory is not None
                else ort.InferenceSession(
                    os.fspath(path), options, providers=providers or ["CPUExecutionProvider"]
                )
            )

    def call(spec: Any, kind: str, inputs: tuple[torch.Tensor, ...]) -> Any:
        session = sessions[spec.index, kind]
        feed = {}
        for value, tensor in zip(session.get_inputs(), inputs, strict=True):
            encoding = encodings.get(value.name[: -len("_in")])
            array = tensor.numpy()
            if encoding is not None:
                codes = np.round(array / encoding.scale) + encoding.zero_point
                array = codes.astype(np.uint8 if encoding.bits == 8 else np.uint16)
            feed[value.name] = array
        names = [o.name for o in session.get_outputs()]
        outputs = []
        for name, array in zip(names, session.run(names, feed), strict=True):
            encoding = encodings.get(name[: -len("_out")])
            if encoding is not None:
                array = (array.astype(np.float32) - encoding.zero_point) * encoding.scale
            outputs.append(torch.from_numpy(np.asarray(array, dtype=np.float32)))
        return outputs[0] if spec.embed else tuple(outputs)

    return call, encodings
