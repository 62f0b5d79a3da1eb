"""graphbuild: incremental, content-addressed export of quantized PyTorch models.

Exports are builds: a DAG of stages, each keyed by what it reads, run only when dirty.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphbuild.engine.codecs import declare_codecs
from graphbuild.errors import (
    ConfigError,
    ExportError,
    GraphbuildError,
    StageError,
    UndeclaredReadError,
    UnknownQuantizerError,
)
from graphbuild.version import __version__ as __version__

if TYPE_CHECKING:
    from graphbuild.api import ExportArtifacts, ExportRequest, export, export_with_pipeline
    from graphbuild.engine.artifact_store import Cache
    from graphbuild.engine.events import EventKind, RunReport, StageEvent
    from graphbuild.engine.pipeline import Pipeline, Stage, StageRef
    from graphbuild.engine.status import StageStatus
    from graphbuild.targets.executorch import ExecuTorchOptions
    from graphbuild.targets.qnn import QnnOnnxOptions
    from graphbuild.targets.registry import PipelineRegistry, build_default_registry

__all__ = [
    "Cache",
    "ConfigError",
    "EventKind",
    "ExecuTorchOptions",
    "ExportArtifacts",
    "ExportError",
    "ExportRequest",
    "GgufOptions",
    "GraphbuildError",
    "Pipeline",
    "PipelineRegistry",
    "QnnOnnxOptions",
    "RunReport",
    "Stage",
    "StageError",
    "StageEvent",
    "StageRef",
    "StageStatus",
    "UndeclaredReadError",
    "UnknownQuantizerError",
    "build_default_registry",
    "export",
    "export_with_pipeline",
    "sweep",
]

_LAZY = {
    "Cache": "engine.artifact_store",
    "Pipeline": "engine.pipeline",
    "Stage": "engine.pipeline",
    "StageRef": "engine.pipeline",
    "EventKind": "engine.events",
    "RunReport": "engine.events",
    "StageEvent": "engine.events",
    "StageStatus": "engine.status",
    "ExportArtifacts": "api",
    "ExportRequest": "api",
    "export": "api",
    "export_with_pipeline": "api",
    "PipelineRegistry": "targets.registry",
    "build_default_registry": "targets.registry",
    "QnnOnnxOptions": "targets.qnn",
    "ExecuTorchOptions": "targets.executorch",
    "GgufOptions": "targets.gguf",
    "sweep": "sweeps",
}

# The codecs of graphbuild's artifact types above the engine, each registered by the module
# that defines it when that module is imported. A warm run imports none of them (its stages
# load torch.export and ONNX lazily), yet must version the codec of every entry it hits:
# declared here, where every process passes, the engine finds them on need without naming a
# module above it.
declare_codecs("graphbuild.frontend.programs", "exported_program")
declare_codecs("graphbuild.onnx.codecs", "onnx", "bound_onnx")
declare_codecs("graphbuild.targets.gguf.artifacts", "gguf_tensors", "gguf_file")


def __getattr__(name: str):
    # torch, onnx, onnxscript and networkx take seconds to import: load what needs them on
    # first use, so that `graphbuild --help` and `graphbuild cache ...` start at once.
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'graphbuild' has no attribute {name!r}")
