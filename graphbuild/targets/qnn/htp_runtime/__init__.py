"""Qualcomm's HTP backend as the judge: compile a QDQ model for an HTP architecture with no CPU
fallback, see what QNN took and how, and compare its numbers with onnxruntime's CPU.

onnxruntime-qnn (the ``htp`` extra) ships Qualcomm's HTP backend (``libQnnHtp.so``: graph
preparation and an HTP simulator on x86_64 Linux) as an onnxruntime plugin execution provider.
This module is the one place graphbuild talks to it:

- :func:`availability` / :func:`require_backend`: is the backend usable here, and if not, why;
  :func:`backend_versions`: what a stage that runs it keys on;
- :class:`HtpTarget`: an HTP architecture (``htp_arch``) and SoC model (``soc_model``);
- :func:`open_session`: an HTP session for a model, CPU fallback disabled unless asked; QNN's
  refusal is an :class:`HtpRefusedError` carrying QNN's own messages and,
  where a session with fallback builds, the partition;
- :class:`PartitionReport`: ONNX nodes QNN took / all, the nodes left on the CPU with QNN's
  reason, and every op QNN received with a float tensor (from QNN's own JSON graph);
- :func:`compare_with_cpu`: per output, max |HTP - ORT CPU| in output quantization steps and
  SQNR of each against a float reference; :func:`forced_comparison` the same op by op, every
  quantized activation forced to the CPU's value;
- :func:`check_model`: all of the above for one model, as one JSON-able report;
- :func:`prepare_context`: the model prepared for one target as a deployable context (the
  EPContext ONNX model and the QNN context binary beside it); :func:`prepare_context_isolated`
  the same with reproducible bytes (a fresh process, a relative path);
- :func:`prepare_shared_context`: several graphs with the same weights (an LLM part's prompt
  and token graphs) in one weight-shared context binary, an EPContext model per graph;
  :func:`check_shared_context` their numbers against ORT's CPU, :func:`shared_context_key`
  what the binary's bytes depend on.

ORT's CPU run is at ``ORT_ENABLE_BASIC``: at its default level onnxruntime's QDQ fusions
mis-type some w8a8 models ("output_dtype INT8 does not match y_zero_point type UINT8").
"""

from __future__ import annotations

from graphbuild.targets.qnn.htp_runtime.backend import (
    INSTALL,
    SOC_MODELS,
    Availability,
    HtpTarget,
    availability,
    backend_versions,
    require_backend,
)
from graphbuild.targets.qnn.htp_runtime.check import HtpCheck, check_model
from graphbuild.targets.qnn.htp_runtime.compare import (
    OutputComparison,
    compare_with_cpu,
    grid_steps,
    output_steps,
    run_cpu,
)
from graphbuild.targets.qnn.htp_runtime.context import (
    PreparedContext,
    context_binaries,
    prepare_context,
)
from graphbuild.targets.qnn.htp_runtime.errors import (
    HtpError,
    HtpRefusedError,
    HtpUnavailableError,
)
from graphbuild.targets.qnn.htp_runtime.forced import ForcedComparison, forced_comparison
from graphbuild.targets.qnn.htp_runtime.isolated import prepare_context_isolated
from graphbuild.targets.qnn.htp_runtime.partition import QNN_EP, CpuNode, FloatOp, PartitionReport
from graphbuild.targets.qnn.htp_runtime.session import HtpSession, ModelSource, open_session
from graphbuild.targets.qnn.htp_runtime.shared_check import (
    SharedContextCheck,
    check_shared_context,
    shared_binary_loads,
)
from graphbuild.targets.qnn.htp_runtime.shared_context import (
    SharedContext,
    SharedGraph,
    prepare_shared_context,
)
from graphbuild.targets.qnn.htp_runtime.shared_key import shared_context_key
from graphbuild.targets.qnn.htp_runtime.shared_weights import (
    WEIGHT_SHARING_FROM_ARCH,
    WeightSharing,
    require_weight_sharing,
)

__all__ = [
    "INSTALL",
    "QNN_EP",
    "SOC_MODELS",
    "WEIGHT_SHARING_FROM_ARCH",
    "Availability",
    "CpuNode",
    "FloatOp",
    "ForcedComparison",
    "HtpCheck",
    "HtpError",
    "HtpRefusedError",
    "HtpSession",
    "HtpTarget",
    "HtpUnavailableError",
    "ModelSource",
    "OutputComparison",
    "PartitionReport",
    "PreparedContext",
    "SharedContext",
    "SharedContextCheck",
    "SharedGraph",
    "WeightSharing",
    "availability",
    "backend_versions",
    "check_model",
    "check_shared_context",
    "compare_with_cpu",
    "context_binaries",
    "forced_comparison",
    "grid_steps",
    "open_session",
    "output_steps",
    "prepare_context",
    "prepare_context_isolated",
    "prepare_shared_context",
    "require_backend",
    "require_weight_sharing",
    "run_cpu",
    "shared_binary_loads",
    "shared_context_key",
]
