"""What the command line prints when something goes wrong: short, once, and where it matters.

* A model whose ``forward`` cannot be traced: torch's one-line reason and the user's line,
  without the partial graph torch prints; the rest of torch's message under
  ``GRAPHBUILD_DEBUG=1``.
* A warning prints once, as graphbuild's ``warning: ...`` line, never Python's two lines with
  a source location; one the run's report carries (coverage) is printed by the report alone.
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from graphbuild.cli.app import app

BRANCHY = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            if y.sum() > 0:  # data-dependent control flow: torch.export cannot trace it
                return y * 2
            return y


    def build():
        return Branchy().eval(), (torch.randn(2, 4),)
    """
)

VANISHING = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Vanishing(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(x * 1e-9)  # a range no scale can represent: coverage warns


    def build():
        torch.manual_seed(0)
        return Vanishing().eval(), (torch.randn(1, 8),)
    """
)


def run(project: Path, monkeypatch: pytest.MonkeyPatch, *args: str, **env: str):
    with monkeypatch.context() as mp:
        mp.chdir(project)
        mp.setenv("GRAPHBUILD_CACHE_DIR", str(project / "cache"))
        mp.delenv("GRAPHBUILD_DEBUG", raising=False)
        for name, value in env.items():
            mp.setenv(name, value)
        result = CliRunner().invoke(app, list(args))
    return SimpleNamespace(code=result.exit_code, out=result.stdout, err=result.stderr)


@pytest.fixture
def branchy(tmp_path: Path) -> Path:
    (tmp_path / "branchy.py").write_text(BRANCHY)
    return tmp_path


def test_an_untraceable_forward_shows_torchs_reason_and_the_users_line(branchy, monkeypatch):
    result = run(branchy, monkeypatch, "export", "--model", "branchy.py:build", "--no-cache")
    assert result.code == 1
    lines = (result.out + result.err).splitlines()
    assert len(lines) <= 8, "\n".join(lines)
    assert "def forward(self" not in result.err  # torch's partial graph
    error = result.err.splitlines()
    assert error[0].startswith("error: stage 'capture' failed: GuardOnDataDependentSymNode: ")
    assert "Could not guard on data-dependent expression" in error[0]
    assert error[1] == '  File "branchy.py", line 13, in forward'
    assert error[2].strip().startswith("if y.sum() > 0:")
    assert "GRAPHBUILD_DEBUG=1" in error[-1] and "TORCH_LOGS" not in result.err


def test_graphbuild_debug_shows_the_rest_of_torchs_message(branchy, monkeypatch):
    args = ("export", "--model", "branchy.py:build", "--no-cache")
    result = run(branchy, monkeypatch, *args, GRAPHBUILD_DEBUG="1")
    assert result.code == 1
    assert "TORCH_LOGS" in result.err and "Traceback" in result.err


@pytest.fixture(scope="module")
def vanishing(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """One export of a model whose activation range collapses (a coverage warning), with a
    shared cache URL nothing answers at (a cache warning) when the redis client is there.
    Warnings print as they do outside pytest (which records them instead): Python's own
    two lines on stderr, unless graphbuild prints them its way."""
    project = tmp_path_factory.mktemp("vanishing")
    (project / "vanishing.py").write_text(VANISHING)
    args = ["export", "--model", "vanishing.py:build", "--set", "quantization.preset=w8a8"]
    unreachable = importlib.util.find_spec("redis") is not None
    if unreachable:
        args += ["--cache-url", "redis://127.0.0.1:1/0"]

    def as_python_prints(message, category, filename, lineno, file=None, line=None):
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))

    with pytest.MonkeyPatch.context() as mp, warnings.catch_warnings():
        warnings.simplefilter("default")
        warnings.showwarning = as_python_prints
        result = run(project, mp, *args)
    assert result.code == 0, result.out + result.err
    return SimpleNamespace(result=result, unreachable=unreachable)


def test_a_coverage_warning_prints_once_from_the_report(vanishing):
    printed = vanishing.result.out + vanishing.result.err
    assert printed.count("collapsed") == 1, printed
    assert "UserWarning" not in printed and "warnings.warn" not in printed


def test_a_cache_warning_prints_once_as_graphbuilds_line(vanishing):
    if not vanishing.unreachable:
        pytest.skip("the redis client (the dev extra) is not installed")
    lines = [line for line in vanishing.result.err.splitlines() if "shared cache" in line]
    assert len(lines) == 1, vanishing.result.err
    assert lines[0].startswith("warning: cannot reach the shared cache at redis://127.0.0.1:1/0")
    assert "RuntimeWarning" not in vanishing.result.err
    assert "open_cache(" not in vanishing.result.err  # no source line
