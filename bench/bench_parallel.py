"""Benchmark: one LLM export (the qnn ``llm`` format, 4 parts) built one stage at a time, with
``-j 2`` on this machine, and (``--ray``) as Ray tasks on a local two-node cluster sharing one
Redis: wall time, peak RSS per process, stage runs. With ``--contexts`` the export is the
``w8a16`` preset, calibrated, and each part's weight-shared v73 HTP context is prepared (in a
child process per part: the work ``-j`` runs side by side).

The model is bench_llm.py's decoder of Qwen2.5-0.5B's shapes with fewer layers (``--layers``,
default 8), so each cold export takes a minute or two on two cores. Each case is a fresh
process with a fresh cache (cold); its peak RSS is that process's high-water mark (with Ray,
the client's; the workers' are each node's own processes), and its peak tree RSS the largest
sum over it and its child processes at once (sampled every 50 ms).

    python bench/bench_parallel.py [--layers 8] [--parts 4] [--contexts] [--ray] [--save FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.process_memory import TreeRss  # noqa: E402

MODEL = """\
import torch

from bench.bench_llm import qwen2_0_5b


def build():
    g = torch.Generator().manual_seed(1)
    return qwen2_0_5b({layers}), (torch.randint(0, 151000, (1, 24), generator=g),)


def calibration():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, 151000, (1, 40), generator=g) for _ in range(2)]
"""

#: The preset path with contexts (``--contexts``), after the options.
CONTEXTS = """\
contexts = true
htp_arch = "v73"

[quantization]
preset = "w8a16"
"""


def _project(
    root: Path, layers: int, parts: int, prompt: int, context: int, contexts: bool
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "bench_model.py").write_text(MODEL.format(layers=layers))
    config = root / "graphbuild.toml"
    config.write_text(
        textwrap.dedent(
            f"""\
            model = "bench_model.py:build"
            target = "qnn"
            format = "llm"
            model_name = "lm"
            output_dir = "out"
            {'calibration = "bench_model.py:calibration"' if contexts else ""}

            [options]
            prompt_len = {prompt}
            context_len = {context}
            parts = {parts}
            """
        )
        + (CONTEXTS if contexts else "")
    )
    return config


def _case(name: str, config: Path, tmp: Path, *args: str) -> dict[str, Any]:
    """One cold export in a fresh process: wall time, its peak RSS, what ran where."""
    cmd = [sys.executable, "-m", "graphbuild", "export", "-c", str(config), "--json"]
    cmd += ["-o", str(tmp / name / "out"), "--cache-dir", str(tmp / name / "cache"), *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"}
    env["GRAPHBUILD_SERVER"] = "0"  # the export in this process: cold, and its RSS measured
    out, err = tmp / f"{name}.json", tmp / f"{name}.log"
    t0 = time.perf_counter()
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr)
        with TreeRss(proc.pid) as tree:
            _, status, usage = os.wait4(proc.pid, 0)  # this child's own rusage: its peak RSS
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name}: exit {proc.returncode}\n{err.read_text()[-3000:]}")
    doc = json.loads(out.read_text())
    ran = [e for e in doc["timeline"] if e["status"] == "ran"]
    return {
        "case": name,
        "wall_seconds": round(wall, 1),
        "peak_rss_mib": round(usage.ru_maxrss / 1024),
        "peak_tree_rss_mib": round(tree.peak / 2**20),
        "context_seconds": {
            e["stage"]: round(e["end"] - e["start"], 1) for e in ran if ".context." in e["stage"]
        },
        "contexts_at_once": _most_at_once([e for e in ran if ".context." in e["stage"]]),
        "stage_runs": len(ran),
        "workers": sorted({e["worker"] for e in ran}),
    }


def _most_at_once(entries: list[dict[str, Any]]) -> int:
    """The most timeline entries running at one moment."""
    edges = sorted([(e["start"], 1) for e in entries] + [(e["end"], -1) for e in entries])
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--parts", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument(
        "--contexts", action="store_true", help="w8a16, calibrated, with each part's HTP context"
    )
    parser.add_argument("--ray", action="store_true", help="also on a local 2-node Ray cluster")
    parser.add_argument("--no-sequential", action="store_true", help="skip the -j 1 case")
    parser.add_argument("--save", default=None, help="write the JSON document here too")
    parser.add_argument("--keep", action="store_true", help="keep the cases' folders")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="graphbuild-bench-parallel-"))
    try:
        _bench(args, tmp)
    finally:  # each case's cache and bundles: gigabytes with --contexts
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


def _bench(args: argparse.Namespace, tmp: Path) -> None:
    config = _project(
        tmp / "project", args.layers, args.parts, args.prompt, args.context, args.contexts
    )
    cases = [_case("sequential", config, tmp, "-j", "1")] if not args.no_sequential else []
    cases.append(_case("j2", config, tmp, "-j", "2"))
    if args.ray:
        from tests.ray_cluster import RayCluster
        from tests.redis_server import RedisServer

        with RedisServer() as url, RayCluster([tmp / "node-a", tmp / "node-b"]) as address:
            ray = ("--executor", "ray", "--ray-address", address, "--cache-url", url)
            cases.append(_case("ray-2-nodes", config, tmp, *ray))
    load = os.getloadavg()
    doc = {
        "model": f"bench_llm's Qwen2.5-0.5B shapes, {args.layers} layers",
        "parts": args.parts,
        "prompt_len": args.prompt,
        "context_len": args.context,
        "contexts": args.contexts,
        "cores": os.cpu_count(),
        "load_average": [round(x, 1) for x in load],
        "cases": cases,
    }
    text = json.dumps(doc, indent=2)
    print(text)
    if args.save:
        Path(args.save).write_text(text + "\n")


if __name__ == "__main__":
    main()
