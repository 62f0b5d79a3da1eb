"""Context preparation with reproducible bytes: in a fresh process, from a relative path.

What QNN's execution provider writes depends on more than the model: the EPContext node's
partition name hashes the path the model was loaded from, and the context binary numbers its
tensors and graphs with counters that run on across every context a process prepares. The
same model prepared twice in one process, or from two temporary directories, gives other
bytes; a build cache needs the same bytes for the same inputs (early cutoff, the fingerprint
check). So :func:`prepare_context_isolated` copies the model into a fresh directory as
``model.onnx`` and prepares it there, by that relative path, in a new Python process
(``python -m graphbuild.targets.qnn.htp_runtime.prepare_worker``); the partition, or QNN's refusal,
comes back as JSON in a file (QNN's libraries print to stdout).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from graphbuild.errors import ExportError
from graphbuild.targets.qnn.htp_runtime.backend import HtpTarget
from graphbuild.targets.qnn.htp_runtime.context import PreparedContext
from graphbuild.targets.qnn.htp_runtime.errors import HtpRefusedError
from graphbuild.targets.qnn.htp_runtime.partition import PartitionReport
from graphbuild.targets.workers import describe_exit, run_worker

__all__ = ["CONTEXT_DIR", "MODEL", "RESULT", "prepare_context_isolated"]

MODEL = "model.onnx"
RESULT = "result.json"
CONTEXT_DIR = "context"
_WORKER = "graphbuild.targets.qnn.htp_runtime.prepare_worker"


def prepare_context_isolated(model: Path, target: HtpTarget, out: Path) -> PreparedContext:
    """:func:`prepare_context` of the model file ``model`` (with its ``.onnx.data``, if any)
    in a fresh process; the EPContext model is written to ``out`` and its binary beside it,
    the same bytes for the same model and target wherever and whenever it runs."""
    if out.suffix != ".onnx" or not out.parent.is_dir():
        raise ExportError(f"a context model is written as <name>.onnx into a directory: {out}")
    with tempfile.TemporaryDirectory(prefix="graphbuild-prepare-") as tmp:
        work = Path(tmp)
        shutil.copyfile(model, work / MODEL)
        data = model.with_name(model.name + ".data")
        if data.is_file():
            shutil.copyfile(data, work / (MODEL + ".data"))
        (work / CONTEXT_DIR).mkdir()
        request = {"htp_arch": target.htp_arch, "soc_model": target.soc_model, "out": out.name}
        proc = run_worker(_WORKER, [json.dumps(request)], work)
        result_file = work / RESULT
        if not result_file.is_file():
            raise ExportError(
                f"preparing the context for {target} in a new process failed "
                f"({describe_exit(proc.returncode)}): "
                f"{proc.stderr.strip()[-2000:] or 'it wrote nothing to stderr'}"
            )
        result = json.loads(result_file.read_text())
        if "refused" in result:
            r = result["refused"]
            partition = r.get("partition")
            raise HtpRefusedError(
                r["onnxruntime_message"],
                r["target"],
                r["qnn_messages"],
                PartitionReport.from_json(partition) if partition else None,
            )
        if "error" in result:
            raise ExportError(f"preparing the context for {target}: {result['error']}")
        binaries = []
        for name in [out.name, *result["binaries"]]:
            shutil.move(work / CONTEXT_DIR / name, out.parent / name)
            if name != out.name:
                binaries.append(out.parent / name)
        partition = PartitionReport.from_json(result["partition"])
        return PreparedContext(out, tuple(binaries), partition)
