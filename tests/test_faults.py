"""Faults: killed and concurrent exports, a damaged or unwritable cache, an edited model file,
and hostile configuration files and command lines.

Invariants under test (docs/design.md): a corrupt or missing cache entry is a miss, rebuilt and
counted, never an error and never a wrong output (6); outputs appear whole or not at all, and a
failed or killed export leaves the output directory as it was (8); a cache that cannot be
written warns once and the run goes on uncached; bad input is exit code 2 with a message,
never a traceback.

The fast tests run the command line in-process (typer's CliRunner) against one module-wide
warm cache, which each test copies before damaging it. The slow ones (``-m slow``) run
``python -m graphbuild`` as subprocesses: SIGKILL at random points, four exports at once,
edits to the model file between runs.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import json
import math
import os
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from graphbuild.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
CONVNET = ROOT / "examples" / "convnet.py"
WORKER = ROOT / "tests" / "fault_worker.py"
LOCK = "graphbuild.lock.json"
OUTPUTS = ("convnet.encodings", "convnet.onnx", LOCK)
# A second version of the export in which every output file differs from the first (w8a16,
# fake-quantized weights): w8a8 encodings and float weights in the ONNX model.
NEW = ("--set", "quantization.preset=w8a8", "--set", "options.fake_quantize_weights=false")
_ENV_RESET = ("NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE", "GRAPHBUILD_DEBUG")
KILL_TRIALS = 12


# --------------------------------------------------------------------------- helpers


def write_config(directory: Path, model: Path = CONVNET) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "graphbuild.toml"
    path.write_text(
        textwrap.dedent(
            f"""\
            model = "{model.as_posix()}:build"
            calibration = "{model.as_posix()}:calibration"
            model_name = "convnet"
            output_dir = "out"

            [quantization]
            preset = "w8a16"
            """
        )
    )
    return path


def digest(path: Path) -> str:
    return xxhash.xxh3_128_hexdigest(path.read_bytes())


def snapshot(directory: Path) -> dict[str, str]:
    """Every file directly in ``directory``: name -> xxh3-128 digest."""
    return {p.name: digest(p) for p in sorted(directory.iterdir()) if p.is_file()}


def contents(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def assert_outputs_whole(out: Path) -> None:
    """The ONNX model loads and runs, the encodings are JSON, the lock's digests match."""
    assert sorted(p.name for p in out.iterdir()) == sorted(OUTPUTS)
    onnx.load(str(out / "convnet.onnx"))
    session = ort.InferenceSession(str(out / "convnet.onnx"), providers=["CPUExecutionProvider"])
    (inp,) = session.get_inputs()
    x = np.random.default_rng(0).standard_normal((1, 3, 16, 16), dtype=np.float32)
    (y,) = session.run(None, {inp.name: x})
    assert y.shape == (1, 10) and np.isfinite(y).all()
    encodings = json.loads((out / "convnet.encodings").read_text())
    assert encodings["activation_encodings"] and encodings["param_encodings"]
    lock = json.loads((out / LOCK).read_text())
    assert sorted(lock["files"]) == ["convnet.encodings", "convnet.onnx"]
    for name, recorded in lock["files"].items():
        assert recorded["xxh3_128"] == digest(out / name), name
        assert recorded["bytes"] == (out / name).stat().st_size, name


def statuses(doc: dict) -> dict[str, str]:
    return {s["name"]: s["status"] for s in doc["stages"]}


def ran(doc: dict) -> list[str]:
    return [s["name"] for s in doc["stages"] if s["status"] == "ran"]


@contextlib.contextmanager
def sandbox(cwd: Path, cache: Path) -> Iterator[None]:
    """In-process CLI runs: working directory, cache location, and sys.path (which loading a
    config extends) restored afterwards."""
    saved = list(sys.path)
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        mp.setenv("GRAPHBUILD_CACHE_DIR", str(cache))
        for name in _ENV_RESET:
            mp.delenv(name, raising=False)
        try:
            yield
        finally:
            sys.path[:] = saved


