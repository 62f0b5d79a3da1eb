"""Sessions on QNN's HTP backend, CPU fallback disabled unless asked, and QNN's refusal as a
typed error carrying its own messages and the partition."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from graphbuild.targets.qnn.htp_runtime.backend import (
    HtpTarget,
    ep_options_for,
    qnn_devices,
    require_backend,
)
from graphbuild.targets.qnn.htp_runtime.errors import HtpRefusedError
from graphbuild.targets.qnn.htp_runtime.intercept import intercepted_output
from graphbuild.targets.qnn.htp_runtime.partition import (
    PartitionReport,
    error_lines,
    read_partition,
    strip_ansi,
)

__all__ = ["HtpSession", "ModelSource", "open_session"]

ModelSource = str | os.PathLike | bytes


@dataclass
class HtpSession:
    """An onnxruntime session on QNN's HTP backend, and what QNN took of the model.
    ``cpu_fallback`` says whether onnxruntime was allowed to put nodes on its CPU."""

    session: Any
    target: HtpTarget
    partition: PartitionReport
    cpu_fallback: bool

    @property
    def input_names(self) -> list[str]:
        return [i.name for i in self.session.get_inputs()]

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.session.get_outputs()]

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The model's outputs by name (what QNN logs meanwhile kept off the process's
        output: a session built verbose to read QNN's reasons stays verbose)."""
        with intercepted_output():
            results = self.session.run(None, dict(feeds))
        return dict(zip(self.output_names, results, strict=True))


def _session_options(
    target: HtpTarget,
    *,
    cpu_fallback: bool,
    json_dir: Path | None,
    verbose: bool,
    provider_options: Mapping[str, str] | None,
    session_config: Mapping[str, str] | None,
) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 0 if verbose else 3
    options.add_session_config_entry(
        "session.disable_cpu_ep_fallback", "0" if cpu_fallback else "1"
    )
    options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    for key, value in (session_config or {}).items():
        options.add_session_config_entry(key, str(value))
    ep_options = ep_options_for(target)
    # graph inputs' Q and outputs' DQ on QNN, as without fallback, so the partition with
    # fallback shows only what QNN could not take
    ep_options["offload_graph_io_quantization"] = "0"
    if json_dir is not None:
        ep_options.update({"dump_json_qnn_graph": "1", "json_qnn_graph_dir": str(json_dir)})
    ep_options.update({k: str(v) for k, v in (provider_options or {}).items()})
    options.add_provider_for_devices(qnn_devices(ort), ep_options)
    return options


def _create(
    model: ModelSource,
    target: HtpTarget,
    *,
    cpu_fallback: bool,
    verbose: bool = False,
    provider_options: Mapping[str, str] | None = None,
    session_config: Mapping[str, str] | None = None,
) -> tuple[Any, PartitionReport | None, str, BaseException | None]:
    """(session or None, partition or None, intercepted log, the error if it failed)."""
    import onnxruntime as ort

    source = model if isinstance(model, bytes) else os.fspath(model)
    with tempfile.TemporaryDirectory(prefix="graphbuild-qnn-json-") as tmp:
        json_dir = Path(tmp)
        options = _session_options(
            target,
            cpu_fallback=cpu_fallback,
            json_dir=json_dir,
            verbose=verbose,
            provider_options=provider_options,
            session_config=session_config,
        )
        session = error = None
        with intercepted_output() as intercepted:
            try:
                session = ort.InferenceSession(source, sess_options=options)
            except Exception as exc:  # onnxruntime's Fail / InvalidGraph / RuntimeException
                error = exc
        log = strip_ansi(intercepted[0]) if intercepted else ""
        partition = read_partition(session, log, json_dir) if session is not None else None
    return session, partition, log, error


def open_session(
    model: ModelSource,
    target: HtpTarget,
    *,
    allow_cpu_fallback: bool = False,
    reasons: bool = False,
    diagnose: bool = True,
    provider_options: Mapping[str, str] | None = None,
    session_config: Mapping[str, str] | None = None,
) -> HtpSession:
    """An HTP session for ``model`` (a path, or the bytes of a model without external data).

    With CPU fallback disabled (the default) a model QNN does not take whole is refused:
    :class:`HtpRefusedError` then carries onnxruntime's message, QNN's error lines and (with
    ``diagnose``, from a second session with fallback) the partition with QNN's reason for
    each CPU node. With fallback allowed, ``reasons`` reads those reasons into the session's
    partition (from QNN EP's verbose log). ``provider_options`` add QNN EP options
    (``htp_graph_finalization_optimization_mode``...) and ``session_config`` session config
    entries (``ep.context_enable``...)."""
    require_backend()
    extra = {"provider_options": provider_options, "session_config": session_config}
    session, partition, log, error = _create(
        model, target, cpu_fallback=allow_cpu_fallback, verbose=reasons, **extra
    )
    if session is not None and partition is not None:
        return HtpSession(session, target, partition, allow_cpu_fallback)
    messages = error_lines(log)
    diagnosis = None
    if not allow_cpu_fallback and diagnose:
        # what QNN would take, and its reason for each node it would not
        _, diagnosis, verbose_log, _ = _create(
            model, target, cpu_fallback=True, verbose=True, **extra
        )
        if diagnosis is None:
            messages = list(dict.fromkeys([*messages, *error_lines(verbose_log)]))
    raise HtpRefusedError(str(error), str(target), messages, diagnosis)
