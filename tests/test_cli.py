"""The command line, in-process through typer's CliRunner and as ``python -m graphbuild``.

One module-scoped warm cache serves every test: a single cold export of the ConvNet (w8a16),
then warm exports that cost a fraction of a second. Cache maintenance runs on copies.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console
from typer.testing import CliRunner

from graphbuild.cli.app import Progress, app, human_size, parse_age, parse_size
from graphbuild.engine.scheduler import EventKind, RunReport, StageEvent, StageRecord
from graphbuild.errors import ExportError

ROOT = Path(__file__).resolve().parents[1]
CONVNET = ROOT / "examples" / "convnet.py"
STAGES = [
    "capture",
    "place_quantizers",
    "placement",
    "fold_source",
    "fold_weights",
    "weight_stats",
    "calibrate",
    "left_float",
    "marker_graph",
    "quant_map",
    "quant_sites",
    "qparams",
    "to_onnx",
    "lower_markers",
    "weight_qparams",
    "weight_digests",
    "bind",
    "htp_view",
    "encodings",
    "coverage",
]
# what a preset change may rerun: the stages that read the preset and their dependents
# (docs/design.md invariant 13: values, never the placement, the statistics or the ONNX export)
PRESET_DEPENDENTS = {
    "quant_map",
    "qparams",
    "weight_qparams",
    "bind",
    "encodings",
    "coverage",
}
_ENV_RESET = ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "GRAPHBUILD_DEBUG")


@pytest.fixture(autouse=True)
def _restore_import_state(tmp_path):
    """Loading a config puts its directory on sys.path; undo that, and forget the modules
    imported from this test's directory."""
    saved = list(sys.path)
    yield
    sys.path[:] = saved
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


def write_config(directory: Path, preset: str = "w8a16", extra: str = "") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "graphbuild.toml"
    path.write_text(
        textwrap.dedent(
            f"""\
            model = "{CONVNET.as_posix()}:build"
            calibration = "{CONVNET.as_posix()}:calibration"
            model_name = "convnet"
            output_dir = "out"

            [quantization]
            preset = "{preset}"
            """
        )
        + textwrap.dedent(extra)
    )
    return path


@contextlib.contextmanager
def environment(cwd: Path, cache: Path, **env: str) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        mp.setenv("GRAPHBUILD_CACHE_DIR", str(cache))
        for name in _ENV_RESET:
            mp.delenv(name, raising=False)
        for name, value in env.items():
            mp.setenv(name, value)
        yield


def invoke(*args: str, code: int = 0) -> SimpleNamespace:
    result = CliRunner().invoke(app, list(args))
    out = SimpleNamespace(code=result.exit_code, stdout=result.stdout, stderr=result.stderr)
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    return out


def invoke_json(*args: str, code: int = 0) -> dict:
    out = invoke(*args, "--json", code=code)
    return json.loads(out.stdout)  # exactly one JSON document


def statuses(doc: dict) -> dict[str, str]:
    return {s["name"]: s["status"] for s in doc["stages"]}


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> SimpleNamespace:
    """A project (graphbuild.toml in its own directory) and a cache for the whole module."""
    root = tmp_path_factory.mktemp("cli")
    project = root / "project"
    write_config(project)
    return SimpleNamespace(root=root, project=project, cache=root / "cache")


@pytest.fixture(scope="module")
def warm(shared) -> dict:
    """The cold export (``export --json``); afterwards the shared cache is warm."""
    with environment(shared.project, shared.cache):
        return invoke_json("export", "--target", "qnn")


@pytest.fixture
def cli(shared, monkeypatch) -> SimpleNamespace:
    """In-process runs in the shared project with the shared cache."""
    monkeypatch.chdir(shared.project)
    monkeypatch.setenv("GRAPHBUILD_CACHE_DIR", str(shared.cache))
    for name in _ENV_RESET:
        monkeypatch.delenv(name, raising=False)
    return shared


# --------------------------------------------------------------------------- export


