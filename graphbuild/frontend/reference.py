"""Reference outputs for the numerics checks of every target, and how errors are measured.

The reference is the quantized torch model (or the PT2E-quantized program) run on the sample
inputs; each target compares what its runtime computes (onnxruntime, ExecuTorch) with it.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import numpy as np
import torch

from graphbuild.compat import full_float32
from graphbuild.frontend.capture import as_args, call_plainly
from graphbuild.frontend.devices import model_device, to_device

__all__ = ["output_errors", "reference_from_model", "reference_from_program", "sqnr_db"]


def sqnr_db(reference: np.ndarray, actual: np.ndarray) -> float:
    """Signal-to-quantization-noise ratio of ``actual`` against ``reference``, in dB."""
    noise = float(np.sum((reference.astype(np.float64) - actual) ** 2))
    signal = float(np.sum(reference.astype(np.float64) ** 2))
    if noise == 0.0:
        return math.inf
    if signal == 0.0:
        return -math.inf
    return 10.0 * math.log10(signal / noise)


def output_errors(reference: np.ndarray, actual: np.ndarray) -> dict[str, float]:
    """Max absolute error and SQNR of one output against its reference."""
    actual = np.asarray(actual, dtype=np.float32).reshape(reference.shape)
    err = float(np.max(np.abs(reference - actual))) if reference.size else 0.0
    return {"max_abs_error": err, "sqnr_db": sqnr_db(reference, actual)}


def reference_from_model(inputs: tuple, samples: Any, context: Any) -> dict:
    """Outputs of the (fake-quantized) torch model on the sample inputs, on the model's own
    device; on CUDA with float32 at full precision (no TF32), as the CPU computes it."""
    model = context.input
    device = model_device(model)
    precise = full_float32() if device.type == "cuda" else contextlib.nullcontext()
    with torch.no_grad(), precise:
        out = call_plainly(model, to_device(as_args(samples), device))
    return outputs_dict(out)


def reference_from_program(inputs: tuple, samples: Any, context: Any) -> dict:
    """Outputs of the PT2E-quantized program on the sample inputs."""
    (program,) = inputs
    with torch.no_grad():
        out = program.program.module()(*to_device(as_args(samples), "cpu"))
    return outputs_dict(out)


def outputs_dict(out: Any) -> dict[str, torch.Tensor]:
    """A model's outputs as the reference every numerics check compares with: its tensor
    leaves in order, as float32 on the CPU, keyed ``0000``, ``0001``..."""
    leaves, _ = torch.utils._pytree.tree_flatten(out)
    tensors = [t.detach().cpu().float().contiguous() for t in leaves if isinstance(t, torch.Tensor)]
    return {f"{i:04d}": t for i, t in enumerate(tensors)}
