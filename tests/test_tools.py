"""Every program and shared library a stage calls is in its key (``engine.toolchain``).

A stage's code closure covers the Python it runs; a program it starts or a shared library a
library loads for it is a *tool*: a stage declares the ones it calls as ``"tool.<name>"``
reads, each read is the tool's identity (its files' digest, a version where it reports one),
and the lock file's ``toolchain`` lists them. The tools here are stubs: an executable shell
script on ``PATH`` and a shared-library file in ``tmp_path``, swapped between runs; then the
built-in pipelines declare the real ones (Arm's model converter and TOSA serializer for
``executorch/vgf``, ExecuTorch's runtime for its numerics check, QNN's HTP libraries for the
stages that prepare or run contexts, llama.cpp for the GGUF numerics check), and a swap of
each reruns exactly the stages that call it.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from torch import nn

import graphbuild as gb
from graphbuild.engine import toolchain
from graphbuild.engine.artifact_store import Cache
from graphbuild.engine.pipeline import Pipeline
from graphbuild.engine.toolchain import Tool, file_digest, tool_identity
from tests.engine_helpers import CALLS, reset, stage

PAST = 1_000_000_000  # an mtime well in the past: a file not modified "just now"


def write_tool(path: Path, version: str, *, past: bool = True) -> Path:
    """A stub executable printing ``version`` for ``--version``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then echo "stub {version} {path}"; fi\n')
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    if past:
        os.utime(path, ns=(PAST, PAST))
    return path


