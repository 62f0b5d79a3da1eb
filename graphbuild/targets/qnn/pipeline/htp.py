"""The HTP check and the ``context`` format, as stages of the qnn pipeline.

::

    bind ─┬─────────────────────────────► check_htp_<arch> ─┐      (onnx_qdq: the file itself)
          └► [qdq_from_encodings] ────────►       ▲          ├► htp_report ─► coverage_on_htp
    encodings ┘  (onnx: Q/DQ rebuilt      float_reference ───┘        (QNN's view in the
                  from the .encodings)                                 coverage report)
    context format:
    bind ─► prepare_context_<arch> ─► context_<arch>          (EPContext .onnx + .bin: products)
                      └─────────────► check_htp_<arch>        (the EPContext model on the HTP)

Each per-target stage is a ``functools.partial`` over its arch and SoC model, so its key holds
exactly its own target; every stage that runs QNN reads ``registry.htp_backend`` (onnxruntime,
onnxruntime-qnn and QNN SDK versions). The model reaches them by digest: a warm re-export is
all hits, a scales-only retune re-binds and re-prepares the context and nothing upstream.
"""

from __future__ import annotations

import functools
import json
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from graphbuild.engine.codecs import FileArtifact
from graphbuild.engine.fingerprint import register_registry
from graphbuild.engine.pipeline import Pipeline, StageRef
from graphbuild.engine.toolchain import Tool, register_tool
from graphbuild.errors import CoverageError, ExportError
from graphbuild.frontend.capture import as_args
from graphbuild.targets.qnn.arch.targets import HtpTarget

__all__ = ["HTP_BACKEND", "add_htp_stages", "context_file_names"]

#: the read that keys a stage on the HTP backend's versions
HTP_BACKEND = "registry.htp_backend"


def _backend_entries() -> dict[str, str]:
    """What prepares and runs HTP graphs here (or why nothing can): part of the key of every
    stage that runs QNN."""
    from graphbuild.targets.qnn.htp_runtime import availability, backend_versions

    found = availability()
    return backend_versions() if found.available else {"unavailable": found.reason}


register_registry("htp_backend", _backend_entries)
#: the backend's own libraries, by content: a rebuilt backend of the same version reruns too
QNN_HTP = register_tool(
    Tool.package_files(
        "qnn-htp", "onnxruntime_qnn", "*QnnHtp.*", "*HtpPrepare.*", "*providers_qnn.*"
    )
)


# --------------------------------------------------------------------------- helpers


def _write_model(model: Any, directory: Path, name: str = "model.onnx") -> Path:
    """``model`` (a BoundModel or a ModelProto) as a file QNN can read: inline, or above
    protobuf's limit with one ``.data`` file beside it."""
    from graphbuild.onnx.bind import BoundModel
    from graphbuild.onnx.save import EXTERNAL_DATA_THRESHOLD, save_model, tensor_bytes

    path = directory / name
    if isinstance(model, BoundModel):
        save_model(model, path, external_data=tensor_bytes(model) > EXTERNAL_DATA_THRESHOLD)
    else:
        onnx.save(model, str(path))
    return path


def _feeds(path: Path, samples: Any) -> dict[str, np.ndarray]:
    """The sample inputs by the model's input names (in order, as onnxruntime takes them)."""
    import torch

    graph = onnx.load(str(path), load_external_data=False).graph
    initializers = {i.name for i in graph.initializer}
    names = [i.name for i in graph.input if i.name not in initializers]
    leaves = [a for a in torch.utils._pytree.tree_flatten(as_args(samples))[0]]
    tensors = [a for a in leaves if isinstance(a, torch.Tensor)]
    if len(tensors) != len(names):
        raise ExportError(
            f"the model takes {len(names)} input(s) ({', '.join(names)}); the samples give "
            f"{len(tensors)} tensor(s)"
        )
    return {n: t.detach().cpu().numpy() for n, t in zip(names, tensors, strict=True)}


def _ordered(reference: Mapping[str, Any]) -> list[np.ndarray]:
    """The reference outputs in order (``outputs_dict`` keys them ``0000``, ``0001``...)."""
    return [np.asarray(reference[k].numpy()) for k in sorted(reference) if ":" not in k]


def context_file_names(model_name: str, target: HtpTarget) -> tuple[str, str]:
    """(EPContext model, context binary) file names: ``<name>_<label>_ctx.onnx`` and the
    ``_qnn.bin`` QNN's execution provider writes beside it."""
    stem = f"{model_name}_{target.label}_ctx"
    return f"{stem}.onnx", f"{stem}_qnn.bin"


# --------------------------------------------------------------------------- stages