def cli(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def invoke(*args: str, code: int = 0):
    result = cli(*args)
    assert result.exit_code == code, (result.exit_code, result.output[-3000:], result.exception)
    return result


def invoke_json(*args: str, code: int = 0) -> dict:
    return json.loads(invoke(*args, "--json", code=code).stdout)


def subprocess_env(cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _ENV_RESET}
    env["GRAPHBUILD_CACHE_DIR"] = str(cache)
    return env


def export_command(config: Path, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "graphbuild",
        "export",
        "--config",
        str(config),
        "--output-dir",
        str(out),
        "--json",
        *extra,
    ]


def run_export(config: Path, out: Path, cache: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        export_command(config, out, *extra),
        env=subprocess_env(cache),
        capture_output=True,
        text=True,
        timeout=600,
    )


def exported(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, failure(proc.stdout, proc.stderr)
    return json.loads(proc.stdout)


def failure(stdout: str, stderr: str) -> str:
    """What a failed ``export --json`` said: the JSON error document is on stdout."""
    try:
        return json.loads(stdout)["error"]["message"][:3000]
    except (ValueError, KeyError, TypeError):
        return (stdout + stderr)[-3000:]


# --------------------------------------------------------------------------- a warm cache


@pytest.fixture(scope="module")
def warm(tmp_path_factory) -> SimpleNamespace:
    """One cold in-process export of the ConvNet (w8a16): its cache and its output files are
    the reference every damaged-cache test compares against."""
    root = tmp_path_factory.mktemp("warm")
    config = write_config(root / "project")
    cache, reference = root / "cache", root / "reference"
    with sandbox(root / "project", cache):
        doc = invoke_json("export", "--config", config, "--cache-dir", cache, "-o", reference)
    assert set(statuses(doc).values()) == {"ran"}
    return SimpleNamespace(
        root=root, config=config, cache=cache, reference=reference, files=contents(reference)
    )


@pytest.fixture
def damaged(warm, tmp_path) -> Iterator[SimpleNamespace]:
    """A copy of the warm cache to damage, and a fresh output directory: nothing has been
    placed there, so the export must load (and so verify) every product from the cache."""
    cache = tmp_path / "cache"
    shutil.copytree(warm.cache, cache)
    with sandbox(warm.config.parent, cache):
        yield SimpleNamespace(cache=cache, out=tmp_path / "out", db=cache / "index" / "cache.db")


def export_into(warm, cache: Path, out: Path, *extra: str) -> dict:
    return invoke_json("export", "--config", warm.config, "--cache-dir", cache, "-o", out, *extra)


def cache_stats(cache: Path) -> dict:
    return invoke_json("cache", "stats", "--cache-dir", cache)


def manifest_rows(db_path: Path) -> dict[str, tuple[str, dict]]:
    """stage -> (index key, manifest) for every action-cache row of the sqlite index."""
    with contextlib.closing(sqlite3.connect(db_path)) as db:
        rows = db.execute("SELECT key, value FROM Cache WHERE key LIKE 'm:%'").fetchall()
    out = {}
    for key, value in rows:
        manifest = json.loads(value)
        assert manifest["stage"] not in out, "the warm cache holds one entry per stage"
        out[manifest["stage"]] = (key, manifest)
    return out


def blob_refs(artifact: dict) -> list[str]:
    refs = [d for d, _ in artifact["parts"]]
    for child in artifact["children"]:
        refs += blob_refs(child)
    return refs


def blob_files(cache: Path) -> list[Path]:
    return [p for p in (cache / "blobs").glob("??/*") if p.is_file()]


def blob_file(cache: Path, digest_: str) -> Path:
    return cache / "blobs" / digest_[:2] / digest_[2:]


def update_row(db_path: Path, sql: str, *params) -> None:
    with contextlib.closing(sqlite3.connect(db_path)) as db:
        assert db.execute(sql, params).rowcount == 1
        db.commit()


def flip_every_blob(cache: Path) -> None:
    blobs = blob_files(cache)
    assert blobs
    for path in blobs:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))


# --------------------------------------------------------------------------- corrupt cache


@pytest.fixture(scope="module")
def flipped(warm) -> SimpleNamespace:
    """A copy of the warm cache with one byte flipped in every blob, exported twice, each
    time into a fresh directory."""
    cache = warm.root / "cache-flipped"
    shutil.copytree(warm.cache, cache)
    flip_every_blob(cache)
    first_out, second_out = warm.root / "flipped-first", warm.root / "flipped-second"
    with sandbox(warm.config.parent, cache):
        first = export_into(warm, cache, first_out)
        first_stats = cache_stats(cache)
        second = export_into(warm, cache, second_out)
        second_stats = cache_stats(cache)
    return SimpleNamespace(
        first=first,
        first_stats=first_stats,
        first_files=contents(first_out),
        second=second,
        second_stats=second_stats,
        second_files=contents(second_out),
    )


def test_a_byte_flipped_in_every_blob_is_detected_rebuilt_and_counted(warm, flipped):
    rebuilt = [s for s in flipped.first["stages"] if s["status"] == "ran"]
    assert "encodings" in {s["name"] for s in rebuilt}  # a product was loaded: rebuilt
    # bind keeps its output's digest, not its bytes (the model holds the weights): no blob
    # to flip; the placement recomputes it, and the files are the warm export's (below)
    assert "bind" not in {s["name"] for s in rebuilt}
    assert all("corrupt" in s["reason"] for s in rebuilt), rebuilt
    assert flipped.first_files == warm.files
    assert flipped.first_stats["corrupt"] == len(rebuilt)


def test_after_rebuilding_flipped_blobs_the_next_export_hits_every_stage(warm, flipped):
    again = flipped.second
    assert ran(again) == [], [(s["name"], s["reason"]) for s in again["stages"]]
    assert flipped.second_stats["corrupt"] == flipped.first_stats["corrupt"]
    assert flipped.second_files == warm.files