def write_library(path: Path, content: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    return path


@pytest.fixture
def tools(tmp_path, monkeypatch):
    """A stub executable ``stub-converter`` on PATH and a stub library ``stub-lib``, both
    registered as tools (for this test only)."""
    bin_dir = tmp_path / "bin"
    write_tool(bin_dir / "stub-converter", "0.11")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    lib = write_library(tmp_path / "lib" / "libstub.so", b"\x7fELF stub library 1")
    exe = Tool.executable("stub-converter", version_args=("--version",))
    monkeypatch.setitem(toolchain.TOOLS, exe.name, exe)
    monkeypatch.setitem(
        toolchain.TOOLS, "stub-lib", Tool("stub-lib", lambda: [("libstub.so", lib)])
    )
    return bin_dir / "stub-converter", lib, "tool.stub-converter", "tool.stub-lib"


def stub_library(monkeypatch, name: str, path: Path, content: bytes) -> Path:
    """Tool ``name`` (a built-in one) known by a stub file instead of its real library."""
    write_library(path, content)
    monkeypatch.setitem(toolchain.TOOLS, name, Tool(name, lambda: [(path.name, path)]))
    return path


def _source(inputs, samples, ctx):
    return 1


def _convert(inputs, samples, ctx):
    return inputs[0] + 1


def _link(inputs, samples, ctx):
    return inputs[0] * 2


def _after(inputs, samples, ctx):
    return inputs[0] + inputs[1]


def tool_pipeline(exe_read: str, lib_read: str) -> Pipeline:
    """source -> convert (calls the converter), source -> link (loads the library),
    convert + link -> after (calls neither)."""
    p = Pipeline(name="tools")
    src = p.register_stage(stage("source", _source), "source", reads=())
    conv = p.register_stage(stage("convert", _convert), "convert", reads=(exe_read,))
    link = p.register_stage(stage("link", _link), "link", reads=(lib_read,))
    after = p.register_stage(stage("after", _after), "after", reads=())
    conv.depends_on(src)
    link.depends_on(src)
    after.depends_on(conv, link)
    return p


def run(p: Pipeline, cache: Cache):
    reset()
    result = p.run(None, context={}, cache=cache)
    return result, list(CALLS)


def test_a_swapped_executable_reruns_exactly_the_stages_that_call_it(tools, tmp_path):
    exe, lib, exe_read, lib_read = tools
    p, cache = tool_pipeline(exe_read, lib_read), Cache(tmp_path / "cache")
    run(p, cache)

    _, warm = run(p, cache)
    write_tool(exe, "0.9")  # Arm's converter from 0.11 back to 0.9
    result, swapped = run(p, cache)

    assert warm == []
    assert swapped == ["convert"]  # its output is the same: the rest hit
    assert result.report.hits == ["source", "link", "after"]
    assert exe_read in result.report["convert"].reason, result.report["convert"].reason
    cache.close()


def test_a_swapped_library_reruns_exactly_the_stages_that_load_it(tools, tmp_path):
    exe, lib, exe_read, lib_read = tools
    p, cache = tool_pipeline(exe_read, lib_read), Cache(tmp_path / "cache")
    run(p, cache)

    write_library(lib, b"\x7fELF stub library 2")
    result, swapped = run(p, cache)

    assert swapped == ["link"]
    assert result.report.hits == ["source", "convert", "after"]
    cache.close()


def test_a_tool_is_known_by_version_and_content_never_by_where_it_is(tools, tmp_path, monkeypatch):
    exe, lib, exe_read, lib_read = tools
    here = tool_identity("stub-converter")
    elsewhere = write_tool(tmp_path / "other" / "place" / "stub-converter", "0.11")
    elsewhere.write_bytes(exe.read_bytes())  # the same program, installed elsewhere
    os.utime(elsewhere, ns=(PAST, PAST))
    monkeypatch.setenv("PATH", f"{elsewhere.parent}{os.pathsep}{os.environ['PATH']}")

    assert here.startswith("stub 0.11 xxh3:"), here
    assert str(tmp_path) not in here and "/" not in here
    assert tool_identity("stub-converter") == here
    write_tool(elsewhere, "0.9")
    assert tool_identity("stub-converter").startswith("stub 0.9 xxh3:")


def test_a_tool_that_prints_its_version_as_json_is_known_by_that_version(tmp_path, monkeypatch):
    """The defect: Arm's model converter 0.9.0 prints ``--version`` as a JSON object, and the
    lock file named it ``{``."""
    tool = tmp_path / "bin" / "json-converter"
    tool.parent.mkdir(parents=True)
    body = '{\n  "version": "d8c1b8e",\n  "dependencies": ["VGF=6da524a"]\n}'
    tool.write_text(f"#!/bin/sh\ncat <<'EOF'\n{body}\nEOF\n")
    tool.chmod(0o755)
    os.utime(tool, ns=(PAST, PAST))
    monkeypatch.setenv("PATH", f"{tool.parent}{os.pathsep}{os.environ['PATH']}")
    exe = Tool.executable("json-converter", version_args=("--version",))
    monkeypatch.setitem(toolchain.TOOLS, exe.name, exe)
    assert tool_identity("json-converter").startswith("d8c1b8e xxh3:")


def test_a_tool_not_installed_is_absent_and_an_unknown_one_always_reruns(tools, tmp_path):
    exe, lib, exe_read, lib_read = tools
    exe.unlink()
    p = Pipeline(name="unknown")
    p.register_stage(stage("calls", _source), "calls", reads=("tool.nobody-registered",))
    cache = Cache(tmp_path / "cache")

    assert tool_identity("stub-converter") == "absent"
    first, second = run(p, cache)[1], run(p, cache)[1]
    assert first == second == ["calls"]  # no digest: never a stale hit
    cache.close()


def test_a_files_digest_is_read_once_while_it_is_unchanged(tools, monkeypatch):
    exe, lib, exe_read, lib_read = tools
    os.utime(lib, ns=(PAST, PAST))
    reads: list[str] = []
    real = toolchain._hash_file

    def counted(path: str) -> str:
        reads.append(path)
        return real(path)

    monkeypatch.setattr(toolchain, "_hash_file", counted)
    monkeypatch.setattr(toolchain, "_digests", {})
    first, again = file_digest(lib), file_digest(lib)
    lib.write_bytes(b"\x7fELF another build")
    os.utime(lib, ns=(PAST + 1, PAST + 1))
    changed = file_digest(lib)

    assert first == again != changed
    assert len(reads) == 2


# --------------------------------------------------------------------------- the lock


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_the_lock_lists_every_tool_the_pipeline_calls_without_a_path(tools, tmp_path):
    exe, lib, exe_read, lib_read = tools

    def factory(request):
        p = tool_pipeline(exe_read, lib_read)
        p.products = ["after"]
        return p

    torch.manual_seed(0)
    art = gb.export(
        Tiny(), (torch.randn(1, 4),), tmp_path / "out", "m", pipeline_factory=factory,
        cache=tmp_path / "cache",
    )  # fmt: skip
    lock = json.loads(art.files["lock"].read_text())

    toolchain_ = lock["toolchain"]
    assert toolchain_["stub-converter"] == tool_identity("stub-converter")
    assert toolchain_["stub-lib"] == tool_identity("stub-lib")
    assert "torch" in toolchain_
    assert not any(str(tmp_path) in v or "/" in v for v in toolchain_.values()), toolchain_
    assert exe_read in lock["stages"]["convert"]["reads"]


# --------------------------------------------------------------------------- the built-in tools


def reads_of(pipeline: Pipeline, tool: str) -> set[str]:
    return {s.name for s in pipeline.stages if f"tool.{tool}" in (s.reads or ())}


def statuses(art) -> dict[str, str]:
    return {s.name: s.status.value for s in art.report.stages}


def ran(art) -> set[str]:
    return {name for name, status in statuses(art).items() if status == "ran"}


def test_arms_model_converter_swapped_on_path_relowers_the_vgf_export(tmp_path, monkeypatch):
    """The defect: Arm's converter from 0.11 to 0.9, and the next export was all hits."""
    from graphbuild.targets.executorch import lowering
    from graphbuild.targets.executorch import pipeline as et

    pytest.importorskip("executorch", reason="the executorch extra")
    monkeypatch.setattr(lowering, "require_format", lambda fmt: None)  # Arm's tools absent
    # the converter's output stands in for the lowering, which needs Arm's tools to run
    monkeypatch.setattr(lowering, "lower_to_pte", lambda programs, fmt, consts: (b"vgf", {}))
    monkeypatch.delenv("MODEL_CONVERTER_PATH", raising=False)
    bin_dir = tmp_path / "bin"
    converter = write_tool(bin_dir / "model-converter", "0.11")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    stub_library(monkeypatch, "tosa-serializer", tmp_path / "tosa" / "serializer.so", b"tosa 1")
    cache = Cache(tmp_path / "cache")

    def export(out: str) -> gb.ExportArtifacts:
        torch.manual_seed(0)
        return gb.export(
            Tiny(), (torch.randn(1, 4),), tmp_path / out, "m", target="executorch",
            format="vgf", cache=cache,
        )  # fmt: skip

    first = export("a")
    warm = export("a")
    write_tool(converter, "0.9")
    swapped = export("b")
    stub_library(monkeypatch, "tosa-serializer", tmp_path / "tosa" / "serializer.so", b"tosa 2")
    new_tosa = export("c")

    assert reads_of(et.build_executorch_pipeline(request("vgf")), "model-converter") == {"lower"}
    assert ran(first) and ran(warm) == set()
    assert ran(swapped) == {"lower"} == ran(new_tosa)
    assert statuses(swapped)["pte"] == "cutoff"  # the same file: the rest cut off
    lock = json.loads(swapped.files["lock"].read_text())
    assert lock["toolchain"]["model-converter"].startswith("stub 0.9 xxh3:")
    assert "tool.model-converter" in lock["stages"]["lower"]["reads"]
    cache.close()


def request(fmt: str, **options):
    from graphbuild.api import ExportRequest

    return ExportRequest(Tiny(), (torch.randn(1, 4),), "out", "m", "executorch", fmt, options)


def test_a_new_executorch_runtime_reruns_only_the_numerics_check(tmp_path, monkeypatch):
    pytest.importorskip("executorch.runtime", reason="the executorch extra")
    lib = tmp_path / "runtime" / "_portable_lib.so"
    stub_library(monkeypatch, "executorch-runtime", lib, b"runtime 1")
    cache = Cache(tmp_path / "cache")

    def export(out: str) -> gb.ExportArtifacts:
        torch.manual_seed(0)
        return gb.export(
            Tiny(), (torch.randn(1, 4),), tmp_path / out, "m", target="executorch",
            format="portable", options={"check_numerics": True}, cache=cache,
        )  # fmt: skip

    export("a")
    stub_library(monkeypatch, "executorch-runtime", lib, b"runtime 2")
    swapped = export("b")

    assert ran(swapped) == {"check_numerics"}, statuses(swapped)
    assert "tool.executorch-runtime" in swapped.report["check_numerics"].reason
    cache.close()


def test_a_rebuilt_qnn_htp_library_reprepares_and_rechecks_the_context(tmp_path, monkeypatch):
    pytest.importorskip("onnxruntime_qnn", reason="the htp extra")
    from graphbuild.targets.qnn import htp_runtime

    if not htp_runtime.availability().available:
        pytest.skip(htp_runtime.availability().reason)
    lib = tmp_path / "qnn" / "libQnnHtp.so"
    stub_library(monkeypatch, "qnn-htp", lib, b"htp build 1")
    cache = Cache(tmp_path / "cache")

    def export(out: str) -> gb.ExportArtifacts:
        torch.manual_seed(0)
        model, sample = nn.Sequential(nn.Linear(16, 8), nn.ReLU()).eval(), torch.randn(2, 16)
        options = {"quantizer": "w8a8", "calibration": [(sample,)], "check_htp": True}
        return gb.export(
            model, (sample,), tmp_path / out, "mlp", format="context",
            options=gb.QnnOnnxOptions(**options), cache=cache,
        )  # fmt: skip

    export("a")
    stub_library(monkeypatch, "qnn-htp", lib, b"htp build 2")
    swapped = export("b")

    assert ran(swapped) == {"prepare_context_v81", "check_htp_v81"}, statuses(swapped)
    cache.close()


def test_a_new_llama_cpp_reruns_only_the_gguf_numerics_check(tmp_path, monkeypatch):
    pytest.importorskip("transformers", reason="the gguf target exports transformers models")
    from graphbuild.targets.gguf import numerics
    from tests import gguf_models as gm

    # llama.cpp itself need not be installed: the check's result stands in for its run
    monkeypatch.setattr(numerics, "compare_with_llama_cpp", lambda *args: {"max_abs": 0.0})
    lib = tmp_path / "llama" / "libllama.so"
    stub_library(monkeypatch, "llama-cpp", lib, b"llama.cpp b1")
    cache, tokenizer = Cache(tmp_path / "cache"), tmp_path / "tokenizer.json"
    gm.tokenizer(tokenizer)

    def export(out: str) -> gb.ExportArtifacts:
        options = gb.GgufOptions(tokenizer=tokenizer, check_numerics=True)
        return gb.export(
            gm.decoder("llama"), (gm.token_ids(),), tmp_path / out, "llama", target="gguf",
            options=options, cache=cache,
        )  # fmt: skip

    export("a")
    stub_library(monkeypatch, "llama-cpp", lib, b"llama.cpp b2")
    swapped = export("b")

    assert ran(swapped) == {"check_numerics"}, statuses(swapped)
    cache.close()
