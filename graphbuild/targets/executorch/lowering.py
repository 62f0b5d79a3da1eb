"""Lowering an ExportedProgram to an ExecuTorch ``.pte``: edge dialect, the format's
partitioner, ``to_executorch``, and a summary of what the delegate took."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Any

from torch.export import ExportedProgram

from graphbuild.errors import ConfigError, ExportError


def require_executorch(what: str) -> None:
    """A ConfigError naming the extra to install when ExecuTorch is missing."""
    if importlib.util.find_spec("executorch") is None or (
        importlib.util.find_spec("executorch.exir") is None
    ):
        raise ConfigError(
            f"{what} needs ExecuTorch, which is not installed: pip install 'graphbuild[executorch]'"
        )


def require_format(fmt: str) -> None:
    """A ConfigError naming what to install when ``fmt``'s flow cannot run here."""
    require_executorch(f"the executorch/{fmt} format")
    if fmt == "vgf":
        missing = _vgf_missing()
        if missing:
            raise ConfigError(
                f"the executorch/vgf format needs Arm's VGF tools, which are not usable here "
                f"({missing}): install the TOSA serializer and Arm's ML SDK model converter "
                "(pip install 'graphbuild[vgf]', see ExecuTorch's Arm backend set-up), or use "
                "--format xnnpack"
            )


def _vgf_missing() -> str | None:
    """Why Arm's VGF flow cannot run here, or None when it can."""
    try:
        from executorch.backends.arm.vgf.model_converter import require_model_converter_binary

        require_model_converter_binary()
    except Exception as err:  # an import error or the converter's own complaint
        return f"{type(err).__name__}: {err}"
    return None


def _partitioners(fmt: str) -> list[Any]:
    if fmt == "xnnpack":
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

        return [XnnpackPartitioner()]
    if fmt == "portable":
        return []
    if fmt == "vgf":  # pragma: no cover - needs Arm's tools
        from executorch.backends.arm.vgf.compile_spec import VgfCompileSpec
        from executorch.backends.arm.vgf.partitioner import VgfPartitioner

        return [VgfPartitioner(VgfCompileSpec())]
    raise ConfigError(f"unknown executorch format '{fmt}'")


def lower_to_pte(
    programs: Mapping[str, ExportedProgram],
    fmt: str,
    constant_methods: Mapping[str, Any] | None = None,
) -> tuple[bytes, dict[str, Any]]:
    """The ``.pte`` bytes of ``programs`` (method name -> program) for ``fmt``, with
    ``constant_methods`` baked in, and the delegation summary over all methods: operators the
    delegate runs and those left to portable kernels, by name."""
    require_format(fmt)
    from executorch.devtools.backend_debug import get_delegation_info
    from executorch.exir import to_edge_transform_and_lower

    try:
        edge = to_edge_transform_and_lower(
            dict(programs),
            partitioner=_partitioners(fmt),
            constant_methods=dict(constant_methods) if constant_methods else None,
        )
        infos = [get_delegation_info(edge.exported_program(m).graph_module) for m in programs]
        pte = edge.to_executorch().buffer
    except Exception as err:
        raise ExportError(
            f"lower: ExecuTorch could not lower the program for '{fmt}': "
            f"{type(err).__name__}: {err}"
        ) from err
    ops: dict[str, dict[str, int]] = {}
    for info in infos:
        for name, row in info.delegation_by_operator.items():
            entry = ops.setdefault(name, {"delegated": 0, "portable": 0})
            entry["delegated"] += int(row.delegated)
            entry["portable"] += int(row.non_delegated)
    summary = {
        "format": fmt,
        "methods": sorted(programs),
        "delegated_subgraphs": sum(int(i.num_delegated_subgraphs) for i in infos),
        "delegated_ops": sum(int(i.num_delegated_nodes) for i in infos),
        "portable_ops": sum(int(i.num_non_delegated_nodes) for i in infos),
        "ops": dict(sorted(ops.items())),
    }
    return bytes(pte), summary
