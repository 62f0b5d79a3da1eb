"""The sweep report: one row per variant, as ``sweep.json``, ``sweep.csv``, a rich table and
``sweep.png`` (size against SQNR, the Pareto front marked).

A row holds the variant's values, what quantizing cost (SQNR against the float model per
output, from the numerics report; the plain SQNR where the target measures only against its
own reference), the device check where the export ran one (a report with a ``summary`` under
``htp``), the files and their sizes, the weight size as the device stores it where a report
gives it (``weight_bytes``), the coverage line, and the time: the seconds of the stages this
variant ran itself (a stage another variant shared by key is counted there once), and how
many of its stages ran, were shared or were hits.

The plot needs matplotlib (``pip install 'graphbuild[sweep]'``); without it the sweep writes
the JSON and CSV and says the plot was skipped.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

__all__ = [
    "min_sqnr",
    "pareto_front",
    "plot",
    "rich_table",
    "size_axis",
    "write_csv",
    "write_json",
]


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def sqnr_by_output(numerics: Mapping[str, Any] | None) -> dict[str, float | None]:
    """Output name -> SQNR in dB against the float model (else against the target's own
    reference, for a model that brought its own quantizers)."""
    if not isinstance(numerics, Mapping):
        return {}
    out = {}
    for row in numerics.get("outputs", []):
        value = row.get("sqnr_db_vs_float", row.get("sqnr_db"))
        out[str(row.get("name"))] = _finite(value) if value != math.inf else math.inf
    return out


def min_sqnr(row: Mapping[str, Any]) -> float | None:
    """The worst output's SQNR of a row (what the plot and the front use)."""
    values = [v for v in (row.get("sqnr_db") or {}).values() if v is not None]
    return min(values) if values else None


def weight_bytes(reports: Mapping[str, Any]) -> int | None:
    """The weight size a report gives (``weight_bytes``: as the device stores them)."""
    for report in reports.values():
        if isinstance(report, Mapping) and isinstance(report.get("weight_bytes"), int):
            return int(report["weight_bytes"])
    return None


