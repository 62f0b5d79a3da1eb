"""A real local Ray cluster for the sweep and parallel-export tests: a head node and a second
node on 127.0.0.1, one worker process each, bounded in time and torn down.

Each node is ``ray start --block`` in a session of its own, so that stopping it (SIGTERM,
then SIGKILL to the session's process group) ends every process it started and nothing
else; each gets its own ``$GRAPHBUILD_CACHE_DIR``, as two machines would have. Tests skip,
saying why, where Ray is not installed (``pip install 'graphbuild[ray]'``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_NO_RAY = (
    "Ray is not installed: the Ray executor's tests need it (pip install 'graphbuild[ray]')"
)


def require_ray() -> Path:
    """The ``ray`` command beside this Python; skips the test when Ray is missing."""
    pytest.importorskip("ray", reason=SKIP_NO_RAY)
    binary = Path(sys.executable).parent / "ray"
    if not binary.exists():
        pytest.skip(SKIP_NO_RAY)
    return binary


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RayCluster:
    """``with RayCluster(cache_dirs) as address:`` a head and ``len(cache_dirs) - 1`` more
    nodes, one CPU (one worker) each, node ``i`` with ``$GRAPHBUILD_CACHE_DIR=cache_dirs[i]``."""

    def __init__(self, cache_dirs: list[Path], *, timeout: float = 90.0):
        self.binary = require_ray()
        self.cache_dirs = cache_dirs
        self.timeout = timeout
        self.nodes: list[subprocess.Popen] = []
        self.temp = Path(tempfile.mkdtemp(prefix="gbray-"))
        self.address = ""

    def __enter__(self) -> str:
        try:
            return self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def _env(self, index: int) -> dict[str, str]:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
        env["GRAPHBUILD_CACHE_DIR"] = str(self.cache_dirs[index])
        env.pop("GRAPHBUILD_CACHE_URL", None)
        return env

    def _node(self, index: int, args: list[str]) -> None:
        log = open(self.temp / f"node{index}.log", "wb")  # noqa: SIM115 - lives with the node
        self.nodes.append(
            subprocess.Popen(
                [str(self.binary), "start", "--block", "--num-cpus=1", *args],
                env=self._env(index),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )

    def _start(self) -> str:
        port = _free_port()
        self.address = f"127.0.0.1:{port}"
        self._node(
            0,
            [
                "--head",
                f"--port={port}",
                "--node-ip-address=127.0.0.1",
                "--include-dashboard=false",
                f"--temp-dir={self.temp}",
                "--disable-usage-stats",
            ],
        )
        self._wait_for(1)
        for index in range(1, len(self.cache_dirs)):
            self._node(index, [f"--address={self.address}", "--node-ip-address=127.0.0.1"])
        self._wait_for(len(self.cache_dirs))
        return self.address

    def _wait_for(self, nodes: int) -> None:
        """Until the cluster has ``nodes`` live nodes (``ray status``), or fail."""
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            for i, proc in enumerate(self.nodes):
                if proc.poll() is not None:
                    log = (self.temp / f"node{i}.log").read_text(errors="replace")[-2000:]
                    raise RuntimeError(f"ray node {i} exited ({proc.returncode}):\n{log}")
            status = subprocess.run(
                [str(self.binary), "status", f"--address={self.address}"],
                capture_output=True,
                text=True,
                timeout=30,
                env=self._env(0),
            )
            active = status.stdout.split("Active:")[-1].split("Pending:")[0]
            if status.returncode == 0 and active.count(" node_") >= nodes:
                return
            time.sleep(0.5)
        raise RuntimeError(f"the Ray cluster did not reach {nodes} node(s) in {self.timeout} s")

    def worker_pids(self) -> set[int]:
        """Process ids of every process the nodes started (their sessions)."""
        out = set()
        for proc in self.nodes:
            found = subprocess.run(
                ["ps", "-o", "pid=", "-s", str(proc.pid)], capture_output=True, text=True
            )
            out |= {int(p) for p in found.stdout.split()}
        return out

    def __exit__(self, *exc: object) -> None:
        for proc in reversed(self.nodes):  # the head last: the others report to it
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for proc in self.nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        for proc in self.nodes:  # whatever the session still holds
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            if proc.poll() is None:
                proc.wait(timeout=10)
        self.nodes.clear()


def kill_a_worker_holding_a_lease(
    proc: subprocess.Popen, cluster: RayCluster, url: str, among: set[str] | None = None
) -> tuple[int, str]:
    """Watch the shared cache's leases; SIGKILL the first Ray worker seen holding one (in the
    middle of building a stage; with ``among``, a stage of one of these keys). (pid, lease
    key)."""
    import redis

    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 600
    seen: dict[str, str] = {}  # lease key -> owner, for the message when none was killed
    while proc.poll() is None and time.monotonic() < deadline:
        for key in client.scan_iter(match="graphbuild:v1:i:lease:*"):
            raw = client.get(key)
            owner = json.loads(raw)["owner"] if raw else ""
            seen[key.decode()] = owner
            if among is not None and key.decode().rsplit(":", 1)[1] not in among:
                continue
            pid = int(owner.rsplit(":", 2)[1]) if owner.count(":") >= 2 else -1
            if pid in cluster.worker_pids() and pid != proc.pid:
                os.kill(pid, signal.SIGKILL)
                return pid, key.decode()
        time.sleep(0.01)
    raise AssertionError(
        f"no worker was seen holding a lease{' on ' + str(sorted(among)) if among else ''}; "
        f"seen: {seen}; workers: {cluster.worker_pids()}"
    )
