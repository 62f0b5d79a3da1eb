"""A real ``redis-server`` for the shared-cache tests, on a free loopback port.

Each server keeps nothing on disk (``--save '' --appendonly no``) and lives in a temporary
directory. Tests that need one skip, saying why, where ``redis-server`` (Debian's package
``redis-server``) or the ``redis`` client (``pip install 'graphbuild[redis]'``) is missing.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

SKIP_NO_SERVER = (
    "redis-server is not installed: the Redis backend's tests need a real server "
    "(apt-get install redis-server)"
)
SKIP_NO_CLIENT = "the redis client is not installed (pip install 'graphbuild[redis]')"


def require_redis() -> str:
    """The path of redis-server; skips the test when it or the client is missing."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip(SKIP_NO_SERVER)
    try:
        import redis  # noqa: F401
    except ImportError:
        pytest.skip(SKIP_NO_CLIENT)
    return binary


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """``with RedisServer() as url:`` a fresh, empty server for the block; with ``password``,
    one that refuses clients without it (the URL carries it). :meth:`pause` makes it a server
    that accepts connections and never answers (the kernel still completes them)."""

    def __init__(self, password: str | None = None) -> None:
        self.binary = require_redis()
        self.password = password
        self.proc: subprocess.Popen | None = None
        self.dir: Path | None = None
        self.url = ""
        self.paused = False

    def __enter__(self) -> str:
        try:
            return self._start()
        except BaseException:
            self.__exit__(None, None, None)  # never leave a server behind
            raise

    def _start(self) -> str:
        import redis

        self.dir = Path(tempfile.mkdtemp(prefix="gb-redis-"))
        for _attempt in range(5):  # the port may be taken between choosing and binding
            port = _free_port()
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    "--port", str(port),
                    "--bind", "127.0.0.1",
                    "--save", "",
                    "--appendonly", "no",
                    "--dir", str(self.dir),
                    "--protected-mode", "yes",
                    *(["--requirepass", self.password] if self.password else []),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
            auth = f":{self.password}@" if self.password else ""
            self.url = f"redis://{auth}127.0.0.1:{port}/0"
            client = redis.Redis.from_url(self.url, socket_connect_timeout=1)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    client.ping()
                    client.close()
                    return self.url
                except redis.exceptions.RedisError:  # not listening yet, or still loading
                    time.sleep(0.02)
            client.close()
            self._stop()
        raise RuntimeError("redis-server did not start")

    def pause(self) -> None:
        """Stop the server's process (SIGSTOP): connections are accepted, nothing answers."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.proc is not None and self.paused:
            os.kill(self.proc.pid, signal.SIGCONT)
        self.paused = False

    def _stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __exit__(self, *exc: object) -> None:
        self._stop()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
