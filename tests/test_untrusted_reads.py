"""What a cache holds is untrusted (docs/design.md, invariant 11): nothing read from it blocks, no
read holds more than the manifest says the blob is, and ``cache verify`` checks every kind
of record the store keeps, exiting 1 when it found one corrupt."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import graphbuild as gb
from graphbuild.cache import base
from graphbuild.cache.base import CorruptBlob
from graphbuild.cache.local import FileBlobs
from graphbuild.cache.local.fs import Dir
from graphbuild.cli.app import app
from graphbuild.engine import closure
from graphbuild.engine.artifact_store import Cache
from graphbuild.engine.pipeline import Pipeline
from graphbuild.hashing import digest_bytes
from tests.engine_helpers import CALLS, reset, stage
from tests.models import FakeQuantConvNet

SAMPLE = (torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(3)),)


# --------------------------------------------------------------------------- no blocking


def _doubled(inputs, samples, context):
    return {k: v * 2 for k, v in inputs.state_dict().items()}


def doubling_pipeline() -> Pipeline:
    p = Pipeline(name="fifo")
    p.register_stage(stage("doubled", _doubled), "doubled", reads=("input.state",))
    return p


def test_a_fifo_where_a_blob_belongs_blocks_no_export_with_a_shared_cache(redis_url, tmp_path):
    model = torch.nn.Linear(64, 64)
    doubling_pipeline().run(model, cache=Cache(tmp_path / "ci", url=redis_url))
    consumer = Cache(tmp_path / "dev", url=redis_url)
    local = consumer.stores.local.blobs
    fifos = []
    for digest, _, _ in Cache.remote(redis_url).blobs.all():
        path = local.path(digest)
        path.parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(path)  # planted where the local copy of a shared blob would be
        fifos.append(path)
    reset()
    done: list[dict] = []

    def run() -> None:
        done.append(doubling_pipeline().run(model, cache=consumer).outputs["doubled"])

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=120)
    for path in fifos:  # a reader still blocked in open() gets its writer and goes on
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            continue

    assert not worker.is_alive(), "reading the cache blocked on a FIFO"
    assert CALLS == []  # the shared cache's copy served the hit
    torch.testing.assert_close(done[0]["weight"], model.weight * 2)


# --------------------------------------------------------------------------- bounded reads


@pytest.fixture
def blob(tmp_path) -> tuple[FileBlobs, str, bytes]:
    blobs = FileBlobs(tmp_path / "cache" / "blobs")
    (tmp_path / "cache").mkdir()
    data = os.urandom(1 << 20)
    digest = digest_bytes(data)
    blobs.write(digest, data)
    return blobs, digest, data


@pytest.fixture
def file_reads(monkeypatch) -> list[str]:
    seen: list[str] = []
    real = Dir.read_bytes
    monkeypatch.setattr(
        Dir, "read_bytes", lambda self, name, *a: seen.append(name) or real(self, name, *a)
    )
    return seen


def test_a_blob_claiming_more_bytes_than_the_machine_holds_is_refused_unread(
    blob, file_reads, monkeypatch
):
    blobs, digest, data = blob
    monkeypatch.setattr(base, "_memory_bytes", lambda: len(data) // 2)

    with pytest.raises(CorruptBlob, match="more than this machine's memory"):
        blobs.read(digest, len(data))
    assert file_reads == []


def test_a_blob_file_of_another_size_than_its_manifest_says_is_not_read(blob):
    blobs, digest, data = blob

    with pytest.raises(CorruptBlob, match=f"has {len(data)} bytes, expected 10"):
        blobs.read(digest, 10)


def _sent(client) -> int:
    return int(client.info("stats")["total_net_output_bytes"])


def test_a_shared_blob_with_an_oversized_chunk_is_refused_without_fetching_it(redis_url):
    import redis

    from graphbuild.cache.redis import CHUNK_SIZE, open_redis

    stores = open_redis(redis_url)
    data = os.urandom(2 * CHUNK_SIZE + 100)
    digest = digest_bytes(data)
    stores.blobs.write(digest, data)
    client = redis.Redis.from_url(redis_url)
    client.set(f"graphbuild:v1:c:{digest}:0", b"\0" * (64 << 20))  # planted: 64 MiB
    before = _sent(client)

    with pytest.raises(CorruptBlob, match="chunk 0"):
        stores.blobs.read(digest, len(data))
    assert _sent(client) - before < 3 * CHUNK_SIZE  # never the planted 64 MiB


def test_a_shared_blob_whose_header_claims_a_huge_size_is_refused_unread(redis_url):
    import redis

    from graphbuild.cache.redis import CHUNK_SIZE, open_redis

    stores = open_redis(redis_url)
    digest = "ab" * 16
    size = 1 << 41  # 2 TiB, in as many 4 MiB chunks as that takes: a well-formed header
    header = {"size": size, "chunks": size // CHUNK_SIZE, "time": 0.0}
    client = redis.Redis.from_url(redis_url)
    client.set(f"graphbuild:v1:b:{digest}", json.dumps(header))
    before = _sent(client)

    with pytest.raises(CorruptBlob, match="more than this machine's memory"):
        stores.blobs.read(digest, size)
    assert _sent(client) - before < 4096


# --------------------------------------------------------------------------- cache verify


@pytest.fixture
def exported(tmp_path) -> Path:
    """A cache after one export in a new process: manifests, explain records, a placement
    stamp, the source summaries it parsed."""
    closure.forget()
    torch.manual_seed(0)
    gb.export(FakeQuantConvNet().eval(), SAMPLE, tmp_path / "out", "net", cache=tmp_path / "c")
    return tmp_path / "c"


def _verify(cache_dir: Path, *flags: str) -> tuple[int, dict]:
    result = CliRunner().invoke(
        app, ["cache", "verify", "--json", "--cache-dir", str(cache_dir), *flags]
    )
    return result.exit_code, json.loads(result.stdout)


def test_cache_verify_checks_every_kind_of_record_and_exits_1_on_corruption(exported, tmp_path):
    cache = Cache(exported)
    index = cache.stores.index
    (stamp_key,) = index.keys("placed:")
    stamp = index.get_json(stamp_key)
    planted = {}
    for name, change in {
        "passwd": lambda f: f.update(name="/etc/passwd"),
        "parent": lambda f: f.update(name="../secret.onnx"),
        "range": lambda f: f.update(ranges=[[2**62, 16, "0" * 32]]),
    }.items():
        bad = json.loads(json.dumps(stamp))
        change(bad["files"][0][1])
        planted[f"placed:planted-{name}"] = bad
    last_key = next(iter(index.keys("last:")))
    planted[last_key] = {**index.get_json(last_key), "reads": "not a table"}
    memo_key = next(iter(index.keys("memo:")))
    planted[memo_key] = {**index.get_json(memo_key), "value": {"forged": True}}
    for key, value in planted.items():
        index.set_json(key, value)
    cache.close()

    code, report = _verify(exported, "--no-repair")
    assert code == 1
    found = sorted(c.split(" ")[1] for c in report["corrupt"])
    assert found == sorted(planted) and report["checked_records"] > len(planted)

    code, report = _verify(exported)
    assert code == 1 and len(report["corrupt"]) == len(planted)
    code, report = _verify(exported)
    assert code == 0 and report["corrupt"] == []
    gb.export(FakeQuantConvNet().eval(), SAMPLE, tmp_path / "out", "net", cache=exported)
    assert _verify(exported)[0] == 0
