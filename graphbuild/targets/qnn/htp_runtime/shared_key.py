"""What the bytes of a shared context depend on, as a build key's facts
(:func:`shared_context_key`): the recipe, the names, the graphs' model bytes, the target and the
versions that prepare it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from graphbuild.targets.qnn.htp_runtime.backend import HtpTarget, backend_versions
from graphbuild.targets.qnn.htp_runtime.session import ModelSource
from graphbuild.targets.qnn.htp_runtime.shared_context import (
    RECIPE,
    _check_names,
    _external_files,
)
from graphbuild.targets.qnn.htp_runtime.shared_weights import hash_file, require_weight_sharing

__all__ = ["shared_context_key"]


def shared_context_key(
    models: Sequence[tuple[str, ModelSource]], target: HtpTarget, name: str
) -> dict[str, Any]:
    """What the bytes of :func:`prepare_shared_context` depend on, as a build key's facts: the
    recipe, the context's and graphs' names (they name the files, and the graphs' load paths
    the QNN graphs), each graph's model bytes (SHA-256 of the ``.onnx`` and its external data
    files), the architecture and SoC model, and the onnxruntime / onnxruntime-qnn / QNN SDK
    versions that prepare it."""
    names = _check_names(models, name)
    require_weight_sharing(target)
    return {
        "recipe": RECIPE,
        "name": name,
        "graphs": [
            {"name": g, "sha256": _model_digest(model)}
            for g, (_, model) in zip(names, models, strict=True)
        ],
        "htp_arch": target.htp_arch,
        "soc_model": target.soc_model,
        "versions": backend_versions(),
    }


def _model_digest(model: ModelSource) -> str:
    h = hashlib.sha256()
    if isinstance(model, bytes):
        h.update(model)
        return h.hexdigest()
    path = Path(model)
    hash_file(h, path)
    for name in _external_files(path):
        h.update(f"\0{name}\0".encode())
        hash_file(h, path.parent / name)
    return h.hexdigest()
