"""The build server: :func:`main` (the client starts it, in its socket's directory).

It listens on its socket first, then imports what an export needs (torch, the engine, the
targets registry, the command line; each command teaches it the rest: the modules a command
imported, its project process imports after it and the server when idle), then serves:
``run`` requests go to the project process of their working directory and ``sys.path``
(forked from here on first use, at most :data:`MAX_PROJECTS` of them), ``status`` and
``stop`` are answered here. It exits when no command has run for ``GRAPHBUILD_SERVER_IDLE``
seconds, when asked to, and when graphbuild's own files or the installed libraries changed
since it started (the command that finds that out is told to start a fresh server). It runs
one thread, so that forking is safe.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import selectors
import signal
import socket
import sys
import sysconfig
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graphbuild.server.paths import idle_seconds, socket_path
from graphbuild.server.protocol import ProtocolError, receive, send

__all__ = ["MAX_PROJECTS", "main"]

MAX_PROJECTS = 4
PRELOAD = (
    "torch",
    "onnx",
    "onnxscript",
    "torchao",
    "graphbuild.api",
    "graphbuild.cli.app",
    "graphbuild.targets.registry",
)


@dataclass
class Project:
    key: tuple
    pid: int
    control: socket.socket
    cwd: str
    in_flight: int = 0
    served: int = 0
    last_used: float = field(default_factory=time.monotonic)


def _code_stamp() -> dict[str, tuple[int, int]]:
    """(mtime, size) of graphbuild's files and of the directories libraries install into."""
    import graphbuild

    stamp = {}
    for path in Path(graphbuild.__file__).parent.rglob("*.py"):
        info = path.stat()
        stamp[str(path)] = (info.st_mtime_ns, info.st_size)
    paths = sysconfig.get_paths()
    for key in ("purelib", "platlib"):
        if key in paths and os.path.isdir(paths[key]):
            info = os.stat(paths[key])
            stamp[paths[key]] = (info.st_mtime_ns, 0)
    return stamp


