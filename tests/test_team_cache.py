"""A team cache on Redis: writers killed mid-push publish nothing a reader accepts, concurrent
writers agree, a server that refuses us, lets us only read or never answers costs an export
nothing but a warning, and ``graphbuild cache`` looks after the server (two clones, users and
Python builds sharing one: ``tests/test_team_sharing.py``).

Every test starts its own ``redis-server`` on a free loopback port and skips, saying why,
where it is not installed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import types
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

from graphbuild.cli.app import app
from graphbuild.engine.artifact_store import Cache
from graphbuild.engine.pipeline import Pipeline
from tests.engine_helpers import CALLS, reset, stage
from tests.redis_server import RedisServer

ROOT = Path(__file__).resolve().parents[1]
DECODER = ROOT / "examples" / "tiny_decoder.py"
STAGE_KEYS = "graphbuild:v1:u:*"


def client(url: str):
    import redis

    return redis.Redis.from_url(url)


# --------------------------------------------------------------------------- pipelines


def _weights(m, samples, ctx):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _scaled(factor: float):
    def scaled(inputs, samples, ctx):
        return {k: v * factor for k, v in inputs[0].items()}

    return scaled


def _total(inputs, samples, ctx):
    return [float(sum(v.double().sum() for v in d.values())) for d in inputs]


def shared_pipeline() -> Pipeline:
    """weights -> three scaled copies -> total: five entries, large blobs included."""
    p = Pipeline(name="shared")
    w = p.register_stage(stage("weights", _weights), "weights", reads=("input.state",))
    branches = [
        p.register_stage(stage(f"scaled{f}", _scaled(f)), f"scaled{f}", reads=()).depends_on(w)
        for f in (1.0, 2.0, 3.0)
    ]
    p.register_stage(stage("total", _total), "total", reads=()).depends_on(*branches)
    return p


def big_model() -> nn.Module:
    """One 12 MiB weight: four of the Redis backend's 4 MiB chunks."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2048, 1536, bias=False))


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


# --------------------------------------------------------------------------- two clones


