"""Commands that do not export start without torch: ``graphbuild --help``, ``cache ...`` and
``targets`` import neither torch nor onnx (nor numpy or networkx, which only the export
needs). Each command runs in a fresh interpreter that then lists what it imported; the time
it takes is measured in ``bench/bench_cli.py``, never here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: What an export needs and a command that does not export must not import.
HEAVY = ("torch", "torchao", "onnx", "onnxscript", "onnxruntime", "numpy", "networkx")

RUN_AND_LIST = textwrap.dedent(
    """
    import contextlib, io, json, sys

    command, heavy = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    sys.argv = ["graphbuild", *command]
    from graphbuild.cli import main

    code = None
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main()
        except SystemExit as done:
            code = done.code
    print(json.dumps({"code": code, "imported": sorted(m for m in heavy if m in sys.modules)}))
    """
)


@pytest.mark.parametrize(
    "command",
    [
        ["--help"],
        ["export", "--help"],
        ["cache", "path"],
        ["cache", "stats"],
        ["cache", "stats", "--json"],
        ["cache", "ls"],
        ["targets"],
    ],
    ids=" ".join,
)
def test_a_command_that_does_not_export_imports_neither_torch_nor_onnx(command, tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "GRAPHBUILD_CACHE_DIR": str(tmp_path / "cache"),
    }
    env.pop("GRAPHBUILD_DEBUG", None)
    proc = subprocess.run(
        [sys.executable, "-c", RUN_AND_LIST, json.dumps(command), json.dumps(HEAVY)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["code"] in (0, None), proc.stderr[-2000:]
    assert result["imported"] == []


MODEL = "import torch\n\n\ndef build():\n    return torch.nn.Linear(4, 2), (torch.randn(1, 4),)\n"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--set", "quantization.preset=w8a61"],
            "unknown quantization preset 'w8a61'; did you mean 'w8a16'?",
        ),
        (["--format", "onx"], "has no format 'onx'; did you mean 'onnx'?"),
        (["--target", "qnnn"], "unknown target 'qnnn'"),
        (["--set", "opsett=21"], "unknown top-level key 'opsett'; did you mean 'opset'?"),
        (["--set", "option.opset=21"], "unknown key 'option.opset'; did you mean 'options.opset'?"),
        (
            ["--set", "options.opsett=21"],
            "unknown key 'opsett' in [options]; did you mean 'opset'?",
        ),
        (["--model", "modle.py:build"], "no such model file"),
    ],
    ids=["preset", "format", "target", "bare key", "dotted table", "option", "model file"],
)
def test_a_configuration_error_of_an_export_is_found_before_torch_is_imported(
    tmp_path, flags, message
):
    """A typo in the configuration is a sentence, exit 2, before the export imports torch
    (seconds) or the model: the process that reports it has not imported torch."""
    (tmp_path / "model.py").write_text(MODEL)
    command = ["export", "--model", "model.py:build", "-o", "out", *flags]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "GRAPHBUILD_CACHE_DIR": str(tmp_path / "cache"),
    }
    env.pop("GRAPHBUILD_DEBUG", None)
    proc = subprocess.run(
        [sys.executable, "-c", RUN_AND_LIST, json.dumps(command), json.dumps(HEAVY)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["code"] == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error: ") and message in proc.stderr, proc.stderr
    assert "torch" not in result["imported"], result
    assert not (tmp_path / "out").exists()