def test_export_json_schema_then_a_second_run_hits_every_stage(warm, cli):
    assert set(warm) >= {"target", "format", "model_name", "output_dir", "seconds", "stages"}
    assert (warm["target"], warm["format"], warm["model_name"]) == ("qnn", "onnx", "convnet")
    assert warm["output_dir"] == str(cli.project / "out")
    assert [s["name"] for s in warm["stages"]] == STAGES
    for stage in warm["stages"]:
        assert set(stage) >= {"name", "status", "seconds", "key", "reason"}
    assert set(statuses(warm).values()) == {"ran"}
    assert set(warm["files"]) == {"onnx", "encodings", "lock"}
    assert all(Path(p).is_file() for p in warm["files"].values())

    again = invoke_json("export")
    assert statuses(again) == dict.fromkeys(STAGES, "hit")
    assert [s["key"] for s in again["stages"]] == [s["key"] for s in warm["stages"]]
    assert again["files"] == warm["files"]
    assert again["seconds_saved"] > 0


def test_plain_output_is_one_line_per_stage_and_a_summary(warm, cli):
    out = invoke("export").stdout
    lines = out.splitlines()
    for stage in STAGES:
        assert any(re.match(rf"{stage}\s+hit$", line) for line in lines), out
    assert re.search(rf"^0 ran, {len(STAGES)} hit, saved \d+\.\d s in \d+\.\d\d s$", out, re.M)
    assert "\x1b[" not in out and "✓" not in out
    assert "  onnx       out/convnet.onnx" in lines  # relative to the working directory


def test_per_tensor_data_files_are_one_line_for_people():
    from graphbuild.cli.export import _file_lines

    files = {"onnx": "/o/m.onnx", "encodings": "/o/m.encodings"}
    files.update({f"onnx.data.{k}": f"/o/m.onnx.data.{k}" for k in range(12)})
    files["lock"] = "/o/graphbuild.lock.json"
    lines = _file_lines(files)
    assert [kind for kind, _ in lines] == ["onnx", "encodings", "onnx.data", "lock"]
    assert lines[2][1].endswith("m.onnx.data.<0-11> (12 files)")


def test_quiet_prints_only_the_files(warm, cli):
    out = invoke("export", "--quiet").stdout
    assert out.splitlines() == [warm["files"][k] for k in ("onnx", "encodings", "lock")]


def test_terminal_shows_a_coloured_line_per_stage_and_the_summary(warm, cli, monkeypatch):
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich treats the captured stream as a terminal
    monkeypatch.setenv("TERM", "xterm")
    out = invoke("export").stdout
    assert "\x1b[32m" in out  # green hits
    for stage in STAGES:
        assert re.search(rf"✓ \S*{stage}\s", re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out)), out
    assert f"0 ran, {len(STAGES)} hit, saved" in out
    monkeypatch.setenv("NO_COLOR", "1")
    plain = invoke("export").stdout
    assert "✓" in plain and "\x1b[32m" not in plain


def test_progress_spins_while_a_stage_runs_then_shows_status_seconds_and_reason():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120, no_color=True)
    with Progress(console) as progress:
        assert progress.live
        progress(StageEvent(EventKind.HIT, "capture", "k1"))
        progress(StageEvent(EventKind.STARTED, "quantize", "k2", reason="ctx.quantizer: a -> b"))
        progress(StageEvent(EventKind.RAN, "quantize", "k2", 2.5, "ctx.quantizer: a -> b"))
        progress(StageEvent(EventKind.CUTOFF, "to_onnx", "k3"))
        progress(StageEvent(EventKind.FAILED, "bind", "k4", 0.25, error=ValueError("bad")))
    report = RunReport(
        "qnn:m",
        [
            StageRecord("capture", "hit", saved_seconds=1.0),
            StageRecord("quantize", "ran", seconds=2.5),
            StageRecord("to_onnx", "cutoff", saved_seconds=2.0),
        ],
    )
    console.print(progress.summary(report, 3.0))
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buf.getvalue())
    assert "quantize running" in text  # the spinner line
    assert re.search(r"✓ capture\s+hit", text)
    assert re.search(r"● quantize\s+ran\s+2\.50 s  ctx\.quantizer: a -> b", text)
    assert re.search(r"≈ to_onnx\s+cutoff\s+early cutoff", text)
    assert re.search(r"✗ bind\s+failed\s+0\.25 s  ValueError: bad", text)
    assert "1 ran, 2 hit, saved 3.0 s (1 early cutoff) in 3.00 s" in text