def size_axis(rows: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
    """(row key, label) of the size the plot puts on its x axis: the weight size where every
    row has one, else the files' size."""
    ok = [r for r in rows if r.get("status") == "ok"]
    if ok and all(r.get("weight_bytes") is not None for r in ok):
        return "weight_bytes", "weights as stored on the device (bytes)"
    return "file_bytes", "exported files (bytes)"


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats: smaller or equal size and larger or
    equal SQNR, one of them strictly. In order of size."""
    front = []
    for i, (size, sqnr) in enumerate(points):
        beaten = any(
            (s <= size and q >= sqnr) and (s < size or q > sqnr)
            for j, (s, q) in enumerate(points)
            if j != i
        )
        if not beaten:
            front.append(i)
    return sorted(front, key=lambda i: (points[i][0], -points[i][1]))


def mark_front(rows: list[dict[str, Any]]) -> None:
    """Set ``pareto`` on every row: True for the variants on the front."""
    key, _ = size_axis(rows)
    candidates = [
        (i, (float(r[key]), min_sqnr(r)))
        for i, r in enumerate(rows)
        if r.get("status") == "ok" and r.get(key) is not None and min_sqnr(r) is not None
    ]
    front = {candidates[k][0] for k in pareto_front([p for _, p in candidates])}
    for i, row in enumerate(rows):
        row["pareto"] = i in front


# --------------------------------------------------------------------------- files


def write_json(path: Path, summary: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> None:
    doc = {"sweep": dict(summary), "variants": list(rows)}
    path.write_text(json.dumps(_jsonable(doc), indent=2, sort_keys=False) + "\n")


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "inf": an output that matches exactly
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def csv_rows(rows: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> tuple[list, list]:
    """(header, rows) of the CSV: one column per varied key, per output's SQNR, and the
    figures."""
    outputs = sorted({name for r in rows for name in (r.get("sqnr_db") or {})})
    header = ["variant", *keys, "status"]
    header += [f"sqnr_db[{name}]" for name in outputs]
    header += ["weight_bytes", "file_bytes", "pareto", "device_check", "coverage"]
    header += ["seconds", "stages_ran", "stages_shared", "stages_hit", "error"]
    out = []
    for r in rows:
        values = dict(r.get("values") or {})
        line = [r["variant"], *(_cell(values.get(k)) for k in keys), r.get("status")]
        line += [_cell((r.get("sqnr_db") or {}).get(name)) for name in outputs]
        line += [r.get("weight_bytes"), r.get("file_bytes"), r.get("pareto")]
        line += [r.get("device_check"), r.get("coverage")]
        stages = r.get("stages") or {}
        line += [f"{r.get('seconds', 0.0):.3f}", stages.get("ran"), stages.get("shared")]
        line += [stages.get("hit"), r.get("error")]
        out.append(line)
    return header, out


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        return f"{value:.3f}" if math.isfinite(value) else str(value)
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True)
    return value


def write_csv(path: Path, rows: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> None:
    header, lines = csv_rows(rows, keys)
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(header)
    writer.writerows(lines)
    path.write_text(buffer.getvalue())


# --------------------------------------------------------------------------- people


def rich_table(rows: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> Table:
    """The rows as a table for the terminal: values, worst SQNR, size, front, time."""
    size_key, _ = size_axis(rows)
    table = Table(show_edge=False, pad_edge=False)
    table.add_column("variant", no_wrap=True)
    for key in keys:
        table.add_column(key.rpartition(".")[2], no_wrap=True)
    table.add_column("SQNR dB", justify="right", no_wrap=True)
    size = "weights" if size_key == "weight_bytes" else "files"
    table.add_column(size, justify="right", no_wrap=True)
    table.add_column("front", justify="center")
    table.add_column("ran/shared/hit", justify="right", no_wrap=True)
    table.add_column("time", justify="right", no_wrap=True)
    checks = any(r.get("device_check") for r in rows)
    if checks:
        table.add_column("device check")
    for r in rows:
        values = dict(r.get("values") or {})
        cells = [r["variant"], *(_short(values.get(k)) for k in keys)]
        if r.get("status") != "ok":
            cells += ["failed", "", "", "", "", *([""] if checks else [])]
            table.add_row(*cells, style="red")
            continue
        sqnr = min_sqnr(r)
        stages = r.get("stages") or {}
        cells += [
            f"{sqnr:.1f}" if sqnr is not None else "-",
            _size(r.get(size_key)),
            "*" if r.get("pareto") else "",
            f"{stages.get('ran', 0)}/{stages.get('shared', 0)}/{stages.get('hit', 0)}",
            f"{r.get('seconds', 0.0):.1f} s",
        ]
        if checks:
            cells.append(str(r.get("device_check") or ""))
        table.add_row(*cells)
    return table


def _short(value: Any) -> str:
    if isinstance(value, str):
        return value
    text = json.dumps(value, sort_keys=True) if isinstance(value, (dict, list)) else str(value)
    return text if len(text) <= 30 else text[:27] + "..."


def _size(n: Any) -> str:
    if not isinstance(n, int):
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def plot(path: Path, rows: Sequence[Mapping[str, Any]], title: str) -> str | None:
    """Write ``sweep.png``: size against the worst output's SQNR, each variant labelled, the
    Pareto front marked and joined. None when written, else why it was skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install 'graphbuild[sweep]')"
    key, label = size_axis(rows)
    points = [
        (r, float(r[key]), min_sqnr(r))
        for r in rows
        if r.get("status") == "ok" and r.get(key) is not None and min_sqnr(r) is not None
    ]
    finite = [p for p in points if math.isfinite(p[2])]
    if not finite:
        return "no variant has a finite SQNR to plot (check_numerics off?)"
    fig, ax = plt.subplots(figsize=(7.0, 4.5), dpi=100)
    others = [p for p in finite if not p[0].get("pareto")]
    front = sorted((p for p in finite if p[0].get("pareto")), key=lambda p: p[1])
    ax.scatter([p[1] for p in others], [p[2] for p in others], color="#999999", label="variant")
    ax.plot(
        [p[1] for p in front],
        [p[2] for p in front],
        "o-",
        color="#d62728",
        label="Pareto front",
        drawstyle="steps-post",
    )
    xs, ys = [p[1] for p in finite], [p[2] for p in finite]
    dx, dy = (max(xs) - min(xs)) * 0.03 or 1.0, (max(ys) - min(ys)) * 0.04 or 1.0
    placed: list[tuple[float, float]] = []
    for r, x, y in sorted(finite, key=lambda p: (p[1], p[2])):
        near = sum(1 for px, py in placed if abs(px - x) < dx and abs(py - y) < dy)
        placed.append((x, y))
        offset = (4, 4 + 9 * near)  # labels of points close together stack upward
        ax.annotate(r["variant"], (x, y), textcoords="offset points", xytext=offset, fontsize=7)
    ax.set_xlabel(label)
    ax.set_ylabel("SQNR vs the float model, worst output (dB)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})
    plt.close(fig)
    return None
