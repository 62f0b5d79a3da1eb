"""The cache under faults, concurrency and maintenance: never a wrong artifact, never a pickle."""

from __future__ import annotations

import errno
import json
import os
import pickle
import sqlite3
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import graphbuild.cache.byte_store as store_module
from graphbuild.cache import FileBlobs
from graphbuild.cache.local.index import DiskIndex
from graphbuild.engine.artifact_store import Cache
from graphbuild.engine.pipeline import Pipeline
from graphbuild.hashing import digest_bytes
from tests.engine_helpers import CALLS, reset, stage


@pytest.fixture(autouse=True)
def _clean_calls():
    reset()
    yield
    reset()


def model(seed: int = 0, width: int = 16) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 4))


def _weights(m, samples, ctx):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _scaled(inputs, samples, ctx):
    return {k: v * ctx["scale"] for k, v in inputs[0].items()}


def cached_pipeline() -> Pipeline:
    """weights (input.state) -> scaled (ctx.scale): two stages whose outputs are tensors."""
    p = Pipeline(name="cached")
    w = p.register_stage(stage("weights", _weights), "weights", reads=("input.state",))
    p.register_stage(stage("scaled", _scaled), "scaled", reads=("ctx.scale",)).depends_on(w)
    return p


def expected_scaled(m: nn.Module, scale: float) -> dict[str, torch.Tensor]:
    return {k: v.detach() * scale for k, v in m.state_dict().items()}


def assert_tensors_equal(actual: dict, expected: dict) -> None:
    assert set(actual) == set(expected)
    for k in expected:
        assert torch.equal(actual[k], expected[k]), k


def manifest(cache: Cache, key: str) -> dict:
    return cache.index.get_json(f"m:{key}")


def blob_paths(cache: Cache, key: str) -> list:
    parts = manifest(cache, key)["artifact"]["parts"]
    return [cache.blobs.path(digest) for digest, _size in parts]


def db(cache_path) -> sqlite3.Connection:
    return sqlite3.connect(str(cache_path / "index" / "cache.db"))


# --------------------------------------------------------------------------- faults


def test_a_flipped_byte_in_a_blob_is_detected_at_read_counted_and_rebuilt(tmp_path):
    m, p = model(), cached_pipeline()
    cache = Cache(tmp_path / "cache")
    first = p.run(m, context={"scale": 2.0}, cache=cache)
    blob = blob_paths(cache, first.report["weights"].key)[0]
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01
    blob.write_bytes(bytes(data))

    reset()
    result = p.run(m, context={"scale": 3.0}, cache=cache)  # scaled must load weights

    assert_tensors_equal(result.outputs["scaled"], expected_scaled(m, 3.0))
    assert CALLS == ["weights", "scaled"]  # scaled asked for weights, which was rebuilt
    assert result.report["weights"].status == "ran"
    assert "corrupt" in result.report["weights"].reason
    assert cache.stats().corrupt == 1
    assert cache.verify().corrupt == []
    cache.close()


def test_a_truncated_blob_is_a_counted_miss_and_rebuilt(tmp_path):
    m, p = model(), cached_pipeline()
    cache = Cache(tmp_path / "cache")
    first = p.run(m, context={"scale": 2.0}, cache=cache)
    blob = blob_paths(cache, first.report["weights"].key)[0]
    blob.write_bytes(blob.read_bytes()[:-3])

    reset()
    result = p.run(m, context={"scale": 2.0}, cache=cache)

    assert result.report.statuses == {"weights": "ran", "scaled": "cutoff"}
    assert_tensors_equal(result.outputs["scaled"], expected_scaled(m, 2.0))
    assert cache.stats().corrupt == 1
    assert cache.verify().corrupt == []  # the rebuilt blob replaced the truncated one
    assert p.run(m, context={"scale": 2.0}, cache=cache).report.ran == []
    cache.close()


def test_a_deleted_blob_is_a_counted_miss_and_rebuilt(tmp_path):
    m, p = model(), cached_pipeline()
    cache = Cache(tmp_path / "cache")
    first = p.run(m, context={"scale": 2.0}, cache=cache)
    blob_paths(cache, first.report["scaled"].key)[-1].unlink()

    reset()
    result = p.run(m, context={"scale": 2.0}, cache=cache)

    assert result.report.statuses == {"weights": "hit", "scaled": "ran"}
    assert_tensors_equal(result.outputs["scaled"], expected_scaled(m, 2.0))
    assert cache.stats().corrupt == 1
    cache.close()


