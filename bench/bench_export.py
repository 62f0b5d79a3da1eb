"""Benchmark: graphbuild ``export`` (cold, warm, after each kind of change) against a plain
float export, per model, each model in its own process.

For each model (``convnet``, ``tiny_decoder`` and the ~168M-parameter ``mid_decoder`` of
:mod:`bench.models`), one child process:

1. builds the float model and its fake-quantized twin (shared weights, scale buffers);
2. warms up both paths once on a 1-layer module, so neither pays the one-time costs
   (torch.export / torch.onnx.export first-call set-up of ~5 s, graphbuild's lazy imports)
   inside a timed run: a plain ``torch.export`` + ``torch.onnx.export`` + ``onnx.save`` of
   a Linear, and a graphbuild export of a fake-quantized Linear into a throwaway cache;
3. times the **baseline**: ``torch.export.export`` + ``torch.onnx.export(program, dynamo=True,
   optimize=False, opset_version=21)`` + ``onnx.save`` of the FLOAT model (external data
   above 2 GiB, as protobuf requires);
4. times graphbuild ``export`` of the fake-quantized model into a fresh cache: **cold**,
   **warm** (no change), **scales** (activation scale buffers x 1.01), **weights** (a few
   weights nudged, scale buffers kept), **encodings** (``encodings_version="2.0.0"``) and
   **opset** (21 -> 20), each change applied on top of the previous state;
5. times graphbuild ``export`` of the FLOAT model quantized by the ``w8a16`` preset (4
   calibration batches) into another fresh cache: **preset_cold**, **preset_warm**, a
   **preset** change (w8a8), a **recalibration** (4 new batches), **histograms** (range
   method ``percentile``: calibration collects histograms once) and a **range** method change
   (``percentile`` -> ``mse``); the recalibration's forward passes (the float model over the
   new batches, best of 3) are timed alone as **passes**. Their fractions are of preset_cold, the
   recalibration's beyond its passes: ``(recalibration - passes) / preset_cold``.

``--repeat N`` repeats steps 3-4 (fresh cache each time; baseline and cold alternate which goes
first) and keeps the best time of each case. A last child measures memory: peak RSS
(``ru_maxrss``) of a process that builds the mid-size decoder and runs only a cold export.

    python bench/bench_export.py [--models convnet,tiny_decoder,mid_decoder] [--quick]
                                 [--repeat N] [--no-memory] [--json] [--save FILE]
                                 [--machine NAME] [--profile-dir DIR]

``--models large_decoder`` adds the 787M-parameter decoder (vocab 32000, hidden 2048, 16
layers, 32 heads, 8 KV heads, ffn 5632; 3.1 GB of fp32): it needs about 32 GiB of memory and
is not run by default (its memory child alone, one cold export, peaks at about 7.5 GB).
``--save FILE`` also writes the JSON document to FILE; ``--machine NAME`` records the machine
and, without ``--save``, writes ``bench/results/NAME.json`` (one per machine is kept there).

``--profile-dir`` runs every graphbuild case under pyinstrument (timings then include its
overhead) and writes one text profile per model and case.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ALL_MODELS = ("convnet", "tiny_decoder", "llama", "mid_decoder", "large_decoder")
#: Run when --models is not given: large_decoder (787M parameters) needs about 32 GiB.
DEFAULT_MODELS = ("convnet", "tiny_decoder", "llama", "mid_decoder")
CASES = ("cold", "warm", "scales", "weights", "encodings", "opset")
#: the float model quantized by graphbuild's own preset: cold (w8a16), warm, a preset change
#: (w8a8), a recalibration (new batches), histograms (range method percentile: a
#: recalibration that also collects histograms) and a range method change (percentile ->
#: mse: values only)
PRESET_CASES = ("preset_cold", "preset_warm", "preset", "recalibration", "histograms", "range")
GIB = 1 << 30
BASELINE_OPSET = 21  # graphbuild's default opset: the baseline exports at the same one

# targets: case -> (limit, what it is a ratio of); per model class ("small" for the convnet and
# the tiny decoder, "mid" for the mid-size decoder)
TARGETS = {
    "small": {
        "warm": 0.03,
        "scales": 0.10,
        "weights": 0.15,
        "encodings": 0.03,
        "cold_vs_baseline": 1.15,
        "preset": 0.05,
        "recalibration": 0.05,
        "range": 0.05,
    },
    "mid": {
        "warm": 0.03,
        "scales": 0.05,
        "weights": 0.08,
        "encodings": 0.03,
        "cold_vs_baseline": 1.15,
        "preset": 0.05,
        "recalibration": 0.05,
        "range": 0.05,
    },
    "large": {
        "warm": 0.02,
        "scales": 0.05,
        "weights": 0.08,
        "encodings": 0.03,
        "cold_vs_baseline": 1.15,
        "preset": 0.05,
        "recalibration": 0.05,
        "range": 0.05,
    },
}
MEMORY_TARGET = 3.0
LARGE_MEMORY_TARGET = 2.5  # peak RSS of the cold export over fp32 weight bytes, at 787M

# docs/design.md's rerun table, as (stages that must be hit or cutoff, stages that must have run)
RERUN_TABLE = {
    "warm": (("capture", "normalize", "to_onnx", "lower_markers", "bind", "encodings"), ()),
    # activation scales only: in qnn/onnx the bound float model does not change (bind cuts off)
    "scales": (("capture", "to_onnx", "bind"), ("qparams", "encodings")),
    "weights": (("capture", "to_onnx"), ("bind",)),
    "encodings": (("capture", "normalize", "to_onnx", "lower_markers", "bind"), ("encodings",)),
    "opset": (("capture", "normalize"), ("to_onnx",)),
    # docs/design.md invariant 13: a preset change and a range method recompute values only; a
    # recalibration reruns the forward passes and nothing structural
    "preset": (
        ("capture", "place_quantizers", "calibrate", "weight_stats", "to_onnx"),
        ("quant_map", "qparams"),
    ),
    "recalibration": (
        ("capture", "place_quantizers", "weight_stats", "to_onnx"),
        ("calibrate", "qparams"),
    ),
    "range": (("capture", "place_quantizers", "calibrate", "to_onnx"), ("qparams",)),
}


def _quiet() -> None:
    import logging

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    for name in ("torch", "torch.onnx", "torch.export", "onnxscript", "torchao"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


# --------------------------------------------------------------------------- the two paths


def baseline_export(model: Any, sample: tuple, path: Path) -> dict[str, float]:
    """torch.export + torch.onnx.export (dynamo, no optimizer) + onnx.save of a float model."""
    import onnx
    import torch

    t0 = time.perf_counter()
    program = torch.export.export(model, sample)
    t1 = time.perf_counter()
    onnx_program = torch.onnx.export(
        program, dynamo=True, optimize=False, verbose=False, opset_version=BASELINE_OPSET
    )
    t2 = time.perf_counter()
    proto = onnx_program.model_proto
    nbytes = sum(p.numel() * p.element_size() for p in program.state_dict.values())
    if nbytes > 2 * GIB - (64 << 20):
        onnx.save(proto, str(path), save_as_external_data=True, location=path.name + ".data")
    else:
        onnx.save(proto, str(path))
    t3 = time.perf_counter()
    return {
        "seconds": t3 - t0,
        "torch_export": t1 - t0,
        "onnx_export": t2 - t1,
        "save": t3 - t2,
        "external_data": nbytes > 2 * GIB - (64 << 20),
    }


def graphbuild_export(model: Any, sample: tuple, out: Path, cache: Path, name: str, **options):
    import graphbuild as gb

    loaded: dict[str, float] = {}

    def listen(event: Any) -> None:  # cache loads of hits that a dirty stage (or placing) needs
        if event.kind.value == "loaded":
            loaded[event.stage] = loaded.get(event.stage, 0.0) + event.seconds

    t0 = time.perf_counter()
    art = gb.export(
        model,
        sample,
        out,
        name,
        options=gb.QnnOnnxOptions(**options),
        cache=str(cache),
        listeners=[listen],
    )
    seconds = time.perf_counter() - t0
    rep = art.report
    stage_seconds = {s.name: s.seconds for s in rep.stages}
    return {
        "seconds": seconds,
        "statuses": rep.statuses,
        "ran": rep.ran,
        "stage_seconds": stage_seconds,  # the stage's function + encoding its output
        "loaded_seconds": loaded,
        "rest_seconds": seconds - sum(stage_seconds.values()) - sum(loaded.values()),
        "reasons": {s.name: s.reason for s in rep.stages if s.reason},
    }


def _warm_up(tmp: Path) -> dict[str, float]:
    """One tiny export on each path before anything is timed."""
    import torch
    from torch import nn

    from bench import models

    class OneLayer(nn.Module):  # not nn.Sequential: its forward argument is named `input`,
        # which graphbuild's normalize stage cannot handle (fx renames it input_1)
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    torch.manual_seed(0)
    lin = OneLayer().eval()
    x = (torch.randn(1, 4),)
    t0 = time.perf_counter()
    baseline_export(lin, x, tmp / "warmup_baseline.onnx")
    t1 = time.perf_counter()
    fq = models.fake_quantize(lin, [x])
    graphbuild_export(fq, x, tmp / "warmup_out", tmp / "warmup_cache", "warmup")
    t2 = time.perf_counter()
    return {"baseline": t1 - t0, "graphbuild": t2 - t1}


class _Profiler:
    """pyinstrument around one case, text written to ``dir/<model>-<case>.txt``."""

    def __init__(self, directory: str | None, model: str):
        self.dir, self.model = directory, model

    def run(self, case: str, fn):
        if not self.dir:
            return fn()
        from pyinstrument import Profiler

        prof = Profiler(interval=0.001)
        prof.start()
        try:
            return fn()
        finally:
            prof.stop()
            Path(self.dir).mkdir(parents=True, exist_ok=True)
            text = prof.output_text(unicode=False, color=False, show_all=False)
            (Path(self.dir) / f"{self.model}-{case}.txt").write_text(text)


def _repetition(
    bm: Any, rep: Path, name: str, *, baseline_first: bool, prof: _Profiler
) -> dict[str, dict[str, Any]]:
    """Baseline and every graphbuild case once, into a fresh cache under ``rep``."""
    from bench import models

    cache, out = rep / "cache", rep / "out"
    rep.mkdir()
    this: dict[str, dict[str, Any]] = {}

    def do_baseline() -> None:
        gc.collect()
        this["baseline"] = baseline_export(bm.float, bm.sample, rep / "baseline.onnx")
        (rep / "baseline.onnx").unlink(missing_ok=True)
        (rep / "baseline.onnx.data").unlink(missing_ok=True)

    def gbx(case: str, **options: Any) -> None:
        gc.collect()
        this[case] = prof.run(
            case, lambda: graphbuild_export(bm.fq, bm.sample, out, cache, name, **options)
        )

    try:
        if baseline_first:
            do_baseline()
            gbx("cold")
        else:
            gbx("cold")
            do_baseline()
        gbx("warm")
        models.change_scales(bm.fq)
        gbx("scales")
        models.change_weights(bm.fq)
        gbx("weights")
        gbx("encodings", encodings_version="2.0.0")
        gbx("opset", opset=20)
        if bm.calibration is not None:
            _preset_cases(bm, rep, name, this, prof)
        return this
    finally:
        shutil.rmtree(rep, ignore_errors=True)


def _preset_cases(bm: Any, rep: Path, name: str, this: dict, prof: _Profiler) -> None:
    """The float model quantized by the ``w8a16`` preset into a cache of its own, then
    retuned (see ``PRESET_CASES``); ``passes`` times the recalibration's forward passes
    alone: the float model over the new batches, as the fraction's allowance."""
    import torch

    cache, out = rep / "preset_cache", rep / "preset_out"
    first, second = bm.calibration(0), bm.calibration(1)

    def gbp(case: str, **options: Any) -> None:
        gc.collect()
        this[case] = prof.run(
            case, lambda: graphbuild_export(bm.float, bm.sample, out, cache, name, **options)
        )

    gbp("preset_cold", quantizer="w8a16", calibration=first)
    gbp("preset_warm", quantizer="w8a16", calibration=first)
    gbp("preset", quantizer="w8a8", calibration=first)
    gbp("recalibration", quantizer="w8a8", calibration=second)
    passes = []
    for _ in range(3):  # the best of 3: a pass of a small model is a blip on a shared machine
        gc.collect()
        t0 = time.perf_counter()
        with torch.no_grad():
            for batch in second:
                bm.float(*batch)
        passes.append(time.perf_counter() - t0)
    this["passes"] = {"seconds": min(passes)}
    import dataclasses

    import graphbuild as gb

    if "range_method" in {f.name for f in dataclasses.fields(gb.QnnOnnxOptions)}:
        gbp("histograms", quantizer="w8a8", calibration=second, range_method="percentile")
        gbp("range", quantizer="w8a8", calibration=second, range_method="mse")