def test_a_truncated_blob_is_a_counted_miss_and_only_its_stage_reruns(warm, damaged):
    rows = manifest_rows(damaged.db)
    shared = {d for s, (_, m) in rows.items() if s != "to_onnx" for d in blob_refs(m["artifact"])}
    own = [d for d in blob_refs(rows["to_onnx"][1]["artifact"]) if d not in shared]
    assert own, "to_onnx has a blob of its own"
    path = blob_file(damaged.cache, own[0])
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    doc = export_into(warm, damaged.cache, damaged.out)

    assert ran(doc) == ["to_onnx"]
    assert contents(damaged.out) == warm.files
    assert cache_stats(damaged.cache)["corrupt"] == 1


def test_a_deleted_index_row_is_a_miss_and_only_its_stage_reruns(warm, damaged):
    key, _ = manifest_rows(damaged.db)["encodings"]
    before = cache_stats(damaged.cache)
    update_row(damaged.db, "DELETE FROM Cache WHERE key = ?", key)

    doc = export_into(warm, damaged.cache, damaged.out)

    assert ran(doc) == ["encodings"]
    assert contents(damaged.out) == warm.files
    after = cache_stats(damaged.cache)
    assert after["misses"] == before["misses"] + 1
    assert after["corrupt"] == before["corrupt"]  # a missing row is indistinguishable from eviction


def test_a_new_process_rebuilding_the_marker_graph_after_a_cached_placement_exports_correctly(
    warm, damaged
):
    # What a kill after place_quantizers was stored, a pruned or corrupt marker_graph entry,
    # or an edit to its code leaves behind: place_quantizers hits, so a new process never ran
    # it, and marker_graph must load the placed program from the cache.
    key, _ = manifest_rows(damaged.db)["marker_graph"]
    update_row(damaged.db, "DELETE FROM Cache WHERE key = ?", key)

    doc = exported(
        run_export(warm.config, damaged.out, damaged.cache, "--cache-dir", damaged.cache)
    )

    assert statuses(doc)["place_quantizers"] == "hit" and statuses(doc)["marker_graph"] == "ran"
    assert contents(damaged.out) == warm.files


GARBAGE_ROWS = {  # diskcache's modes: 1 raw (in the row), 3 text file, 4 pickle
    "truncated-manifest": "UPDATE Cache SET value = substr(value, 1, length(value) / 2) WHERE key = ?",
    "garbage-text": "UPDATE Cache SET value = 'garbage' WHERE key = ?",
    "json-list": "UPDATE Cache SET value = '[1, 2, 3]' WHERE key = ?",
    "json-without-artifact": 'UPDATE Cache SET value = \'{"stage": "encodings"}\' WHERE key = ?',
    "binary-bytes": "UPDATE Cache SET value = x'00ff00ff' WHERE key = ?",
    "planted-pickle": "UPDATE Cache SET value = x'80049500', mode = 4 WHERE key = ?",
    "file-row-naming-no-file": "UPDATE Cache SET value = NULL, mode = 3, filename = NULL WHERE key = ?",
}


@pytest.mark.parametrize("garbage", list(GARBAGE_ROWS))
def test_garbage_in_an_index_row_is_a_counted_miss_and_rebuilt(warm, damaged, garbage):
    key, _ = manifest_rows(damaged.db)["encodings"]
    update_row(damaged.db, GARBAGE_ROWS[garbage], key)

    doc = export_into(warm, damaged.cache, damaged.out)

    assert ran(doc) == ["encodings"]
    assert contents(damaged.out) == warm.files
    assert cache_stats(damaged.cache)["corrupt"] == 1


def test_an_index_row_holding_another_entrys_manifest_is_a_counted_miss(warm, damaged):
    rows = manifest_rows(damaged.db)
    bind_key, _ = rows["bind"]
    _, encodings_manifest = rows["encodings"]
    update_row(
        damaged.db,
        "UPDATE Cache SET value = ? WHERE key = ?",
        json.dumps(encodings_manifest, sort_keys=True),
        bind_key,
    )

    doc = export_into(warm, damaged.cache, damaged.out)

    assert contents(damaged.out) == warm.files
    assert statuses(doc)["bind"] == "ran"
    assert cache_stats(damaged.cache)["corrupt"] == 1


# --------------------------------------------------------------------------- unwritable cache