def qdq_from_encodings(inputs: tuple, samples: Any, context: Any) -> onnx.ModelProto:
    """``onnx``: the QDQ model a QNN tool builds from the float model and its ``.encodings``,
    in the forms the HTP runs fully quantized (what the HTP check compiles)."""
    from graphbuild.onnx.save import materialize
    from graphbuild.targets.qnn.encodings.qdq import insert_qdq
    from graphbuild.targets.qnn.rewrites.qdq_forms import apply_htp_forms

    bound, enc_file = inputs
    return apply_htp_forms(
        insert_qdq(materialize(bound), json.loads(enc_file.data)),
        matmul_int16_requantize=context["matmul_int16_requantize"],
    )


def check_htp(
    inputs: tuple, samples: Any, context: Any, *, htp_arch: str, soc_model: str
) -> dict[str, Any]:
    """Compile the QDQ model on the HTP with CPU fallback disabled; what QNN took, and its
    outputs against onnxruntime's CPU (in output steps) and the float model (SQNR)."""
    from graphbuild.targets.qnn.htp_runtime import check_model

    model, reference = inputs
    target = HtpTarget(htp_arch, soc_model)
    with tempfile.TemporaryDirectory(prefix="graphbuild-htp-") as tmp:
        path = _write_model(model, Path(tmp))
        # by its bytes where it has no external data: what QNN names after the model's path
        # (its messages, its partitions) is then the same in every run
        external = path.with_name(path.name + ".data").exists()
        source = path if external else path.read_bytes()
        check = check_model(source, _feeds(path, samples), target, reference=_ordered(reference))
    return check.to_json()


def prepare_context(
    inputs: tuple, samples: Any, context: Any, *, htp_arch: str, soc_model: str
) -> tuple[FileArtifact, list[FileArtifact], dict[str, Any]]:
    """The QDQ model prepared for one HTP target: (EPContext model, context binaries, what
    QNN took), in a fresh process so the bytes are the same every time. A model QNN refuses
    fails here, with QNN's reasons."""
    from graphbuild.targets.qnn.htp_runtime import prepare_context_isolated as prepare

    (bound,) = inputs
    target = HtpTarget(htp_arch, soc_model)
    model_file, binary_file = context_file_names(context["model_name"], target)
    with tempfile.TemporaryDirectory(prefix="graphbuild-context-") as tmp:
        source = _write_model(bound, Path(tmp))
        out = Path(tmp) / "context"
        out.mkdir()
        prepared = prepare(source, target, out / model_file)
        if [b.name for b in prepared.binaries] != [binary_file]:
            raise ExportError(
                f"QNN's execution provider wrote context binaries "
                f"{[b.name for b in prepared.binaries]}, not the one file {binary_file} "
                "graphbuild places (a newer onnxruntime-qnn naming them otherwise?)"
            )
        return (
            FileArtifact.read(prepared.model),
            [FileArtifact.read(b) for b in prepared.binaries],
            prepared.partition.to_json(),
        )


def context_files(
    inputs: tuple, samples: Any, context: Any, *, label: str
) -> dict[str, FileArtifact]:
    """The files of one prepared context, by kind: what placement writes."""
    ((model, binaries, _),) = inputs
    files = {f"context_{label}": model}
    for i, binary in enumerate(binaries):
        files[f"context_{label}_bin" + (f"{i}" if i else "")] = binary
    return files


def check_context(
    inputs: tuple, samples: Any, context: Any, *, htp_arch: str, soc_model: str
) -> dict[str, Any]:
    """Run the EPContext model on the HTP and compare with the QDQ model on onnxruntime's
    CPU (the numerics of what is deployed)."""
    from graphbuild.targets.qnn.htp_runtime import (
        HtpCheck,
        PartitionReport,
        backend_versions,
        compare_with_cpu,
        open_session,
        output_steps,
    )

    (model, binaries, partition), bound, reference = inputs
    target = HtpTarget(htp_arch, soc_model)
    with tempfile.TemporaryDirectory(prefix="graphbuild-context-") as tmp:
        directory = Path(tmp)
        for artifact in (model, *binaries):
            (directory / artifact.name).write_bytes(artifact.data)
        qdq = _write_model(bound, directory, "qdq_source.onnx")
        session = open_session(directory / model.name, target)
        outputs = compare_with_cpu(
            session,
            qdq,
            _feeds(qdq, samples),
            steps=output_steps(onnx.load(str(qdq), load_external_data=False)),
            reference=_ordered(reference),
        )
    check = HtpCheck(
        target,
        compiled=True,
        partition=PartitionReport.from_json(partition),
        outputs=outputs,
        versions=backend_versions(),
    )
    return {**check.to_json(), "ran": "the EPContext model"}


def htp_report(inputs: tuple, samples: Any, context: Any) -> dict[str, Any]:
    """The HTP checks of every target, and one summary line."""
    checks = list(inputs)
    summary = "; ".join(c["summary"] for c in checks)
    for c in checks:
        if not c["compiled"]:
            warnings.warn(f"htp: {c['summary']}", stacklevel=2)
    return {"checks": checks, "summary": summary}


