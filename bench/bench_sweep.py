"""Benchmark: a sweep of N variants against N exports run one after another.

The variants: examples/sweep.toml's nine (presets w8a16, w8a8, w4a16 x calibration sets
default, large, narrow) of the tiny decoder, with the numerics check on. Each measurement
starts from an EMPTY cache in a temporary directory, in fresh processes:

* **sequential**: N ``python -m graphbuild export`` processes one after another, sharing one
  cache (what a person scripts today: the only sharing is what the cache holds when each
  starts, so the trace and the ONNX conversion are hits after the first export);
* **sweep -j 1**: one ``python -m graphbuild sweep -j 1`` (every job in that process);
* **sweep -j N**: ``python -m graphbuild sweep -j N`` (a local pool of N processes).

Reported: wall seconds of each, the ratios sequential / sweep, how many stage runs each made,
and the load average before and after (the machine is shared; note it beside any figure).

    python bench/bench_sweep.py [--jobs 2] [--json] [--out bench/results/sweep-<machine>.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "sweep.toml"
PRESETS = ("w8a16", "w8a8", "w4a16")
CALIBRATIONS = {
    "default": "calibration",
    "large": "calibration_large",
    "narrow": "calibration_narrow",
}


def _run(args: list[str], env: dict[str, str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return seconds, out.stdout


def _env(cache: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GRAPHBUILD_CACHE_DIR": str(cache)}
    env.pop("GRAPHBUILD_CACHE_URL", None)
    return env


def sequential(work: Path) -> dict[str, Any]:
    """N export processes one after another over one cache."""
    cache, ran = work / "cache-seq", 0
    total = 0.0
    for preset, name in itertools.product(PRESETS, CALIBRATIONS):
        spec = f"{ROOT / 'examples' / 'tiny_decoder.py'}:{CALIBRATIONS[name]}"
        args = [sys.executable, "-m", "graphbuild", "export", "-c", str(CONFIG), "--json"]
        args += ["--set", f"quantization.preset={preset}", "--set", f'calibration="{spec}"']
        args += ["--set", "check_numerics=true", "-o", str(work / "seq" / f"{preset}-{name}")]
        seconds, stdout = _run(args, _env(cache))
        total += seconds
        ran += sum(1 for s in json.loads(stdout)["stages"] if s["status"] == "ran")
    return {"seconds": total, "stage_runs": ran}


def sweep(work: Path, jobs: int) -> dict[str, Any]:
    cache = work / f"cache-j{jobs}"
    args = [sys.executable, "-m", "graphbuild", "sweep", "-c", str(CONFIG), "--json"]
    args += ["-j", str(jobs), "-o", str(work / f"sweep-j{jobs}"), "--cache-dir", str(cache)]
    seconds, stdout = _run(args, _env(cache))
    doc = json.loads(stdout)["sweep"]
    return {"seconds": seconds, "stage_runs": doc["jobs_run"], "runs": doc["stage_runs"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--json", action="store_true", help="print the JSON document only")
    parser.add_argument("--out", type=Path, help="also write the JSON document here")
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="gb-bench-sweep-") as tmp:
        work = Path(tmp)
        results = {
            "sequential": sequential(work),
            "sweep_j1": sweep(work, 1),
            f"sweep_j{args.jobs}": sweep(work, args.jobs),
        }
    seq = results["sequential"]["seconds"]
    doc = {
        "variants": len(PRESETS) * len(CALIBRATIONS),
        "cpus": os.cpu_count(),
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "results": results,
        "ratios": {
            k: round(seq / v["seconds"], 2) for k, v in results.items() if k != "sequential"
        },
    }
    text = json.dumps(doc, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    if args.json:
        print(text)
        return
    for name, r in results.items():
        print(f"{name:<12} {r['seconds']:8.1f} s  {r['stage_runs']:4d} stage runs")
    for name, ratio in doc["ratios"].items():
        print(f"sequential / {name}: {ratio:.2f}x")
    print(f"load average before {doc['load_before']}, after {doc['load_after']}")


if __name__ == "__main__":
    main()
