"""Usage and environment errors are sentences, found before the first stage runs.

On the command line: exit 2 and one ``error: ...`` line that says what is wrong and what to
do, never a bare errno after every stage ran. In the Python API: a typed error naming the
argument (``ArgumentTypeError`` is also a ``TypeError``), never a ``TypeError`` or an
``AttributeError`` from inside a stage. The read-only file system and another user's closed
directory are real: a user namespace (``unshare``) mounts a read-only tmpfs or hides a
directory owned by another uid; where user namespaces are not available those tests skip.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import graphbuild as gb
from graphbuild.cli.app import app
from graphbuild.config import load_config
from graphbuild.errors import ArgumentTypeError, CacheError, ConfigError, ExportError

ROOT = Path(__file__).resolve().parents[1]
CONVNET = f"{ROOT / 'examples' / 'convnet.py'}:build"


def cli(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def assert_refused_before_any_stage(code: int, out: str, err: str, *phrases: str) -> None:
    assert code == 2, (out, err)
    assert out == "" and "capture" not in err  # nothing ran
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert "Errno" not in err and "Traceback" not in err
    for phrase in phrases:
        assert phrase in err, err


@pytest.fixture
def project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GRAPHBUILD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("GRAPHBUILD_DEBUG", raising=False)
    return tmp_path


# --------------------------------------------------------------------------- the output directory


def test_an_output_dir_that_is_a_file_is_exit_2_before_any_stage(project):
    (project / "out").write_text("not a directory")
    code, out, err = cli("export", "--model", CONVNET, "--output-dir", "out")
    assert_refused_before_any_stage(code, out, err, "out is a file", "--output-dir")


def test_an_output_dir_below_a_file_is_exit_2_before_any_stage(project):
    (project / "out").write_text("not a directory")
    code, out, err = cli("export", "--model", CONVNET, "--output-dir", "out/convnet")
    assert_refused_before_any_stage(code, out, err, "is a file, not a directory")


def _user_namespaces() -> str | None:
    """Why a user namespace cannot be made here, or None when it can."""
    if shutil.which("unshare") is None:
        return "needs util-linux's unshare"
    probe = subprocess.run(["unshare", "-Urm", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"user namespaces are not available here ({probe.stderr.strip()[:80]})"
    return None


needs_namespaces = pytest.mark.skipif(
    _user_namespaces() is not None, reason=str(_user_namespaces())
)


def run_in_namespace(
    shell: str, cwd: Path, tmp: Path, *unshare: str
) -> subprocess.CompletedProcess:
    """``shell`` (with ``$GB`` the command line) in a new user namespace."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "GRAPHBUILD_CACHE_DIR": str(tmp / "cache"),
        "GB": f"{sys.executable} -m graphbuild",
    }
    env.pop("GRAPHBUILD_DEBUG", None)
    return subprocess.run(
        ["unshare", *unshare, "sh", "-c", shell],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@needs_namespaces
def test_an_output_dir_on_a_read_only_file_system_is_exit_2_before_any_stage(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    proc = run_in_namespace(
        f"mount -t tmpfs -o ro tmpfs {ro} && $GB export --model {CONVNET} --output-dir ro/out",
        tmp_path,
        tmp_path,
        "-Urm",
    )
    assert_refused_before_any_stage(
        proc.returncode, proc.stdout, proc.stderr, "ro is on a read-only file system"
    )
    assert ".tmp" not in proc.stderr  # no internal temporary file named


def _closed_directory(tmp_path: Path) -> tuple[Path, tuple[str, ...]]:
    """A directory this process (in the namespace ``unshare`` args give) may not enter:
    as root, one owned by another uid with mode 0700, entered from a user namespace in
    which root has no power over it; otherwise one of ours with mode 0."""
    closed = tmp_path / "theirs"
    closed.mkdir()
    if os.geteuid() == 0:
        os.chown(closed, 12345, 12345)
        closed.chmod(0o700)
        return closed, ("-U",)
    closed.chmod(0)
    return closed, ()


@needs_namespaces
def test_a_cache_dir_inside_another_users_closed_directory_is_exit_2(tmp_path):
    closed, unshare = _closed_directory(tmp_path)
    try:
        shell = f"$GB export --model {CONVNET} --cache-dir theirs/cache"
        proc = run_in_namespace(shell, tmp_path, tmp_path, *unshare)
    finally:
        closed.chmod(stat.S_IRWXU)
    assert_refused_before_any_stage(
        proc.returncode, proc.stdout, proc.stderr, "you may not enter", "--cache-dir"
    )


@needs_namespaces
def test_an_output_dir_inside_another_users_closed_directory_is_exit_2(tmp_path):
    closed, unshare = _closed_directory(tmp_path)
    try:
        shell = f"$GB export --model {CONVNET} --no-cache --output-dir theirs/out"
        proc = run_in_namespace(shell, tmp_path, tmp_path, *unshare)
    finally:
        closed.chmod(stat.S_IRWXU)
    assert_refused_before_any_stage(
        proc.returncode, proc.stdout, proc.stderr, f"you may not enter {closed}"
    )


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_a_second_model_in_the_same_output_directory_is_refused_with_the_reason(tmp_path):
    sample, cache = (torch.randn(1, 4),), gb.Cache(tmp_path / "cache")
    first = gb.export(Small().eval(), sample, tmp_path / "out", "first", cache=cache)
    lock = (tmp_path / "out" / "graphbuild.lock.json").read_text()
    events: list = []
    with pytest.raises(ExportError) as refused:
        gb.export(
            Small().eval(),
            sample,
            tmp_path / "out",
            "second",
            cache=False,
            listeners=[events.append],
        )
    assert "holds the export of model 'first'" in str(refused.value)
    assert "another directory" in str(refused.value)
    assert events == []  # refused before any stage ran
    assert (tmp_path / "out" / "graphbuild.lock.json").read_text() == lock
    assert all(path.exists() for path in first.files.values())
    again = gb.export(Small().eval(), sample, tmp_path / "out", "first", cache=cache)
    assert again.lock["model_name"] == "first"  # the same model still re-exports there


# --------------------------------------------------------------------------- the Python API


@pytest.mark.parametrize(
    ("argument", "message"),
    [
        (
            {"output_directory": 7},
            "output_directory must be a path (str or os.PathLike), got int 7",
        ),
        ({"cache": 3.5}, "cache must be a gb.Cache, a directory, a redis:// URL"),
        ({"model": lambda x: x}, "the model must be a torch.nn.Module, got function"),
        ({"data": None}, "the sample inputs (data) are None"),
        (
            {"options": gb.QnnOnnxOptions(quantizer="w8a16", calibration=5)},
            "calibration must be a list of batches (each a tuple of positional inputs or a "
            "tensor), got int 5",
        ),
    ],
    ids=["output_directory", "cache", "model", "data", "calibration"],
)
def test_an_argument_of_the_wrong_type_is_named_before_any_stage(tmp_path, argument, message):
    events: list = []
    arguments = {
        "model": Small().eval(),
        "data": (torch.randn(1, 4),),
        "output_directory": tmp_path / "out",
        "model_name": "m",
        "cache": False,
        "listeners": [events.append],
        **argument,
    }
    model, data = arguments.pop("model"), arguments.pop("data")
    directory, name = arguments.pop("output_directory"), arguments.pop("model_name")
    with pytest.raises(ArgumentTypeError) as wrong:
        gb.export(model, data, directory, name, **arguments)
    assert message in str(wrong.value)
    assert isinstance(wrong.value, TypeError) and events == []


def test_an_unusable_cache_directory_in_the_api_is_a_cache_error_that_says_why(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(CacheError, match="cannot create the cache at .*file/cache"):
        gb.export(
            Small().eval(),
            (torch.randn(1, 4),),
            tmp_path / "o",
            "m",
            cache=tmp_path / "file" / "cache",
        )


# --------------------------------------------------------------------------- configuration


def test_a_bad_preset_given_with_set_says_so(tmp_path):
    (tmp_path / "graphbuild.toml").write_text(
        f'model = "{CONVNET}"\n[quantization]\npreset = "w8a16"\n'
    )
    cfg = load_config(cwd=tmp_path, overrides=["quantization.preset=w9a9"])
    with pytest.raises(ConfigError) as bad:
        cfg.export_options()
    assert str(bad.value).startswith(f"{tmp_path / 'graphbuild.toml'} (with --set): ")
    assert "unknown quantization preset 'w9a9'" in str(bad.value)
    (tmp_path / "graphbuild.toml").write_text(
        f'model = "{CONVNET}"\n[quantization]\npreset = "w9a9"\n'
    )
    with pytest.raises(ConfigError) as in_file:
        load_config(cwd=tmp_path).export_options()
    assert "(with --set)" not in str(in_file.value)  # the file's own mistake


def test_a_mistyped_model_path_is_no_such_model_file_not_an_output_directory_conflict(project):
    """``--model`` names the model's file; a typo in it (whose stem would be another model
    name) is said as such, not as the other model's export holding the directory."""
    (project / "out").mkdir()
    (project / "out" / "graphbuild.lock.json").write_text('{"model_name": "convnet"}')
    code, out, err = cli("export", "--model", "examples/convnett.py:build", "-o", "out")
    assert_refused_before_any_stage(code, out, err, "no such model file", "convnett.py")
    assert "holds the export" not in err