def test_force_reruns_the_named_stage_only(warm, cli):
    doc = invoke_json("export", "--force", "encodings")
    assert [n for n, s in statuses(doc).items() if s == "ran"] == ["encodings"]
    assert next(s for s in doc["stages"] if s["name"] == "encodings")["reason"] == "forced"
    err = invoke_json("export", "--force", "nosuch", code=2)
    assert "cannot force unknown stage(s) nosuch" in err["error"]["message"]


def test_bare_force_forces_every_stage(cli, monkeypatch):
    seen = {}

    def fake_export(request):
        seen["force"] = request.force
        raise ExportError("stopped before any work")

    monkeypatch.setattr("graphbuild.api.export_with_pipeline", fake_export)
    assert "stopped" in invoke("export", "--force", "--quiet", code=2).stderr
    assert seen["force"] is True
    invoke("export", "--quiet", "--force", code=2)
    assert seen["force"] is True
    invoke("export", "--force", "bind", "--force", "encodings", code=2)
    assert seen["force"] == ["bind", "encodings"]


def test_dry_run_and_status_execute_nothing(warm, cli):
    before = invoke_json("cache", "stats")
    for doc in (invoke_json("export", "--dry-run"), invoke_json("status")):
        assert set(doc) >= {"target", "format", "model_name", "run_id", "dirty", "stages"}
        assert doc["up_to_date"] is True and doc["dirty"] == []
        assert statuses(doc) == dict.fromkeys(STAGES, "hit")
        assert {"name", "status", "key", "reason", "changes"} <= set(doc["stages"][0])
    after = invoke_json("cache", "stats")
    assert (after["misses"], after["entries"]) == (before["misses"], before["entries"])
    assert "up to date" in invoke("status").stdout
    no_cache = invoke_json("status", "--no-cache")
    assert statuses(no_cache) == {"capture": "dirty", **dict.fromkeys(STAGES[1:], "maybe")}
    assert no_cache["stages"][0]["reason"] == "no cache" and no_cache["cache"] is None


# --------------------------------------------------------------------------- preset change


@pytest.fixture(scope="module")
def preset_change(shared, warm) -> SimpleNamespace:
    """Export with w8a16, switch the tmp graphbuild.toml to w8a8, then status, export and
    explain (against the w8a16 config) in that order."""
    project = shared.root / "preset"
    write_config(project, "w8a16")
    with environment(project, shared.cache):
        before = invoke_json("export")
        write_config(project, "w8a8")
        status = invoke_json("status")
        after = invoke_json("export")
        back = ["--set", "quantization.preset=w8a16"]
        explain = invoke_json("explain", *back)
        explain_text = invoke("explain", "qparams", *back).stdout
        one = invoke_json("explain", "qparams", *back)
        unknown = invoke_json("explain", "nosuch", code=2)
    return SimpleNamespace(
        before=before,
        status=status,
        after=after,
        explain=explain,
        explain_text=explain_text,
        one=one,
        unknown=unknown,
    )


def test_preset_change_status_names_the_value_stages_dirty_because_of_ctx_quantizer(
    preset_change,
):
    assert statuses(preset_change.before) == dict.fromkeys(STAGES, "hit")
    status = preset_change.status
    assert status["dirty"] == ["quant_map", "qparams"] and status["up_to_date"] is False
    for name in status["dirty"]:
        stage = next(s for s in status["stages"] if s["name"] == name)
        assert "ctx.quantizer" in stage["reason"]
        assert {"read": "ctx.quantizer", "old": "w8a16", "new": "w8a8"} in stage["changes"]
    assert {statuses(status)[s] for s in set(STAGES) - PRESET_DEPENDENTS} == {"hit"}
    assert {statuses(status)[s] for s in PRESET_DEPENDENTS - set(status["dirty"])} == {"maybe"}


def test_preset_change_export_reruns_values_never_the_placement_or_calibration(preset_change):
    ran = {name for name, s in statuses(preset_change.after).items() if s == "ran"}
    assert {"quant_map", "qparams"} <= ran <= PRESET_DEPENDENTS
    for stage in ("capture", "place_quantizers", "calibrate", "weight_stats", "marker_graph"):
        assert statuses(preset_change.after)[stage] == "hit"
    qparams = next(s for s in preset_change.after["stages"] if s["name"] == "qparams")
    assert qparams["reason"] == "ctx.quantizer: w8a16 -> w8a8"


