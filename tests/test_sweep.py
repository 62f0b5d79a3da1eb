"""Sweeps of the tiny decoder: every distinct stage key runs once across the variants (one
trace, one ONNX conversion for presets x calibration sets), each variant is placed as its own
export would be, and the report has one row per variant.

The nine-variant sweep of the issue and the Ray cluster are in tests/test_sweep_ray.py (slow);
these use four variants and share one cache, so later tests build only what is new to them.
"""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

import graphbuild as gb
from graphbuild.cli.app import app
from graphbuild.errors import ConfigError
from tests.sweep_helpers import DECODER, write_config

FOUR = {"quantization.preset": ["w8a16", "w4a16"], "calibration": ["default", "narrow"]}


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A config and one cache for the module, and the four-variant sweep run over it."""
    root = tmp_path_factory.mktemp("sweep")
    config = write_config(root / "project")
    cache = gb.Cache(root / "cache")
    result = gb.sweep(FOUR, config=config, output_dir=root / "out", cache=cache, jobs=1)
    return config, cache, root, result


def test_four_variants_trace_once_and_convert_to_onnx_once(shared):
    _, _, _, result = shared

    runs = result.summary["stage_runs"]
    assert runs["capture"] == 1 and runs["to_onnx"] == 1
    # a preset quantizes in parts: one placement, one calibration per set, values per variant
    assert (runs["place_quantizers"], runs["calibrate"], runs["qparams"]) == (1, 2, 4)
    assert [r["variant"] for r in result.rows] == [
        "w8a16-default",
        "w8a16-narrow",
        "w4a16-default",
        "w4a16-narrow",
    ]
    assert all(r["status"] == "ok" for r in result.rows)
    for row in result.rows:
        assert row["stage_status"]["capture"] in ("ran", "shared")
        assert sorted(os.listdir(row["output_dir"])) == [
            "graphbuild.lock.json",
            "tiny_decoder.encodings",
            "tiny_decoder.onnx",
        ]


def test_each_row_measures_what_quantizing_cost(shared):
    rows = {r["variant"]: r for r in shared[3].rows}

    for calibration in ("default", "narrow"):
        w8, w4 = rows[f"w8a16-{calibration}"], rows[f"w4a16-{calibration}"]
        assert w8["sqnr_db"]["output"] > w4["sqnr_db"]["output"] > 10
        assert w4["weight_bytes"] < w8["weight_bytes"]
        assert w8["values"] == {"quantization.preset": "w8a16", "calibration": calibration}
        assert "tensors quantized" in w8["coverage"]
    assert any(r["pareto"] for r in rows.values())


def test_a_variant_is_the_export_it_stands_for_byte_for_byte(shared, tmp_path):
    config, _, _, result = shared
    row = next(r for r in result.rows if r["variant"] == "w4a16-narrow")
    args = ["export", "-c", str(config), "--cache-dir", str(tmp_path / "own-cache")]
    args += ["-o", str(tmp_path / "own"), "--set", "quantization.preset=w4a16"]
    args += ["--set", f'calibration="{DECODER}:calibration_narrow"', "--set", "check_numerics=true"]

    out = CliRunner().invoke(app, args)

    assert out.exit_code == 0, out.output
    for name in ("tiny_decoder.onnx", "tiny_decoder.encodings"):
        assert (Path(row["output_dir"]) / name).read_bytes() == (
            tmp_path / "own" / name
        ).read_bytes()


def test_the_report_files(shared):
    _, _, root, result = shared

    doc = json.loads((root / "out" / "sweep.json").read_text())
    assert doc["sweep"]["stage_runs"]["capture"] == 1
    assert [v["variant"] for v in doc["variants"]] == [r["variant"] for r in result.rows]
    with open(root / "out" / "sweep.csv", newline="") as f:
        lines = list(csv.DictReader(f))
    assert len(lines) == 4
    assert {"variant", "quantization.preset", "calibration", "sqnr_db[output]"} <= set(lines[0])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in doc["sweep"]["plot"]
    else:
        png = (root / "out" / "sweep.png").read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 5000


def test_a_second_sweep_over_a_warm_cache_runs_no_stage(shared, tmp_path):
    config, cache, _, first = shared

    again = gb.sweep(FOUR, config=config, output_dir=tmp_path / "out", cache=cache, jobs=1)

    assert again.summary["jobs_run"] == 0
    assert {s for r in again.rows for s in r["stage_status"].values()} == {"hit"}
    assert [r["sqnr_db"] for r in again.rows] == [r["sqnr_db"] for r in first.rows]


def test_a_process_pool_builds_what_is_new_in_its_workers(shared, tmp_path):
    config, cache, _, _ = shared

    result = gb.sweep(
        ["quantization.preset=w8a16,w4a16"],
        config=config,
        overrides=["options.opset=17"],
        output_dir=tmp_path / "out",
        cache=cache,
        jobs=2,
    )

    runs = result.summary["stage_runs"]
    # hits: the opset is read after them
    assert not {"capture", "place_quantizers", "calibrate"} & set(runs)
    assert runs["to_onnx"] == 1
    assert result.summary["workers"] and all(
        not w.endswith(f":{os.getpid()}") for w in result.summary["workers"]
    )
    assert all(r["status"] == "ok" for r in result.rows)


def test_a_failing_variant_is_reported_and_the_others_are_placed(shared, tmp_path):
    config, cache, _, _ = shared
    overlapping = '{"blocks.0.*" = "w4", "blocks.0.mlp.*" = "float"}'

    result = gb.sweep(
        [f"options.layer_overrides={overlapping},{{}}"],
        config=config,
        output_dir=tmp_path / "out",
        cache=cache,
        jobs=1,
    )

    bad, good = result.rows
    assert bad["status"] == "failed" and "'blocks.0.mlp.*'" in bad["error"]
    assert good["status"] == "ok" and good["stage_status"]["calibrate"] == "hit"
    assert result.failed == [bad["variant"]]


def test_a_variant_with_a_bad_value_fails_before_anything_runs(shared, tmp_path):
    config, cache, _, _ = shared
    with pytest.raises(ConfigError, match=r"sweep variant 99: .*opset"):
        gb.sweep(["options.opset=21,99"], config=config, output_dir=tmp_path, cache=cache)


def test_the_command_line_prints_one_json_document(shared, tmp_path, monkeypatch):
    config, cache, _, _ = shared
    monkeypatch.chdir(tmp_path)
    args = ["sweep", "-c", str(config), "--cache-dir", str(cache.path), "-j", "1", "--json"]
    args += ["-V", "quantization.preset=w8a16,w4a16", "-V", "calibration=default,narrow"]

    out = CliRunner().invoke(app, [*args, "-o", "cli-out"])

    assert out.exit_code == 0, out.output
    doc = json.loads(out.stdout)
    assert len(doc["variants"]) == 4 and doc["sweep"]["jobs_run"] == 0  # all in the cache
    assert Path(doc["files"]["csv"]) == tmp_path / "cli-out" / "sweep.csv"


def test_the_command_line_table_and_a_failed_variant_exit_1(shared, tmp_path, monkeypatch):
    config, cache, _, _ = shared
    monkeypatch.chdir(tmp_path)
    overlapping = '{"blocks.0.*" = "w4", "blocks.0.mlp.*" = "float"}'
    args = ["sweep", "-c", str(config), "--cache-dir", str(cache.path), "-j", "1"]

    out = CliRunner().invoke(app, [*args, "-V", f"options.layer_overrides={overlapping},{{}}"])

    assert out.exit_code == 1
    assert "1 of 2 variants failed" in out.output
    assert "SQNR dB" in out.output  # the table, with the variant that was placed