def test_a_deleted_manifest_is_a_miss_and_rebuilt(tmp_path):
    m, p = model(), cached_pipeline()
    cache = Cache(tmp_path / "cache")
    first = p.run(m, context={"scale": 2.0}, cache=cache)
    cache.close()
    with db(tmp_path / "cache") as conn:
        deleted = conn.execute(
            "DELETE FROM Cache WHERE key = ?", (f"m:{first.report['weights'].key}",)
        ).rowcount
    assert deleted == 1

    reset()
    cache = Cache(tmp_path / "cache")
    result = p.run(m, context={"scale": 2.0}, cache=cache)

    assert result.report.statuses == {"weights": "ran", "scaled": "cutoff"}
    assert result.report["weights"].reason.startswith("no cache entry for this key")
    assert_tensors_equal(result.outputs["scaled"], expected_scaled(m, 2.0))
    assert cache.verify().corrupt == []
    cache.close()


def _many_weights(m, samples, ctx):
    # enough tensors that the manifest outgrows diskcache's 32 KiB file threshold
    return {f"t{i:04d}": torch.full((2,), float(i)) for i in range(400)}


def test_a_large_manifest_is_kept_inside_the_index_database(tmp_path):
    p = Pipeline(name="large")
    p.register_stage(stage("many", _many_weights), "many", reads=())
    cache = Cache(tmp_path / "cache")
    key = p.run(None, cache=cache).report["many"].key
    cache.close()

    with db(tmp_path / "cache") as conn:
        filename, value = conn.execute(
            "SELECT filename, value FROM Cache WHERE key = ?", (f"m:{key}",)
        ).fetchone()
    assert filename is None and len(value) > 2**15  # no value file anyone could swap


def _as_older_graphbuild_wrote_it(cache_dir, key: str) -> str:
    """Rewrite a manifest row as graphbuild before 0.2 stored a large one: in a value file."""
    import diskcache

    from graphbuild.cache.local.index import JsonOnlyDisk

    legacy = diskcache.Cache(
        str(cache_dir / "index"),
        disk=JsonOnlyDisk,
        eviction_policy="none",
        disk_min_file_size=2**15,
    )
    text = legacy.get(f"m:{key}")
    legacy.set(f"m:{key}", text)
    legacy.close()
    with db(cache_dir) as conn:
        (filename,) = conn.execute(
            "SELECT filename FROM Cache WHERE key = ?", (f"m:{key}",)
        ).fetchone()
    assert filename, "the manifest should be stored as a file"
    return filename


@pytest.mark.parametrize("damage", ["delete", "truncate"])
def test_a_large_manifest_file_deleted_or_truncated_is_a_miss_and_rebuilt(tmp_path, damage):
    p = Pipeline(name="large")
    p.register_stage(stage("many", _many_weights), "many", reads=())
    cache = Cache(tmp_path / "cache")
    first = p.run(None, cache=cache)
    cache.close()
    filename = _as_older_graphbuild_wrote_it(tmp_path / "cache", first.report["many"].key)
    reset()
    assert p.run(None, cache=Cache(tmp_path / "cache")).report.ran == []  # still read
    path = tmp_path / "cache" / "index" / filename
    if damage == "delete":
        path.unlink()
    else:
        path.write_text(path.read_text()[:100])

    reset()
    cache = Cache(tmp_path / "cache")
    result = p.run(None, cache=cache)

    assert result.report.ran == ["many"]
    assert result.outputs["many"]["t0399"].tolist() == [399.0, 399.0]
    assert cache.stats().corrupt == (1 if damage == "truncate" else 0)
    assert p.run(None, cache=cache).report.ran == []
    cache.close()


def test_verify_finds_and_removes_a_corrupt_entry(tmp_path):
    m, p = model(), cached_pipeline()
    cache = Cache(tmp_path / "cache")
    first = p.run(m, context={"scale": 2.0}, cache=cache)
    blob = blob_paths(cache, first.report["scaled"].key)[0]
    blob.write_bytes(b"\x00" * blob.stat().st_size)

    report = cache.verify()

    assert len(report.corrupt) == 2  # the blob and the entry naming it
    assert report.removed_entries == 1
    assert cache.verify().corrupt == []
    reset()
    assert p.run(m, context={"scale": 2.0}, cache=cache).report.ran == ["scaled"]
    cache.close()


# --------------------------------------------------------------------------- concurrency

