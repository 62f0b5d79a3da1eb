"""The worker of :mod:`~graphbuild.targets.qnn.htp_runtime.shared_context`: run as
``python -m graphbuild.targets.qnn.htp_runtime.shared_worker '<request JSON>'`` in a fresh
directory; writes ``result.json`` there.

A request with ``graphs`` prepares them, in order, into one weight-shared context (the models
at the given relative paths, the EPContext models into ``context_dir``): ``partitions``, QNN's
refusal of a graph (with the partition of a diagnosing session that does not share), or the
error. A request with ``probe`` opens an HTP session on that EPContext model: ``{}`` where it
builds, the error where it raises; where the backend kills the process no result is written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from graphbuild.targets.qnn.htp_runtime.backend import HtpTarget
from graphbuild.targets.qnn.htp_runtime.errors import HtpRefusedError
from graphbuild.targets.qnn.htp_runtime.session import open_session
from graphbuild.targets.qnn.htp_runtime.shared_context import shared_session_config

_RESULT = "result.json"


def _prepare(request: dict[str, Any], target: HtpTarget) -> dict[str, Any]:
    graphs = request["graphs"]
    sessions, partitions = [], []
    for i, graph in enumerate(graphs):
        config = shared_session_config(
            f"{request['context_dir']}/{graph['name']}.onnx", last=i == len(graphs) - 1
        )
        try:
            session = open_session(graph["model"], target, session_config=config, diagnose=False)
        except HtpRefusedError as refused:
            diagnosed = refused
            try:  # QNN's reasons, from sessions that leave the shared context alone
                open_session(graph["model"], target)
            except HtpRefusedError as again:
                diagnosed = again
            return {
                "refused": {
                    "graph": graph["name"],
                    "onnxruntime_message": diagnosed.onnxruntime_message,
                    "target": diagnosed.target,
                    "qnn_messages": diagnosed.qnn_messages,
                    "partition": diagnosed.partition.to_json() if diagnosed.partition else None,
                }
            }
        sessions.append(session)
        partitions.append(session.partition.to_json())
    return {"partitions": partitions}


def main(argv: list[str]) -> None:
    """The worker: do what ``argv[0]`` asks; write ``result.json``."""
    request = json.loads(argv[0])
    target = HtpTarget(request["htp_arch"], request["soc_model"])
    try:
        if "probe" in request:
            open_session(request["probe"], target, diagnose=False)
            result: dict[str, Any] = {}
        else:
            result = _prepare(request, target)
    except Exception as exc:  # reported to the parent, which raises it as an ExportError
        result = {"error": f"{type(exc).__name__}: {exc}"}
    Path(_RESULT).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
