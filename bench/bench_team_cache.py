"""Benchmark: an export warm from a shared Redis cache against one warm from the local cache.

Setup: a temporary ``graphbuild.toml`` naming the tiny decoder (``examples/tiny_decoder.py``,
preset ``w8a16``) by absolute path, and a ``redis-server`` on a free loopback port (nothing
saved to disk). One cold ``graphbuild export --cache-url`` from clone A fills A's local cache
and the server. Then, best of N each (interleaved, so drifting load hits both alike):

* **local warm**: clone A exports again: every stage a hit in its own cache;
* **remote warm**: a new clone (an empty local cache directory) exports with
  ``--cache-url``: every stage a hit on the server, the final products copied down;
* **remote, second run**: that clone exports again (what it copied down is now local).

Each figure is the export's own time (``"seconds"`` in ``export --json``) and the whole
process's (Python start-up and imports included).

    python bench/bench_team_cache.py [--repeat 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.redis_server import RedisServer  # noqa: E402

DECODER = ROOT / "examples" / "tiny_decoder.py"


def export(clone: Path, url: str) -> tuple[float, float, dict[str, str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAPHBUILD_")}
    env["PYTHONPATH"] = str(ROOT)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "graphbuild", "export", "--config", str(clone / "graphbuild.toml"),
         "--cache-dir", str(clone / "cache"), "--cache-url", url, "--json"],
        capture_output=True, text=True, env=env, cwd=clone, check=True,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    doc = json.loads(proc.stdout)
    return doc["seconds"], wall, {s["name"]: s["status"] for s in doc["stages"]}


def clone(root: Path, name: str) -> Path:
    directory = root / name
    directory.mkdir()
    (directory / "graphbuild.toml").write_text(
        f'model = "{DECODER.as_posix()}:build"\n'
        f'calibration = "{DECODER.as_posix()}:calibration"\n'
        'model_name = "tiny"\noutput_dir = "out"\n[quantization]\npreset = "w8a16"\n'
    )
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gb-bench-team-"))
    results: dict[str, list[tuple[float, float]]] = {"local": [], "remote": [], "second": []}
    try:
        with RedisServer() as url:
            first = clone(root, "a")
            cold = export(first, url)
            assert set(cold[2].values()) == {"ran"}, cold[2]
            for i in range(args.repeat):
                seconds, wall, statuses = export(first, url)
                assert set(statuses.values()) == {"hit"}, statuses
                results["local"].append((seconds, wall))
                other = clone(root, f"b{i}")
                seconds, wall, statuses = export(other, url)
                assert set(statuses.values()) == {"hit"}, statuses
                results["remote"].append((seconds, wall))
                seconds, wall, statuses = export(other, url)
                results["second"].append((seconds, wall))
                shutil.rmtree(other)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    best = {k: (min(s for s, _ in v), min(w for _, w in v)) for k, v in results.items()}
    report: dict[str, Any] = {
        "cold": {"export_s": cold[0], "process_s": cold[1]},
        **{k: {"export_s": s, "process_s": w} for k, (s, w) in best.items()},
        "repeat": args.repeat,
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"{'':24}{'export':>10}{'process':>10}")
    labels = {"cold": "cold (fills the server)", "local": "local warm",
              "remote": "remote warm (new clone)", "second": "remote, second run"}  # fmt: skip
    for key, label in labels.items():
        row = report[key]
        print(f"{label:24}{row['export_s']:>9.2f}s{row['process_s']:>9.2f}s")


if __name__ == "__main__":
    main()
