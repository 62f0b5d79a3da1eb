"""In-flight deduplication: processes that need the same stage key at the same moment build
it once; the others wait for its entry. A holder that dies blocks nobody beyond its lease's
time; a cache that cannot hold leases builds as before.

The contract each backend keeps (one holder at a time, expiry, renewal) is in
tests/test_cache_contract.py; these tests are about the scheduler using it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from graphbuild.cache.leases import owner_pid
from graphbuild.engine.artifact_store import Cache
from graphbuild.engine.events import EventKind
from graphbuild.engine.pipeline import Pipeline
from graphbuild.engine.plan import plan
from graphbuild.engine.status import StageStatus
from tests.engine_helpers import CALLS, Recorder, reset, stage

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "lease_worker.py"


def _answer(inputs, samples, ctx):
    return {"answer": 42}


def _plus_one(inputs, samples, ctx):
    return {"answer": inputs[0]["answer"] + 1}


def pipeline() -> Pipeline:
    p = Pipeline(name="leases")
    first = p.register_stage(stage("answer", _answer), "answer", reads=())
    p.register_stage(stage("plus_one", _plus_one), "plus_one", reads=()).depends_on(first)
    return p


def _two_processes_at_once(tmp_path: Path, cache_args: list[list[str]]) -> list[dict]:
    log, go = tmp_path / "ran.log", tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), *args, str(log), str(go)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for args in cache_args
    ]
    time.sleep(0.5)
    go.touch()  # both are imported and waiting: they ask for the key together
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    docs = [json.loads(out.strip().splitlines()[-1]) for out in outs]
    docs.append({"builders": log.read_text().split()})
    return docs


def test_two_processes_needing_one_key_at_once_build_it_once(tmp_path):
    *results, log = _two_processes_at_once(tmp_path, [[str(tmp_path / "c")]] * 2)

    assert len(log["builders"]) == 1
    assert sorted(r["status"] for r in results) == ["hit", "ran"]
    waited = next(r for r in results if r["status"] == "hit")
    assert waited["reason"].startswith("built by ") and "while this run waited" in waited["reason"]


def test_two_machines_sharing_a_redis_cache_build_a_key_once(tmp_path, redis_url):
    machines = [[str(tmp_path / "local-a"), redis_url], [str(tmp_path / "local-b"), redis_url]]

    *results, log = _two_processes_at_once(tmp_path, machines)

    assert len(log["builders"]) == 1
    assert sorted(r["status"] for r in results) == ["hit", "ran"]


def test_a_dead_holder_blocks_a_run_only_until_its_lease_expires(tmp_path):
    cache = Cache(tmp_path / "c")
    p = pipeline()
    key = plan(p, None, (), context={}, cache=cache)["answer"].key
    dead = "gone-host:999999:0000"
    assert cache.stores.index.acquire_lease(key, dead, 1.0)  # its holder never returns
    events = Recorder()
    reset()

    t0 = time.perf_counter()
    report = p.run(None, cache=cache, listeners=[events]).report
    waited = time.perf_counter() - t0

    assert report.statuses == {"answer": StageStatus.RAN, "plus_one": StageStatus.RAN}
    assert CALLS == ["answer", "plus_one"]
    assert events.of(EventKind.WAITING) == ["answer"]
    assert 0.8 < waited < 10
    assert cache.lease_holder(key) is None  # released once the entry was written


def test_the_lease_on_a_key_is_held_while_its_stage_runs_and_released_after(tmp_path):
    cache = Cache(tmp_path / "c")
    watched: dict[str, str | None] = {}

    def watch(inputs, samples, ctx):
        watched["holder"] = cache.lease_holder(watched["key"])
        return {"answer": 1}

    p = Pipeline(name="watched")
    p.register_stage(watch, "watch", reads=(), version="1")  # a fixed version: no closure key
    watched["key"] = plan(p, None, (), context={}, cache=cache)["watch"].key

    p.run(None, cache=cache)

    assert owner_pid(watched["holder"]) == (os.uname().nodename, os.getpid())
    assert cache.lease_holder(watched["key"]) is None


def test_a_read_only_cache_builds_without_a_lease(tmp_path):
    Cache(tmp_path / "c")  # created, then opened read-only
    cache = Cache(tmp_path / "c", readonly=True)
    with pytest.raises(OSError):
        cache.stores.index.acquire_lease("k", "me", 30.0)
    reset()

    report = pipeline().run(None, cache=cache).report

    assert report.statuses == {"answer": StageStatus.RAN, "plus_one": StageStatus.RAN}
    assert not cache.try_lease("k").held
