"""``graphbuild server status|stop [--json]``: what the build server of this user and
environment is doing, and stopping it. Neither starts one."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from graphbuild.server.client import connect, connect_quietly
from graphbuild.server.paths import socket_path
from graphbuild.server.protocol import ProtocolError, receive, send

__all__ = ["server_command"]

USAGE = "usage: graphbuild server status|stop [--json]"


def _ask(path: Path, op: str) -> dict[str, Any] | None:
    """The server's answer to ``op``; None when none is running (or it exited, idle,
    before answering)."""
    sock = connect(path)
    if sock is None:
        return None
    with sock:
        try:
            send(sock, {"op": op})
            return receive(sock)[0]
        except (OSError, ProtocolError):
            return None


def server_command(argv: list[str]) -> int:
    as_json = "--json" in argv
    words = [a for a in argv if a != "--json"]
    if words in (["--help"], ["-h"]):
        print(USAGE + "\n\n" + (__doc__ or "").strip())
        return 0
    if words not in (["status"], ["stop"]):
        print(USAGE, file=sys.stderr)
        return 2
    try:
        path = socket_path()
    except OSError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    reply = _ask(path, words[0])
    if reply is None:
        if as_json:
            print(json.dumps({"running": False, "socket": str(path)}))
        else:
            print(f"no build server is running (its socket would be {path})")
        return 0
    if words == ["stop"]:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and connect_quietly(path):
            time.sleep(0.05)
        if as_json:
            print(json.dumps({"running": False, "stopped": reply.get("pid")}))
        else:
            print(f"stopped the build server (pid {reply.get('pid')})")
        return 0
    if as_json:
        print(json.dumps({"running": True, **reply}))
        return 0
    print(
        f"build server pid {reply['pid']}, up {reply['uptime_seconds']:.0f} s, "
        f"{reply['commands']} commands, exits after {reply['idle_timeout_seconds']:.0f} s idle"
    )
    print(f"  socket  {reply['socket']}")
    for project in reply["projects"]:
        state = "running a command" if project["running"] else "idle"
        print(
            f"  project {project['cwd']} (pid {project['pid']}, {project['commands']} commands, {state})"
        )
    return 0