def test_a_cache_dir_that_cannot_be_created_is_exit_2_naming_it_and_writes_nothing(warm, tmp_path):
    # We run as root, so chmod stops nothing: put the cache under a regular file instead.
    afile = tmp_path / "afile"
    afile.write_text("a regular file, not a directory")
    cache, out = afile / "cache", tmp_path / "out"
    with sandbox(warm.config.parent, tmp_path / "unused"):
        err = invoke_json(
            "export", "--config", warm.config, "--cache-dir", cache, "-o", out, code=2
        )
        plain = invoke("export", "--config", warm.config, "--cache-dir", cache, "-o", out, code=2)
    assert err["error"]["type"] == "CacheError" and err["error"]["exit_code"] == 2
    assert f"cannot create the cache at {cache}" in err["error"]["message"]
    assert plain.stderr.startswith("error: cannot create the cache at")
    assert "Traceback" not in plain.output
    assert not out.exists()


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("blocked", ["blobs", "index"])
def test_a_cache_that_cannot_be_written_warns_once_and_the_export_goes_on_uncached(
    warm, tmp_path, monkeypatch, blocked
):
    # as root, chmod stops nothing, and a file in place of a directory is damage the cache
    # repairs: the disk fills up instead
    from graphbuild.cache.local.blobs import FileBlobs
    from graphbuild.cache.local.index import DiskIndex

    monkeypatch.setattr(
        *{"blobs": (FileBlobs, "write"), "index": (DiskIndex, "set_json")}[blocked], _no_space
    )
    cache, out = tmp_path / "cache", tmp_path / "out"
    with sandbox(warm.config.parent, cache):
        result = invoke(
            "export", "--config", warm.config, "--cache-dir", cache, "-o", out, "--json"
        )
    doc = json.loads(result.stdout)

    # the CLI prints each warning once, as graphbuild's one line on stderr
    lines = result.stderr.splitlines()
    messages = [line for line in lines if "cannot write to the cache" in line]
    assert len(messages) == 1, lines
    assert messages[0].startswith("warning: cannot write to the cache")
    assert str(cache) in messages[0] and "without caching" in messages[0]
    assert "No space left on device" in messages[0]
    assert set(statuses(doc).values()) == {"ran"}
    assert contents(out) == warm.files


# --------------------------------------------------------------------------- a full disk


def _database_full(*args, **kwargs):
    # what SQLite says when it cannot grow the database or its journal (SQLITE_FULL)
    raise sqlite3.OperationalError("database or disk is full")


def fill_the_disk(monkeypatch, where: str) -> None:
    """Every write to the cache fails with ENOSPC; with ``where="open"`` opening the index
    for writing fails too, as SQLite's open does on a full disk (it writes its settings)."""
    import diskcache

    from graphbuild.cache.local.blobs import FileBlobs
    from graphbuild.cache.local.index import DiskIndex

    monkeypatch.setattr(FileBlobs, "write", _no_space)
    for method in ("set_json", "delete", "incr", "acquire_lease", "renew_lease", "clear"):
        monkeypatch.setattr(DiskIndex, method, _no_space)
    if where == "open":
        monkeypatch.setattr(diskcache, "Cache", _database_full)


@pytest.mark.parametrize("where", ["open", "writes"])
def test_on_a_full_disk_the_export_still_hits_every_cached_stage(warm, damaged, monkeypatch, where):
    fill_the_disk(monkeypatch, where)

    result = invoke(
        "export", "--config", warm.config, "--cache-dir", damaged.cache, "-o", damaged.out,
        "--json",
    )  # fmt: skip
    doc = json.loads(result.stdout)

    counts = collections.Counter(statuses(doc).values())
    assert counts == {"hit": len(doc["stages"])} and len(doc["stages"]) > 5, statuses(doc)
    assert contents(damaged.out) == warm.files
    assert (damaged.cache / "index").is_dir()  # not taken for damage and moved aside
    messages = [line for line in result.stderr.splitlines() if "cannot write" in line]
    assert len(messages) <= 1, messages  # one warning at most (no write is needed on a hit)
    if where == "open":
        assert messages and "disk is full" in messages[0] and "without caching" in messages[0]


def test_cache_verify_on_a_full_disk_says_so_and_exits_0(warm, damaged, monkeypatch):
    fill_the_disk(monkeypatch, "open")

    result = cli("cache", "verify", "--cache-dir", damaged.cache)
    doc = invoke_json("cache", "verify", "--cache-dir", damaged.cache)

    assert result.exit_code == 0, result.output
    assert "corrupt:" not in result.output and "disk is full" in result.output, result.output
    assert doc["corrupt"] == [] and doc["checked_entries"] == len(manifest_rows(damaged.db))
    assert any("disk is full" in note for note in doc["notes"]), doc["notes"]
    assert (damaged.cache / "index").is_dir()
    assert [p.name for p in damaged.cache.iterdir() if "damaged" in p.name] == []


def test_cache_verify_on_a_full_disk_still_reports_what_is_corrupt(warm, damaged, monkeypatch):
    _, manifest = manifest_rows(damaged.db)["encodings"]
    victim = blob_file(damaged.cache, blob_refs(manifest["artifact"])[0])
    victim.write_bytes(victim.read_bytes()[:-1] + b"!")
    fill_the_disk(monkeypatch, "open")

    doc = invoke_json("cache", "verify", "--cache-dir", damaged.cache, code=1)

    assert any(victim.parent.name + victim.name in c for c in doc["corrupt"]), doc["corrupt"]
    assert not any(c.startswith("index") for c in doc["corrupt"]), doc["corrupt"]
    assert any("disk is full" in note for note in doc["notes"]), doc["notes"]
    assert victim.exists()  # reported, not repaired: nothing could be written


# --------------------------------------------------------------------------- placement