WORKER = """
import json, sys, time
from pathlib import Path

import torch
from torch import nn

from graphbuild.engine.artifact_store import Cache
from graphbuild.engine.pipeline import Pipeline


def weights(m, samples, ctx):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def make_scaled(factor):
    def scaled(inputs, samples, ctx):
        return {k: v * factor for k, v in inputs[0].items()}
    return scaled


def total(inputs, samples, ctx):
    return [float(sum(v.double().sum() for v in d.values())) for d in inputs]


cache_dir, sync, me = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(4)])
p = Pipeline(name="shared")
w = p.register_stage(weights, "weights", reads=("input.state",))
branches = [
    p.register_stage(make_scaled(f), f"scaled{f}", reads=()).depends_on(w) for f in (1, 2, 3)
]
p.register_stage(total, "total", reads=()).depends_on(*branches)

(sync / f"ready-{me}").touch()
deadline = time.time() + 60
while not (sync / "go").exists() and time.time() < deadline:
    time.sleep(0.005)

cache = Cache(cache_dir)
result = p.run(model, cache=cache)
out = {
    "total": result.outputs["total"],
    "digests": {s.name: s.digest for s in result.report.stages},
    "writable": cache.writable,
}
print(json.dumps(out))
"""


def test_four_processes_building_on_one_cache_at_once_agree(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(WORKER))
    sync = tmp_path / "sync"
    sync.mkdir()
    cache_dir = tmp_path / "cache"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(cache_dir), str(sync), str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    deadline = time.time() + 60
    while len(list(sync.glob("ready-*"))) < 4 and time.time() < deadline:
        if any(proc.poll() not in (None, 0) for proc in procs):
            break
        time.sleep(0.01)
    (sync / "go").touch()

    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert "cannot write to the cache" not in err
        results.append(json.loads(out.strip().splitlines()[-1]))

    assert all(r == results[0] for r in results[1:])
    assert results[0]["writable"]
    cache = Cache(cache_dir)
    report = cache.verify()
    assert report.corrupt == []
    assert report.checked_entries == 5
    assert cache.stats().corrupt == 0
    cache.close()


# --------------------------------------------------------------------------- maintenance


class Clock:
    """Stands in for the ``time`` module of graphbuild.cache.byte_store."""

    def __init__(self) -> None:
        self.now = time.time()

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(store_module, "time", SimpleNamespace(time=c.time))
    return c


def weights_only() -> Pipeline:
    p = Pipeline(name="weights")
    p.register_stage(stage("weights", _weights), "weights", reads=("input.state",))
    return p


def test_prune_to_a_size_drops_least_recently_used_entries_first(tmp_path, clock):
    p, a, b = weights_only(), model(seed=0), model(seed=1)
    cache = Cache(tmp_path / "cache")
    key_a = p.run(a, cache=cache).report["weights"].key
    clock.now += 100
    key_b = p.run(b, cache=cache).report["weights"].key
    clock.now += 100
    assert p.run(a, cache=cache).report["weights"].status == "hit"  # a is now the most recent
    size_a = manifest(cache, key_a)["bytes"]
    assert cache.size() == size_a + manifest(cache, key_b)["bytes"]

    report = cache.prune(max_bytes=size_a)

    assert report.removed_entries == 1
    assert [e.key for e in cache.entries()] == [key_a]
    assert cache.size() == size_a
    reset()
    assert p.run(a, cache=cache).report.ran == []
    assert p.run(b, cache=cache).report.ran == ["weights"]
    cache.close()


def test_prune_older_than_drops_entries_unused_for_that_long(tmp_path, clock):
    p, a, b = weights_only(), model(seed=0), model(seed=1)
    cache = Cache(tmp_path / "cache")
    p.run(a, cache=cache)
    clock.now += 1000
    key_b = p.run(b, cache=cache).report["weights"].key

    report = cache.prune(older_than=500)

    assert report.removed_entries == 1
    assert report.removed_blobs > 0
    assert [e.key for e in cache.entries()] == [key_b]
    assert cache.verify().corrupt == []
    cache.close()


def test_gc_removes_only_unreferenced_blobs(tmp_path):
    m, p = model(), cached_pipeline()
    cache = Cache(tmp_path / "cache")
    p.run(m, context={"scale": 2.0}, cache=cache)
    referenced = {d for d, _size, _mtime in cache.blobs.all()}
    orphan = b"no manifest names me"
    cache.blobs.write(digest_bytes(orphan), orphan)

    assert cache.gc().removed_blobs == 0  # the default grace spares fresh blobs
    report = cache.gc(grace=0)

    assert report.removed_blobs == 1
    assert report.freed_bytes == len(orphan)
    assert {d for d, _size, _mtime in cache.blobs.all()} == referenced
    reset()
    result = p.run(m, context={"scale": 2.0}, cache=cache)
    assert result.report.ran == []
    assert_tensors_equal(result.outputs["scaled"], expected_scaled(m, 2.0))
    cache.close()


# --------------------------------------------------------------------------- no pickles


