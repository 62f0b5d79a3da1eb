"""What goes wrong with QNN's HTP backend: not installable here, or a model it refuses."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from graphbuild.errors import ExportError

if TYPE_CHECKING:
    from graphbuild.targets.qnn.htp_runtime.partition import PartitionReport

__all__ = ["HtpError", "HtpRefusedError", "HtpUnavailableError"]


class HtpError(ExportError):
    """Qualcomm's HTP backend (onnxruntime-qnn) could not be used or did not accept a model."""


class HtpUnavailableError(HtpError):
    """The HTP backend cannot run here: onnxruntime-qnn missing, or not for this platform."""


class HtpRefusedError(HtpError):
    """QNN's HTP backend would not compile a model as asked (CPU fallback disabled).

    ``onnxruntime_message`` is onnxruntime's error, ``qnn_messages`` the error lines QNN and its
    execution provider logged, ``partition`` (where a session with CPU fallback builds) what
    QNN would take, with its reason for each node left on the CPU."""

    def __init__(
        self,
        onnxruntime_message: str,
        target: str,
        qnn_messages: Sequence[str] = (),
        partition: PartitionReport | None = None,
    ):
        self.onnxruntime_message = onnxruntime_message
        self.target = target
        self.qnn_messages = list(qnn_messages)
        self.partition = partition
        lines = [f"QNN's HTP backend ({target}) refused the model: {onnxruntime_message}"]
        cpu = partition.cpu_nodes if partition is not None else ()
        if cpu:
            lines.append(f"{len(cpu)} node(s) QNN would not take:")
            lines += [f"  {n.name} ({n.op_type}): {n.reason or 'no reason logged'}" for n in cpu]
        shown = [m for m in self.qnn_messages if m not in onnxruntime_message]
        if shown:
            lines.append("QNN said:")
            lines += [f"  {m}" for m in shown[:20]]
        super().__init__("\n".join(lines))
