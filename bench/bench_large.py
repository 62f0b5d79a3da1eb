"""Benchmark: graphbuild alone on the 787M-parameter decoder, for machines that cannot hold the
whole ``bench_export.py --models large_decoder`` run (about 32 GiB: its float baseline export
peaks at 5.5x the weights). One process, one fresh cache per path, the same cases as
``bench_export.py``: the pre-quantized model's cold, warm, scales-only, weights-only and
encodings-version exports, then the float model through the ``w8a16`` preset (cold), a preset
change (``w8a8``) and a recalibration, with the recalibration's forward passes timed alone.
Each case's fraction is of its path's cold export, the recalibration's beyond its passes.

    python bench/bench_large.py [--model large_decoder] [--save FILE]

Peak memory is ``bench_export.py --memory-worker large_decoder``'s measurement (one cold
export in a process of its own).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="large_decoder")
    parser.add_argument("--save", default=None, help="write the JSON document here too")
    args = parser.parse_args()
    warnings.simplefilter("ignore")

    import torch

    import graphbuild as gb
    from bench import models

    bm = models.build(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="graphbuild-bench-large-"))
    cases: dict[str, Any] = {}

    def run(case: str, model: Any, path: str, **options: Any) -> None:
        gc.collect()
        t0 = time.perf_counter()
        art = gb.export(
            model,
            bm.sample,
            tmp / f"out-{path}",
            args.model,
            options=gb.QnnOnnxOptions(**options),
            cache=str(tmp / f"cache-{path}"),
        )
        seconds = time.perf_counter() - t0
        load = os.getloadavg()[0]
        cases[case] = {"seconds": seconds, "ran": art.report.ran, "load": load}
        print(f"{case:14s} {seconds:8.2f} s  load {load:.2f}  ran {', '.join(art.report.ran)}")

    try:
        run("cold", bm.fq, "fq")
        run("warm", bm.fq, "fq")
        models.change_scales(bm.fq)
        run("scales", bm.fq, "fq")
        models.change_weights(bm.fq)
        run("weights", bm.fq, "fq")
        run("encodings", bm.fq, "fq", encodings_version="2.0.0")
        first, second = bm.calibration(0), bm.calibration(1)
        run("preset_cold", bm.float, "preset", quantizer="w8a16", calibration=first)
        run("preset", bm.float, "preset", quantizer="w8a8", calibration=first)
        run("recalibration", bm.float, "preset", quantizer="w8a8", calibration=second)
        t0 = time.perf_counter()
        with torch.no_grad():
            for batch in second:
                bm.float(*batch)
        cases["passes"] = {"seconds": time.perf_counter() - t0}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    cold, preset_cold = cases["cold"]["seconds"], cases["preset_cold"]["seconds"]
    fractions = {c: cases[c]["seconds"] / cold for c in ("warm", "scales", "weights", "encodings")}
    fractions["preset"] = cases["preset"]["seconds"] / preset_cold
    fractions["recalibration - passes"] = (
        cases["recalibration"]["seconds"] - cases["passes"]["seconds"]
    ) / preset_cold
    for name, value in fractions.items():
        print(f"  {name:24s} {value:.3f} of cold")
    doc = {
        "model": args.model,
        "fp32_weight_bytes": models.weight_bytes(bm.float),
        "cases": cases,
        "fractions": fractions,
        "loadavg_end": os.getloadavg(),
    }
    if args.save:
        Path(args.save).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
