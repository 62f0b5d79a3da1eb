"""Messages between the client, the server and its processes: a 4-byte length, then JSON;
file descriptors ride along with the first byte (``SCM_RIGHTS``)."""

from __future__ import annotations

import contextlib
import json
import socket
import struct
from typing import Any

__all__ = ["ProtocolError", "receive", "send"]

_HEADER = struct.Struct("!I")
MAX_FDS = 8
MAX_MESSAGE = 64 << 20


class ProtocolError(OSError):
    """The other end closed the connection or sent something that is not a message."""


def send(sock: socket.socket, message: dict[str, Any], fds: list[int] | tuple = ()) -> None:
    data = json.dumps(message).encode()
    frame = _HEADER.pack(len(data)) + data
    if fds:
        sent = socket.send_fds(sock, [frame[:1]], list(fds))
        if sent != 1:
            raise ProtocolError("could not send the file descriptors")
        frame = frame[1:]
    sock.sendall(frame)


def receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One message and the descriptors that came with it; ``ProtocolError`` at EOF."""
    first, fds, _flags, _addr = socket.recv_fds(sock, 1, MAX_FDS)
    if not first:
        for fd in fds:
            _close(fd)
        raise ProtocolError("connection closed")
    head = first + _exactly(sock, _HEADER.size - 1)
    (size,) = _HEADER.unpack(head)
    if size > MAX_MESSAGE:
        raise ProtocolError(f"a message of {size} bytes")
    try:
        return json.loads(_exactly(sock, size)), list(fds)
    except ValueError as err:
        raise ProtocolError(f"not a message: {err}") from err


def _exactly(sock: socket.socket, size: int) -> bytes:
    chunks = []
    while size:
        chunk = sock.recv(size)
        if not chunk:
            raise ProtocolError("connection closed in a message")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _close(fd: int) -> None:
    import os

    with contextlib.suppress(OSError):
        os.close(fd)