def test_preset_change_export_does_not_rerun_the_onnx_exporter(preset_change):
    assert statuses(preset_change.after)["to_onnx"] == "hit"


def test_explain_shows_each_changed_read_with_old_and_new_values(preset_change):
    stages = {s["name"]: s for s in preset_change.explain["stages"]}
    assert list(stages) == STAGES
    assert preset_change.explain["run_id"] == "qnn:convnet"
    qparams = stages["qparams"]
    assert qparams["status"] == "hit"  # w8a16 is still cached, but the last run was w8a8
    assert qparams["changes"] == [{"read": "ctx.quantizer", "old": "w8a8", "new": "w8a16"}]
    assert qparams["last_run"]["status"] == "ran" and qparams["last_run"]["when"] > 0
    assert stages["capture"]["changes"] == []
    assert stages["capture"]["reason"] == "unchanged since the last run"
    for unchanged in ("place_quantizers", "calibrate"):  # structure and statistics
        assert stages[unchanged]["reason"] == "unchanged since the last run"
    # which tensor each quantizer marks is the same for every preset: no new lowering
    assert stages["lower_markers"]["reason"] == "unchanged since the last run"
    assert [c["read"] for c in stages["encodings"]["changes"]][:1] == ["ctx.quantizer"]
    assert [s["name"] for s in preset_change.one["stages"]] == ["qparams"]
    assert "ctx.quantizer: w8a8 -> w8a16" in preset_change.explain_text
    assert "no stage named 'nosuch'" in preset_change.unknown["error"]["message"]


@pytest.fixture(scope="module")
def readme_loop(shared, warm) -> SimpleNamespace:
    """The README's tuning loop under its own model name (so its last-run records are its
    own): export, export w8a8, export encodings 2.0.0 (w8a16), then explain encodings."""
    project = shared.root / "readme"
    write_config(project, "w8a16")
    name = ["--name", "tour"]
    with environment(project, shared.cache):
        invoke("export", *name)
        invoke("export", *name, "--set", "quantization.preset=w8a8")
        versioned = invoke_json("export", *name, "--set", "options.encodings_version=2.0.0")
        explained = invoke("explain", "encodings", *name).stdout
        doc = invoke_json("explain", "encodings", *name)
    return SimpleNamespace(versioned=versioned, explained=explained, doc=doc)


def test_explain_lists_the_more_reads_an_export_summarised(readme_loop):
    encodings = next(s for s in readme_loop.versioned["stages"] if s["name"] == "encodings")
    assert encodings["reason"] == "ctx.encodings_version: 1.0.0 -> 2.0.0 (+3 more)"
    ran_because = readme_loop.explained.split("why that run ran:")[1].splitlines()[1:]
    assert [line.split(":")[0].strip() for line in ran_because] == [
        "ctx.encodings_version",
        "ctx.quantizer",
        "output of 'quant_map'",
        "output of 'qparams'",
    ]
    assert "ctx.quantizer: w8a8 -> w8a16" in readme_loop.explained
    (stage,) = readme_loop.doc["stages"]
    assert stage["last_run"]["reason"] == encodings["reason"]
    assert len(stage["last_run"]["changes"]) == 4


# --------------------------------------------------------------------------- graph, targets


def test_graph_text_dot_mermaid_and_json(cli):
    text = invoke("graph").stdout
    assert text.startswith(f"qnn/onnx: {len(STAGES)} stages")
    for stage in STAGES:
        assert stage in text
    assert "reads input.structure, samples.spec" in text
    dot = invoke("graph", "--format", "dot").stdout
    assert dot.startswith('digraph "qnn/onnx"') and '"capture" -> "place_quantizers";' in dot
    mermaid = invoke("graph", "-f", "mermaid").stdout
    assert mermaid.startswith("flowchart LR") and "capture --> place_quantizers" in mermaid
    doc = invoke_json("graph", "--export-format", "onnx_qdq")
    assert doc["pipeline"] == "qnn/onnx_qdq" and doc["format"] == "onnx_qdq"
    by_name = {s["name"]: s for s in doc["stages"]}
    assert by_name["capture"]["reads"] == ["input.structure", "samples.spec"]
    assert by_name["to_onnx"]["depends_on"] == ["marker_graph"]
    assert by_name["bind"]["product"] and not by_name["capture"]["product"]
    invoke("graph", "--format", "png", code=2)


