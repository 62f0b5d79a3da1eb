"""What every cache backend promises (graphbuild/cache/base.py), checked on each of them: the
local directory, a real Redis server, and the two layered. A new backend joins ``BACKENDS``.

Each backend comes with a way to plant what a hostile writer could put there (a row that is
not JSON, bytes that do not match their name), since whatever a store returns is untrusted.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from graphbuild.cache import ActionIndex, BlobStore, CorruptBlob, Stores
from graphbuild.cache.local import open_local
from graphbuild.engine.artifact_store import Cache
from graphbuild.engine.pipeline import Pipeline
from graphbuild.hashing import digest_bytes
from tests.engine_helpers import CALLS, reset, stage
from tests.redis_server import RedisServer

BACKENDS = ["local", "redis", "layered"]
BIG = 9 << 20  # more than two of the Redis backend's 4 MiB chunks


@dataclass
class Backend:
    """A backend's stores, and how to plant a row or a blob behind the store's back."""

    stores: Stores
    plant_row: Callable[[str, str], None]
    plant_blob: Callable[[str, bytes], None]
    layered: bool = False

    @property
    def index(self) -> ActionIndex:
        assert self.stores.index is not None
        return self.stores.index

    @property
    def blobs(self) -> BlobStore:
        return self.stores.blobs


def _plant_local_row(root: Path) -> Callable[[str, str], None]:
    def plant(key: str, text: str) -> None:
        with sqlite3.connect(str(root / "index" / "cache.db")) as conn:
            conn.execute(
                "INSERT OR REPLACE INTO Cache (key, raw, store_time, expire_time, access_time,"
                " access_count, tag, size, mode, filename, value)"
                " VALUES (?, 1, 0, NULL, 0, 0, NULL, 0, 1, NULL, ?)",
                (key, text),
            )

    return plant


def _plant_local_blob(root: Path) -> Callable[[str, bytes], None]:
    def plant(digest: str, data: bytes) -> None:
        path = root / "blobs" / digest[:2] / digest[2:]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    return plant


def _plant_redis_row(url: str) -> Callable[[str, str], None]:
    import redis

    def plant(key: str, text: str) -> None:
        redis.Redis.from_url(url).set(f"graphbuild:v1:i:{key}", text)

    return plant


def _plant_redis_blob(url: str) -> Callable[[str, bytes], None]:
    import redis

    def plant(digest: str, data: bytes) -> None:
        client = redis.Redis.from_url(url)
        client.set(f"graphbuild:v1:c:{digest}:0", data)
        client.set(f"graphbuild:v1:b:{digest}", json.dumps({"size": len(data), "chunks": 1}))

    return plant


@pytest.fixture(params=BACKENDS)
def backend(request, tmp_path) -> Iterator[Backend]:
    kind = request.param
    if kind == "local":
        yield Backend(
            open_local(tmp_path / "c"), _plant_local_row(tmp_path / "c"),
            _plant_local_blob(tmp_path / "c"),
        )  # fmt: skip
        return
    from graphbuild.cache.layered import layered
    from graphbuild.cache.redis import open_redis

    with RedisServer() as url:
        remote = open_redis(url)
        stores = remote if kind == "redis" else layered(open_local(tmp_path / "c"), remote)
        # layered: a hostile writer plants in the shared cache, which the local one trusts no more
        yield Backend(
            stores, _plant_redis_row(url), _plant_redis_blob(url), layered=kind == "layered"
        )
        stores.close()


def blob(text: str) -> tuple[str, bytes]:
    data = text.encode()
    return digest_bytes(data), data


# --------------------------------------------------------------------------- the index


def test_the_index_satisfies_the_protocol(backend):
    assert isinstance(backend.index, ActionIndex)
    assert isinstance(backend.blobs, BlobStore)


def test_a_row_written_is_read_back_and_an_absent_one_is_none(backend):
    backend.index.set_json("m:k1", {"a": [1, 2], "b": "x"})

    assert backend.index.get_json("m:k1") == {"a": [1, 2], "b": "x"}
    assert backend.index.get_json("m:absent") is None


@pytest.mark.parametrize("text", ["garbage", "[1, 2]", '"a string"', "{"])
def test_a_row_that_is_not_a_json_object_is_a_value_error(backend, text):
    backend.plant_row("m:planted", text)

    with pytest.raises(ValueError):
        backend.index.get_json("m:planted")


def test_delete_says_whether_the_row_was_there(backend):
    backend.index.set_json("m:k1", {"a": 1})

    assert backend.index.delete("m:k1") is True
    assert backend.index.delete("m:k1") is False
    assert backend.index.get_json("m:k1") is None


def test_keys_lists_the_rows_under_a_prefix_only(backend):
    for key in ("m:a", "m:b", "last:x", "m*literal"):
        backend.index.set_json(key, {})

    assert sorted(backend.index.keys("m:")) == ["m:a", "m:b"]
    assert sorted(backend.index.keys("m*")) == ["m*literal"]  # a glob character is a character


def test_counters_count_and_a_planted_one_reads_as_zero(backend):
    backend.index.incr("hits")
    backend.index.incr("hits", 4)
    backend.plant_row("stat:misses", "not a number")

    assert backend.index.counter("hits") == 5
    assert backend.index.counter("misses") == 0
    assert backend.index.counter("never") == 0


def test_clear_removes_every_row(backend):
    backend.index.set_json("m:a", {})
    backend.index.incr("hits")
    backend.index.clear()

    assert list(backend.index.keys("")) == []
    assert backend.index.counter("hits") == 0


# --------------------------------------------------------------------------- the blob store


def test_a_blob_written_is_read_back_checked(backend):
    digest, data = blob("hello, team")

    assert backend.blobs.write(digest, data) is True
    assert backend.blobs.write(digest, data) is False  # content-addressed: once is enough
    assert backend.blobs.has(digest, len(data))
    assert not backend.blobs.has(digest, len(data) + 1)
    assert backend.blobs.read(digest, len(data)) == data
    assert backend.blobs.verify(digest)


def test_a_large_blob_round_trips_in_chunks(backend):
    data = torch.arange(BIG // 4, dtype=torch.int32).numpy().tobytes()
    digest = digest_bytes(data)
    backend.blobs.write(digest, memoryview(data))

    assert backend.blobs.read(digest, len(data)) == data
    assert (digest, len(data)) in {(d, s) for d, s, _ in backend.blobs.all()}


def test_an_absent_blob_is_a_corrupt_blob_on_read(backend):
    digest, data = blob("never written")

    assert not backend.blobs.has(digest, len(data))
    with pytest.raises(CorruptBlob):
        backend.blobs.read(digest)
    assert backend.blobs.delete(digest) is None


@pytest.mark.parametrize("name", ["../../etc/passwd", "A" * 32, "0" * 31, "0" * 32 + "\n", ""])
def test_a_name_that_is_not_a_digest_is_refused_everywhere(backend, name):
    assert not backend.blobs.has(name, 0)
    assert not backend.blobs.verify(name)
    assert backend.blobs.delete(name) is None
    with pytest.raises(CorruptBlob):
        backend.blobs.read(name)
    with pytest.raises(ValueError):
        backend.blobs.write(name, b"x")


def test_planted_bytes_that_do_not_match_their_name_are_never_returned(backend):
    digest, data = blob("the real bytes")
    backend.plant_blob(digest, b"other bytes!!!")

    with pytest.raises(CorruptBlob, match="does not match"):
        backend.blobs.read(digest)
    assert not backend.blobs.verify(digest)


def test_delete_frees_what_was_there_once(backend):
    digest, data = blob("short-lived")
    backend.blobs.write(digest, data)

    assert backend.blobs.delete(digest) == len(data)
    assert backend.blobs.delete(digest) is None
    assert not backend.blobs.has(digest, len(data))


def test_clear_removes_every_blob(backend):
    written = [blob(f"blob {i}") for i in range(3)]
    for digest, data in written:
        backend.blobs.write(digest, data)

    removed, freed = backend.blobs.clear()

    assert (removed, freed) == (3, sum(len(d) for _, d in written))
    assert list(backend.blobs.all()) == []


def test_sweep_keeps_finished_blobs(backend):
    digest, data = blob("finished")
    backend.blobs.write(digest, data)
    backend.blobs.sweep(older_than=float("inf"))

    assert backend.blobs.read(digest) == data


# --------------------------------------------------------------------------- leases


def test_a_lease_is_held_by_one_owner_at_a_time(backend):
    assert backend.index.acquire_lease("k1", "alice", 30.0) is True
    assert backend.index.acquire_lease("k1", "bob", 30.0) is False
    assert backend.index.lease_holder("k1") == "alice"
    assert backend.index.lease_holder("k2") is None


def test_only_the_owner_renews_or_releases_a_lease(backend):
    backend.index.acquire_lease("k1", "alice", 30.0)

    assert backend.index.renew_lease("k1", "bob", 30.0) is False
    assert backend.index.release_lease("k1", "bob") is False
    assert backend.index.lease_holder("k1") == "alice"
    assert backend.index.release_lease("k1", "alice") is True
    assert backend.index.release_lease("k1", "alice") is False
    assert backend.index.acquire_lease("k1", "bob", 30.0) is True


def test_a_lease_nobody_renews_expires_and_another_owner_takes_it(backend):
    backend.index.acquire_lease("k1", "dead holder", 0.3)
    time.sleep(0.5)

    assert backend.index.lease_holder("k1") is None
    assert backend.index.renew_lease("k1", "dead holder", 30.0) is False
    assert backend.index.acquire_lease("k1", "bob", 30.0) is True
    assert backend.index.release_lease("k1", "dead holder") is False  # bob's stays
    assert backend.index.lease_holder("k1") == "bob"


def test_a_renewed_lease_outlives_its_first_time(backend):
    backend.index.acquire_lease("k1", "alice", 0.4)
    time.sleep(0.25)
    assert backend.index.renew_lease("k1", "alice", 2.0) is True
    time.sleep(0.4)

    assert backend.index.lease_holder("k1") == "alice"
    assert backend.index.acquire_lease("k1", "bob", 30.0) is False


def test_of_owners_asking_at_the_same_moment_exactly_one_gets_the_lease(backend):
    barrier = threading.Barrier(8)

    def ask(owner: str) -> bool:
        barrier.wait()
        return backend.index.acquire_lease("contended", owner, 30.0)

    with ThreadPoolExecutor(8) as pool:
        taken = list(pool.map(ask, [f"owner{i}" for i in range(8)]))

    assert taken.count(True) == 1
    assert backend.index.lease_holder("contended") == f"owner{taken.index(True)}"


def test_a_planted_lease_row_is_no_holder(backend):
    backend.plant_row("lease:k1", "not json")

    assert backend.index.lease_holder("k1") is None
    assert backend.index.renew_lease("k1", "alice", 30.0) is False


def test_a_cache_lease_is_renewed_while_held_and_free_once_released(backend):
    cache = Cache.over(backend.stores)
    cache.lease_seconds = 0.3
    lease = cache.try_lease("k" * 32)
    assert lease is not None and lease.held
    time.sleep(0.7)  # more than twice its time: only renewal keeps it

    assert cache.try_lease("k" * 32) is None
    assert cache.lease_holder("k" * 32) == lease.owner
    lease.release()
    assert cache.lease_holder("k" * 32) is None
    with cache.try_lease("k" * 32) as again:
        assert again.held


# --------------------------------------------------------------------------- a cache over them


def _weights(m, samples, ctx):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _total(inputs, samples, ctx):
    return float(sum(v.double().sum() for v in inputs[0].values()))


def pipeline() -> Pipeline:
    p = Pipeline(name="contract")
    w = p.register_stage(stage("weights", _weights), "weights", reads=("input.state",))
    p.register_stage(stage("total", _total), "total", reads=()).depends_on(w)
    return p


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))


def test_a_cache_over_the_stores_hits_on_the_second_run(backend):
    cache = Cache.over(backend.stores)
    m, p = model(), pipeline()
    reset()
    first = p.run(m, cache=cache).outputs["total"]
    reset()
    second = p.run(m, cache=cache)

    assert CALLS == []
    assert second.outputs["total"] == first
    assert cache.verify(repair=False).corrupt == []


def test_a_cache_over_the_stores_rebuilds_a_tampered_manifest(backend):
    cache = Cache.over(backend.stores)
    m, p = model(), pipeline()
    key = p.run(m, cache=cache).report["total"].key
    manifest = backend.index.get_json(f"m:{key}")
    manifest["artifact"]["meta"] = {"planted": True}  # the digest no longer matches
    backend.plant_row(f"m:{key}", json.dumps(manifest))
    if backend.layered:
        backend.index.local.delete(f"m:{key}")  # so that the shared copy is the one read

    reset()
    p.run(m, cache=cache)

    assert CALLS == ["total"]
    assert cache.stats().corrupt == 1
