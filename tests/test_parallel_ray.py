"""One LLM export (4 parts, ``w8a16``, each part's weight-shared HTP context) built as Ray
tasks on a local cluster of two nodes that share one Redis (``graphbuild export --executor
ray``): the files and lock of a sequential export, byte for byte, each part graph and each
part's context built once across the cluster, the timeline naming the workers; a worker killed
while it prepares a part's context costs a retry, not a wrong or missing file.

Slow: the Ray cluster takes 10-20 s to start, and each export a minute or two on two loaded
cores.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.ray_cluster import ROOT, RayCluster, kill_a_worker_holding_a_lease, require_ray

pytestmark = pytest.mark.slow

PARTS = 4


def _project(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "lm_model.py").write_text(
        textwrap.dedent(
            """\
            import torch

            from tests.llm_models import PROMPT, causal_lm


            def build():
                return causal_lm("llama", layers=4), (torch.tensor([PROMPT]),)
            """
        )
    )
    config = root / "graphbuild.toml"
    config.write_text(
        textwrap.dedent(
            f"""\
            model = "lm_model.py:build"
            target = "qnn"
            format = "llm"
            model_name = "lm"
            output_dir = "out"

            [cache]
            lease_seconds = 3

            [quantization]
            preset = "w8a16"

            [options]
            prompt_len = 4
            context_len = 32
            parts = {PARTS}
            contexts = true
            htp_arch = "v73"
            """
        )
    )
    return config


def _export(config: Path, out: Path, cache: Path, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "graphbuild", "export", "-c", str(config), "--json"]
    cmd += ["-o", str(out), "--cache-dir", str(cache), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("GRAPHBUILD_CACHE_URL", None)
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc: subprocess.Popen) -> dict:
    try:
        stdout, stderr = proc.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 0, stderr.decode(errors="replace")[-3000:]
    return json.loads(stdout)


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _htp_missing() -> str:
    from graphbuild.targets.qnn.htp_runtime import availability

    found = availability()
    return "" if found.available else found.reason


@pytest.fixture(scope="module")
def sequential(tmp_path_factory):
    """The export built one stage at a time in one process, with a cache of its own."""
    if _htp_missing():
        pytest.skip(_htp_missing())
    root = tmp_path_factory.mktemp("seq")
    config = _project(root / "project")
    doc = _finish(_export(config, root / "out", root / "cache", "-j", "1"))
    return config, root / "out", doc


def _same_files(out: Path, reference: Path) -> None:
    ours, theirs = _files(out), _files(reference)
    assert sorted(ours) == sorted(theirs)
    assert "graphbuild.lock.json" in ours
    for name, data in theirs.items():
        assert ours[name] == data, f"{name} differs from the sequential export's"


def _ran_once_each(doc: dict) -> dict[str, str]:
    """Stage -> the worker that built it; every stage that ran on the cluster ran once."""
    ran = [e for e in doc["timeline"] if e["status"] == "ran"]
    names = [e["stage"] for e in ran]
    assert len(names) == len(set(names)), names
    return {e["stage"]: e["worker"] for e in ran}


def test_four_parts_on_two_ray_nodes_sharing_one_redis(sequential, tmp_path, redis_url):
    require_ray()
    config, reference, seq = sequential
    nodes = [tmp_path / "node-a", tmp_path / "node-b"]

    with RayCluster(nodes) as address:
        args = ("--executor", "ray", "--ray-address", address, "--cache-url", redis_url)
        doc = _finish(_export(config, tmp_path / "out", tmp_path / "coordinator", *args))

    _same_files(tmp_path / "out", reference)
    where = _ran_once_each(doc)
    seq_ran = {s["name"] for s in seq["stages"] if s["status"] == "ran"}
    assert set(where) == seq_ran  # every stage the sequential export ran, once, on the cluster
    graphs = [f"p{i}.{kind}.graph" for i in range(1, PARTS + 1) for kind in ("prompt", "token")]
    assert set(graphs) <= set(where)
    contexts = [f"p{i}.context.v73" for i in range(1, PARTS + 1)]
    assert set(contexts) <= set(where)  # each prepared once, the timeline says by which worker
    assert len(set(where.values())) == 2  # both nodes' workers built stages


def _key(doc: dict, stage: str) -> str:
    (key,) = [s["key"] for s in doc["stages"] if s["name"] == stage]
    return key


def test_a_worker_killed_preparing_a_context_costs_a_retry_not_a_file(
    sequential, tmp_path, redis_url
):
    require_ray()
    config, reference, seq = sequential
    nodes = [tmp_path / "node-a", tmp_path / "node-b"]

    cluster = RayCluster(nodes)
    with cluster as address:
        args = ("--executor", "ray", "--ray-address", address, "--cache-url", redis_url)
        proc = _export(config, tmp_path / "out", tmp_path / "coordinator", *args)
        preparing = {_key(seq, f"p{i}.context.v73") for i in range(1, PARTS + 1)}
        killed, lease = kill_a_worker_holding_a_lease(proc, cluster, redis_url, among=preparing)
        doc = _finish(proc)

    _same_files(tmp_path / "out", reference)
    where = _ran_once_each(doc)
    (stage,) = [s["name"] for s in doc["stages"] if s["key"] == lease.rsplit(":", 1)[1]]
    assert int(where[stage].rsplit(":", 1)[1]) != killed  # built again, by another worker