def test_graph_needs_no_config_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    doc = invoke_json("graph")
    names = [s["name"] for s in doc["stages"]]
    assert "quantize" not in names and "place_quantizers" not in names  # no quantizer


def test_targets_lists_every_target_with_its_formats_and_options():
    doc = {t["target"]: t for t in invoke_json("targets")["targets"]}
    assert doc["qnn"]["formats"] == ["onnx", "onnx_qdq", "context", "llm"]
    assert doc["qnn"]["default_format"] == "onnx"
    assert "opset" in doc["qnn"]["options"] and "w8a16" in doc["qnn"]["presets"]
    assert doc["executorch"]["formats"][0] == "xnnpack"
    assert "recipe" in doc["executorch"]["options"]
    assert doc["executorch"]["top_level"] == ["recipe"] and doc["qnn"]["top_level"] == []
    text = invoke("targets").stdout
    assert "qnn:" in text and "executorch:" in text
    assert "formats: xnnpack, portable, vgf (default xnnpack)" in text


# --------------------------------------------------------------------------- cache


def test_cache_path_stats_ls_and_show(warm, cli, monkeypatch):
    assert invoke("cache", "path").stdout.strip() == str(cli.cache)
    assert invoke_json("cache", "path", "--cache-dir", "elsewhere")["path"] == str(
        cli.project / "elsewhere"
    )
    stats = invoke_json("cache", "stats")
    keys = {"entries", "blobs", "bytes", "hits", "misses", "corrupt", "bytes_saved"}
    assert keys | {"seconds_saved", "path", "size_limit"} <= set(stats)
    assert stats["entries"] >= len(STAGES) and stats["path"] == str(cli.cache)
    assert re.search(r"size\s+\d+(\.\d)? (B|KiB|MiB) in \d+ blobs", invoke("cache", "stats").stdout)

    entries = invoke_json("cache", "ls")["entries"]
    assert {"key", "stage", "pipeline", "bytes", "seconds", "created", "last_used"} <= set(
        entries[0]
    )
    capture = next(e for e in entries if e["stage"] == "capture")
    manifest = invoke_json("cache", "show", capture["key"][:12])
    assert manifest["key"] == capture["key"] and manifest["stage"] == "capture"
    assert "input.structure" in manifest["reads"]
    listed = sum(e["bytes"] for e in entries)
    total = invoke("cache", "ls").stdout.strip().splitlines()[-1]
    assert total.startswith(f"{len(entries)} entries, {human_size(listed)} of outputs")
    assert "no entry" in invoke_json("cache", "show", "zzzz", code=2)["error"]["message"]


def test_cache_ls_total_agrees_with_stats_or_says_why(warm, cli):
    listed = sum(e["bytes"] for e in invoke_json("cache", "ls")["entries"])
    stored = invoke_json("cache", "stats")
    total = invoke("cache", "ls").stdout.strip().splitlines()[-1]
    assert listed != stored["bytes"]  # the ConvNet's stages share blobs
    assert f"the cache holds {human_size(stored['bytes'])} in {stored['blobs']} blobs" in total
    assert "stored once" in total


@pytest.fixture
def cache_copy(warm, shared, tmp_path) -> Path:
    copy = tmp_path / "cache"
    shutil.copytree(shared.cache, copy)
    return copy


def test_cache_prune_by_size_evicts_until_it_fits(cache_copy):
    before = invoke_json("cache", "stats", "--cache-dir", str(cache_copy))
    doc = invoke_json("cache", "prune", "--max-size", "1K", "--cache-dir", str(cache_copy))
    assert doc["command"] == "prune" and doc["removed_entries"] > 0
    assert doc["freed_bytes"] > 0 and doc["stats"]["bytes"] <= 1024
    assert doc["stats"]["bytes"] == before["bytes"] - doc["freed_bytes"]
    assert doc["stats"]["entries"] == before["entries"] - doc["removed_entries"]
    assert (
        invoke_json("cache", "prune", "--older-than", "7d", "--cache-dir", str(cache_copy))[
            "removed_entries"
        ]
        == 0
    )


