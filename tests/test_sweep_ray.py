"""The issue's sweep: nine variants of the tiny decoder (three presets x three calibration
sets) trace once and convert to ONNX once, in this process and on a local Ray cluster of two
nodes (one worker each, its own local cache) sharing one Redis; a worker killed in the middle
of a stage is retried by Ray and the files are byte for byte those of the local sweep.

Slow: the Ray cluster takes 10-20 s to start, and the nine-variant sweeps a minute or two
each on two loaded cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import graphbuild as gb
from tests.ray_cluster import ROOT, RayCluster, kill_a_worker_holding_a_lease, require_ray
from tests.sweep_helpers import write_config

pytestmark = pytest.mark.slow

NINE = {
    "quantization.preset": ["w8a16", "w8a8", "w4a16"],
    "calibration": ["default", "large", "narrow"],
}
LEASE_SECONDS = 3  # how long the killed worker's lease keeps its retry waiting
FILES = ("tiny_decoder.onnx", "tiny_decoder.encodings")


@pytest.fixture(scope="module")
def local_sweep(tmp_path_factory):
    """The nine variants swept in this process, with a cache of their own."""
    root = tmp_path_factory.mktemp("local")
    config = write_config(root / "project", lease_seconds=LEASE_SECONDS)
    result = gb.sweep(NINE, config=config, output_dir=root / "out", cache=root / "cache", jobs=1)
    return config, result


def test_nine_variants_trace_once_and_convert_to_onnx_once(local_sweep):
    _, result = local_sweep

    runs = result.summary["stage_runs"]
    assert (runs["capture"], runs["to_onnx"], runs["place_quantizers"]) == (1, 1, 1)
    assert (runs["calibrate"], runs["qparams"]) == (3, 9)  # per calibration set, per variant
    assert len(result.rows) == 9 and not result.failed


def _sweep_on_ray(config: Path, out: Path, url: str, address: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "graphbuild", "sweep", "-c", str(config), "--json"]
    args += ["--executor", "ray", "--ray-address", address, "--cache-url", url]
    args += ["--cache-dir", str(out / "coordinator-cache"), "-o", str(out / "variants")]
    for key, values in NINE.items():
        args += ["--vary", f"{key}={','.join(values)}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc: subprocess.Popen) -> dict:
    try:
        stdout, stderr = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, stderr.decode(errors="replace")[-3000:]
    return json.loads(stdout)


def _same_files_as_the_local_sweep(doc: dict, local) -> None:
    local_rows = {r["variant"]: r for r in local.rows}
    assert sorted(local_rows) == sorted(r["variant"] for r in doc["variants"])
    for row in doc["variants"]:
        assert row["status"] == "ok", row
        mine = local_rows[row["variant"]]
        for name in FILES:
            ours = (Path(row["output_dir"]) / name).read_bytes()
            assert ours == (Path(mine["output_dir"]) / name).read_bytes(), (row["variant"], name)
        assert row["sqnr_db"] == mine["sqnr_db"]


def _verify_shared_cache(url: str) -> None:
    report = gb.Cache.remote(url).verify(repair=False)
    assert report.corrupt == [] and report.checked_entries > 0


def test_nine_variants_on_two_ray_nodes_sharing_one_redis(local_sweep, tmp_path, redis_url):
    require_ray()
    config, local = local_sweep
    nodes = [tmp_path / "node-a", tmp_path / "node-b"]

    with RayCluster(nodes) as address:
        doc = _finish(_sweep_on_ray(config, tmp_path, redis_url, address))

    runs = doc["sweep"]["stage_runs"]
    assert (runs["capture"], runs["to_onnx"], runs["place_quantizers"]) == (1, 1, 1)
    assert (runs["calibrate"], runs["qparams"]) == (3, 9)  # per calibration set, per variant
    assert len(doc["sweep"]["workers"]) == 2  # both nodes' workers ran jobs
    # each node's cache holds what it built and, copied down, what it read from the other's
    entries = sum(gb.Cache(n, readonly=True).stats().entries for n in nodes)
    assert entries > doc["sweep"]["jobs_run"]
    _same_files_as_the_local_sweep(doc, local)
    _verify_shared_cache(redis_url)


def test_a_worker_killed_mid_stage_is_retried_and_the_files_are_the_same(
    local_sweep, tmp_path, redis_url
):
    require_ray()
    config, local = local_sweep
    nodes = [tmp_path / "node-a", tmp_path / "node-b"]

    cluster = RayCluster(nodes)
    with cluster as address:
        sweep = _sweep_on_ray(config, tmp_path, redis_url, address)
        killed, lease = kill_a_worker_holding_a_lease(sweep, cluster, redis_url)
        doc = _finish(sweep)

    assert killed not in {int(w.rsplit(":", 1)[1]) for w in doc["sweep"]["workers"]}
    assert lease.rsplit(":", 1)[1] in {  # the stage it was building was built (by a retry)
        key for row in doc["variants"] for key in _keys(row)
    }
    _same_files_as_the_local_sweep(doc, local)
    _verify_shared_cache(redis_url)


def _keys(row: dict) -> set[str]:
    """The stage keys of a placed variant (its lock file)."""
    lock = json.loads((Path(row["output_dir"]) / "graphbuild.lock.json").read_text())
    return {stage["key"] for stage in lock["stages"].values()}
