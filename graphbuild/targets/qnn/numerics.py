"""The numerics check: onnxruntime against the quantized torch model, on the sample inputs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from graphbuild.frontend.reference import output_errors
from graphbuild.onnx.bind import BoundModel
from graphbuild.onnx.save import materialize


def run_onnx(model: Any, args: tuple) -> list[np.ndarray]:
    """Run an in-memory ModelProto in onnxruntime on torch/numpy positional inputs."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    leaves = [a for a in torch.utils._pytree.tree_flatten(args)[0] if isinstance(a, torch.Tensor)]
    names = [i.name for i in session.get_inputs()]
    feeds = {n: t.detach().cpu().numpy() for n, t in zip(names, leaves, strict=False)}
    return session.run(None, feeds)


def compare_outputs(
    bound: BoundModel,
    encodings: Mapping[str, Any],
    reference: Mapping[str, torch.Tensor],
    args: tuple,
    *,
    reinsert: bool,
) -> dict[str, Any]:
    """Max abs error, SQNR and error in output quantization steps, per output. With
    ``reinsert``, Q/DQ are put back into the float model from the encodings document alone
    before running it (the ``onnx`` format's contract)."""
    from graphbuild.targets.qnn.encodings import insert_fake_quant, read_encodings

    model = materialize(bound)
    if reinsert:
        model = insert_fake_quant(model, encodings)
    actual = run_onnx(model, args)
    names = [o.name for o in model.graph.output]
    table = read_encodings(encodings)
    outputs = []
    for (_, ref), got, name in zip(sorted(reference.items()), actual, names, strict=True):
        errors = output_errors(ref.numpy(), got)
        enc = table.get(name)
        step = float(np.max(enc.scale)) if enc is not None and enc.scale.size == 1 else None
        err = errors["max_abs_error"]
        outputs.append(
            {
                "name": name,
                **errors,
                "output_step": step,
                "max_error_steps": err / step if step else None,
            }
        )
    return {"outputs": outputs, "encodings_reinserted": reinsert}