def test_cache_prune_reports_in_human_sizes(cache_copy):
    out = invoke("cache", "prune", "--max-size", "0", "--cache-dir", str(cache_copy)).stdout
    assert re.search(r"^freed \d+\.\d (KiB|MiB), removed \d+ entries and \d+ blobs$", out, re.M)
    assert re.search(r"-> 0 B, 0 entries$", out, re.M)


def test_cache_gc_removes_unreferenced_blobs_only(cache_copy):
    from graphbuild.engine.artifact_store import Cache
    from graphbuild.hashing import digest_bytes

    cache = Cache(cache_copy)
    data = b"orphan" * 1000
    digest = digest_bytes(data)
    cache.blobs.write(digest, data)
    os.utime(cache.blobs.path(digest), (1, 1))  # older than gc's grace period
    entries = cache.stats().entries
    cache.close()
    doc = invoke_json("cache", "gc", "--cache-dir", str(cache_copy))
    assert (doc["removed_blobs"], doc["freed_bytes"]) == (1, len(data))
    assert doc["stats"]["entries"] == entries
    out = invoke("cache", "gc", "--cache-dir", str(cache_copy)).stdout
    assert out.startswith("freed 0 B, removed 0 entries and 0 blobs")


def test_cache_verify_finds_and_removes_a_corrupt_blob(cache_copy):
    blob = max((p for p in (cache_copy / "blobs").rglob("*") if p.is_file()), key=os.path.getsize)
    blob.write_bytes(b"\0" * blob.stat().st_size)
    doc = invoke_json("cache", "verify", "--cache-dir", str(cache_copy), code=1)
    assert doc["command"] == "verify" and doc["checked_blobs"] > 0
    assert any(c.startswith("blob ") for c in doc["corrupt"])
    assert doc["removed_blobs"] == 1 and doc["removed_entries"] >= 1
    out = invoke("cache", "verify", "--cache-dir", str(cache_copy)).stdout
    assert re.search(r"^checked \d+ blobs and \d+ entries, 0 corrupt, freed 0 B", out)


def test_cache_clean_removes_everything(cache_copy):
    before = invoke_json("cache", "stats", "--cache-dir", str(cache_copy))
    doc = invoke_json("cache", "clean", "--cache-dir", str(cache_copy))
    assert doc["removed_entries"] == before["entries"] and doc["freed_bytes"] == before["bytes"]
    assert (doc["stats"]["entries"], doc["stats"]["bytes"]) == (0, 0)
    assert invoke("cache", "clean", "--cache-dir", str(cache_copy)).stdout.startswith("freed 0 B")


def test_cache_sizes_and_ages_parse_and_print():
    assert [parse_size(s) for s in ("1024", "500M", "2G", "1.5k", "3MiB")] == [
        1024,
        500 << 20,
        2 << 30,
        1536,
        3 << 20,
    ]
    assert [parse_age(s) for s in ("30m", "12h", "7d", "90")] == [1800, 43200, 604800, 90]
    assert [human_size(n) for n in (0, 1023, 1024, 12.3 * 2**20)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "12.3 MiB",
    ]


def test_bad_sizes_and_missing_prune_limits_are_usage_errors(tmp_path):
    cache = str(tmp_path / "c")
    err = invoke_json("cache", "prune", "--max-size", "12X", "--cache-dir", cache, code=2)
    assert "not a size" in err["error"]["message"]
    invoke("cache", "prune", "--cache-dir", cache, code=2)


# --------------------------------------------------------------------------- errors


def test_missing_config_is_exit_2_and_says_how_to_create_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = invoke("export", code=2)
    assert "no graphbuild.toml" in out.stderr and "Create" in out.stderr
    assert "Traceback" not in out.stderr
    err = invoke_json("status", code=2)
    assert err["error"]["type"] == "ConfigError" and err["error"]["exit_code"] == 2
    invoke("export", "--config", str(tmp_path / "nope.toml"), code=2)


def _bad_project(directory: Path, text: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "cli_models.py").write_text(
        textwrap.dedent(
            """\
            import torch

            def raises():
                raise RuntimeError("weights not found at /nowhere/w.pt")

            class Boom(torch.nn.Module):
                def forward(self, x):
                    raise ValueError("forward exploded")

            def boom():
                return Boom(), (torch.randn(2),)
            """
        )
    )
    (directory / "graphbuild.toml").write_text(textwrap.dedent(text))
    return directory


