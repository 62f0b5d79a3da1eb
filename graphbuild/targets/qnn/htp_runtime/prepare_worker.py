"""The worker of :func:`~graphbuild.targets.qnn.htp_runtime.isolated.prepare_context_isolated`:
run as ``python -m graphbuild.targets.qnn.htp_runtime.prepare_worker '<request JSON>'`` in a
directory holding ``model.onnx``; prepares it and writes ``result.json`` (the binaries and the
partition, QNN's refusal, or the error)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from graphbuild.targets.qnn.htp_runtime.backend import HtpTarget
from graphbuild.targets.qnn.htp_runtime.context import prepare_context
from graphbuild.targets.qnn.htp_runtime.errors import HtpRefusedError
from graphbuild.targets.qnn.htp_runtime.isolated import CONTEXT_DIR, MODEL, RESULT


def main(argv: list[str]) -> None:
    """The worker: prepare ``model.onnx`` (in the working directory) as asked in ``argv[0]``;
    write ``result.json``."""
    request = json.loads(argv[0])
    target = HtpTarget(request["htp_arch"], request["soc_model"])
    try:
        prepared = prepare_context(MODEL, target, Path(CONTEXT_DIR) / request["out"])
        result = {
            "binaries": [b.name for b in prepared.binaries],
            "partition": prepared.partition.to_json(),
        }
    except HtpRefusedError as refused:
        result = {
            "refused": {
                "onnxruntime_message": refused.onnxruntime_message,
                "target": refused.target,
                "qnn_messages": refused.qnn_messages,
                "partition": refused.partition.to_json() if refused.partition else None,
            }
        }
    except Exception as exc:  # reported to the parent, which raises it as an ExportError
        result = {"error": f"{type(exc).__name__}: {exc}"}
    Path(RESULT).write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