def coverage_on_htp(inputs: tuple, samples: Any, context: Any) -> dict[str, Any]:
    """The coverage report as QNN sees it: graphbuild's HTP rules, then what the HTP backend
    took. ``strict_coverage`` fails when QNN refused the model, put a node on the CPU or
    (with a preset) received an op in float."""
    from graphbuild.targets.qnn.presets.quantizer import is_preset_quantizer
    from graphbuild.targets.qnn.reports.coverage import check_coverage

    report, htp = inputs
    preset = is_preset_quantizer(context["quantizer"])
    qnn = [_qnn_view(c, preset) for c in htp["checks"]]
    merged = {**report, "rules_summary": report["summary"], "qnn": qnn}
    merged["summary"] = "; ".join(q["summary"] for q in qnn) + (
        f" (graphbuild's rules: {report['summary']})"
    )
    if context["strict_coverage"]:
        check_coverage(report)
        failing = [q for q in qnn if q["violations"]]
        if failing:
            raise CoverageError(
                "strict coverage: "
                + "; ".join(f"{q['summary']}: " + ", ".join(q["violations"][:8]) for q in failing)
            )
    return merged


def _qnn_view(check: Mapping[str, Any], preset: bool) -> dict[str, Any]:
    """One target's partition, as the coverage report gives it, with what breaks strict
    coverage: a refusal, CPU nodes, and (with a preset) every op QNN received in float."""
    partition = check.get("partition") or {}
    cpu = partition.get("cpu_nodes", [])
    floats = partition.get("float_ops", [])
    violations = []
    if not check["compiled"]:
        violations.append(f"refused with CPU fallback disabled ({check['refusal'][:200]})")
    violations += [f"{n['name']} ({n['op_type']}) on the CPU: {n['reason']}" for n in cpu]
    if preset:
        violations += [f"{o['name']} ({o['op_type']}) runs in float" for o in floats]
    target = f"QNN HTP v{check['htp_arch']} (SoC {check['soc_model']})"
    line = target + (": " if check["compiled"] else " refused it with CPU fallback disabled: ")
    if partition:
        line += f"{partition['qnn_nodes']}/{partition['total_nodes']} ONNX nodes on QNN"
        if cpu:
            line += f", {len(cpu)} on the CPU"
        line += f", {len(floats)} QNN ops float"
    else:
        line += "; ".join(check.get("qnn_messages", [])[:3]) or check["refusal"][:300]
    return {
        "htp_arch": check["htp_arch"],
        "soc_model": check["soc_model"],
        "compiled": check["compiled"],
        "qnn_nodes": partition.get("qnn_nodes"),
        "total_nodes": partition.get("total_nodes"),
        "cpu_nodes": cpu,
        "float_ops": floats,
        "violations": violations,
        "summary": line,
    }


# --------------------------------------------------------------------------- wiring


def add_htp_stages(
    p: Pipeline,
    targets: Sequence[HtpTarget],
    *,
    fmt: str,
    bound: StageRef,
    enc: StageRef,
    coverage: StageRef,
    reference: StageRef,
    model_name: str,
) -> None:
    """Add the HTP check (formats ``onnx``, ``onnx_qdq``) or the context preparation and its
    check (``context``, whose contexts become the pipeline's products) for ``targets``."""
    checks: list[StageRef] = []
    if fmt == "context":
        products, files = [], set()
        for t in targets:
            kw = {"htp_arch": t.htp_arch, "soc_model": t.soc_model}
            prep = p.register_stage(
                functools.partial(prepare_context, **kw),
                f"prepare_context_{t.label}",
                reads=("ctx.model_name", HTP_BACKEND, QNN_HTP),
            ).depends_on(bound)
            products.append(
                p.register_stage(
                    functools.partial(context_files, label=t.label),
                    f"context_{t.label}",
                    reads=(),
                ).depends_on(prep)
            )
            checks.append(
                p.register_stage(
                    functools.partial(check_context, **kw),
                    f"check_htp_{t.label}",
                    reads=("samples", HTP_BACKEND, QNN_HTP),
                ).depends_on(prep, bound, reference)
            )
            files.update(context_file_names(model_name, t))
        p.products = [s.name for s in products]
        p.output_files = frozenset(files)
    else:
        model = bound
        if fmt == "onnx":
            model = p.register_stage(
                qdq_from_encodings, "qdq_from_encodings", reads=("ctx.matmul_int16_requantize",)
            )
            model.depends_on(bound, enc)
        for t in targets:
            checks.append(
                p.register_stage(
                    functools.partial(check_htp, htp_arch=t.htp_arch, soc_model=t.soc_model),
                    f"check_htp_{t.label}",
                    reads=("samples", HTP_BACKEND, QNN_HTP),
                ).depends_on(model, reference)
            )
    report = p.register_stage(htp_report, "htp_report", reads=()).depends_on(*checks)
    view = p.register_stage(
        coverage_on_htp, "coverage_on_htp", reads=("ctx.quantizer", "ctx.strict_coverage")
    ).depends_on(coverage, report)
    p.reports["htp"] = report.name
    p.reports["coverage"] = view.name
