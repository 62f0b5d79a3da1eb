"""A back end's native log lines (ExecuTorch's CPU probe writes ``[cpuinfo_utils.cpp:87] ...``
to the process's stderr from C++) become records of graphbuild's logging, never lines in the
middle of graphbuild's own output."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from graphbuild.targets.native_log import native_lines_logged

ROOT = Path(__file__).resolve().parents[1]


def test_lines_native_code_writes_to_fd_2_become_log_records(capfd, caplog):
    caplog.set_level(logging.INFO, logger="graphbuild.runtime.probe")
    with native_lines_logged("probe"):
        os.write(2, b"[cpuinfo_utils.cpp:87] Failed to open midr file\n\nsecond line\n")
    print("after the block", file=sys.stderr)
    assert capfd.readouterr().err == "after the block\n"
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            "graphbuild.runtime.probe",
            logging.INFO,
            "[cpuinfo_utils.cpp:87] Failed to open midr file",
        ),
        ("graphbuild.runtime.probe", logging.INFO, "second line"),
    ]


def test_fd_2_is_given_back_when_the_block_raises(capfd):
    with pytest.raises(RuntimeError), native_lines_logged("probe"):
        raise RuntimeError("the runtime failed")
    os.write(2, b"visible\n")
    assert capfd.readouterr().err == "visible\n"


@pytest.mark.slow
def test_executorchs_cpu_probe_lines_go_to_graphbuilds_log_not_stderr(tmp_path):
    pytest.importorskip("executorch", reason="runs ExecuTorch's runtime (the executorch extra)")
    code = (
        "import logging, sys; logging.basicConfig(stream=sys.stdout, level=logging.WARNING, "
        "format='%(name)s: %(message)s'); "
        "logging.getLogger('graphbuild.runtime').setLevel(logging.INFO); "
        "import graphbuild as gb; from examples import convnet; m, s = convnet.build(); "
        f"gb.export(m, s, {str(tmp_path / 'out')!r}, 'convnet', target='executorch', "
        "options={'check_numerics': True, 'recipe': 'fp32'}, cache=False)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "cpuinfo_utils.cpp" not in proc.stderr
    probe = [line for line in proc.stdout.splitlines() if "cpuinfo_utils.cpp" in line]
    assert all(line.startswith("graphbuild.runtime.executorch: [") for line in probe), probe
