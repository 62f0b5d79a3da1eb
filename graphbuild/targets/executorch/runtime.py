"""The numerics check: the ``.pte`` in ExecuTorch's runtime against the torch reference."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from graphbuild.frontend.reference import output_errors


def run_pte(pte: bytes, args: tuple, method: str = "forward") -> list[torch.Tensor]:
    """Outputs of ``method`` of the program in ``pte`` on CPU tensors ``args``."""
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(pte)
    leaves = [a for a in torch.utils._pytree.tree_flatten(args)[0] if isinstance(a, torch.Tensor)]
    outputs = program.load_method(method).execute([t.detach().cpu().contiguous() for t in leaves])
    return [o for o in outputs if isinstance(o, torch.Tensor)]


def compare_pte(
    pte: bytes,
    reference: Mapping[str, torch.Tensor],
    args: tuple,
    float_reference: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Max abs error and SQNR per output of the ``.pte`` run on ``args`` against
    ``reference``. With ``float_reference`` (the float model's outputs, when ``reference`` is
    a quantized program) each output also has ``max_abs_error_vs_float`` and
    ``sqnr_db_vs_float``; ``reference`` says what the plain figures are measured against."""
    actual = run_pte(pte, args)
    against = "float model" if float_reference is None else "quantized program"
    report: dict[str, Any] = {"reference": against, "outputs": []}
    for name, expected in (("reference", reference), ("float model", float_reference)):
        if expected is not None and len(actual) != len(expected):
            report["error"] = f"{len(actual)} outputs, expected {len(expected)} ({name})"
            return report
    for index, got in enumerate(actual):
        got_np = got.detach().float().numpy()
        row = {"name": f"output_{index}", **output_errors(_nth(reference, index), got_np)}
        if float_reference is not None:
            errors = output_errors(_nth(float_reference, index), got_np)
            row.update({f"{key}_vs_float": value for key, value in errors.items()})
        report["outputs"].append(row)
    return report


def _nth(outputs: Mapping[str, torch.Tensor], index: int) -> Any:
    return outputs[sorted(outputs)[index]].numpy()
