"""A request process: one command run as the in-process command line would run it, in a
process forked from its project process, with the client's stdin, stdout and stderr, working
directory, environment and arguments.

Its model comes from the project's memo (:mod:`~graphbuild.server.memo`) when a valid entry
is there; otherwise (the first attempt) it hands the config to the project process, which
builds and keeps the model and forks the request again, and exits with :data:`REBUILD`. A
second attempt that still finds no valid entry (the build failed, or reads a file that
changes every time) builds in-process, so a failing factory reports as it does without a
server.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import io
import json
import os
import pickle
import select
import signal
import socket
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any, NoReturn

from graphbuild.server import memo
from graphbuild.server.protocol import send
from graphbuild.server.warm import computed

__all__ = ["REBUILD", "cli_command", "install_loader", "run_request", "watch_client"]

#: The exit status of a request process that asks its project process to build the model.
REBUILD = 75


def _write_watch_report(cfg: Any, entry: memo.Entry) -> None:
    """With ``GRAPHBUILD_WATCH_REPORT`` set, the files ``export --watch`` watches: the config
    file, the project's sources and every file the model's build read."""
    target = os.environ.get("GRAPHBUILD_WATCH_REPORT")
    if not target:
        return
    files = {p: "read by the model's build" for p in entry.reads}
    files.update({p: "source" for p in entry.sources})
    if cfg.source is not None:
        files[str(cfg.source)] = "configuration"
    with open(target, "w", encoding="utf-8") as out:
        json.dump({"files": files}, out)


def install_loader(handoff: Any = None, env: dict[str, str] | None = None) -> None:
    """Set :data:`graphbuild.config.settings.model_loader`: a valid memo entry is used; else
    ``handoff(cfg)`` (a request's first attempt) passes the build on, or the model is built
    here, recording its reads. ``env`` is the client's environment (the memo key's; the
    command line sets variables of its own), else this process's."""
    from graphbuild.config import settings

    def loader(cfg: Any, build: Any) -> Any:
        entry = memo.MEMO.get(memo.memo_key(cfg, env))
        if entry is None or entry.changed():
            if handoff is not None:
                handoff(cfg)
            entry = memo.build_recorded(cfg, build)
        _write_watch_report(cfg, entry)
        return entry.value

    settings.model_loader = loader


def _client_gone(conn: socket.socket) -> bool:
    """Whether the client closed its end (it died or was killed): the connection reads EOF
    (a client sends nothing after its request)."""
    try:
        return conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


@contextlib.contextmanager
def watch_client(conn_fd: int, interval: float = 0.2) -> Iterator[None]:
    """While in the block, a thread polls the client's connection and interrupts this
    process (``SIGINT``: a ``KeyboardInterrupt`` in the main thread) when the client is gone,
    so that a killed client (``SIGKILL`` included) does not leave its command running and
    later placing files. A ``KeyboardInterrupt`` may still arrive as the block ends: the
    caller catches it."""
    conn = socket.socket(fileno=os.dup(conn_fd))
    stop = threading.Event()

    def poll() -> None:
        poller = select.poll()
        poller.register(conn.fileno(), select.POLLIN | select.POLLHUP | select.POLLERR)
        while not stop.is_set():
            if poller.poll(interval * 1000) and _client_gone(conn) and not stop.is_set():
                os.kill(os.getpid(), signal.SIGINT)
                return

    watcher = threading.Thread(target=poll, name="graphbuild-client-watch", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        stop.set()
        watcher.join()
        conn.close()


def _stdio(fds: list[int], encoding: str) -> None:
    for fd, target in zip(fds, (0, 1, 2), strict=True):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "rb", closefd=False), encoding=encoding)
    for name, fd in (("stdout", 1), ("stderr", 2)):
        stream = io.TextIOWrapper(
            io.FileIO(fd, "wb", closefd=False),
            encoding=encoding,
            errors="backslashreplace",
            line_buffering=os.isatty(fd) or fd == 2,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def run_request(
    request: dict[str, Any], fds: list[int], notes: int, attempt: int, threads: int
) -> NoReturn:
    """Run ``request`` (``argv``, ``cwd``, ``env``) and exit; never returns. ``fds`` are the
    client's connection, stdin, stdout and stderr; ``notes`` a pipe to the project process
    (a JSON line per note: ``build``, ``imported``)."""
    conn = socket.socket(fileno=fds[0])
    code = 1
    born: frozenset[str] = frozenset(sys.modules)
    try:
        send(conn, {"pid": os.getpid()})
        _stdio(fds[1:], request.get("encoding") or "utf-8")
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["graphbuild", *request["argv"]]
        _threads(threads)
        warnings.resetwarnings()

        def handoff(cfg: Any) -> None:
            if attempt == 1:
                data = base64.b64encode(pickle.dumps(cfg)).decode()
                os.write(notes, (json.dumps({"build": data}) + "\n").encode())
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(REBUILD)

        install_loader(handoff, dict(request["env"]))
        with watch_client(fds[0]):
            code = _run_cli()
    except BaseException as err:  # a failure of the server itself: say so, exit 1
        print(f"error: graphbuild's build server failed: {err!r}", file=sys.stderr)
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
    with contextlib.suppress(OSError):
        send(conn, {"exit": code})
        conn.close()  # the client is done; what follows is for the next command
    with contextlib.suppress(OSError):  # its pipes see EOF now, not after the notes
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
    with contextlib.suppress(Exception):
        _note_imports(notes, born)
        _note(notes, {"closures": computed(), "used": memo.MEMO.used})
    os._exit(0)


@functools.cache
def cli_command() -> Any:
    """The command line's Click command, made once (the server makes it before forking:
    Typer reads every command's signature and type hints to make it)."""
    import typer.main

    from graphbuild.cli.app import app

    return typer.main.get_command(app)


def _run_cli() -> int:
    """What ``graphbuild.cli.main`` does, with the command made once."""
    from graphbuild.cli.app import quiet_libraries

    quiet_libraries()
    try:
        cli_command().main(args=sys.argv[1:], prog_name="graphbuild")
    except SystemExit as done:
        if done.code is None:
            return 0
        return done.code if isinstance(done.code, int) else 1
    except KeyboardInterrupt:
        return 130
    return 0


def _threads(threads: int) -> None:
    """The project process ran torch on one thread (an OpenMP pool does not survive a fork);
    the request gets the client's ``OMP_NUM_THREADS`` or torch's own default."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    try:
        wanted = int(os.environ.get("OMP_NUM_THREADS", "") or threads)
    except ValueError:
        wanted = threads
    torch.set_num_threads(max(1, wanted))


def _note_imports(notes: int, born: frozenset[str]) -> None:
    """Tell the project process which installed libraries and graphbuild modules this
    command imported, so it (and the server) import them before the next command."""
    names = []
    for name in set(sys.modules) - born:
        where = getattr(sys.modules.get(name), "__file__", None)
        if where and (memo._library(where) or memo._own(where)):
            names.append(name)
    if names:
        _note(notes, {"imported": sorted(names)})


def _note(notes: int, note: dict[str, Any]) -> None:
    with contextlib.suppress(OSError, TypeError, ValueError):
        os.write(notes, (json.dumps(note) + "\n").encode())