def write_config(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "graphbuild.toml"
    config.write_text(
        textwrap.dedent(
            f"""\
            model = "{DECODER.as_posix()}:build"
            calibration = "{DECODER.as_posix()}:calibration"
            model_name = "tiny"
            output_dir = "out"

            [quantization]
            preset = "w8a16"
            """
        )
    )
    return config


def statuses(doc: dict) -> dict[str, str]:
    return {s["name"]: s["status"] for s in doc["stages"]}


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def export_clone(clone: Path, url: str, *extra: str) -> dict:
    """``graphbuild export`` in a clone of its own: own directory, own local cache."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAPHBUILD_")}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-m", "graphbuild", "export", "--config", str(clone / "graphbuild.toml"),
         "--cache-dir", str(clone / "cache"), "--cache-url", url, "--json", *extra],
        capture_output=True, text=True, env=env, cwd=clone, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.fixture(scope="module")
def team(tmp_path_factory):
    """One server, and a first clone that exported the tiny decoder through it (cold)."""
    with RedisServer() as url:
        root = tmp_path_factory.mktemp("team")
        first = root / "alice"
        write_config(first)
        doc = export_clone(first, url)
        assert set(statuses(doc).values()) == {"ran"}
        yield url, root, first, len(statuses(doc))


def test_cache_commands_work_on_the_shared_cache(team, tmp_path):
    url, _, first, stages = team

    def run(*args: str) -> dict:
        result = CliRunner().invoke(app, ["cache", *args, "--cache-url", url, "--json"])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    stats = run("stats")
    entries = run("ls")["entries"]
    verify = run("verify", "--no-repair")

    assert stats["entries"] == len(entries) == stages and stats["blobs"] > 0  # one per stage
    assert {e["stage"] for e in entries} >= {"capture", "to_onnx", "bind", "encodings", "coverage"}
    assert stats["path"] == url
    assert verify["corrupt"] == [] and verify["checked_entries"] == stages
    local = CliRunner().invoke(
        app, ["cache", "stats", "--json", "--cache-dir", str(first / "cache")]
    )
    assert json.loads(local.stdout)["entries"] == stages  # the local cache is another cache


def test_cache_verify_on_the_shared_cache_finds_and_removes_a_corrupt_blob(redis_url, tmp_path):
    cache = Cache(tmp_path / "local", url=redis_url)
    shared_pipeline().run(small_model(), cache=cache)
    r = client(redis_url)
    chunk = sorted(r.scan_iter(match="graphbuild:v1:c:*"))[0]
    r.set(chunk, b"\x00" + r.get(chunk)[1:])

    result = CliRunner().invoke(app, ["cache", "verify", "--cache-url", redis_url, "--json"])

    doc = json.loads(result.stdout)
    assert result.exit_code == 1, result.output  # it found corruption
    assert doc["removed_blobs"] == 1 and doc["removed_entries"] >= 1
    assert any(c.startswith("blob ") for c in doc["corrupt"])
    assert Cache.remote(redis_url).verify(repair=False).corrupt == []


def test_cache_prune_and_gc_on_the_shared_cache(redis_url, tmp_path):
    cache = Cache(tmp_path / "local", url=redis_url)
    shared_pipeline().run(small_model(), cache=cache)
    remote = Cache.remote(redis_url)
    assert len(remote.entries()) == 5

    pruned = CliRunner().invoke(
        app, ["cache", "prune", "--max-size", "0", "--cache-url", redis_url, "--json"]
    )

    assert pruned.exit_code == 0, pruned.output
    assert json.loads(pruned.stdout)["removed_entries"] == 5
    assert remote.entries() == [] and list(remote.blobs.all()) == []
    assert len(Cache(tmp_path / "local").entries()) == 5  # only the shared cache was pruned


def test_cache_clean_needs_an_explicit_url_to_touch_the_shared_cache(
    redis_url, tmp_path, monkeypatch
):
    cache = Cache(tmp_path / "local", url=redis_url)
    shared_pipeline().run(small_model(), cache=cache)
    monkeypatch.setenv("GRAPHBUILD_CACHE_URL", redis_url)

    result = CliRunner().invoke(app, ["cache", "clean", "--cache-dir", str(tmp_path / "local")])

    assert result.exit_code == 0, result.output
    assert len(Cache.remote(redis_url).entries()) == 5


# --------------------------------------------------------------------------- consumers


def test_a_read_only_consumer_reads_hits_and_writes_nothing(redis_url, tmp_path):
    shared_pipeline().run(small_model(), cache=Cache(tmp_path / "ci", url=redis_url))
    keys_before = sorted(client(redis_url).scan_iter())

    reset()
    consumer = Cache(tmp_path / "dev", url=redis_url, remote_readonly=True)
    shared_pipeline().run(small_model(), cache=consumer)
    reset()
    other = shared_pipeline()
    other.register_stage(stage("extra", _total), "extra", reads=()).depends_on("weights")
    other.run(small_model(), cache=consumer)  # a new stage: built, kept locally only

    assert CALLS == ["extra"]
    assert sorted(client(redis_url).scan_iter()) == keys_before


def test_an_unreachable_shared_cache_warns_once_and_the_run_goes_on_locally(tmp_path):
    with RedisServer() as url:
        pass  # the server is gone: nothing listens on its port now

    with pytest.warns(RuntimeWarning, match="going on with the local cache") as caught:
        cache = Cache(tmp_path / "local", url=url)
        shared_pipeline().run(small_model(), cache=cache)
    reset()
    shared_pipeline().run(small_model(), cache=Cache(tmp_path / "local"))

    assert len([w for w in caught if "local cache" in str(w.message)]) == 1
    assert CALLS == []  # the local cache kept everything


def test_a_shared_cache_lost_mid_run_warns_once_and_the_run_goes_on(tmp_path):
    server = RedisServer()
    url = server.__enter__()
    cache = Cache(tmp_path / "local", url=url)
    server.__exit__(None, None, None)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = shared_pipeline().run(small_model(), cache=cache)

    assert result.report.ran == ["weights", "scaled1.0", "scaled2.0", "scaled3.0", "total"]
    assert len([w for w in caught if "cannot be used" in str(w.message)]) == 1
    assert cache.writable


# --------------------------------------------------------------------------- writers


WRITER = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[1])
local, url, mode, signal_file = sys.argv[2], sys.argv[3], sys.argv[4], Path(sys.argv[5])

import redis
from graphbuild.engine.artifact_store import Cache
from graphbuild.cache.redis import RedisIndex
from tests.test_team_cache import big_model, shared_pipeline, small_model

def stop_here():
    signal_file.touch()
    time.sleep(600)  # the test kills us with SIGKILL

if mode == "mid-upload":  # inside a blob's upload: its second chunk is staged
    real_set = redis.Redis.set
    def staged(self, name, value, *args, **kwargs):
        out = real_set(self, name, value, *args, **kwargs)
        if str(name).startswith("graphbuild:v1:u:") and str(name).endswith(":1"):
            stop_here()
        return out
    redis.Redis.set = staged
elif mode == "before-manifest":  # every blob published, no manifest yet
    real_json = RedisIndex.set_json
    def manifest(self, key, value):
        if key.startswith("m:"):
            stop_here()
        return real_json(self, key, value)
    RedisIndex.set_json = manifest
elif mode == "sync":  # start together with the others
    while not signal_file.exists():
        time.sleep(0.005)

model = big_model() if mode != "sync" else small_model()
cache = Cache(local, url=url)
if mode != "sync":  # a killed writer's leases lapse soon: the reader waits that long first
    cache.lease_seconds = 2.0
result = shared_pipeline().run(model, cache=cache)
print(json.dumps({"total": result.outputs["total"],
                  "digests": {s.name: s.digest for s in result.report.stages}}))
"""


def start_writer(tmp_path: Path, url: str, mode: str, name: str) -> tuple[subprocess.Popen, Path]:
    script = tmp_path / "writer.py"
    script.write_text(textwrap.dedent(WRITER))
    signal_file = tmp_path / f"{name}.signal"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(ROOT), str(tmp_path / name), url, mode, str(signal_file)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    return proc, signal_file


@pytest.mark.parametrize("moment", ["mid-upload", "before-manifest"])
def test_a_writer_killed_mid_push_leaves_no_entry_a_reader_accepts(redis_url, tmp_path, moment):
    proc, stopped = start_writer(tmp_path, redis_url, moment, "writer")
    deadline = time.time() + 300
    while not stopped.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    assert stopped.exists(), proc.communicate()[1][-3000:]
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    remote = Cache.remote(redis_url)
    assert remote.entries() == []
    assert remote.verify(repair=False).corrupt == []
    reset()
    reader = shared_pipeline().run(big_model(), cache=Cache(tmp_path / "reader", url=redis_url))
    assert CALLS == ["weights", "scaled1.0", "scaled2.0", "scaled3.0", "total"]
    assert reader.outputs["total"][0] == pytest.approx(
        float(big_model()[0].weight.detach().double().sum())
    )
    r = client(redis_url)
    staged = list(r.scan_iter(match=STAGE_KEYS))
    assert all(r.ttl(k) > 0 for k in staged)  # an interrupted upload expires by itself
    if moment == "mid-upload":
        assert staged


def test_published_blobs_no_manifest_names_are_collected(redis_url, tmp_path):
    proc, stopped = start_writer(tmp_path, redis_url, "before-manifest", "writer")
    deadline = time.time() + 300
    while not stopped.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    remote = Cache.remote(redis_url)
    assert list(remote.blobs.all())

    report = remote.gc(grace=0)

    assert report.removed_blobs > 0 and list(remote.blobs.all()) == []
    assert list(client(redis_url).scan_iter(match="graphbuild:v1:c:*")) == []


def test_four_writers_sharing_one_server_agree(redis_url, tmp_path):
    procs = [start_writer(tmp_path, redis_url, "sync", f"w{i}")[0] for i in range(4)]
    time.sleep(0.5)
    for i in range(4):
        (tmp_path / f"w{i}.signal").touch()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        assert "cannot" not in err, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))

    assert all(r == results[0] for r in results[1:])
    remote = Cache.remote(redis_url)
    assert remote.verify(repair=False).corrupt == []
    assert len(remote.entries()) == 5
    reset()
    shared_pipeline().run(small_model(), cache=Cache(tmp_path / "late", url=redis_url))
    assert CALLS == []