@pytest.fixture(scope="module")
def two_versions(warm) -> SimpleNamespace:
    """The warm cache, copied, also warm for the NEW export; both versions' output files."""
    cache = warm.root / "cache-two-versions"
    shutil.copytree(warm.cache, cache)
    new = warm.root / "reference-new"
    with sandbox(warm.config.parent, cache):
        export_into(warm, cache, new, *NEW)
    old_files, new_files = snapshot(warm.reference), snapshot(new)
    assert all(old_files[n] != new_files[n] for n in OUTPUTS)  # every file has two versions
    return SimpleNamespace(cache=cache, old=old_files, new=new_files)


def into(directory: Path, dst) -> bool:
    """Whether a move to ``dst`` places something in (or as) ``directory``."""
    path = Path(os.fsdecode(dst)).resolve()
    return directory.resolve() in (path, path.parent)


@pytest.mark.parametrize("failing_move", [2, 3], ids=["second-move", "third-move"])
def test_a_placement_that_fails_midway_leaves_the_output_directory_as_it_was(
    warm, two_versions, tmp_path, monkeypatch, failing_move
):
    out = tmp_path / "out"
    shutil.copytree(warm.reference, out)
    cache = tmp_path / "cache"
    shutil.copytree(two_versions.cache, cache)
    real_replace, moves = os.replace, []

    def replace(src, dst, *args, **kwargs):
        if into(out, dst):
            moves.append(Path(os.fsdecode(dst)).name)
            if len(moves) == failing_move:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fsdecode(dst))
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", replace)
    with sandbox(warm.config.parent, cache):
        result = cli("export", "--config", warm.config, "--cache-dir", cache, "-o", out, *NEW)

    if result.exit_code == 0:  # placed in fewer moves than it takes to strike
        assert len(moves) < failing_move and snapshot(out) == two_versions.new
    else:
        assert "No space left on device" in result.output
        assert snapshot(out) == two_versions.old, f"moved before the failure: {moves[:-1]}"


@pytest.mark.slow
@pytest.mark.parametrize("killed_after", [1, 2], ids=["first-move", "second-move"])
def test_sigkill_between_two_file_moves_leaves_the_output_directory_as_it_was(
    warm, two_versions, tmp_path, killed_after
):
    out = tmp_path / "out"
    shutil.copytree(warm.reference, out)
    cache = tmp_path / "cache"
    shutil.copytree(two_versions.cache, cache)
    command = [sys.executable, str(WORKER), str(out), str(killed_after)]
    command += export_command(warm.config, out, *NEW)[3:]  # the graphbuild arguments
    proc = subprocess.run(
        command, env=subprocess_env(cache), capture_output=True, text=True, timeout=600
    )

    if proc.returncode == 0:  # placed in fewer moves than it takes to strike
        assert snapshot(out) == two_versions.new
    else:
        assert proc.returncode == -signal.SIGKILL, failure(proc.stdout, proc.stderr)
        assert out.is_dir() and snapshot(out) == two_versions.old


# --------------------------------------------------------------------------- SIGKILL trials


