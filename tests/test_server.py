"""The build server: a served command streams its output and exits with its code, a model
is built once per change of what its factory read (a replaced checkpoint rebuilds it, a
preset change does not), a crashing build leaves the server up, an idle server exits, the
command runs in-process when no server can start, and the client imports nothing heavy.

Each test runs ``python -m graphbuild`` in fresh processes with ``GRAPHBUILD_SERVER=1`` and a
server directory of its own, and stops the server it started."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

ROOT = Path(__file__).resolve().parents[1]

MODEL = textwrap.dedent(
    """
    import os

    import torch

    HERE = os.path.dirname(os.path.abspath(__file__))


    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x):
            return torch.relu(self.fc(x))


    def build():
        with open(os.path.join(HERE, "builds.txt"), "a") as log:
            log.write("built\\n")
        if os.environ.get("CRASH_FACTORY"):
            os.kill(os.getpid(), 9)
        net = Net().eval()
        net.load_state_dict(torch.load(os.path.join(HERE, "ckpt.pt")))
        return net, (torch.linspace(-1, 1, 4).reshape(1, 4),)


    def calibration():
        return [(torch.linspace(-1, 1, 4).reshape(1, 4) * s,) for s in (0.5, 1.0, 2.0)]
    """
)

CONFIG = textwrap.dedent(
    """
    model = "net.py:build"
    calibration = "net.py:calibration"
    model_name = "net"
    output_dir = "out"

    [quantization]
    preset = "w8a16"
    """
)


def _checkpoint(path: Path, value: float) -> None:
    torch.save({"fc.weight": torch.full((3, 4), value), "fc.bias": torch.zeros(3)}, path)


class Project:
    """A project directory and an environment whose commands use a server of their own."""

    def __init__(self, root: Path, server_dir: Path) -> None:
        self.root = root
        self.server_dir = server_dir
        env = {k: v for k, v in os.environ.items() if not k.startswith("GRAPHBUILD_")}
        env.pop("PYTEST_CURRENT_TEST", None)
        env.update(
            PYTHONPATH=str(ROOT),
            GRAPHBUILD_SERVER="1",
            GRAPHBUILD_SERVER_DIR=str(server_dir),
            GRAPHBUILD_SERVER_IDLE="120",
            GRAPHBUILD_CACHE_DIR=str(root.parent / "cache"),
            NO_COLOR="1",
        )
        self.env = env

    def run(self, *argv: str, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "graphbuild", *argv],
            cwd=self.root,
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=600,
        )

    def status(self) -> dict:
        proc = self.run("server", "status", "--json")
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    def builds(self) -> int:
        path = self.root / "builds.txt"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def weight(self) -> np.ndarray:
        model = onnx.load(self.root / "out" / "net.onnx")
        found = [numpy_helper.to_array(t) for t in model.graph.initializer if t.dims == [3, 4]]
        assert len(found) == 1
        return found[0]


@pytest.fixture
def project(tmp_path: Path) -> Iterator[Project]:
    root = tmp_path / "project"
    root.mkdir()
    (root / "net.py").write_text(MODEL)
    (root / "graphbuild.toml").write_text(CONFIG)
    _checkpoint(root / "ckpt.pt", 0.5)
    server_dir = Path(tempfile.mkdtemp(prefix="gbs-", dir="/tmp"))  # a socket path is short
    os.chmod(server_dir, 0o700)
    project = Project(root, server_dir)
    try:
        yield project
    finally:
        project.run("server", "stop")
        shutil.rmtree(server_dir, ignore_errors=True)


def _stages(proc: subprocess.CompletedProcess) -> dict[str, str]:
    return {s["name"]: s["status"] for s in json.loads(proc.stdout)["stages"]}


def test_a_served_export_streams_its_output_and_exits_with_its_code(project: Project) -> None:
    first = project.run("export")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "capture" in first.stdout and "ran" in first.stdout
    status = project.status()
    assert status["running"] and status["commands"] == 1
    assert [p["cwd"] for p in status["projects"]] == [str(project.root)]

    again = project.run("export", "--json")
    assert again.returncode == 0, again.stderr[-3000:]
    assert set(_stages(again).values()) == {"hit"}
    bad = project.run("export", "--format", "onnnx")
    assert bad.returncode == 2
    assert "no format 'onnnx'" in bad.stderr
    broken = project.run("export", "--model", "net.py:missing")  # fails in the model's build
    assert broken.returncode == 2
    assert "has no attribute 'missing'" in broken.stderr and "Traceback" not in broken.stderr
    assert project.status()["pid"] == status["pid"]  # one server answered all three


def test_a_replaced_checkpoint_rebuilds_the_served_model_and_a_preset_change_does_not(
    project: Project,
) -> None:
    assert project.run("export").returncode == 0
    assert np.allclose(project.weight(), 0.5, atol=0.01)
    assert project.builds() == 1

    preset = project.run("export", "--json", "--set", "quantization.preset=w8a8")
    assert preset.returncode == 0, preset.stderr[-3000:]
    assert project.builds() == 1  # the model was kept
    assert _stages(preset)["capture"] == "hit" and _stages(preset)["qparams"] == "ran"

    _checkpoint(project.root / "ckpt.pt", -0.25)
    replaced = project.run("export", "--json")
    assert replaced.returncode == 0, replaced.stderr[-3000:]
    assert project.builds() == 2
    assert np.allclose(project.weight(), -0.25, atol=0.01)
    assert _stages(replaced)["capture"] == "hit"  # weights only: no trace


@pytest.mark.slow
def test_a_build_that_crashes_leaves_the_server_running(project: Project) -> None:
    crashed = project.run("export", CRASH_FACTORY="1")
    assert crashed.returncode == 1
    assert "lost this command" in crashed.stderr
    pid = project.status()["pid"]

    fine = project.run("export")
    assert fine.returncode == 0, fine.stderr[-3000:]
    assert project.status()["pid"] == pid


def test_an_idle_server_exits(project: Project) -> None:
    started = project.run("graph", GRAPHBUILD_SERVER_IDLE="1")
    assert started.returncode == 0, started.stderr[-3000:]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and project.status()["running"]:
        time.sleep(0.5)
    assert not project.status()["running"]
    assert not list(project.server_dir.glob("*.sock"))


def test_without_a_server_the_command_runs_in_process(project: Project) -> None:
    os.chmod(project.server_dir, 0o777)  # a directory others may write to is refused
    proc = project.run("graph")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warning: no build server" in proc.stderr
    assert "qparams" in proc.stdout
    os.chmod(project.server_dir, 0o700)

    proc = project.run("--no-server", "graph")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "qparams" in proc.stdout and not proc.stderr
    assert not project.status()["running"]


def test_the_client_imports_nothing_heavy() -> None:
    code = (
        "import sys, graphbuild.server.client, graphbuild.server.commands, "
        "graphbuild.server.watch\n"
        "heavy = ('torch', 'onnx', 'numpy', 'typer', 'rich', 'graphbuild.api', 'graphbuild.cli')\n"
        "print([m for m in heavy if m in sys.modules])"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.slow
def test_watch_exports_again_after_the_model_file_changes(project: Project) -> None:
    watcher = subprocess.Popen(
        [sys.executable, "-m", "graphbuild", "export", "--watch", "--watch-runs", "2"],
        cwd=project.root,
        env=project.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = ""
        while "watch: export 1 exited 0" not in line:
            line = watcher.stderr.readline()
            assert line, "the watcher stopped before its first export"
        source = project.root / "net.py"
        source.write_text(source.read_text().replace("torch.relu(", "torch.sigmoid("))
        out, err = watcher.communicate(timeout=600)
    finally:
        watcher.kill()
    assert watcher.returncode == 0, err[-3000:]
    assert "watch: net.py changed (source)" in err
    # the first export ran every stage; the second traced again, the model's code changed
    assert len(re.findall(r"^capture\s+ran", out, re.M)) == 2, out
    assert project.builds() == 2


SLOW_FORWARD = """
        if os.environ.get("SLOW_FORWARD"):
            import time
            with open(os.path.join(HERE, "slow.pid"), "w") as out:
                out.write(str(os.getpid()))
            time.sleep(60)
        return torch.relu(self.fc(x))