def _reader_url(redis_url: str) -> str:
    """A user whose ACL lets it read every key and write none."""
    client(redis_url).acl_setuser(
        "reader", enabled=True, passwords=["+secret"], keys=["*"],
        commands=["+@read", "+@connection", "-@write"],
    )  # fmt: skip
    return redis_url.replace("redis://", "redis://reader:secret@")


@pytest.mark.parametrize("age", [0, 3600], ids=["fresh entries", "entries an hour old"])
def test_a_reader_whose_acl_forbids_writes_is_a_reader(redis_url, tmp_path, monkeypatch, age):
    shared_pipeline().run(small_model(), cache=Cache(tmp_path / "ci", url=redis_url))
    reader_url = _reader_url(redis_url)
    keys_before = sorted(client(redis_url).scan_iter())
    clock = time.time
    monkeypatch.setattr(
        "graphbuild.cache.byte_store.time", types.SimpleNamespace(time=lambda: clock() + age)
    )

    reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        consumer = Cache(tmp_path / "dev", url=reader_url)  # no --cache-readonly
        other = shared_pipeline()
        other.register_stage(stage("extra", _total), "extra", reads=()).depends_on("weights")
        other.run(small_model(), cache=consumer)

    assert CALLS == ["extra"]  # hits from the server however old; the new stage built
    assert sorted(client(redis_url).scan_iter()) == keys_before
    shown = [str(w.message) for w in caught if "shared cache" in str(w.message)]
    assert len(shown) == 1 and "read" in shown[0] and "secret" not in shown[0], shown
    assert consumer.writable  # the local cache took the result


