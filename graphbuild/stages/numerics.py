"""The numerics check: onnxruntime against the quantized torch model, on the sample inputs."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from .bind import BoundModel, materialize


def sqnr_db(reference: np.ndarray, actual: np.ndarray) -> float:
    """Signal-to-quantization-noise ratio of ``actual`` against ``reference``, in dB."""
    noise = float(np.sum((reference.astype(np.float64) - actual) ** 2))
    signal = float(np.sum(reference.astype(np.float64) ** 2))
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


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
    feeds = {n: t.detach().cpu().numpy() for n, t in zip(names, leaves)}
    return session.run(None, feeds)


def compare_outputs(
    bound: BoundModel,
    encodings: Mapping[str, Any] | None,
    reference: Mapping[str, torch.Tensor],
    args: tuple,
) -> dict[str, Any]:
    """Max abs error and SQNR per output. With ``encodings``, Q/DQ are put back into the
    float model from the encodings document alone before running it."""
    from .encodings import insert_fake_quant

    model = materialize(bound)
    if encodings is not None:
        model = insert_fake_quant(model, encodings)
    actual = run_onnx(model, args)
    names = [o.name for o in model.graph.output]
    outputs = []
    for (_, ref), got, name in zip(sorted(reference.items()), actual, names):
        ref_np = ref.numpy()
        got = np.asarray(got, dtype=np.float32).reshape(ref_np.shape)
        outputs.append(
            {
                "name": name,
                "max_abs_error": float(np.max(np.abs(ref_np - got))) if ref_np.size else 0.0,
                "sqnr_db": sqnr_db(ref_np, got),
            }
        )
    return {"outputs": outputs, "encodings_used": encodings is not None}
