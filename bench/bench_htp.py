"""Benchmark: preparing QNN context binaries on Qualcomm's HTP backend (onnxruntime-qnn), per
model of the test zoo, and what the cache saves of it.

For each model (``tests/zoo.py``, random weights, one preset), after an ``onnx_qdq`` export:

* **compile**: an HTP session on the QDQ file with CPU fallback disabled (graph preparation
  for ``htp_arch`` v81, SoC 87), best of N; a model QNN refuses is timed to the refusal;
* **prepare**: the same with the context written (``ep.context_enable``, embed mode 0): the
  EPContext model and the ``.bin`` (``htp_runtime.prepare_context``), best of N, and the
  binary's size; for a model QNN refuses, the preparation of what it takes with CPU fallback
  allowed (not a context graphbuild deploys: a measure of the cost);
* **context export**: ``graphbuild export --format context`` cold (empty cache, the whole
  pipeline: capture, PT2E calibration, ONNX, preparation, the EPContext model's run on the
  HTP) and warm (every stage a hit), with the ``prepare_context`` stage's share of the cold
  export (it prepares in a fresh process, for reproducible bytes: the process's start-up
  is the difference from **prepare**).

    python bench/bench_htp.py [--models resnet,mobilenetv3,gpt2] [--preset w8a16]
                              [--repeat 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = ("resnet", "mobilenetv3", "bert", "gpt2", "llama", "vit")


def _export(name: str, preset: str, fmt: str, out: Path, cache: Any) -> Any:
    import graphbuild as gb
    from tests import zoo

    model, sample = zoo.build(name)
    return gb.export(
        model,
        sample,
        out,
        name,
        format=fmt,
        options=gb.QnnOnnxOptions(quantizer=preset, calibration=zoo.calibration(name)),
        cache=cache,
    )


def _best(fn: Any, repeat: int) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
    return best, result


def run_model(name: str, preset: str, repeat: int, tmp: Path) -> dict[str, Any]:
    import graphbuild as gb
    from graphbuild.targets.qnn import htp_runtime as hr

    target = hr.HtpTarget.of("v81")
    qdq = _export(name, preset, "onnx_qdq", tmp / name / "qdq", False).files["onnx"]
    row: dict[str, Any] = {"model": name, "preset": preset, "onnx_bytes": qdq.stat().st_size}

    def compile_once() -> str:
        try:
            hr.open_session(qdq, target)
            return ""
        except hr.HtpRefusedError as refused:
            return refused.onnxruntime_message

    row["compile_s"], refusal = _best(compile_once, repeat)
    counter = iter(range(repeat))
    if refusal:  # no deployable context; what preparing the part QNN takes costs
        row["refused"] = refusal[:200]

        def prepare_with_fallback() -> Any:
            out = tmp / name / f"fallback{next(counter)}"
            out.mkdir(parents=True)
            config = {
                "ep.context_enable": "1",
                "ep.context_file_path": str(out / f"{name}_ctx.onnx"),
                "ep.context_embed_mode": "0",
            }
            return hr.open_session(qdq, target, allow_cpu_fallback=True, session_config=config)

        row["prepare_with_cpu_fallback_s"], _ = _best(prepare_with_fallback, repeat)
        return row

    def prepare_once() -> Any:
        out = tmp / name / f"ctx{next(counter)}"
        out.mkdir(parents=True)
        return hr.prepare_context(qdq, target, out / f"{name}_ctx.onnx")

    row["prepare_s"], prepared = _best(prepare_once, repeat)
    row["context_bin_bytes"] = sum(b.stat().st_size for b in prepared.binaries)
    cache = gb.Cache(tmp / name / "cache")
    t0 = time.perf_counter()
    cold = _export(name, preset, "context", tmp / name / "context", cache)
    row["export_cold_s"] = time.perf_counter() - t0
    row["export_cold_prepare_s"] = cold.report["prepare_context_v81"].seconds
    row["export_warm_s"], warm = _best(
        lambda: _export(name, preset, "context", tmp / name / "context", cache), repeat
    )
    row["warm_all_hits"] = all(s.status.value == "hit" for s in warm.report.stages)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--preset", default="w8a16")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    from graphbuild.targets.qnn import htp_runtime as hr

    found = hr.availability()
    if not found.available:
        raise SystemExit(f"bench_htp: {found.reason}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-htp-") as tmp:
        for name in args.models.split(","):
            rows.append(run_model(name, args.preset, args.repeat, Path(tmp)))
            if not args.json:
                print(json.dumps(rows[-1]), flush=True)
    doc = {
        "versions": hr.backend_versions(),
        "load_average": list(os.getloadavg()),
        "preset": args.preset,
        "repeat": args.repeat,
        "models": rows,
    }
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(f"load average {doc['load_average']}; {doc['versions']}")


if __name__ == "__main__":
    main()
