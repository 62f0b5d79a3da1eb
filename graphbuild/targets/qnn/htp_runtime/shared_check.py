"""The graphs of a weight-shared QNN context (:mod:`.shared_context`) on the HTP, against their
QDQ models on onnxruntime's CPU.

The x86-64 HTP simulator of onnxruntime-qnn 2.7 (QNN 2.51) cannot load a weight-shared binary:
creating the QNN context from it (``contextCreateFromBinary``, with or without
``ep.share_ep_contexts`` at load) calls a null function pointer in ``libQnnHtp.so`` and the
process dies with SIGSEGV, on v73, v75, v79 and v81 alike; the same graphs prepared one context
each load and run. So :func:`shared_binary_loads` tries the binary in a child process, and
:func:`check_shared_context` runs the weight-shared binary where that works, else per-graph
contexts of the same QDQ graphs, and says which in its result.
"""

from __future__ import annotations

import os
import signal
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from graphbuild.errors import ConfigError
from graphbuild.targets.qnn.htp_runtime.backend import (
    HtpTarget,
    backend_versions,
    require_backend,
)
from graphbuild.targets.qnn.htp_runtime.check import _load_graph
from graphbuild.targets.qnn.htp_runtime.compare import (
    OutputComparison,
    compare_with_cpu,
    output_steps,
)
from graphbuild.targets.qnn.htp_runtime.context import prepare_context
from graphbuild.targets.qnn.htp_runtime.session import ModelSource, open_session
from graphbuild.targets.qnn.htp_runtime.shared_context import SharedContext, spawn_worker

__all__ = ["SharedContextCheck", "check_shared_context", "shared_binary_loads"]


@dataclass
class SharedContextCheck:
    """The graphs of a shared context run on the HTP simulator against the QDQ models on ORT's
    CPU. ``shared_binary`` says whether the numbers came from the weight-shared binary; where
    the simulator cannot load it they come from per-graph contexts of the same QDQ graphs
    (prepared with the same options, only not sharing), and ``fallback_reason`` says why."""

    target: HtpTarget
    shared_binary: bool
    outputs: dict[str, list[OutputComparison]] = field(default_factory=dict)
    fallback_reason: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "htp_arch": self.target.htp_arch,
            "soc_model": self.target.soc_model,
            "shared_binary": self.shared_binary,
            "fallback_reason": self.fallback_reason,
            "outputs": {g: [o.to_json() for o in outs] for g, outs in self.outputs.items()},
        }


def shared_binary_loads(prepared: SharedContext) -> str:
    """Whether the HTP backend here loads the weight-shared binary: ``""`` where a session on
    the first graph's EPContext model builds, else why not. Tried in a child process, since
    the x86-64 simulator dies (SIGSEGV) creating a context from such a binary."""
    require_backend()
    request = {
        "htp_arch": prepared.target.htp_arch,
        "soc_model": prepared.target.soc_model,
        "probe": os.fspath(prepared.graphs[0].model.resolve()),
    }
    with tempfile.TemporaryDirectory(prefix="graphbuild-shared-probe-") as tmp:
        proc, result = spawn_worker(Path(tmp), request)
    if result is not None:
        return result.get("error", "")
    how = f"exit status {proc.returncode}"
    if proc.returncode < 0:
        with_signal = signal.Signals(-proc.returncode).name
        how = f"killed by {with_signal}"
    versions = backend_versions()
    return (
        f"QNN's HTP backend ({prepared.target}) cannot load the weight-shared binary "
        f"{prepared.binary.name} here: the session on {prepared.graphs[0].model.name} was "
        f"{how} creating the QNN context from it (onnxruntime-qnn "
        f"{versions['onnxruntime_qnn']}, QNN {versions['qnn_sdk']}, x86-64 simulator)"
    )


def check_shared_context(
    prepared: SharedContext,
    models: Sequence[tuple[str, ModelSource]],
    feeds: Mapping[str, Mapping[str, np.ndarray]],
) -> SharedContextCheck:
    """Run each graph of ``prepared`` on the HTP with ``feeds[graph name]`` and compare with
    its QDQ model (``models``, as prepared) on ORT's CPU, per output in output steps and SQNR.
    From the weight-shared binary where the backend here loads it
    (:func:`shared_binary_loads`), else from per-graph contexts (:func:`prepare_context`)."""
    by_name = dict(models)
    missing = [g.name for g in prepared.graphs if g.name not in by_name or g.name not in feeds]
    if missing:
        raise ConfigError(f"check_shared_context needs a model and feeds for graph(s) {missing}")
    reason = shared_binary_loads(prepared)
    check = SharedContextCheck(prepared.target, shared_binary=not reason, fallback_reason=reason)
    with tempfile.TemporaryDirectory(prefix="graphbuild-shared-check-") as tmp:
        for graph in prepared.graphs:
            qdq = by_name[graph.name]
            if reason:
                source = Path(tmp) / graph.name
                source.mkdir()
                context = prepare_context(qdq, prepared.target, source / f"{graph.name}.onnx")
                ctx_model = context.model
            else:
                ctx_model = graph.model
            session = open_session(ctx_model, prepared.target, diagnose=False)
            steps = output_steps(_load_graph(qdq))
            check.outputs[graph.name] = compare_with_cpu(
                session, qdq, feeds[graph.name], steps=steps
            )
            del session
    return check
