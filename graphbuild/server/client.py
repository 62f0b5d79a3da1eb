"""The ``graphbuild`` command: a thin client of the build server, or the command line itself.

``export``, ``status``, ``explain`` and ``graph`` (not their ``--help``) go to the server of
this user and environment, started in the background when none answers; every other command,
and every command with ``--no-server``, ``GRAPHBUILD_SERVER=0``, in CI or under pytest, runs
in this process (:func:`graphbuild.server.paths.server_wanted`). When no server can be
started or reached, the command runs in this process after one ``warning:`` line.
``graphbuild server status|stop`` looks after the server; ``export --watch`` re-exports on
every change (:mod:`~graphbuild.server.watch`).

This module imports the standard library and graphbuild's top only, so a served command
costs a Python start-up and a round trip.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from graphbuild.server.paths import runtime_dir, server_wanted, socket_path
from graphbuild.server.protocol import ProtocolError, receive, send

__all__ = ["connect", "main", "run_in_process", "run_served", "start_server"]

SERVED = frozenset({"export", "status", "explain", "graph"})
START_TIMEOUT = 30.0


class Unavailable(OSError):
    """No server could be reached or started."""


def connect(path: Path) -> socket.socket | None:
    """A connection to the server at ``path``; None when nothing listens there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    return sock


def _daemon_code() -> str:
    """The server's start: this ``sys.path`` without the working directory (a ``torch.py``
    there would shadow torch for every project the server serves), with the directory this
    graphbuild is imported from."""
    import graphbuild

    home = os.path.dirname(os.path.dirname(os.path.realpath(graphbuild.__file__)))
    cwd = os.getcwd()
    paths = [p for p in sys.path if p and os.path.abspath(p) != cwd]
    if home not in paths:
        paths.insert(0, home)
    return (
        f"import sys; sys.path[:] = {paths!r}\nfrom graphbuild.server.daemon import main\nmain()\n"
    )


def start_server(path: Path) -> socket.socket:
    """Connect, starting the server first when none listens; under a lock file, so that of
    several commands started at once one starts it and the others connect to it."""
    sock = connect(path)
    if sock is not None:
        return sock
    log = path.with_suffix(".log")
    with open(path.with_suffix(".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        sock = connect(path)
        if sock is not None:
            return sock
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a stale socket: nothing listens on it
        with open(log, "wb") as out:
            daemon = subprocess.Popen(
                [sys.executable, "-c", _daemon_code()],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=path.parent,
                env={**os.environ, "GRAPHBUILD_SERVER_SOCKET": str(path)},
            )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            sock = connect(path)
            if sock is not None:
                return sock
            if daemon.poll() is not None:
                tail = log.read_text(errors="replace").strip().splitlines()[-1:] or ["no output"]
                raise Unavailable(f"the build server exited at once: {tail[0]} (see {log})")
            time.sleep(0.02)
    raise Unavailable(f"the build server did not start within {START_TIMEOUT:.0f} s (see {log})")


def run_served(argv: list[str], env: dict[str, str] | None = None) -> int | None:
    """Run ``argv`` on the server: its exit code, or None when no server could be used."""
    for _ in range(2):
        try:
            sock = start_server(socket_path())
        except OSError as err:
            print(f"warning: no build server ({err}); running in this process", file=sys.stderr)
            return None
        with sock:
            request = {
                "op": "run",
                "argv": argv,
                "cwd": os.getcwd(),
                "env": dict(os.environ if env is None else env),
                "sys_path": sys.path,
                "encoding": getattr(sys.stdout, "encoding", None) or "utf-8",
            }
            try:
                send(sock, request, [0, 1, 2])
            except OSError as err:
                print(f"warning: the build server refused the command ({err})", file=sys.stderr)
                return None
            code = _follow(sock)
        if code != "restart":
            return code
        _wait_gone(socket_path())
    return None


#: Signals that end the client: each is passed on to the command's process as ``SIGINT``
#: first, so that the command stops rather than running on without its client.
FORWARDED = (signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def _forwarding(pid: list[int | None]) -> Iterator[None]:
    """While in the block, a ``SIGTERM`` or ``SIGHUP`` interrupts the command's process
    (``pid[0]``), then ends this one as the signal would have."""

    def forward(signum: int, _frame: Any) -> None:
        if pid[0] is not None:
            with contextlib.suppress(OSError):
                os.kill(pid[0], signal.SIGINT)
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    saved = {}
    for signum in FORWARDED:
        with contextlib.suppress(OSError, ValueError):  # not the main thread: not forwarded
            saved[signum] = signal.signal(signum, forward)
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


def _follow(sock: socket.socket) -> Any:
    """Read the server's messages until the command ends: its exit code, or ``restart``."""
    pid: list[int | None] = [None]
    with _forwarding(pid):
        return _follow_messages(sock, pid)


def _follow_messages(sock: socket.socket, current: list[int | None]) -> Any:
    pid, interrupted = None, False
    while True:
        try:
            message, _ = receive(sock)
        except KeyboardInterrupt:
            if interrupted or pid is None:
                return 130
            interrupted = True
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGINT)
            continue
        except (ProtocolError, OSError):
            if pid is None:
                return "restart"  # it exited (idle) before taking the command: a fresh one will
            print(
                "error: the build server lost this command (its process died); "
                "rerun it, or run it with --no-server",
                file=sys.stderr,
            )
            return 1
        if "restart" in message:
            return "restart"
        if "pid" in message:
            pid = current[0] = message["pid"]
        if "error" in message:
            print(f"error: {message['error']}", file=sys.stderr)
        if "exit" in message:  # its output is written and flushed by then
            return int(message["exit"])


def _wait_gone(path: Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and connect_quietly(path):
        time.sleep(0.05)


def connect_quietly(path: Path) -> bool:
    sock = connect(path)
    if sock is None:
        return False
    sock.close()
    return True


def run_in_process(argv: list[str]) -> None:
    """The command line in this process (exits with the command's code)."""
    if os.environ.get("GRAPHBUILD_WATCH_REPORT"):
        from graphbuild.server.request import install_loader

        install_loader()
    from graphbuild.cli.app import main as cli_main

    sys.argv = ["graphbuild", *argv]
    cli_main()


def _split_flags(argv: list[str]) -> tuple[list[str], bool]:
    """``argv`` without ``--no-server`` (before a ``--``), and whether it was there."""
    end = argv.index("--") if "--" in argv else len(argv)
    head = [a for a in argv[:end] if a != "--no-server"]
    return head + argv[end:], len(head) != end


def _served(argv: list[str]) -> bool:
    if not argv or argv[0] not in SERVED:
        return False
    return not any(a in ("--help", "-h") for a in argv)


def main(argv: list[str] | None = None) -> None:
    """The ``graphbuild`` entry point."""
    argv = list(sys.argv[1:] if argv is None else argv)
    argv, no_server = _split_flags(argv)
    use_server = not no_server and server_wanted()
    if argv[:1] == ["server"]:
        from graphbuild.server.commands import server_command

        sys.exit(server_command(argv[1:]))
    if argv[:1] == ["export"] and "--watch" in argv:
        from graphbuild.server.watch import watch

        sys.exit(watch(argv, use_server))
    if use_server and _served(argv):
        try:
            runtime_dir()
        except OSError as err:
            print(f"warning: no build server ({err}); running in this process", file=sys.stderr)
        else:
            code = run_served(argv)
            if code is not None:
                sys.exit(code)
    run_in_process(argv)
