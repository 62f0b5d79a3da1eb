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


def compare_pte(pte: bytes, reference: Mapping[str, torch.Tensor], args: tuple) -> dict[str, Any]:
    """Max abs error and SQNR per output of the ``.pte`` run on ``args``."""
    actual = run_pte(pte, args)
    if len(actual) != len(reference):
        return {"outputs": [], "error": f"{len(actual)} outputs, expected {len(reference)}"}
    outputs = []
    for index, ((_, ref), got) in enumerate(zip(sorted(reference.items()), actual, strict=True)):
        errors = output_errors(ref.numpy(), got.detach().float().numpy())
        outputs.append({"name": f"output_{index}", **errors})
    return {"outputs": outputs}