class Payload:
    """Unpickling this creates ``marker``: proof that the cache ran code."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickled_manifest_planted_in_the_index_is_never_executed(tmp_path):
    m, p = model(), cached_pipeline()
    marker = tmp_path / "pwned"
    cache = Cache(tmp_path / "cache")
    key = p.run(m, context={"scale": 2.0}, cache=cache).report["weights"].key
    cache.close()
    with db(tmp_path / "cache") as conn:
        changed = conn.execute(
            "UPDATE Cache SET mode = 4, value = ? WHERE key = ?",
            (sqlite3.Binary(pickle.dumps(Payload(marker))), f"m:{key}"),
        ).rowcount
    assert changed == 1

    reset()
    cache = Cache(tmp_path / "cache")
    result = p.run(m, context={"scale": 2.0}, cache=cache)

    assert result.report.statuses == {"weights": "ran", "scaled": "cutoff"}
    assert_tensors_equal(result.outputs["scaled"], expected_scaled(m, 2.0))
    assert cache.stats().corrupt == 1
    cache.verify()
    cache.gc(grace=0)
    assert not marker.exists()
    cache.close()


def test_pickled_counters_and_explain_records_are_never_executed_and_break_nothing(tmp_path):
    m, p = model(), cached_pipeline()
    marker = tmp_path / "pwned"
    cache = Cache(tmp_path / "cache")
    p.run(m, context={"scale": 2.0}, cache=cache)
    p.run(m, context={"scale": 2.0}, cache=cache)  # creates the hits counter
    cache.close()
    payload = sqlite3.Binary(pickle.dumps(Payload(marker)))
    with db(tmp_path / "cache") as conn:
        changed = conn.execute(
            "UPDATE Cache SET mode = 4, value = ? WHERE key IN (?, ?, ?)",
            (payload, "stat:hits", "stat:misses", "last:cached:weights"),
        ).rowcount
    assert changed == 3

    cache = Cache(tmp_path / "cache")
    before = cache.stats()
    result = p.run(m, context={"scale": 3.0}, cache=cache)

    assert result.report.statuses == {"weights": "hit", "scaled": "ran"}
    assert cache.last_run("cached", "weights")["status"] == "hit"  # rewritten as JSON
    assert before.hits == before.misses == 0
    assert cache.stats().hits == 1 and cache.stats().misses == 1
    assert not marker.exists()
    cache.close()


def test_a_pickled_key_row_planted_in_the_index_is_never_executed(tmp_path):
    m, p = model(), cached_pipeline()
    marker = tmp_path / "pwned"
    cache = Cache(tmp_path / "cache")
    p.run(m, context={"scale": 2.0}, cache=cache)
    cache.close()
    now = time.time()
    with db(tmp_path / "cache") as conn:
        conn.execute(
            "INSERT INTO Cache (key, raw, store_time, expire_time, access_time, access_count,"
            " tag, size, mode, filename, value) VALUES (?, 0, ?, NULL, ?, 0, NULL, 0, 1, NULL, ?)",
            (sqlite3.Binary(pickle.dumps(Payload(marker))), now, now, "{}"),
        )

    reset()
    cache = Cache(tmp_path / "cache")
    result = p.run(m, context={"scale": 2.0}, cache=cache)
    stats = cache.stats()
    entries = cache.entries()
    verify = cache.verify()
    cache.gc(grace=0)
    cache.prune(max_bytes=10**9)

    assert result.report.ran == []
    assert stats.entries == 2
    assert len(entries) == 2
    assert verify.corrupt == []
    assert not marker.exists()
    cache.close()


# --------------------------------------------------------------------------- unwritable cache


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("target", [(FileBlobs, "write"), (DiskIndex, "set_json")])
def test_a_cache_that_cannot_be_written_warns_once_and_the_run_goes_on_uncached(
    tmp_path, monkeypatch, target
):
    # chmod cannot make a directory read-only for root, so the disk "fills up" instead
    monkeypatch.setattr(*target, _no_space)
    m, p = model(), cached_pipeline()
    cache = Cache(tmp_path / "cache")

    with pytest.warns(RuntimeWarning) as caught:
        first = p.run(m, context={"scale": 2.0}, cache=cache)
        second = p.run(m, context={"scale": 2.0}, cache=cache)

    messages = [str(w.message) for w in caught if "cannot write to the cache" in str(w.message)]
    assert len(messages) == 1
    assert "No space left on device" in messages[0]
    assert first.report.ran == second.report.ran == ["weights", "scaled"]
    assert_tensors_equal(second.outputs["scaled"], expected_scaled(m, 2.0))
    assert not cache.writable
    cache.close()