@pytest.mark.parametrize(
    "toml, message",
    [
        ('model = "missing.py:build"\n', "no such model file"),
        ('model = "cli_models.py:nope"\n', "has no attribute 'nope'"),
        ('model = "cli_models.py:raises"\n', "raised RuntimeError: weights not found at /nowhere"),
        ('model = "cli_models.py:boom"\n[options]\nopsett = 1\n', "did you mean 'opset'"),
        ('model = "cli_models.py:boom"\n[options]\nopset = "17"\n', "must be an integer, got '17'"),
        (
            'model = "cli_models.py:boom"\nformat = "onnx_xyz"\n',
            "has no format 'onnx_xyz'; did you mean 'onnx'? Formats: context, llm, onnx, onnx_qdq",
        ),
    ],
)
def test_bad_configuration_is_exit_2_with_a_message_not_a_traceback(
    tmp_path, monkeypatch, toml, message
):
    monkeypatch.chdir(_bad_project(tmp_path, toml))
    monkeypatch.setenv("GRAPHBUILD_CACHE_DIR", str(tmp_path / "cache"))
    out = invoke("export", code=2)
    assert message in out.stderr and out.stderr.startswith("error: ")
    assert "Traceback" not in out.stderr and out.stdout == ""
    assert message in invoke_json("status", code=2)["error"]["message"]


def test_graphbuild_debug_shows_the_traceback(tmp_path, monkeypatch):
    monkeypatch.chdir(_bad_project(tmp_path, 'model = "cli_models.py:raises"\n'))
    monkeypatch.setenv("GRAPHBUILD_DEBUG", "1")
    out = invoke("export", code=2)
    assert "Traceback" in out.stderr and "weights not found" in out.stderr


def test_failing_stage_is_exit_1_naming_the_stage(tmp_path, monkeypatch):
    monkeypatch.chdir(_bad_project(tmp_path, 'model = "cli_models.py:boom"\n'))
    monkeypatch.setenv("GRAPHBUILD_CACHE_DIR", str(tmp_path / "cache"))
    out = invoke("export", code=1)
    assert "error: stage 'capture' failed: ValueError: forward exploded" in out.stderr
    assert "Traceback" not in out.stderr
    assert re.search(r"^capture\s+failed\s+\d+\.\d\d s  ValueError: forward exploded", out.stdout)
    doc = invoke_json("export", code=1)
    assert doc["error"]["stage"] == "capture" and doc["error"]["exit_code"] == 1
    assert statuses(doc)["capture"] == "failed" and statuses(doc)["to_onnx"] == "skipped"


def test_usage_errors_are_exit_2(cli):
    invoke("export", "--no-such-flag", code=2)
    invoke("cache", "frobnicate", code=2)
    err = invoke_json("status", "--cache-dir", "x", "--no-cache", code=2)
    assert "contradict" in err["error"]["message"]


# --------------------------------------------------------------------------- subprocesses


def run_module(*args: str, cwd: Path, cache: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in _ENV_RESET}
    env["GRAPHBUILD_CACHE_DIR"] = str(cache)
    return subprocess.run(
        [sys.executable, "-m", "graphbuild", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_python_m_graphbuild_export_in_a_project_with_no_other_flag(warm, shared):
    proc = run_module("export", "--target", "qnn", "--json", cwd=shared.project, cache=shared.cache)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads(proc.stdout)  # stdout is exactly one JSON document
    assert doc["model_name"] == "convnet" and set(doc["files"]) == {"onnx", "encodings", "lock"}
    # Same keys in a new process: the model file loads under a stable module name, and no
    # key depends on the process (hash seeds, ids, import order).
    ran = [s for s in doc["stages"] if s["status"] != "hit"]
    assert not ran, ran


def test_python_m_graphbuild_factory_error_is_exit_2_without_traceback(tmp_path):
    project = _bad_project(tmp_path, 'model = "cli_models.py:raises"\n')
    proc = run_module("export", cwd=project, cache=tmp_path / "cache")
    assert proc.returncode == 2
    assert "raised RuntimeError: weights not found at /nowhere/w.pt" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_cli_needs_no_click_package():
    """typer 0.29 vendors click: a plain `pip install graphbuild` has no click package."""
    code = "import sys; sys.modules['click'] = None; import graphbuild.cli.app; print('ok')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