def run_model(name: str, repeat: int, profile_dir: str | None) -> dict[str, Any]:
    """The whole measurement of one model (run in a child process)."""
    _quiet()
    import torch

    from bench import models

    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    bm = models.build(name)
    build_seconds = time.perf_counter() - t0
    tmp = Path(tempfile.mkdtemp(prefix=f"bench_export_{name}_"))
    prof = _Profiler(profile_dir, name)
    try:
        warmup = _warm_up(tmp)
        best: dict[str, dict[str, Any]] = {}
        runs: list[dict[str, Any]] = []

        def keep(case: str, result: dict[str, Any]) -> None:
            if case not in best or result["seconds"] < best[case]["seconds"]:
                best[case] = result

        for r in range(repeat):
            this = _repetition(bm, tmp / f"rep{r}", name, baseline_first=r % 2 == 0, prof=prof)
            for case, res in this.items():
                keep(case, res)
            if "passes" in this and this.get("recalibration") is best.get("recalibration"):
                best["passes"] = this["passes"]  # the passes of the kept recalibration
            runs.append({k: round(v["seconds"], 4) for k, v in this.items()})
        return {
            "model": name,
            "info": bm.info,
            "build_seconds": build_seconds,
            "warmup_seconds": warmup,
            "repeat": repeat,
            "best": best,
            "runs": runs,
            "maxrss_bytes": _maxrss_bytes(),
            "loadavg_end": os.getloadavg(),
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_memory(name: str, what: str) -> dict[str, Any]:
    """Build ``name`` and run ONE cold export (``what`` = graphbuild or baseline); nothing
    else runs in this process, so ru_maxrss is that export's peak."""
    _quiet()
    import torch

    from bench import models

    torch.set_grad_enabled(False)
    bm = models.build(name)
    gc.collect()
    rss_built, maxrss_built = _rss_bytes(), _maxrss_bytes()
    tmp = Path(tempfile.mkdtemp(prefix=f"bench_mem_{name}_"))
    try:
        t0 = time.perf_counter()
        if what == "graphbuild":
            res = graphbuild_export(bm.fq, bm.sample, tmp / "out", tmp / "cache", name)
            ran = res["ran"]
        else:
            baseline_export(bm.float, bm.sample, tmp / "baseline.onnx")
            ran = []
        seconds = time.perf_counter() - t0
        peak = _maxrss_bytes()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    wb = bm.info["fp32_weight_bytes"]
    return {
        "model": name,
        "what": what,
        "fp32_weight_bytes": wb,
        "rss_after_build": rss_built,
        "maxrss_after_build": maxrss_built,
        "peak_rss": peak,
        "peak_over_weights": peak / wb,
        "export_over_weights": (peak - rss_built) / wb,
        "seconds": seconds,
        "ran": ran,
    }


# --------------------------------------------------------------------------- the parent


def _machine(name: str | None) -> dict[str, Any]:
    """What the figures were measured on: name, cores, memory, software, date, commit."""
    import platform

    import torch

    try:
        with open("/proc/meminfo") as f:
            mem_gib = round(int(f.readline().split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        mem_gib = None
    try:
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {
        "name": name,
        "cpus": os.cpu_count(),
        "memory_gib": mem_gib,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit,
    }


def _child(args: list[str], timeout: float = 3600) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result_path = f.name
    cmd = [sys.executable, str(Path(__file__).resolve()), *args, "--result", result_path]
    env = dict(os.environ, PYTHONWARNINGS="ignore", TORCH_CPP_LOG_LEVEL="ERROR")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr[-8000:])
            raise RuntimeError(f"child {' '.join(args)} failed with exit code {proc.returncode}")
        return json.loads(Path(result_path).read_text())
    finally:
        os.unlink(result_path)


def _targets_for(name: str) -> dict[str, float]:
    return TARGETS[{"mid_decoder": "mid", "large_decoder": "large"}.get(name, "small")]


def _rerun_ok(case: str, statuses: dict[str, str]) -> bool:
    if case not in RERUN_TABLE:
        return True
    hit, ran = RERUN_TABLE[case]
    ok = all(statuses.get(s) in ("hit", "cutoff") for s in hit)
    return ok and all(statuses.get(s) == "ran" for s in ran)


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    """Ratios and target checks of one model's result."""
    best = result["best"]
    cold = best["cold"]["seconds"]
    base = best["baseline"]["seconds"]
    targets = _targets_for(result["model"])
    rows = []
    checks = []
    preset = [c for c in PRESET_CASES if c in best]
    for case in ("baseline", *CASES, *preset):
        res = best[case]
        ratio = res["seconds"] / cold
        if case in PRESET_CASES:
            ratio = res["seconds"] / best["preset_cold"]["seconds"]
        if case == "recalibration":  # beyond its forward passes, measured alone
            ratio = (res["seconds"] - best["passes"]["seconds"]) / best["preset_cold"]["seconds"]
        row = {"case": case, "seconds": res["seconds"], "ratio_to_cold": ratio}
        if case == "baseline":
            row["ran"] = ["torch.export", "torch.onnx.export", "onnx.save"]
        else:
            row["ran"] = res["ran"]
            row["rerun_table_ok"] = _rerun_ok(case, res["statuses"])
        if case == "cold":
            row["ratio_to_baseline"] = cold / base
        if case == "preset_cold":
            row["ratio_to_baseline"] = res["seconds"] / base
        if case == "recalibration":
            row["passes_seconds"] = best["passes"]["seconds"]
        rows.append(row)
        if case in targets:
            what = "(recalibration - passes)" if case == "recalibration" else case
            checks.append(
                {
                    "check": f"{what} / cold",
                    "value": ratio,
                    "limit": targets[case],
                    "pass": ratio <= targets[case],
                }
            )
    checks.append(
        {
            "check": "cold / baseline",
            "value": cold / base,
            "limit": targets["cold_vs_baseline"],
            "pass": cold / base <= targets["cold_vs_baseline"],
        }
    )
    return {"rows": rows, "checks": checks}


def print_model(result: dict[str, Any], summary: dict[str, Any]) -> None:
    info = result["info"]
    print()
    print(
        f"== {result['model']}: {info['params'] / 1e6:.3f}M params, "
        f"{info['fp32_weight_bytes'] / 2**20:.1f} MiB fp32, {info['fake_quant_layers']} "
        f"fake-quant layers; best of {result['repeat']}; build {result['build_seconds']:.2f} s; "
        f"warm-up baseline {result['warmup_seconds']['baseline']:.2f} s, "
        f"graphbuild {result['warmup_seconds']['graphbuild']:.2f} s; load at end "
        f"{result['loadavg_end'][0]:.2f}"
    )
    print(f"{'case':<10} {'seconds':>9} {'/cold':>8} {'/base':>7} {'table':>5}  stages that ran")
    for row in summary["rows"]:
        vs_base = f"{row['ratio_to_baseline']:.3f}" if "ratio_to_baseline" in row else ""
        table = "" if "rerun_table_ok" not in row else ("ok" if row["rerun_table_ok"] else "BAD")
        ran = ", ".join(row["ran"]) or "(none)"
        print(
            f"{row['case']:<10} {row['seconds']:9.3f} {row['ratio_to_cold']:8.4f} "
            f"{vs_base:>7} {table:>5}  {ran}"
        )
    b = result["best"]["baseline"]
    print(
        f"baseline split: torch.export {b['torch_export']:.3f} s, torch.onnx.export "
        f"{b['onnx_export']:.3f} s, onnx.save {b['save']:.3f} s"
    )
    print(
        "graphbuild seconds: stages that ran (function + encoding the output) | cache loads "
        "of hits | rest (keys, fingerprints, cache writes, placing files)"
    )
    if "passes" in result["best"]:
        print(
            f"preset cases are fractions of preset_cold; recalibration's is (recalibration - "
            f"passes) / preset_cold, passes = {result['best']['passes']['seconds']:.3f} s"
        )
    for case in (*CASES, *(c for c in PRESET_CASES if c in result["best"])):
        res = result["best"][case]
        stages = ", ".join(f"{k} {v:.3f}" for k, v in res["stage_seconds"].items() if v >= 0.0005)
        loads = ", ".join(f"{k} {v:.3f}" for k, v in res["loaded_seconds"].items())
        print(
            f"  {case:<10} {stages or '-'} | loaded: {loads or '-'} | rest {res['rest_seconds']:.3f}"
        )
    for check in summary["checks"]:
        verdict = "PASS" if check["pass"] else "MISS"
        print(
            f"  {verdict}  {check['check']:<18} {check['value']:8.4f}  (target <= {check['limit']})"
        )


def print_memory(mem: dict[str, Any]) -> None:
    print()
    print(
        f"== memory: {mem['graphbuild']['model']}, fp32 weights "
        f"{mem['graphbuild']['fp32_weight_bytes'] / 2**20:.1f} MiB"
    )
    print(
        f"{'process':<22} {'rss built':>10} {'peak rss':>10} {'peak/w':>7} {'(peak-built)/w':>15}"
        f" {'seconds':>8}"
    )
    for what in ("baseline", "graphbuild"):
        m = mem.get(what)
        if not m:
            continue
        print(
            f"{what + ' cold export':<22} {m['rss_after_build'] / 2**20:8.0f}Mi "
            f"{m['peak_rss'] / 2**20:8.0f}Mi {m['peak_over_weights']:7.2f} "
            f"{m['export_over_weights']:15.2f} {m['seconds']:8.2f}"
        )
    for check in mem["checks"]:
        verdict = "PASS" if check["pass"] else "MISS"
        print(
            f"  {verdict}  {check['check']:<30} {check['value']:6.2f}  (target <= {check['limit']})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help=f"comma-separated, from {ALL_MODELS}")
    parser.add_argument("--quick", action="store_true", help="skip the mid-size decoder")
    parser.add_argument(
        "--repeat",
        type=int,
        default=None,
        help="repetitions per model (default 3 small, 1 mid-size)",
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the memory measurement")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--save", default=None, help="also write the JSON document here")
    parser.add_argument(
        "--machine",
        default=None,
        help="a name for this machine, recorded in the document; with no --save, the document "
        "is written to bench/results/<machine>.json",
    )
    parser.add_argument("--profile-dir", default=None, help="pyinstrument text per case here")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--memory-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--memory-what", default="graphbuild", help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        res = run_model(args.worker, args.repeat or 1, args.profile_dir)
        Path(args.result).write_text(json.dumps(res))
        return
    if args.memory_worker:
        res = run_memory(args.memory_worker, args.memory_what)
        Path(args.result).write_text(json.dumps(res))
        return

    names = [n.strip() for n in args.models.split(",")] if args.models else list(DEFAULT_MODELS)
    if args.quick:
        names = [n for n in names if n not in ("mid_decoder", "large_decoder")]
    unknown = set(names) - set(ALL_MODELS)
    if unknown:
        parser.error(f"unknown model(s) {', '.join(sorted(unknown))}; known: {ALL_MODELS}")

    doc: dict[str, Any] = {
        "models": {},
        "targets": TARGETS,
        "memory_target": MEMORY_TARGET,
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "machine": _machine(args.machine),
    }
    if not args.json:
        load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        print(f"{os.cpu_count()} CPUs, load average at start {load} (other processes add noise)")
    for name in names:
        repeat = args.repeat or (1 if name in ("mid_decoder", "large_decoder") else 3)
        extra = ["--profile-dir", args.profile_dir] if args.profile_dir else []
        result = _child(["--worker", name, "--repeat", str(repeat), *extra])
        summary = summarize(result)
        doc["models"][name] = {**result, **summary}
        if not args.json:
            print_model(result, summary)
            sys.stdout.flush()

    measured = [n for n in ("large_decoder", "mid_decoder") if n in names]
    if measured and not args.no_memory:
        biggest = measured[0]
        limit = LARGE_MEMORY_TARGET if biggest == "large_decoder" else MEMORY_TARGET
        mem = {
            what: _child(["--memory-worker", biggest, "--memory-what", what])
            for what in ("baseline", "graphbuild")
        }
        g = mem["graphbuild"]
        mem["checks"] = [
            {
                "check": "graphbuild peak / weights",
                "value": g["peak_over_weights"],
                "limit": limit,
                "pass": g["peak_over_weights"] <= limit,
            },
            {
                "check": "graphbuild (peak-built) / w",
                "value": g["export_over_weights"],
                "limit": limit,
                "pass": g["export_over_weights"] <= limit,
            },
        ]
        doc["memory"] = mem
        if not args.json:
            print_memory(mem)

    if args.machine and not args.save:
        args.save = str(ROOT / "bench" / "results" / f"{args.machine}.json")
    if args.save:
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        Path(args.save).write_text(json.dumps(doc, indent=2, default=str) + "\n")
    if args.json:
        print(json.dumps(doc, indent=2, default=str))


if __name__ == "__main__":
    main()
