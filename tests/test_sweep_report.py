"""The sweep report: the Pareto front, the CSV's columns, the table, and a plot that is skipped
with the reason where matplotlib is missing."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from graphbuild.sweeps import report
from graphbuild.sweeps.runner import SweepResult, write_reports

ROOT = Path(__file__).resolve().parents[1]


def row(name, size, sqnr, status="ok", **extra):
    return {
        "variant": name,
        "values": {"quantization.preset": name},
        "status": status,
        "weight_bytes": size,
        "file_bytes": 1000,
        "sqnr_db": {"output": sqnr} if sqnr is not None else {},
        "stages": {"ran": 3, "shared": 2, "hit": 1},
        "seconds": 1.5,
        **extra,
    }


def test_the_front_holds_the_variants_no_other_beats():
    points = [(10, 20.0), (20, 30.0), (20, 25.0), (30, 29.0), (15, 20.0), (40, 45.0)]
    assert report.pareto_front(points) == [0, 1, 5]


def test_equal_points_are_both_on_the_front():
    assert report.pareto_front([(10, 20.0), (10, 20.0)]) == [0, 1]


def test_marking_the_front_skips_failed_variants_and_uses_the_worst_output():
    rows = [
        row("a", 100, 30.0),
        row("b", 50, 25.0),
        row("c", 50, None, status="failed"),
        {**row("d", 200, 40.0), "sqnr_db": {"logits": 40.0, "hidden": 10.0}},
    ]
    report.mark_front(rows)

    assert [r["pareto"] for r in rows] == [True, True, False, False]
    assert report.min_sqnr(rows[3]) == 10.0


def test_the_size_axis_is_the_weights_where_every_variant_has_them():
    assert report.size_axis([row("a", 1, 1.0), row("b", 2, 2.0)])[0] == "weight_bytes"
    assert report.size_axis([row("a", None, 1.0), row("b", 2, 2.0)])[0] == "file_bytes"


def _result(rows):
    report.mark_front(rows)
    summary = {"variants": len(rows), "stage_runs": {"capture": 1}}
    return SweepResult(rows, summary, batch=None, keys=["quantization.preset"])  # type: ignore[arg-type]


def test_the_json_and_csv_files(tmp_path):
    rows = [row("w8a16", 300, 40.0), row("w4a16", 150, float("inf")), row("x", 1, None, "failed")]
    rows[2]["error"] = "stage 'quantize': boom"

    files = write_reports(_result(rows), tmp_path)

    doc = json.loads(files["json"].read_text())
    assert doc["sweep"]["stage_runs"] == {"capture": 1}
    assert doc["variants"][1]["sqnr_db"]["output"] == "inf"
    with open(files["csv"], newline="") as f:
        lines = list(csv.DictReader(f))
    assert [line["variant"] for line in lines] == ["w8a16", "w4a16", "x"]
    assert lines[0]["quantization.preset"] == "w8a16" and lines[0]["sqnr_db[output]"] == "40.000"
    assert lines[2]["status"] == "failed" and "boom" in lines[2]["error"]


def test_the_plot_marks_the_front(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the sweep extra)")
    rows = [row("a", 100, 30.0), row("b", 50, 25.0), row("c", 120, 20.0)]

    files = write_reports(_result(rows), tmp_path)

    assert files["png"].read_bytes().startswith(b"\x89PNG")


def test_without_matplotlib_the_plot_is_skipped_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # an import of it fails

    result = _result([row("a", 100, 30.0)])
    files = write_reports(result, tmp_path)

    assert "png" not in files and not (tmp_path / "sweep.png").exists()
    assert "matplotlib is not installed" in result.summary["plot"]
    assert files["csv"].exists() and files["json"].exists()


def test_the_table_shows_values_the_worst_sqnr_and_failures():
    rows = [row("w8a16", 300, 40.0), row("bad", 1, None, "failed")]
    report.mark_front(rows)
    console = Console(width=200, record=True)

    console.print(report.rich_table(rows, ["quantization.preset"]))

    text = console.export_text()
    assert "preset" in text and "40.0" in text and "300 B" in text and "3/2/1" in text
    assert "failed" in text


def test_the_sweep_command_imports_no_torch_for_its_help():
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from graphbuild.cli.app import app\n"
        "r = CliRunner().invoke(app, ['sweep', '--help'])\n"
        "assert r.exit_code == 0 and '--vary' in r.output, r.output\n"
        "print(sorted(m for m in ('torch', 'onnx', 'ray', 'matplotlib') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
