"""A back end's child process that dies says how: a signal by name, with what it usually
means, so a crash inside a backend reads as one and not as a bare negative exit code."""

from __future__ import annotations

import signal
from pathlib import Path

from graphbuild.targets.workers import describe_exit, run_worker


def test_a_segfault_is_named_as_a_crash_in_native_code() -> None:
    text = describe_exit(-signal.SIGSEGV)
    assert "SIGSEGV" in text and "crashed" in text


def test_a_kill_names_the_likely_out_of_memory() -> None:
    assert "SIGKILL" in describe_exit(-signal.SIGKILL) and "memory" in describe_exit(-9)


def test_an_exit_code_is_given_as_it_is() -> None:
    assert describe_exit(3) == "exit code 3"


def test_a_worker_that_crashes_is_described_by_its_signal(tmp_path: Path) -> None:
    (tmp_path / "crasher.py").write_text(
        "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n"
    )
    proc = run_worker("crasher", [], tmp_path, first_on_path=[str(tmp_path)])
    assert proc.returncode == -signal.SIGSEGV
    assert "SIGSEGV" in describe_exit(proc.returncode)
