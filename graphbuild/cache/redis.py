"""A shared cache on a Redis server: the action index and the blob store as Redis keys.

Keys, all under ``graphbuild:v1:`` (nothing else on the server is read, listed or removed):

- ``i:<index key>``: one JSON object per index row (``i:m:<stage key>`` a manifest);
- ``b:<digest>``: a blob's header, ``{"size", "chunks", "time"}``, written last;
- ``c:<digest>:<n>``: the blob's bytes in chunks of :data:`CHUNK_SIZE` (4 MiB; a Redis value
  stays far below its 512 MiB limit and a large blob streams in pieces);
- ``u:<token>:<n>``: chunks of an upload in progress, which expire after :data:`STAGE_TTL`.

A blob is uploaded to ``u:`` keys, then published in one MULTI/EXEC that renames its chunks
into place, makes them persistent and writes the header; a manifest is written after every
blob it names is published. A writer killed at any point (kill -9 included) leaves staged
chunks that expire, or published blobs no manifest names (``gc`` collects them): never an
entry a reader accepts. Whatever the server holds is untrusted, as a local cache is: headers
are checked for shape, blobs against their digests, manifests by the cache against their own
digests; anyone with write access to the server can still plant an entry that is consistent
and wrong (README, "Team cache").
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import secrets
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.exceptions

from graphbuild.cache.base import (
    CorruptBlob,
    StoreReadOnly,
    Stores,
    StoreUnavailable,
    check_blob_size,
    checked_blob,
    read_only_error,
)
from graphbuild.cache.names import is_digest
from graphbuild.errors import CacheError
from graphbuild.hashing import Hasher

PREFIX = "graphbuild:v1:"
_INDEX = PREFIX + "i:"
_HEADER = PREFIX + "b:"
_CHUNK = PREFIX + "c:"
_STAGE = PREFIX + "u:"
CHUNK_SIZE = 4 << 20
STAGE_TTL = 6 * 3600
_BATCH = 500
_CHUNK_KEY = re.compile(re.escape(_CHUNK) + r"([0-9a-f]{32}):(\d{1,9})")
_HEADER_KEY = re.compile(re.escape(_HEADER) + r"([0-9a-f]{32})")
_STAGE_KEY = re.compile(re.escape(_STAGE) + r"[0-9a-f]{16}:\d{1,9}")

#: Seconds to wait for a connection and for each answer unless ``$GRAPHBUILD_CACHE_TIMEOUT``
#: (or ``?socket_connect_timeout=``/``?socket_timeout=`` in the URL) says otherwise: a team
#: cache that hangs costs an export a few seconds once, never a minute per question.
TIMEOUT_ENV = "GRAPHBUILD_CACHE_TIMEOUT"
CONNECT_TIMEOUT = 3.0
READ_TIMEOUT = 5.0

F = TypeVar("F", bound=Callable[..., Any])


def redact(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + netloc))


class _Server:
    """One server's client and what this process learnt about it: after a question timed
    out or the connection failed, every later one fails at once, without asking (a server
    that hangs costs one timeout a run)."""

    def __init__(self, client: redis.Redis, location: str):
        self.client = client
        self.location = location
        self.down: str | None = None

    def ask(self) -> redis.Redis:
        if self.down is not None:
            raise StoreUnavailable(
                f"the shared cache at {self.location}: {self.down}; not asked again"
            )
        return self.client

    def failed(self, err: redis.exceptions.RedisError) -> StoreUnavailable:
        """The error to raise for ``err``; a lost connection or a timeout marks the server
        down for the rest of the process's run."""
        if isinstance(err, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
            self.down = _why(err)
        return StoreUnavailable(f"the shared cache at {self.location}: {_why(err)}")


def _why(err: redis.exceptions.RedisError) -> str:
    if isinstance(err, redis.exceptions.TimeoutError):
        return f"no answer in time (timed out; ${TIMEOUT_ENV} sets the seconds to wait)"
    return str(err) or type(err).__name__


def _asks(*, write: bool = False) -> Callable[[F], F]:
    """Server, network and permission errors leave the stores as StoreUnavailable (an
    OSError); a write this user may not make (an ACL that allows reads only) as
    StoreReadOnly; a key of the wrong type planted where the store reads is handled where it
    is read, as damage."""

    def decorate(method: F) -> F:
        @functools.wraps(method)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            self.server.ask()
            try:
                return method(self, *args, **kwargs)
            except redis.exceptions.NoPermissionError as err:
                if write:
                    raise StoreReadOnly(
                        f"the shared cache at {self.location} lets this user read, not write "
                        f"({err})"
                    ) from err
                raise self.server.failed(err) from err
            except redis.exceptions.RedisError as err:
                raise self.server.failed(err) from err

        return wrapper  # type: ignore[return-value]

    return decorate


def _glob(text: str) -> str:
    """``text`` with Redis glob characters escaped."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


class RedisIndex:
    """The action index on a Redis server: one string key per row, counters as integers."""

    def __init__(self, server: _Server, *, readonly: bool = False):
        self.server = server
        self.client = server.client
        self.location = server.location
        self.readonly = readonly

    def _writable(self) -> None:
        if self.readonly:
            raise read_only_error(self.location)

    @_asks()
    def get_json(self, key: str) -> dict[str, Any] | None:
        try:
            raw = self.client.get(_INDEX + key)
        except redis.exceptions.NoPermissionError:
            raise
        except redis.exceptions.ResponseError as err:  # a planted key of another type
            raise ValueError(f"index row {key}: {err}") from err
        if raw is None:
            return None
        data = json.loads(raw.decode("utf-8"))
        if type(data) is not dict:
            raise ValueError(f"index row {key} is not a JSON object")
        return data

    @_asks(write=True)
    def set_json(self, key: str, value: dict[str, Any]) -> None:
        self._writable()
        self.client.set(_INDEX + key, json.dumps(value, sort_keys=True))

    @_asks(write=True)
    def delete(self, key: str) -> bool:
        self._writable()
        return bool(self.client.delete(_INDEX + key))

    @_asks()
    def keys(self, prefix: str) -> Iterator[str]:
        found = []
        for raw in self.client.scan_iter(match=_glob(_INDEX + prefix) + "*", count=1000):
            try:
                found.append(raw.decode("utf-8")[len(_INDEX) :])
            except UnicodeDecodeError:
                continue
        return iter(found)

    @_asks(write=True)
    def incr(self, counter: str, delta: int = 1) -> None:
        self._writable()
        try:
            self.client.incrby(_INDEX + f"stat:{counter}", delta)
        except redis.exceptions.ResponseError:  # not a number (planted): restart
            self.client.set(_INDEX + f"stat:{counter}", delta)

    def counter(self, counter: str) -> int:
        try:
            raw = self.server.ask().get(_INDEX + f"stat:{counter}")
            value = int(raw) if raw is not None else 0
        except redis.exceptions.RedisError as err:
            self.server.failed(err)
            return 0
        except (StoreUnavailable, ValueError):
            return 0
        return value if abs(value) < 2**62 else 0

    @_asks(write=True)
    def clear(self) -> None:
        self._writable()
        _delete_matching(self.client, _glob(_INDEX) + "*", lambda _key: True)

    def close(self) -> None:
        self.client.close()


class RedisBlobs:
    """The blob store on a Redis server: a header per blob, its bytes in chunks."""

    def __init__(self, server: _Server, *, readonly: bool = False):
        self.server = server
        self.client = server.client
        self.location = server.location
        self.readonly = readonly

    def _header(self, digest: str) -> tuple[int, int, float] | None:
        """(size, chunks, time) from the header; None when absent or not one we write."""
        try:
            raw = self.client.get(_HEADER + digest)
        except redis.exceptions.ResponseError:
            return None
        return _parse_header(raw)

    @_asks()
    def has(self, digest: str, size: int) -> bool:
        if not is_digest(digest):
            return False
        header = self._header(digest)
        if header is None or header[0] != size:
            return False
        chunks = header[1]
        return chunks == 0 or self.client.exists(*_chunk_keys(digest, chunks)) == chunks

    @_asks(write=True)
    def write(self, digest: str, data: bytes | bytearray | memoryview) -> bool:
        if not is_digest(digest):
            raise ValueError(f"not a blob digest: {str(digest)[:80]!r}")
        if self.readonly:
            raise read_only_error(self.location)
        view = memoryview(data).cast("B")
        if self.has(digest, view.nbytes):
            return False
        token = secrets.token_hex(8)
        count = math.ceil(view.nbytes / CHUNK_SIZE)
        staged = [f"{_STAGE}{token}:{n}" for n in range(count)]
        for n, key in enumerate(staged):  # a kill -9 here leaves keys that expire
            self.client.set(key, bytes(view[n * CHUNK_SIZE : (n + 1) * CHUNK_SIZE]), ex=STAGE_TTL)
        header = json.dumps({"size": view.nbytes, "chunks": count, "time": time.time()})
        with self.client.pipeline(transaction=True) as tx:
            for key, final in zip(staged, _chunk_keys(digest, count), strict=True):
                tx.rename(key, final)
                tx.persist(final)
            tx.set(_HEADER + digest, header)
            results = tx.execute(raise_on_error=False)
        if any(isinstance(r, Exception) for r in results):  # a staged chunk expired meanwhile
            self.client.delete(_HEADER + digest)
            raise StoreUnavailable(f"the shared cache at {self.location}: upload of a blob failed")
        return True

    @_asks()
    def read(self, digest: str, size: int | None = None) -> bytes:
        """The blob's bytes, checked against its digest. Each chunk is read bounded
        (``GETRANGE``) and checked for the length its place says before the next is asked
        for: a planted header or chunk cannot make the reader hold more than the size the
        header and the manifest agree on, and a size this machine could not hold is refused
        before any byte is read."""
        if not is_digest(digest):
            raise CorruptBlob(str(digest), "is not a digest (32 lowercase hex digits)")
        header = self._header(digest)
        if header is None:
            raise CorruptBlob(digest, f"is not on the shared cache at {self.location}")
        length, chunks, _ = header
        if size is not None and length != size:
            raise CorruptBlob(digest, f"has {length} bytes, expected {size}")
        check_blob_size(digest, length)
        out: list[bytes] = []
        keys = _chunk_keys(digest, chunks)
        for start in range(0, chunks, 8):  # 32 MiB a round trip
            with self.client.pipeline(transaction=False) as batch:
                for key in keys[start : start + 8]:
                    batch.getrange(key, 0, CHUNK_SIZE)  # at most CHUNK_SIZE + 1 bytes
                parts = batch.execute(raise_on_error=False)
            for n, part in enumerate(parts, start):
                expected = min(CHUNK_SIZE, length - n * CHUNK_SIZE)
                if isinstance(part, redis.exceptions.ConnectionError):
                    raise part
                if not isinstance(part, bytes) or len(part) != expected:
                    raise CorruptBlob(digest, f"has chunk {n} missing or of the wrong size")
                out.append(part)
        return checked_blob(digest, b"".join(out), length)

    @_asks()
    def verify(self, digest: str) -> bool:
        """True when the blob is there whole and matches its digest; False for a blob that
        is missing or damaged; StoreUnavailable when the server cannot tell."""
        if not is_digest(digest):
            return False
        header = self._header(digest)
        if header is None:
            return False
        h = Hasher()
        try:
            for key in _chunk_keys(digest, header[1]):
                chunk = self.client.get(key)
                if chunk is None:
                    return False
                h.update(chunk)
        except redis.exceptions.ResponseError:  # a planted key of another type
            return False
        return h.hexdigest() == digest

    def delete(self, digest: str) -> int | None:
        if not is_digest(digest) or self.readonly or self.server.down is not None:
            return None
        try:
            raw = self.client.get(_HEADER + digest)
        except redis.exceptions.RedisError as err:
            self.server.failed(err)
            return None
        if raw is None:
            return None
        header = _parse_header(raw)
        size, chunks = (header[0], header[1]) if header else (0, 0)
        try:
            with self.client.pipeline(transaction=True) as tx:
                tx.delete(_HEADER + digest, *_chunk_keys(digest, chunks))
                tx.execute()
        except redis.exceptions.RedisError as err:
            self.server.failed(err)
            return None
        return size

    @_asks()
    def all(self) -> Iterator[tuple[str, int, float]]:
        found = []
        keys = [
            k
            for k in (
                _decode(raw) for raw in self.client.scan_iter(match=_HEADER + "*", count=1000)
            )
            if k and _HEADER_KEY.fullmatch(k)
        ]
        for start in range(0, len(keys), _BATCH):
            batch = keys[start : start + _BATCH]
            for key, raw in zip(batch, _mget(self.client, batch), strict=True):
                header = _parse_header(raw)
                if header is not None:
                    found.append((key[len(_HEADER) :], header[0], header[2]))
        return iter(found)

    @_asks(write=True)
    def sweep(self, older_than: float) -> int:
        """Remove published chunks no header names (an interrupted delete); staged chunks
        expire by themselves."""
        if self.readonly:
            return 0
        headers = {d for d, _, _ in self.all()}

        def orphan(key: str) -> bool:
            match = _CHUNK_KEY.fullmatch(key)
            return match is not None and match.group(1) not in headers

        return _delete_matching(self.client, _glob(_CHUNK) + "*", orphan)

    @_asks(write=True)
    def clear(self) -> tuple[int, int]:
        if self.readonly:
            raise read_only_error(self.location)
        blobs = list(self.all())
        _delete_matching(
            self.client, _glob(_HEADER) + "*", lambda k: bool(_HEADER_KEY.fullmatch(k))
        )
        _delete_matching(self.client, _glob(_CHUNK) + "*", lambda k: bool(_CHUNK_KEY.fullmatch(k)))
        _delete_matching(self.client, _glob(_STAGE) + "*", lambda k: bool(_STAGE_KEY.fullmatch(k)))
        return len(blobs), sum(s for _, s, _ in blobs)

    def close(self) -> None:
        self.client.close()


def _chunk_keys(digest: str, chunks: int) -> list[str]:
    return [f"{_CHUNK}{digest}:{n}" for n in range(chunks)]


def _decode(raw: bytes) -> str | None:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _mget(client: redis.Redis, keys: list[str]) -> list[Any]:
    """MGET that reads a key of another type as absent."""
    try:
        return client.mget(keys)
    except redis.exceptions.ResponseError:
        return [None] * len(keys)


def _parse_header(raw: Any) -> tuple[int, int, float] | None:
    """A header as the store writes it, or None: sizes are counts, the chunk count is what
    the size needs in chunks of at most :data:`CHUNK_SIZE` (a header cannot make the reader
    fetch more than the size says)."""
    if raw is None:
        return None
    try:
        header = json.loads(raw)
    except (ValueError, TypeError):
        return None
    if type(header) is not dict:
        return None
    size, chunks, when = header.get("size"), header.get("chunks"), header.get("time", 0.0)
    if type(size) is not int or type(chunks) is not int or size < 0 or chunks < 0:
        return None
    if chunks < math.ceil(size / CHUNK_SIZE) or chunks > max(1, size) or chunks > 10**6:
        return None
    if type(when) not in (int, float) or not math.isfinite(when):
        return None
    return size, chunks, float(when)


def _delete_matching(client: redis.Redis, pattern: str, keep: Callable[[str], bool]) -> int:
    """Delete every key matching ``pattern`` for which ``keep(key)`` says it is ours."""
    removed = 0
    batch: list[str] = []
    for raw in client.scan_iter(match=pattern, count=1000):
        key = _decode(raw)
        if key is not None and keep(key):
            batch.append(key)
        if len(batch) >= _BATCH:
            removed += client.delete(*batch)
            batch = []
    if batch:
        removed += client.delete(*batch)
    return removed


def timeouts() -> tuple[float, float]:
    """(connect, read) seconds: ``$GRAPHBUILD_CACHE_TIMEOUT`` for both, else the defaults."""
    text = os.environ.get(TIMEOUT_ENV)
    if not text:
        return CONNECT_TIMEOUT, READ_TIMEOUT
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise CacheError(f"${TIMEOUT_ENV} must be a number of seconds above 0, got {text!r}")
    return seconds, seconds


def open_redis(url: str, *, readonly: bool = False) -> Stores:
    """The stores on the Redis server at ``url`` (``redis://host:port/db``, ``rediss://``
    or ``unix:///path.sock``); StoreUnavailable when it cannot be reached, does not answer
    in time (:func:`timeouts`) or refuses the credentials: a team cache is an optimisation,
    and a server in any of those states is one this run does without."""
    location = redact(url)
    connect, read = timeouts()
    try:
        client = redis.Redis.from_url(
            url, socket_timeout=read, socket_connect_timeout=connect, health_check_interval=30
        )
    except ValueError as err:
        raise CacheError(f"not a Redis URL: {location} ({err})") from err
    try:
        client.ping()
    except redis.exceptions.AuthenticationError as err:
        client.close()
        raise StoreUnavailable(
            f"the shared cache at {location} refused the credentials ({err}); check the user "
            "and password in the URL"
        ) from err
    except redis.exceptions.RedisError as err:
        client.close()
        raise StoreUnavailable(f"cannot reach the shared cache at {location}: {_why(err)}") from err
    except OSError as err:
        client.close()
        raise StoreUnavailable(f"cannot reach the shared cache at {location}: {err}") from err
    server = _Server(client, location)
    return Stores(
        index=RedisIndex(server, readonly=readonly),
        blobs=RedisBlobs(server, readonly=readonly),
        location=location,
        readonly=readonly,
    )
