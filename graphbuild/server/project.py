"""A project process: forked from the server for one working directory and ``sys.path``; it
runs that project's commands one after another, each in a request process of its own
(:mod:`~graphbuild.server.request`), and keeps the models they built
(:data:`graphbuild.server.memo.MEMO`).

Torch runs on one thread here: an OpenMP thread pool started before a fork leaves the forked
process hanging at its first parallel region, so the project process builds models on one
thread and its request processes set their own thread count.
"""

from __future__ import annotations

import base64
import contextlib
import gc
import importlib
import json
import os
import pickle
import select
import socket
import sys
import warnings
from collections.abc import Iterator
from typing import Any, NoReturn

from graphbuild.server import memo
from graphbuild.server.paths import idle_seconds
from graphbuild.server.protocol import ProtocolError, receive, send
from graphbuild.server.request import REBUILD, run_request, watch_client
from graphbuild.server.warm import recompute

__all__ = ["run_project"]


def run_project(control: socket.socket, threads: int) -> NoReturn:
    """Serve the requests the server sends over ``control`` until it closes; never returns.
    Idle for a third of the server's idle time, it drops its models. A request that finds the project's sources edited goes back to the server (``stale``),
    which starts a fresh project process for it."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
    idle = idle_seconds() / 3
    born = frozenset(sys.modules)
    sources: dict[str, str] = {}
    while True:
        if memo.MEMO and not select.select([control], [], [], idle)[0]:
            memo.MEMO.clear()  # idle: its models' memory goes back (the next build rebuilds)
            gc.collect()
        try:
            request, fds = receive(control)
        except (ProtocolError, OSError):
            os._exit(0)
        if any(memo.digest(path) != d for path, d in sources.items()):
            send(control, {"op": "stale", "request": request}, fds)
            os._exit(0)
        imported: set[str] = set()
        closures: list[list[Any]] = []
        try:
            _serve(request, fds, control, threads, imported, closures)
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        _import(imported)
        recompute(closures)  # the next request starts with the closures this one computed
        _remember_sources(sources, born)
        try:
            send(control, {"op": "done", "imported": sorted(imported)})
        except OSError:
            os._exit(0)


def _remember_sources(sources: dict[str, str], born: frozenset[str]) -> None:
    """Add the digests of the project's modules this process imported since: as the model's
    build found them where it recorded them (right after the build), else as they are now.
    A digest once taken is kept, so an edit made while a command ran still makes the next
    one find this process stale."""
    for entry in memo.MEMO.values():
        for path, digest in entry.sources.items():
            sources.setdefault(path, digest)
    fresh = [p for p in memo.project_sources(born).values() if p not in sources]
    for path, digest in memo.digests(fresh).items():
        sources.setdefault(path, digest)


def _serve(
    request: dict[str, Any],
    fds: list[int],
    control: socket.socket,
    threads: int,
    imported: set,
    closures: list,
) -> None:
    for attempt in (1, 2):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            control.close()
            run_request(request, fds, write_end, attempt, threads)
        os.close(write_end)
        with os.fdopen(read_end, "rb") as notes_file:
            notes = [json.loads(line) for line in notes_file if line.strip()]
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        for note in notes:
            for key in note.get("used", ()):
                memo.MEMO.touch(key)
            imported.update(note.get("imported", ()))
            closures.extend(note.get("closures", ()))
        build = next((n["build"] for n in notes if "build" in n), None)
        if code == REBUILD and build is not None and attempt == 1:
            _build(pickle.loads(base64.b64decode(build)), request, fds)
            continue
        if code != 0:
            _crashed(fds[0], code)
        return


def _crashed(conn_fd: int, code: int) -> None:
    how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
    with contextlib.suppress(OSError), socket.socket(fileno=os.dup(conn_fd)) as conn:
        send(conn, {"error": f"the command's process {how}", "exit": 1})


@contextlib.contextmanager
def _as_client(request: dict[str, Any], fds: list[int]) -> Iterator[None]:
    """The client's working directory, environment and stdout/stderr, for a build."""
    saved = [os.dup(1), os.dup(2)]
    environ = dict(os.environ)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os.dup2(fds[2], 1)
    os.dup2(fds[3], 2)
    try:
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in saved:
            os.close(fd)
        os.environ.clear()
        os.environ.update(environ)


def _build(cfg: Any, request: dict[str, Any], fds: list[int]) -> None:
    """Build ``cfg``'s model here and keep it; a failure keeps nothing (the request's second
    attempt builds it again and reports the error as the command line does). A client that
    goes away interrupts the build (:func:`~graphbuild.server.request.watch_client`)."""
    key = None
    try:
        with watch_client(fds[0]), _as_client(request, fds), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            key = memo.memo_key(cfg, request["env"])
            memo.MEMO.pop(key)
            memo.MEMO.put(key, memo.build_recorded(cfg, cfg.build_model))
    except BaseException:  # the user's factory: anything may fail; the request reports it
        if key is not None:
            memo.MEMO.pop(key)


def _import(names: set[str]) -> None:
    """Import what the last command imported, so the next one finds it imported."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in sorted(names):
            if name not in sys.modules:
                with contextlib.suppress(BaseException):
                    importlib.import_module(name)
