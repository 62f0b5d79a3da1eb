"""The numerics check: the ``.pte`` in ExecuTorch's runtime against the torch reference.

A ``.pte`` with a VGF delegate runs in a fresh Python process
(``python -m graphbuild.targets.executorch.runtime <dir>``) on a Vulkan device
(:mod:`.vulkan`): the delegate's Vulkan driver and layers live and die with that process, and
a crash in them (at exit, in a backend's destructor) cannot take the export down. The program
and its inputs go to the process as files in a temporary directory, the outputs come back
the same way.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from graphbuild.errors import ExportError
from graphbuild.frontend.reference import output_errors
from graphbuild.targets.native_log import native_lines_logged
from graphbuild.targets.workers import run_worker

_WORKER = "graphbuild.targets.executorch.runtime"
_PTE, _INPUTS, _OUTPUTS, _RESULT = "model.pte", "inputs.pt", "outputs.pt", "result.json"


def run_pte(pte: bytes, args: tuple, method: str = "forward") -> list[torch.Tensor]:
    """Outputs of ``method`` of the program in ``pte`` on CPU tensors ``args``."""
    from executorch.runtime import Runtime

    leaves = [a for a in torch.utils._pytree.tree_flatten(args)[0] if isinstance(a, torch.Tensor)]
    with native_lines_logged("executorch"):  # its CPU probe's lines, in graphbuild's logging
        program = Runtime.get().load_program(pte)
        inputs = [t.detach().cpu().contiguous() for t in leaves]
        outputs = program.load_method(method).execute(inputs)
    return [o for o in outputs if isinstance(o, torch.Tensor)]


def run_pte_on_vulkan(pte: bytes, args: tuple, method: str = "forward") -> list[torch.Tensor]:
    """:func:`run_pte` in a fresh process on a Vulkan device with Arm's ML extensions (the
    emulation layer's when no device has them natively), for a ``.pte`` with a VGF delegate.
    Raises :class:`~graphbuild.errors.VulkanDeviceError` when there is no such device, an
    ExportError with the runtime's last words when the program does not run."""
    from graphbuild.targets.executorch.vulkan import vgf_environment

    leaves = [a for a in torch.utils._pytree.tree_flatten(args)[0] if isinstance(a, torch.Tensor)]
    with tempfile.TemporaryDirectory(prefix="graphbuild-vgf-") as tmp:
        work = Path(tmp)
        env = vgf_environment(work)
        (work / _PTE).write_bytes(pte)
        torch.save([t.detach().cpu().contiguous() for t in leaves], work / _INPUTS)
        proc = run_worker(_WORKER, [str(work), method], work, env=env)
        result = work / _RESULT
        status = json.loads(result.read_text()) if result.is_file() else {}
        if status.get("ok") and (work / _OUTPUTS).is_file():
            # the outputs are complete (written before the result): a crash after them, in
            # the runtime's teardown, does not make them wrong
            return list(torch.load(work / _OUTPUTS, weights_only=True))
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise ExportError(
            f"ExecuTorch's runtime did not run '{method}' of the VGF program on "
            f"{env.get('VK_INSTANCE_LAYERS') and 'the emulated ' or 'the '}Vulkan device (exit "
            f"status {proc.returncode}): {status.get('error', 'the process died')}; its last "
            f"output:\n{tail}"
        )


def compare_pte(
    pte: bytes,
    reference: Mapping[str, torch.Tensor],
    args: tuple,
    float_reference: Mapping[str, torch.Tensor] | None = None,
    *,
    run: Callable[[bytes, tuple], list[torch.Tensor]] = run_pte,
) -> dict[str, Any]:
    """Max abs error and SQNR per output of the ``.pte`` run on ``args`` (by ``run``:
    :func:`run_pte` here, :func:`run_pte_on_vulkan` for VGF) against ``reference``. With
    ``float_reference`` (the float model's outputs, when ``reference`` is a quantized
    program) each output also has ``max_abs_error_vs_float`` and ``sqnr_db_vs_float``;
    ``reference`` says what the plain figures are measured against."""
    actual = run(pte, args)
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


def _worker(work: Path, method: str) -> None:
    """The runtime's process: run ``method`` of ``work``'s program on its inputs, write the
    outputs, then ``result.json`` (``ok``, or the error)."""
    try:
        inputs = torch.load(work / _INPUTS, weights_only=True)
        outputs = run_pte((work / _PTE).read_bytes(), tuple(inputs), method)
        torch.save([o.clone() for o in outputs], work / _OUTPUTS)
        status: dict[str, Any] = {"ok": True}
    except Exception as err:  # reported to the parent, which raises a typed error
        status = {"ok": False, "error": f"{type(err).__name__}: {err}"}
    (work / _RESULT).write_text(json.dumps(status))
    sys.stdout.flush()
    sys.stderr.flush()


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), sys.argv[2])