"""


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL])
def test_a_killed_client_stops_its_command(project: Project, how: signal.Signals) -> None:
    source = project.root / "net.py"
    source.write_text(
        source.read_text().replace("\n        return torch.relu(self.fc(x))\n", SLOW_FORWARD)
    )
    client = subprocess.Popen(
        [sys.executable, "-m", "graphbuild", "export"],
        cwd=project.root,
        env={**project.env, "SLOW_FORWARD": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    marker = project.root / "slow.pid"
    try:
        deadline = time.monotonic() + 300
        while not marker.exists() or not marker.read_text():
            assert client.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        client.send_signal(how)
        client.wait(timeout=10)
    finally:
        client.kill()
    assert _gone(int(marker.read_text()), timeout=15)  # the command's process
    assert not (project.root / "out").exists()
    deadline = time.monotonic() + 30  # the project process is free for the next command
    while project.status()["projects"][0]["running"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert project.status()["projects"][0]["running"] == 0


HIDDEN_READS = textwrap.dedent(
    """
    import json
    import os
    import threading

    import torch

    from net import Net

    HERE = os.path.dirname(os.path.abspath(__file__))
    WEIGHTS = os.path.join(HERE, "weights")


    def build():
        with open(os.path.join(HERE, "builds.txt"), "a") as log:
            log.write("built\\n")
        config = {}

        def read_config():  # opened by another thread than the build's
            with open(os.path.join(WEIGHTS, "config.json")) as f:
                config.update(json.load(f))

        reader = threading.Thread(target=read_config)
        reader.start()
        reader.join()
        # read by C++, not Python's open (as safetensors' memory map is)
        weight = torch.from_file(os.path.join(WEIGHTS, "weight.bin"), size=12)
        scale = config["scale"] * float(os.environ.get("NET_SCALE", "1"))
        net = Net().eval()
        with torch.no_grad():
            net.fc.weight.copy_(weight.reshape(3, 4) * scale)
            net.fc.bias.zero_()
        return net, (torch.linspace(-1, 1, 4).reshape(1, 4),)
    """
)


def test_unseen_reads_and_environment_variables_rebuild_the_served_model(
    project: Project,
) -> None:
    weights = project.root / "weights"
    weights.mkdir()
    (weights / "config.json").write_text('{"scale": 1.0}')
    np.full(12, 0.5, dtype=np.float32).tofile(weights / "weight.bin")
    (project.root / "hidden.py").write_text(HIDDEN_READS)
    config = project.root / "graphbuild.toml"
    config.write_text(config.read_text().replace("net.py:build", "hidden.py:build"))
    first = project.run("export")
    assert first.returncode == 0, first.stderr[-3000:]
    assert np.allclose(project.weight(), 0.5, atol=0.01)
    assert project.builds() == 1

    np.full(12, -0.25, dtype=np.float32).tofile(weights / "weight.bin")  # beside config.json
    replaced = project.run("export")
    assert replaced.returncode == 0, replaced.stderr[-3000:]
    assert np.allclose(project.weight(), -0.25, atol=0.01)
    assert project.builds() == 2

    scaled = project.run("export", NET_SCALE="2")
    assert scaled.returncode == 0, scaled.stderr[-3000:]
    assert np.allclose(project.weight(), -0.5, atol=0.01)
    assert project.builds() == 3
    assert project.run("export", NET_SCALE="2").returncode == 0
    assert project.builds() == 3  # the same environment: the model was kept


def test_the_memo_keeps_the_most_recently_used_models() -> None:
    from graphbuild.server.memo import Entry, Memo, memo_entries

    assert memo_entries({}) == 2 and memo_entries({"GRAPHBUILD_SERVER_MEMO": "5"}) == 5
    kept = Memo(limit=lambda: 2)
    for key in ("a", "b"):
        kept.put(key, Entry(key, {}))
    assert kept.get("a").value == "a"  # "b" is now the least recently used
    kept.put("c", Entry("c", {}))
    assert "b" not in kept and "a" in kept and "c" in kept
    kept.touch("a")  # a use a request process reported
    kept.put("d", Entry("d", {}))
    assert sorted(kept.entries) == ["a", "d"] and kept.used == ["a"]
    none = Memo(limit=lambda: 0)
    none.put("a", Entry("a", {}))
    assert len(none) == 0


def test_the_server_does_not_import_from_the_first_clients_directory(project: Project) -> None:
    (project.root / "onnxscript.py").write_text(
        "import os\n"
        "open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'shadowed'), 'w')\n"
        "raise ImportError('a local module shadowed an installed library')\n"
    )
    proc = project.run("graph")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert project.status()["running"]
    assert not (project.root / "shadowed").exists()


@pytest.mark.parametrize("job", ["SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID"])
def test_a_batch_job_uses_no_server_unless_asked(job: str) -> None:
    from graphbuild.server.paths import server_wanted

    assert server_wanted({})
    assert not server_wanted({job: "4242"})  # its server would outlive the job, in its cgroup
    assert server_wanted({job: "4242", "GRAPHBUILD_SERVER": "1"})