@pytest.mark.parametrize("how", ["a wrong password", "no password", "an unknown user"])
def test_a_server_that_refuses_our_credentials_warns_and_the_run_goes_on_locally(tmp_path, how):
    with RedisServer(password="s3cret") as url:
        given = {
            "a wrong password": url.replace(":s3cret@", ":wrong@"),
            "no password": url.replace(":s3cret@", ""),
            "an unknown user": url.replace("://:s3cret@", "://nobody:s3cret@"),
        }[how]
        reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = shared_pipeline().run(small_model(), cache=Cache(tmp_path / "l", url=given))
        written = client(url).dbsize()

    assert result.report.ran == ["weights", "scaled1.0", "scaled2.0", "scaled3.0", "total"]
    shown = [str(w.message) for w in caught if "shared cache" in str(w.message)]
    assert len(shown) == 1 and "127.0.0.1" in shown[0], shown
    assert "s3cret" not in shown[0] and "wrong" not in shown[0]
    assert written == 0
    reset()
    shared_pipeline().run(small_model(), cache=Cache(tmp_path / "l"))
    assert CALLS == []  # the local cache kept everything


@pytest.fixture
def silent_server(monkeypatch):
    """A real server, paused: it accepts connections and never answers. Timeouts of 1 s."""
    monkeypatch.setenv("GRAPHBUILD_CACHE_TIMEOUT", "1")
    server = RedisServer()
    with server as url:
        yield server, url


def test_a_server_that_never_answers_costs_one_timeout_and_the_run_goes_on(silent_server, tmp_path):
    server, url = silent_server
    server.pause()
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = shared_pipeline().run(small_model(), cache=Cache(tmp_path / "l", url=url))

    assert time.monotonic() - start < 15  # a 1 s timeout, not a minute per question
    assert result.report.ran == ["weights", "scaled1.0", "scaled2.0", "scaled3.0", "total"]
    assert len([w for w in caught if "shared cache" in str(w.message)]) == 1


def test_after_one_timeout_a_run_stops_asking_the_server(silent_server, tmp_path, monkeypatch):
    import redis.connection

    server, url = silent_server
    shared_pipeline().run(small_model(), cache=Cache(tmp_path / "ci", url=url))
    cache = Cache(tmp_path / "l", url=url)  # the server answered when the run began
    server.pause()
    asked: list[object] = []
    real = redis.connection.AbstractConnection.send_packed_command
    monkeypatch.setattr(
        redis.connection.AbstractConnection,
        "send_packed_command",
        lambda self, *a, **k: asked.append(a) or real(self, *a, **k),
    )
    start = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = shared_pipeline().run(small_model(), cache=cache)

    assert result.report.ran == ["weights", "scaled1.0", "scaled2.0", "scaled3.0", "total"]
    assert len(asked) == 1  # the question that timed out, and no other
    assert time.monotonic() - start < 15
    assert len([w for w in caught if "cannot be used" in str(w.message)]) == 1


def test_cache_stats_on_a_server_that_never_answers_fails_in_seconds_with_a_sentence(
    silent_server,
):
    server, url = silent_server
    server.pause()
    start = time.monotonic()

    result = CliRunner().invoke(app, ["cache", "stats", "--cache-url", url])

    assert time.monotonic() - start < 15
    assert result.exit_code == 2, result.output
    assert "shared cache at redis://127.0.0.1" in result.output and "timed out" in result.output


def test_the_default_timeouts_are_a_few_seconds(redis_url, monkeypatch):
    from graphbuild.cache.redis import open_redis

    monkeypatch.delenv("GRAPHBUILD_CACHE_TIMEOUT", raising=False)
    stores = open_redis(redis_url)
    options = stores.index.client.connection_pool.connection_kwargs
    stores.close()

    assert 1 <= options["socket_connect_timeout"] <= 5
    assert 1 <= options["socket_timeout"] <= 10


def test_a_size_limit_prunes_the_local_cache_never_the_shared_one(redis_url, tmp_path):
    shared_pipeline().run(small_model(), cache=Cache(tmp_path / "ci", url=redis_url))
    entries = len(Cache.remote(redis_url).entries())

    limited = Cache(tmp_path / "dev", size_limit=0, url=redis_url)
    shared_pipeline().run(small_model(), cache=limited)

    assert len(Cache.remote(redis_url).entries()) == entries == 5
    assert Cache(tmp_path / "dev").size() == 0
