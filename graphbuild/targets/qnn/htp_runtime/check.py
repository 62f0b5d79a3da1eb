"""The HTP check of one model for one target, as one report: does it compile with CPU fallback
disabled, what QNN took of it, and its numbers against onnxruntime's CPU, end to end and with
every quantized activation forced to the CPU's value (:mod:`.forced`)."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import onnx

from graphbuild.targets.qnn.htp_runtime.backend import HtpTarget, backend_versions, require_backend
from graphbuild.targets.qnn.htp_runtime.compare import (
    OutputComparison,
    compare_with_cpu,
    output_steps,
)
from graphbuild.targets.qnn.htp_runtime.errors import HtpRefusedError
from graphbuild.targets.qnn.htp_runtime.forced import ForcedComparison, forced_comparison
from graphbuild.targets.qnn.htp_runtime.partition import PartitionReport
from graphbuild.targets.qnn.htp_runtime.session import ModelSource, open_session

__all__ = ["HtpCheck", "check_model"]


@dataclass
class HtpCheck:
    """The HTP check of one model for one target: did it compile with no CPU fallback, what
    QNN took, and the numbers (from the fallback session where the strict one was refused)."""

    target: HtpTarget
    compiled: bool
    partition: PartitionReport | None
    outputs: list[OutputComparison] = field(default_factory=list)
    refusal: str = ""
    qnn_messages: list[str] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)
    forced: ForcedComparison | None = None

    def summary(self) -> str:
        head = f"QNN HTP {self.target}: " + ("compiled" if self.compiled else "refused")
        parts = [head]
        if self.partition is not None:
            parts.append(self.partition.summary())
        steps = [o.max_diff_steps for o in self.outputs if o.max_diff_steps is not None]
        if steps:
            where = "" if self.compiled else " (with CPU fallback)"
            parts.append(f"max {max(steps):.3g} output steps from ORT CPU{where}")
        if self.forced is not None and not self.forced.error:
            parts.append(f"op by op at most {self.forced.max_steps:.3g} steps")
        return "; ".join(parts)

    def to_json(self) -> dict[str, Any]:
        return {
            "htp_arch": self.target.htp_arch,
            "soc_model": self.target.soc_model,
            "compiled": self.compiled,
            "refusal": self.refusal,
            "qnn_messages": list(self.qnn_messages),
            "partition": self.partition.to_json() if self.partition else None,
            "outputs": [o.to_json() for o in self.outputs],
            "versions": dict(self.versions),
            "forced": self.forced.to_json() if self.forced is not None else None,
            "summary": self.summary(),
        }


def check_model(
    model: ModelSource,
    feeds: Mapping[str, np.ndarray],
    target: HtpTarget,
    *,
    cpu_model: ModelSource | None = None,
    steps: Mapping[str, float | None] | None = None,
    reference: Mapping[str, np.ndarray] | Sequence[np.ndarray] | None = None,
    forced: bool = True,
) -> HtpCheck:
    """Compile ``model`` for ``target`` with CPU fallback disabled; report the partition and
    compare with ORT CPU (on ``cpu_model``, default ``model``), end to end and, with
    ``forced`` for a QDQ model that compiled, op by op (:func:`forced_comparison`). A refused
    model is reported, not raised: its numbers then come from a session with CPU fallback,
    where one builds."""
    require_backend()
    compiled, refusal, messages = True, "", []
    try:
        session = open_session(model, target, diagnose=False)
    except HtpRefusedError as refused:
        compiled, refusal = False, refused.onnxruntime_message
        messages = [m for m in refused.qnn_messages if m not in refusal]
        try:  # what QNN takes, with its reasons for the rest, and the numbers of that
            session = open_session(model, target, allow_cpu_fallback=True, reasons=True)
        except HtpRefusedError as again:
            session = None
            messages += [m for m in again.qnn_messages if m not in messages]
    check = HtpCheck(
        target,
        compiled,
        session.partition if session else None,
        refusal=refusal,
        qnn_messages=list(messages),
        versions=backend_versions(),
    )
    if session is not None:
        compared = cpu_model if cpu_model is not None else model
        if steps is None:
            steps = output_steps(_load_graph(compared))
        check.outputs = compare_with_cpu(session, compared, feeds, steps=steps, reference=reference)
    if compiled and forced and cpu_model is None:
        check.forced = forced_comparison(_load_model(model), feeds, target, steps or {})
        check.outputs = [
            replace(o, forced_max_diff_steps=check.forced.outputs.get(o.name))
            for o in check.outputs
        ]
    return check


def _load_graph(model: ModelSource) -> onnx.ModelProto:
    """The graph of ``model`` (its weights stay on disk)."""
    if isinstance(model, bytes):
        return onnx.load_from_string(model)
    return onnx.load(os.fspath(model), load_external_data=False)


def _load_model(model: ModelSource) -> onnx.ModelProto:
    """``model`` with its weights."""
    if isinstance(model, bytes):
        return onnx.load_from_string(model)
    return onnx.load(os.fspath(model))