@pytest.fixture(scope="module")
def kill_trials(tmp_path_factory) -> SimpleNamespace:
    """KILL_TRIALS exports of the NEW version over an output directory holding the old one,
    each SIGKILLed after a random delay in [0, cold export time), then exported again.

    Even trials start from an empty cache (the kill lands anywhere from start-up to
    placement); odd trials reuse the cache the previous trial filled (a warm run, so the kill
    lands more often in loading and placement). Set GRAPHBUILD_FAULT_SEED to replay."""
    root = tmp_path_factory.mktemp("kill")
    config = write_config(root / "project")
    exported(run_export(config, root / "old", root / "cache-old"))
    t0 = time.perf_counter()
    exported(run_export(config, root / "new", root / "cache-new", *NEW))
    cold = time.perf_counter() - t0
    seed = int(os.environ.get("GRAPHBUILD_FAULT_SEED", random.randrange(2**32)))
    rng = random.Random(seed)
    trials = []
    for i in range(KILL_TRIALS):
        cache = root / f"cache-{i - i % 2}"
        out = root / f"out-{i}"
        shutil.copytree(root / "old", out)
        delay = rng.uniform(0.0, cold)
        proc = subprocess.Popen(
            export_command(config, out, *NEW),
            env=subprocess_env(cache),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            proc.wait(timeout=delay)
            killed = False
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            killed = True
        after_kill = snapshot(out)
        again = run_export(config, out, cache, *NEW)
        with sandbox(root, cache):
            verify = invoke_json("cache", "verify", "--no-repair", "--cache-dir", cache)
        trials.append(
            SimpleNamespace(
                label=f"seed {seed}, trial {i}, {'warm' if i % 2 else 'cold'} cache, "
                f"killed after {delay:.2f} s of {cold:.2f} s",
                killed=killed,
                after_kill=after_kill,
                again=again,
                out=out,
                verify=verify,
            )
        )
    return SimpleNamespace(
        trials=trials, old=snapshot(root / "old"), new=snapshot(root / "new"), seed=seed
    )


@pytest.mark.slow
def test_a_killed_export_leaves_each_output_file_either_the_old_or_the_new_version(kill_trials):
    assert sum(t.killed for t in kill_trials.trials) >= KILL_TRIALS // 2, "too few kills"
    for t in kill_trials.trials:
        assert sorted(t.after_kill) == sorted(OUTPUTS), t.label
        rerun = snapshot(t.out)  # the same build, finished by the export that followed
        for name, got in t.after_kill.items():
            versions = (kill_trials.old[name], kill_trials.new[name], rerun.get(name))
            assert got in versions, f"{t.label}: {name} is neither the old nor the new file"


@pytest.mark.slow
def test_after_a_kill_the_next_export_succeeds_with_whole_files(kill_trials):
    for t in kill_trials.trials:
        assert t.again.returncode == 0, f"{t.label}: {failure(t.again.stdout, t.again.stderr)}"
        assert_outputs_whole(t.out)
        now = snapshot(t.out)
        for name in ("convnet.onnx", "convnet.encodings"):  # the lock names the run's keys
            assert now[name] == kill_trials.new[name], f"{t.label}: {name}"


@pytest.mark.slow
def test_after_a_kill_cache_verify_finds_no_corruption(kill_trials):
    for t in kill_trials.trials:
        assert t.verify["corrupt"] == [], t.label
        assert t.verify["stats"]["corrupt"] == 0, t.label


# --------------------------------------------------------------------------- concurrency


@pytest.mark.slow
def test_four_concurrent_exports_into_one_cache_agree_byte_for_byte_and_leave_it_clean(
    tmp_path,
):
    config = write_config(tmp_path / "project")
    cache = tmp_path / "cache"
    outs = [tmp_path / f"out-{i}" for i in range(4)]
    procs = []
    for out in outs:  # started a little apart, so that their stages interleave
        procs.append(
            subprocess.Popen(
                export_command(config, out),
                env=subprocess_env(cache),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        time.sleep(0.75)
    results = [(proc, *proc.communicate(timeout=600)) for proc in procs]

    for proc, stdout, stderr in results:
        assert proc.returncode == 0, failure(stdout, stderr)
        assert "cannot write to the cache" not in stderr
        json.loads(stdout)
    first = contents(outs[0])
    assert sorted(first) == sorted(OUTPUTS)
    assert all(contents(out) == first for out in outs[1:])
    assert_outputs_whole(outs[0])
    with sandbox(tmp_path, cache):
        verify = invoke_json("cache", "verify", "--no-repair", "--cache-dir", cache)
    assert verify["corrupt"] == [] and verify["stats"]["corrupt"] == 0


# --------------------------------------------------------------------------- model edits

EDITS = {
    "a comment at the end of a line": (
        "x = torch.relu(self.conv1(x))",
        "x = torch.relu(self.conv1(x))  # first block",
    ),
    "a new comment line that shifts every line": ("from __future__", "# edited\nfrom __future__"),
}


@pytest.fixture(scope="module")
def model_edits(tmp_path_factory) -> SimpleNamespace:
    """A copy of examples/convnet.py as the model: exported, then after each comment-only
    edit of EDITS, then after a code edit (8 -> 6 channels), each into its own directory."""
    root = tmp_path_factory.mktemp("edits")
    model = root / "project" / "convnet.py"
    model.parent.mkdir(parents=True)
    shutil.copy(CONVNET, model)
    config = write_config(root / "project", model)
    cache = root / "cache"
    runs = {"before": exported(run_export(config, root / "before", cache))}
    for label, (old, new) in EDITS.items():
        source = model.read_text()
        assert old in source
        model.write_text(source.replace(old, new, 1))
        runs[label] = exported(run_export(config, root / label, cache))
    source = model.read_text()
    assert "channels: int = 8" in source
    model.write_text(source.replace("channels: int = 8", "channels: int = 6"))
    runs["code"] = exported(run_export(config, root / "code", cache))
    return SimpleNamespace(root=root, runs=runs)


@pytest.mark.slow
@pytest.mark.parametrize("edit", list(EDITS))
def test_a_comment_edit_reruns_nothing(model_edits, edit):
    """The model's code counts by its syntax tree, so a comment, even one that shifts every
    line, is not a change: every stage hits."""
    doc = model_edits.runs[edit]
    assert set(statuses(doc).values()) == {"hit"}, [
        (s["name"], s["status"], s["reason"]) for s in doc["stages"]
    ]


@pytest.mark.slow
@pytest.mark.parametrize("edit", list(EDITS))
def test_a_comment_edit_leaves_the_exported_model_and_encodings_identical(model_edits, edit):
    before, after = model_edits.root / "before", model_edits.root / edit
    for name in ("convnet.onnx", "convnet.encodings"):
        assert (after / name).read_bytes() == (before / name).read_bytes(), name
    assert_outputs_whole(after)


@pytest.mark.slow
def test_a_code_edit_reruns_from_capture_on_and_changes_the_outputs(model_edits):
    """Every stage reruns from the capture on; one whose inputs changed but whose output did
    not (the quantizer map: 8 or 6 channels, the same quantizers) cuts off what only it
    feeds."""
    doc = model_edits.runs["code"]
    state = statuses(doc)
    assert set(state.values()) <= {"ran", "cutoff"}
    assert all(state[name] == "ran" for name in ("capture", "to_onnx", "bind", "encodings"))
    capture = doc["stages"][0]
    assert capture["name"] == "capture" and capture["reason"].startswith("input.structure:")
    before, after = model_edits.root / "before", model_edits.root / "code"
    for name in ("convnet.onnx", "convnet.encodings"):
        assert (after / name).read_bytes() != (before / name).read_bytes(), name
    assert_outputs_whole(after)


# --------------------------------------------------------------------------- hostile input

BOOM = '''\
"""Model factories that never build a model: no fuzzed input may start a real export."""

NOT_CALLABLE = 3


def build():
    raise RuntimeError("the fuzzed config must not build a model")


def returns_none():
    return None


def needs_args(x):
    return x
'''


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> SimpleNamespace:
    """A project whose every model spec fails before an export could start."""
    root = tmp_path_factory.mktemp("hostile")
    (root / "boom.py").write_text(BOOM)
    (root / "graphbuild.toml").write_text('model = "boom.py:build"\n')
    (root / "bad.toml").write_text("model = [unclosed\n")
    (root / "pyproject.toml").write_text('[tool.graphbuild]\nmodel = "boom.py:build"\n')
    return SimpleNamespace(root=root, cache=root / "cache")


def assert_handled(result, argv) -> None:
    """Bad input: exit 2 with a message; valid input: exit 0; never a traceback."""
    output = result.stdout + result.stderr
    context = (argv, result.exit_code, output[-2000:])
    assert result.exception is None or isinstance(result.exception, SystemExit), (
        *context,
        repr(result.exception),
    )
    assert result.exit_code in (0, 2), context
    assert "Traceback" not in output, context
    assert output.strip(), context


HOSTILE = {
    "size-beyond-float-range": (None, ["cache", "prune", "--max-size", "9" * 400]),
    "nul-in-cache-dir": ('cache_dir = "a\\u0000b"\n', ["cache", "stats", "--json"]),
    "nul-in-output-dir": ('output_dir = "a\\u0000b"\n', ["graph"]),
    "nul-in-model-path": ('model = "bo\\u0000om.py:build"\n', ["status", "--json"]),
    "config-not-utf8": (b'model_name = "\xff\xfe"\n', ["graph"]),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_input_is_exit_2_with_a_message(hostile, tmp_path, case):
    config, argv = HOSTILE[case]
    if config is not None:
        path = tmp_path / "graphbuild.toml"
        if isinstance(config, bytes):
            path.write_bytes(config)
        else:
            path.write_text(config)
        argv = [*argv, "--config", str(path)]
    with sandbox(hostile.root, tmp_path / "cache"):
        result = cli(*argv, "--cache-dir", tmp_path / "c") if config is None else cli(*argv)
    assert_handled(result, argv)
    assert result.exit_code == 2


def test_a_pyproject_that_is_not_utf8_is_exit_2_with_a_message(hostile, tmp_path):
    path = tmp_path / "pyproject.toml"
    path.write_bytes(b'[tool.graphbuild]\nmodel_name = "\xff\xfe"\n')
    with sandbox(hostile.root, tmp_path / "cache"):
        result = cli("graph", "--config", path)
    assert_handled(result, ["graph", "--config", path])
    assert result.exit_code == 2


# Strings that stay inside the sandbox when used as a path: no separators, no "~" or "..".
_text = st.text(
    st.characters(blacklist_characters="/\\~.", blacklist_categories=("Cs",)), max_size=12
)
_scalar = st.one_of(_text, st.integers(), st.floats(), st.booleans(), st.integers(-(2**70), 2**70))
_junk = st.recursive(
    _scalar,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=6,
)
_model_spec = st.one_of(
    st.sampled_from(
        [
            "boom.py:build",
            "boom.py:nope",
            "boom.py:NOT_CALLABLE",
            "boom.py:returns_none",
            "boom.py:needs_args",
            "missing.py:build",
            "fuzz_no_such_package.module:build",
            "boom.py",
            ":",
            "::",
            "",
            "boom.py:1abc",
        ]
    ),
    st.builds("{}.py:{}".format, _text, _text),
    st.builds("fuzz_no_such_{}:{}".format, _text, _text),
    _junk,
)
_quantizer_spec = st.one_of(
    _model_spec,
    st.sampled_from(["math:floor", "math:pi", "torchao.quantization.pt2e.quantizer:Quantizer"]),
)
_options = st.fixed_dictionaries(
    {},
    optional={
        "opset": st.one_of(st.integers(-5, 40), _junk),
        "encodings_version": st.one_of(st.sampled_from(["1.0.0", "0.6.1", "2.0.0", "3"]), _junk),
        "input_names": st.one_of(st.lists(_text, max_size=3), _junk),
        "output_names": st.one_of(st.lists(_text, max_size=3), _junk),
        "external_data": st.one_of(st.booleans(), _junk),
        "fake_quantize_weights": st.one_of(st.booleans(), _junk),
        "check_numerics": st.one_of(st.booleans(), _junk),
        "opsett": _junk,
    },
)
_quantization = st.fixed_dictionaries(
    {},
    optional={
        "preset": st.one_of(st.sampled_from(["w8a8", "w8a16", "w4a16", "W8A8", "w8a9", ""]), _junk),
        "quantizer": _quantizer_spec,
        "presets": _junk,
    },
)
_config = st.fixed_dictionaries(
    {},
    optional={
        "model": _model_spec,
        "samples": _model_spec,
        "calibration": _model_spec,
        "target": st.one_of(st.sampled_from(["qnn", "QNN", "htp", ""]), _junk),
        "format": st.one_of(st.sampled_from(["onnx", "onnx_qdq", "qdq", ""]), _junk),
        "model_name": st.one_of(st.sampled_from(["convnet", "a/b", "..", ".", ""]), _junk),
        "output_dir": st.one_of(_text, _junk),
        "cache_dir": st.one_of(_text, _junk),
        "quantization": st.one_of(_quantization, _junk),
        "options": st.one_of(_options, _junk),
    },
)
_config_with_unknown_keys = st.builds(
    lambda known, unknown: {**unknown, **known},
    _config,
    st.dictionaries(_text, _junk, max_size=2),
)


def toml_string(text: str) -> str:
    escaped = []
    for ch in text:
        if ch in '"\\':
            escaped.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            escaped.append(f"\\u{ord(ch):04x}")
        else:
            escaped.append(ch)
    return '"' + "".join(escaped) + '"'


def toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(map(toml_value, value)) + "]"
    return "{" + ", ".join(f"{toml_string(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


def toml_document(table: dict) -> str:
    return "".join(f"{toml_string(k)} = {toml_value(v)}\n" for k, v in table.items())


_documents = st.one_of(
    _config_with_unknown_keys.map(toml_document),
    _config.map(toml_document),
    st.text(max_size=200),
    st.binary(max_size=200),
)
_config_commands = st.sampled_from(
    [
        ["graph"],
        ["graph", "--json"],
        ["status", "--json"],
        ["explain"],
        ["export", "--json"],
        ["export", "--dry-run"],
        ["cache", "stats", "--json"],
        ["cache", "path"],
    ]
)


@settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(document=_documents, command=_config_commands, pyproject=st.booleans())
def test_fuzzed_config_files_are_exit_0_or_2_with_a_message_never_a_traceback(
    hostile, document, command, pyproject
):
    if pyproject:
        name = "fuzz-pyproject/pyproject.toml"
        if isinstance(document, str):
            document = "[tool.graphbuild]\n" + document
    else:
        name = "fuzz.toml"
    path = hostile.root / name
    path.parent.mkdir(exist_ok=True)
    if isinstance(document, bytes):
        path.write_bytes(document)
    else:
        path.write_text(document, encoding="utf-8")
    argv = [*command, "--config", str(path)]
    with sandbox(hostile.root, hostile.cache):
        result = cli(*argv)
    assert_handled(result, (argv, document))


COMMANDS = [
    [],
    ["export"],
    ["status"],
    ["explain"],
    ["graph"],
    ["targets"],
    ["cache"],
    ["cache", "path"],
    ["cache", "stats"],
    ["cache", "ls"],
    ["cache", "show"],
    ["cache", "clean"],
    ["cache", "prune"],
    ["cache", "gc"],
    ["cache", "verify"],
]
FLAGS = [
    "--json",
    "--config",
    "-c",
    "--target",
    "-t",
    "--format",
    "-f",
    "--model",
    "-m",
    "--output-dir",
    "-o",
    "--name",
    "--cache-dir",
    "--no-cache",
    "--force",
    "--dry-run",
    "--quiet",
    "-q",
    "--set",
    "-s",
    "--max-size",
    "--older-than",
    "--grace",
    "--repair",
    "--no-repair",
    "--export-format",
    "--help",
]
VALUES = [
    "graphbuild.toml",
    "bad.toml",
    "missing.toml",
    "pyproject.toml",
    "boom.py:build",
    "boom.py:nope",
    "missing.py:build",
    "qnn",
    "onnx",
    "onnx_qdq",
    "dot",
    "mermaid",
    "capture",
    "all",
    "500M",
    "2G",
    "12X",
    "0",
    "-1",
    "1.5k",
    "30m",
    "7d",
    "x=1",
    "options.opset=17",
    "options.opset=abc",
    "quantization.preset=w8a8",
    "model=boom.py:build",
    "=",
    "",
    "out",
    "cachedir",
]


@settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    command=st.sampled_from(COMMANDS),
    rest=st.lists(st.one_of(st.sampled_from(FLAGS), st.sampled_from(VALUES), _text), max_size=6),
)
def test_fuzzed_command_lines_are_exit_0_or_2_with_a_message_never_a_traceback(
    hostile, command, rest
):
    argv = [*command, *rest]
    with sandbox(hostile.root, hostile.cache):
        result = cli(*argv)
    assert_handled(result, argv)