class Server:
    def __init__(self, path: Path, idle: float) -> None:
        self.path = path
        self.idle = idle
        self.started = time.time()
        self.last_activity = time.monotonic()
        self.served = 0
        self.projects: dict[tuple, Project] = {}
        self.selector = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        old = os.umask(0o177)
        try:
            self.listener.bind(str(path))
        finally:
            os.umask(old)
        self.listener.listen(64)
        self.inode = path.stat().st_ino
        self.threads = 1
        self.stamp: dict[str, tuple[int, int]] = {}
        self.running = True
        self.to_import: set[str] = set()

    def preload(self) -> None:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in PRELOAD:
                with contextlib.suppress(Exception):
                    importlib.import_module(name)
        with contextlib.suppress(Exception):
            from graphbuild.server.request import cli_command

            cli_command()
        torch = sys.modules.get("torch")
        if torch is not None:
            self.threads = torch.get_num_threads()
            torch.set_num_threads(1)
        self.stamp = _code_stamp()

    def serve(self) -> None:
        self.selector.register(self.listener, selectors.EVENT_READ, None)
        while self.running:
            events = self.selector.select(timeout=min(1.0, max(0.05, self.idle / 4)))
            for key, _ in events:
                if key.data is None:
                    self._accept()
                else:
                    self._from_project(key.data)
            self._reap_exited()
            busy = any(p.in_flight for p in self.projects.values())
            if not events and not busy and self.to_import:  # idle: learn what commands import
                self._import(sorted(self.to_import))
                self.to_import.clear()
            if not busy and time.monotonic() - self.last_activity > self.idle:
                print(f"idle for {self.idle:.0f} s: exiting", flush=True)
                self.running = False
        self.shutdown()

    # ------------------------------------------------------------------ clients

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        fds: list[int] = []
        try:
            conn.settimeout(10)
            request, fds = receive(conn)
            conn.settimeout(None)
            op = request.get("op")
            if op == "run":  # idle means no command: asking for the status is not one
                self.last_activity = time.monotonic()
            if op == "status":
                send(conn, self.status())
            elif op == "stop":
                send(conn, {"stopping": True, "pid": os.getpid()})
                self.running = False
            elif op == "run" and len(fds) == 3:
                if self.stamp and _code_stamp() != self.stamp:
                    send(conn, {"restart": "graphbuild or an installed library changed"})
                    self.running = False
                else:
                    self._route(request, [conn.fileno(), *fds])
            else:
                send(conn, {"error": f"unknown request {op!r}", "exit": 2})
        except (OSError, ProtocolError, ValueError) as err:
            print(f"a request failed: {err!r}", flush=True)
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
            conn.close()

    def status(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "socket": str(self.path),
            "started": self.started,
            "uptime_seconds": time.time() - self.started,
            "idle_timeout_seconds": self.idle,
            "commands": self.served,
            "python": sys.executable,
            "projects": [
                {"cwd": p.cwd, "pid": p.pid, "commands": p.served, "running": p.in_flight}
                for p in self.projects.values()
            ],
        }

    # ----------------------------------------------------------------- projects

    def _route(self, request: dict[str, Any], fds: list[int]) -> None:
        key = (request["cwd"], tuple(request.get("sys_path", ())))
        project = self.projects.get(key) or self._start_project(key, request, fds)
        send(project.control, request, fds)
        project.in_flight += 1
        project.served += 1
        project.last_used = time.monotonic()
        self.served += 1

    def _start_project(self, key: tuple, request: dict[str, Any], fds: list[int]) -> Project:
        idle = [p for p in self.projects.values() if not p.in_flight]
        if len(self.projects) >= MAX_PROJECTS and idle:
            self._drop(min(idle, key=lambda p: p.last_used))
        ours, theirs = socket.socketpair()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        pid = os.fork()
        if pid == 0:  # the project process: nothing of the server's but ``theirs``
            try:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                self.selector.close()
                self.listener.close()
                ours.close()
                for project in self.projects.values():
                    project.control.close()
                for fd in fds:
                    os.close(fd)
                sys.path[:] = list(key[1]) or sys.path
                with contextlib.suppress(OSError):
                    os.chdir(key[0])
                from graphbuild.server.project import run_project

                run_project(theirs, self.threads)
            finally:
                os._exit(1)
        theirs.close()
        project = Project(key, pid, ours, key[0])
        self.projects[key] = project
        self.selector.register(ours, selectors.EVENT_READ, project)
        return project

    def _from_project(self, project: Project) -> None:
        try:
            message, fds = receive(project.control)
        except (OSError, ProtocolError):
            self._drop(project)  # it died (a crash while building a model): its clients saw EOF
            return
        self.last_activity = time.monotonic()
        if message.get("op") == "done":
            project.in_flight = max(0, project.in_flight - 1)
            self.to_import.update(message.get("imported", ()))
        elif message.get("op") == "stale":  # its sources changed: a fresh one takes the request
            project.in_flight = max(0, project.in_flight - 1)
            self._drop(project)
            request = message["request"]
            try:
                fresh = self._start_project(project.key, request, fds)
                send(fresh.control, request, fds)
                fresh.in_flight += 1
                fresh.served += 1
            finally:
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)

    def _drop(self, project: Project) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(project.control)
        project.control.close()
        self.projects.pop(project.key, None)
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(project.pid, os.WNOHANG)

    def _import(self, names: Any) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name in names:
                if isinstance(name, str) and name not in sys.modules:
                    with contextlib.suppress(BaseException):
                        importlib.import_module(name)

    def shutdown(self) -> None:
        """Unlink the socket (no new client connects), serve those already connected (their
        project processes finish them), then exit."""
        with contextlib.suppress(OSError):
            if self.path.stat().st_ino == self.inode:
                self.path.unlink()
        self.running = True  # so that a queued ``run`` is routed, not refused
        self.listener.setblocking(False)
        while True:
            try:
                ready = self.selector.select(timeout=0)
            except OSError:
                break
            if not any(key.data is None for key, _ in ready):
                break
            self._accept()
        self.listener.close()
        for project in list(self.projects.values()):
            self._drop(project)
        self._reap()

    def _reap_exited(self) -> None:
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass

    def _reap(self) -> None:
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                time.sleep(0.05)


def main() -> None:
    """Serve until idle or stopped (started by the client, detached, output to a log), on
    the socket the client chose (``GRAPHBUILD_SERVER_SOCKET``): recomputing it here could
    name another one."""
    given = os.environ.pop("GRAPHBUILD_SERVER_SOCKET", "")
    path = Path(given) if given else socket_path()
    server = Server(path, idle_seconds())
    signal.signal(signal.SIGTERM, lambda *_: setattr(server, "running", False))
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    print(f"graphbuild server {os.getpid()} listening on {path}", flush=True)
    server.preload()
    print(f"ready after {time.time() - server.started:.1f} s", flush=True)
    server.serve()


if __name__ == "__main__":
    main()
