"""A cache entry is data, never instructions (docs/design.md, invariant 11).

Whoever can write to a shared cache must not be able to make a victim's export write or delete
a file outside the cache and output directories: manifests are checked against their own
digests, only 32 hex digits are a digest, file names are plain names the pipeline declares,
maintenance touches only what the store wrote, a damaged index is quarantined and rebuilt, and
a read-only cache is read.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import graphbuild as gb
from graphbuild.cache import FileBlobs
from graphbuild.engine.artifact_store import Cache
from graphbuild.engine.codecs import FileArtifact
from graphbuild.engine.pipeline import Pipeline
from graphbuild.errors import CacheError, ExportError
from graphbuild.hashing import digest_bytes, digest_json
from tests.engine_helpers import CALLS, reset, stage

ROOT = Path(__file__).resolve().parents[1]


def _weights(m, samples, ctx):
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _note(inputs, samples, ctx):
    total = sum(float(v.double().sum()) for v in inputs[0].values())
    return FileArtifact(f"{ctx['model_name']}.txt", f"sum {total:.6f}\n".encode())


def note_pipeline(request) -> Pipeline:
    """weights (input.state) -> note: a text file placed as ``<model_name>.txt``."""
    p = Pipeline(name="note")
    w = p.register_stage(stage("weights", _weights), "weights", reads=("input.state",))
    n = p.register_stage(stage("note", _note), "note", reads=("ctx.model_name",)).depends_on(w)
    p.products = [n.name]
    p.output_files = frozenset({f"{request.model_name}.txt"})
    return p


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def export(out: Path, cache: Cache | Path):
    return gb.export(
        model(),
        (),
        out,
        "net",
        target="note",
        format="file",
        pipeline_factory=note_pipeline,
        cache=cache,
    )


def manifests(cache_dir: Path) -> dict[str, dict]:
    """Every manifest row, by index key, read straight from the database."""
    with sqlite3.connect(str(cache_dir / "index" / "cache.db")) as conn:
        rows = conn.execute("SELECT key, value FROM Cache WHERE key LIKE 'm:%'").fetchall()
    return {k: json.loads(v) for k, v in rows}


def rewrite(cache_dir: Path, index_key: str, manifest: dict) -> None:
    with sqlite3.connect(str(cache_dir / "index" / "cache.db")) as conn:
        conn.execute(
            "UPDATE Cache SET value = ? WHERE key = ?",
            (json.dumps(manifest, sort_keys=True), index_key),
        )


def of_stage(cache_dir: Path, name: str) -> tuple[str, dict]:
    (found,) = [(k, m) for k, m in manifests(cache_dir).items() if m["stage"] == name]
    return found


def redigest(artifact: dict) -> None:
    """What an attacker who knows the format does: make the description self-consistent."""
    artifact["digest"] = digest_json(
        [
            artifact["codec"],
            artifact["meta"],
            [d for d, _ in artifact["parts"]],
            [c["digest"] for c in artifact["children"]],
        ]
    )


def files_under(path: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(path)): p.read_bytes()
        for p in sorted(path.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


@pytest.fixture
def warm(tmp_path):
    """A warm cache and the clean export's files."""
    cache_dir = tmp_path / "cache"
    art = export(tmp_path / "clean", cache_dir)
    assert art.report.ran == ["weights", "note"]
    return cache_dir, files_under(tmp_path / "clean")


# --------------------------------------------------------------------------- manifests


@pytest.mark.parametrize("consistent", [False, True], ids=["stale-digest", "recomputed-digest"])
def test_a_file_name_set_to_an_absolute_path_in_a_manifest_writes_nothing_outside(
    tmp_path, warm, consistent
):
    cache_dir, clean = warm
    victim = tmp_path / "victim" / "owned.txt"
    key, m = of_stage(cache_dir, "note")
    m["artifact"]["meta"]["name"] = str(victim)
    if consistent:
        redigest(m["artifact"])
    rewrite(cache_dir, key, m)

    reset()
    art = export(tmp_path / "out", cache_dir)

    assert not victim.exists()
    assert CALLS == ["note"]  # the tampered entry was a miss, rebuilt from the weights' hit
    assert files_under(tmp_path / "out") == clean
    assert Cache(cache_dir).stats().corrupt == 1
    assert art.report["note"].status == "ran"


def test_a_manifest_whose_meta_was_edited_fails_its_own_digest(tmp_path, warm):
    cache_dir, clean = warm
    key, m = of_stage(cache_dir, "weights")
    m["artifact"]["meta"][0][1]["shape"] = [4, 16]  # same bytes, another shape
    rewrite(cache_dir, key, m)

    reset()
    export(tmp_path / "out", cache_dir)

    assert CALLS == ["weights"]  # rebuilt with the same digest: note is a cutoff
    assert files_under(tmp_path / "out") == clean


def test_a_self_consistent_manifest_naming_an_undeclared_file_is_a_typed_error(tmp_path, warm):
    cache_dir, _ = warm
    key, m = of_stage(cache_dir, "note")
    m["artifact"]["meta"]["name"] = ".bashrc"
    redigest(m["artifact"])
    rewrite(cache_dir, key, m)

    with pytest.raises(ExportError, match="not one the pipeline declares"):
        export(tmp_path / "out", cache_dir)

    assert not (tmp_path / "out").exists()


def test_a_placement_stamp_naming_a_path_outside_is_ignored(tmp_path, warm):
    cache_dir, clean = warm
    export(tmp_path / "out", cache_dir)
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the output directory")
    with sqlite3.connect(str(cache_dir / "index" / "cache.db")) as conn:
        rows = conn.execute("SELECT key, value FROM Cache WHERE key LIKE 'placed:%'").fetchall()
        for key, value in rows:
            stamp = json.loads(value)
            st = secret.stat()
            for _, f in stamp["files"]:  # "intact" as far as sizes, mtimes and inodes go
                f.update(name=str(secret), bytes=st.st_size, mtime_ns=st.st_mtime_ns)
                f["inode"] = st.st_ino
            conn.execute("UPDATE Cache SET value = ? WHERE key = ?", (json.dumps(stamp), key))
    (tmp_path / "out" / "net.txt").write_text("edited")  # so placement has work to do

    art = export(tmp_path / "out", cache_dir)

    assert files_under(tmp_path / "out") == clean
    assert secret.read_text() == "not for the output directory"
    assert all(p.parent == tmp_path / "out" for p in art.files.values())


def test_a_digest_that_is_not_32_hex_digits_never_becomes_a_path(tmp_path, warm):
    cache_dir, clean = warm
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious")
    key, m = of_stage(cache_dir, "weights")
    m["artifact"]["parts"][0][0] = ".." + str(victim)  # blobs/.. + /abs/victim.bin
    redigest(m["artifact"])
    rewrite(cache_dir, key, m)

    reset()
    export(tmp_path / "out", cache_dir)
    Cache(cache_dir).verify()

    assert victim.read_bytes() == b"precious"
    assert CALLS == ["weights"]  # rebuilt with the same digest: note is a cutoff
    assert files_under(tmp_path / "out") == clean
    with pytest.raises(ValueError, match="not a blob digest"):
        FileBlobs(cache_dir / "blobs").path(".." + str(victim))


def test_an_index_row_naming_a_value_file_outside_is_never_read_or_deleted(tmp_path, warm):
    cache_dir, clean = warm
    victim = tmp_path / "victim.txt"
    victim.write_text("{}")
    key, _ = of_stage(cache_dir, "weights")
    with sqlite3.connect(str(cache_dir / "index" / "cache.db")) as conn:
        conn.execute(
            "UPDATE Cache SET mode = 3, filename = ?, value = NULL WHERE key = ?",
            (os.path.relpath(victim, cache_dir / "index"), key),
        )

    reset()
    export(tmp_path / "out", cache_dir)
    cache = Cache(cache_dir)
    cache.verify()
    cache.clear()

    assert victim.read_text() == "{}"
    assert CALLS == ["weights"]  # rebuilt with the same digest: note is a cutoff
    assert files_under(tmp_path / "out") == clean


# --------------------------------------------------------------------------- maintenance


def test_clean_verify_and_gc_remove_only_names_the_store_writes(tmp_path, warm):
    cache_dir, _ = warm
    strays = [
        cache_dir / "blobs" / "mydoc.txt",
        cache_dir / "blobs" / "ab" / "notes.txt",
        cache_dir / "blobs" / "tmp" / "keep-me",
        cache_dir / "notes.md",
    ]
    for p in strays:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("mine")
    cache = Cache(cache_dir)

    assert cache.verify().corrupt == []
    assert cache.gc(grace=0).removed_blobs == 0
    report = cache.clear()

    assert report.removed_blobs > 0
    assert list(cache.blobs.all()) == []
    assert all(p.read_text() == "mine" for p in strays)


def test_a_new_cache_is_marked_and_a_non_empty_unmarked_directory_is_refused(tmp_path):
    home = tmp_path / "home"
    (home / "projects").mkdir(parents=True)
    (home / "notes.txt").write_text("mine")

    with pytest.raises(CacheError, match="not a graphbuild cache"):
        Cache(home)

    fresh = Cache(tmp_path / "new")
    assert fresh.marked and (tmp_path / "new" / "CACHEDIR.TAG").is_file()
    assert (home / "notes.txt").read_text() == "mine" and not (home / "index").exists()


def test_maintenance_refuses_a_cache_whose_marker_is_gone(tmp_path, warm):
    cache_dir, _ = warm
    cache = Cache(cache_dir)
    (cache_dir / "CACHEDIR.TAG").unlink()
    blobs = list(cache.blobs.all())

    for op in (cache.clear, cache.gc, cache.verify, lambda: cache.prune(max_bytes=0)):
        with pytest.raises(CacheError, match="no graphbuild cache marker"):
            op()

    assert list(cache.blobs.all()) == blobs
    assert cache.verify(repair=False).corrupt == []  # reporting only is fine


def test_a_cache_from_before_the_marker_is_marked_when_opened(tmp_path, warm):
    cache_dir, _ = warm
    (cache_dir / "CACHEDIR.TAG").unlink()
    assert Cache(cache_dir).marked


def test_failed_deletes_are_not_counted_as_freed(tmp_path, warm, monkeypatch):
    cache_dir, _ = warm
    cache = Cache(cache_dir)
    orphan = b"an orphan blob"
    cache.blobs.write(digest_bytes(orphan), orphan)

    def refuse(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(Path, "unlink", refuse)
    monkeypatch.setattr(os, "unlink", refuse)
    report = cache.gc(grace=0)

    assert (report.removed_blobs, report.freed_bytes) == (0, 0)
    assert digest_bytes(orphan) in {d for d, _, _ in cache.blobs.all()}


# --------------------------------------------------------------------------- damaged index


def _truncate(db: Path) -> None:
    db.write_bytes(db.read_bytes()[:1000])


def _random(db: Path) -> None:
    db.write_bytes(os.urandom(db.stat().st_size))


def _directory(db: Path) -> None:
    db.unlink()
    db.mkdir()
    (db / "x").write_text("x")


@pytest.mark.parametrize("damage", [_truncate, _random, _directory], ids=lambda f: f.__name__[1:])
def test_a_damaged_index_is_reported_quarantined_and_rebuilt(tmp_path, warm, damage):
    cache_dir, clean = warm
    for p in (cache_dir / "index").glob("cache.db-*"):
        p.unlink()  # no WAL left beside it to repair it
    damage(cache_dir / "index" / "cache.db")
    blobs_before = sorted(p.name for p in (cache_dir / "blobs").rglob("*") if p.is_file())

    with pytest.warns(RuntimeWarning, match="was damaged"):
        cache = Cache(cache_dir)
    quarantined = cache.quarantined
    gc = cache.gc(grace=0)
    reset()
    export(tmp_path / "out", cache)
    cache.close()

    assert quarantined is not None and quarantined.is_dir()
    assert quarantined.name.startswith("index.damaged-")
    assert gc.quarantined == str(quarantined) and gc.removed_blobs == 0
    assert sorted(p.name for p in (cache_dir / "blobs").rglob("*") if p.is_file()) == blobs_before
    assert CALLS == ["weights", "note"]  # a fresh index: everything rebuilt
    assert files_under(tmp_path / "out") == clean
    reset()
    export(tmp_path / "again", Cache(cache_dir))  # the rebuilt index serves hits
    assert CALLS == []


def _open_under(directory: Path) -> list[str]:
    """The files under ``directory`` this process holds open (Linux's /proc/self/fd)."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the directory's own descriptor, closed as it was listed
        if target.startswith(str(directory) + os.sep):
            held.append(target)
    return held


def _safe_note_pipeline(request) -> Pipeline:
    p = note_pipeline(request)
    p.parallel_safe = True
    return p


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs Linux's /proc/self/fd")
@pytest.mark.parametrize("jobs", [1, 2])
def test_an_export_closes_the_cache_it_opened_from_a_path(tmp_path, jobs):
    """A cache named by its directory is the export's own, and the index's SQLite connections
    are one per thread (this one, the cache writer's, each stage thread's): left open, they
    stayed open until the garbage collector found them, and the same process opening that
    index again (a repair, a second export) met the first connections' locks."""
    cache_dir = tmp_path / "cache"
    factory = _safe_note_pipeline if jobs > 1 else note_pipeline
    gb.export(
        model(),
        (),
        tmp_path / "out",
        "net",
        target="note",
        format="file",
        pipeline_factory=factory,
        cache=cache_dir,
        jobs=jobs,
    )
    assert _open_under(cache_dir) == []


def test_an_export_leaves_a_cache_it_was_given_open(tmp_path):
    cache = Cache(tmp_path / "cache")
    export(tmp_path / "out", cache)
    reset()
    export(tmp_path / "again", cache)
    assert CALLS == []  # the same Cache object, still open, serves hits
    cache.close()


# --------------------------------------------------------------------------- permissions


@pytest.mark.parametrize("umask", [0o002, 0o022])
def test_blobs_honour_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        store = FileBlobs(tmp_path / "blobs")
        data = b"shared with the group"
        store.write(digest_bytes(data), data)
        mode = stat.S_IMODE(store.path(digest_bytes(data)).stat().st_mode)
    finally:
        os.umask(old)
    assert mode == 0o666 & ~umask


READER = """
import json, os, sys
os.environ["GRAPHBUILD_CACHE_DIR"] = sys.argv[1]
sys.path.insert(0, sys.argv[3])
import warnings
warnings.simplefilter("error")  # a read-only cache is no cause for a warning
from graphbuild.engine.artifact_store import Cache
from tests.test_cache_integrity import export
from tests.engine_helpers import CALLS
cache = Cache(sys.argv[1])
art = export(__import__("pathlib").Path(sys.argv[2]), cache)
print(json.dumps({"calls": CALLS, "readonly": cache.readonly, "stats": cache.stats().to_json()}))
"""


def _as_reader() -> list[str]:
    """A command prefix that takes write access away: root ignores file modes, so as root
    the capabilities that let it (DAC override, file owner) are dropped with setpriv."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: cannot make a cache read-only for us")
    return [setpriv, "--bounding-set", "-dac_override,-dac_read_search,-fowner", "--"]


def test_a_read_only_cache_gives_hits(warm):
    cache_dir, clean = warm
    base = Path(tempfile.mkdtemp(prefix="gb-ro-", dir="/tmp"))
    try:
        shared = base / "cache"
        shutil.copytree(cache_dir, shared)
        out = base / "out"
        out.mkdir()
        script = base / "reader.py"
        script.write_text(textwrap.dedent(READER))
        for p in [shared, *shared.rglob("*")]:
            p.chmod(0o555 if p.is_dir() else 0o444)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(base)}
        proc = subprocess.run(
            [*_as_reader(), sys.executable, str(script), str(shared), str(out / "net"), str(ROOT)],
            capture_output=True,
            text=True,
            env=env,
            cwd=base,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout.strip().splitlines()[-1])
        assert doc["calls"] == []  # every stage hit
        assert doc["readonly"] is True
        assert files_under(out / "net") == clean
    finally:
        for p in [base, *base.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        shutil.rmtree(base)


@pytest.mark.parametrize("value", [True, None, "false", 0])
def test_a_stored_flag_other_than_false_is_a_corrupt_entry(tmp_path, warm, value):
    cache_dir, clean = warm
    key, m = of_stage(cache_dir, "weights")
    m["artifact"]["stored"] = value
    rewrite(cache_dir, key, m)

    reset()
    export(tmp_path / "out", cache_dir)

    assert CALLS == ["weights"]
    assert files_under(tmp_path / "out") == clean
    assert Cache(cache_dir).stats().corrupt == 1


def test_only_an_entry_as_a_whole_keeps_no_bytes_never_a_part_of_it():
    from graphbuild.cache.manifest import InvalidManifest, check_artifact
    from graphbuild.engine.codecs import encode

    whole = encode(({"a": torch.zeros(2)}, "x")).describe()
    assert check_artifact({**whole, "stored": False}) == whole["digest"]
    whole["children"][0]["stored"] = False
    with pytest.raises(InvalidManifest, match="stored"):
        check_artifact(whole)


def test_an_entry_marked_as_keeping_no_bytes_is_recomputed_and_checked(tmp_path, warm):
    cache_dir, clean = warm
    key, m = of_stage(cache_dir, "note")
    m["artifact"]["stored"] = False  # as a rematerializing stage writes it
    m["bytes"] = 0
    rewrite(cache_dir, key, m)

    reset()
    art = export(tmp_path / "out", cache_dir)

    assert CALLS == ["note"] and art.report["note"].status == "hit"
    assert files_under(tmp_path / "out") == clean


def test_an_entry_keeping_no_bytes_that_names_another_output_places_nothing(tmp_path, warm):
    from graphbuild.errors import FingerprintMismatchError, StageError

    cache_dir, _ = warm
    key, m = of_stage(cache_dir, "note")
    m["artifact"]["stored"] = False
    m["artifact"]["meta"]["name"] = "net.other"  # self-consistent, and not what note makes
    m["bytes"] = 0
    redigest(m["artifact"])
    rewrite(cache_dir, key, m)

    with pytest.raises(StageError, match="'note'") as err:
        export(tmp_path / "out", cache_dir)

    assert isinstance(err.value.cause, FingerprintMismatchError)
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- records


@pytest.mark.parametrize("codecs", [1, [1], "x", None, {"tensors": 1}, {"tensors": ["a"]}])
def test_a_manifest_whose_codecs_are_not_a_table_of_versions_is_a_corrupt_entry(
    tmp_path, warm, codecs
):
    cache_dir, clean = warm
    key, m = of_stage(cache_dir, "weights")
    m["codecs"] = codecs
    rewrite(cache_dir, key, m)

    reset()
    export(tmp_path / "out", cache_dir)

    assert CALLS == ["weights"]  # rebuilt with the same digest: note is a cutoff
    assert files_under(tmp_path / "out") == clean
    assert Cache(cache_dir).stats().corrupt == 1


@pytest.mark.parametrize("field", ["seconds", "created", "last_used"])
@pytest.mark.parametrize("value", [2**70, 1e300])
def test_a_manifest_with_a_number_out_of_range_is_a_corrupt_entry(tmp_path, warm, field, value):
    cache_dir, clean = warm
    key, m = of_stage(cache_dir, "weights")
    m[field] = value
    rewrite(cache_dir, key, m)

    reset()
    export(tmp_path / "out", cache_dir)

    assert CALLS == ["weights"]
    assert files_under(tmp_path / "out") == clean
    assert Cache(cache_dir).stats().corrupt == 1


@pytest.mark.parametrize(
    "field, value",
    [
        ("code", 5),
        ("upstream", [1]),
        ("upstream", {"weights": 5}),
        ("reads", 5),
        ("reads", {"input.state": 5}),
        ("reads", {"input.state": {"digest": 5}}),
        ("toolchain", 5),
        ("toolchain", {"torch": [1]}),
        ("key", [1]),
        ("digest", {"a": 1}),
    ],
)
def test_a_malformed_explain_record_counts_as_no_record(tmp_path, warm, field, value):
    cache_dir, clean = warm
    with sqlite3.connect(str(cache_dir / "index" / "cache.db")) as conn:
        rows = conn.execute("SELECT key, value FROM Cache WHERE key LIKE 'last:%'").fetchall()
        assert rows
        for key, text in rows:
            record = json.loads(text)
            record[field] = value
            conn.execute("UPDATE Cache SET value = ? WHERE key = ?", (json.dumps(record), key))
        conn.execute("DELETE FROM Cache WHERE key LIKE 'm:%'")  # every stage explains a miss

    reset()
    art = export(tmp_path / "out", cache_dir)

    assert CALLS == ["weights", "note"]
    assert files_under(tmp_path / "out") == clean
    assert art.report["weights"].reason == "no cached result (first run)"
    assert Cache(cache_dir).last_run("note:net", "weights")["code"] != value  # rewritten


# --------------------------------------------------------------------------- symlinks


def _shard_to(cache_dir: Path, victim: Path) -> None:
    shard = next(p for p in (cache_dir / "blobs").iterdir() if p.name != "tmp")
    shutil.rmtree(shard)
    shard.symlink_to(victim, target_is_directory=True)


def _blobs_to(cache_dir: Path, victim: Path) -> None:
    shutil.rmtree(cache_dir / "blobs")
    (cache_dir / "blobs").symlink_to(victim, target_is_directory=True)


def _index_to(cache_dir: Path, victim: Path) -> None:
    shutil.rmtree(cache_dir / "index")
    (cache_dir / "index").symlink_to(victim, target_is_directory=True)


def _db_to(cache_dir: Path, victim: Path) -> None:
    other = victim / "other.db"
    with sqlite3.connect(str(other)) as conn:
        conn.execute("CREATE TABLE mine (x)")
    shutil.rmtree(cache_dir / "index")
    (cache_dir / "index").mkdir()
    (cache_dir / "index" / "cache.db").symlink_to(other)


def _tmp_to(cache_dir: Path, victim: Path) -> None:
    shutil.rmtree(cache_dir / "blobs")
    (cache_dir / "blobs").mkdir()
    (cache_dir / "blobs" / "tmp").symlink_to(victim, target_is_directory=True)


@pytest.mark.parametrize(
    "plant", [_shard_to, _blobs_to, _index_to, _db_to, _tmp_to], ids=lambda f: f.__name__[1:]
)
def test_a_symlink_in_the_store_never_leads_a_write_or_delete_outside(tmp_path, warm, plant):
    cache_dir, clean = warm
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious.txt").write_text("mine")
    plant(cache_dir, victim)
    before = files_under(victim)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the store says what it moved aside
        export(tmp_path / "out", cache_dir)
        assert files_under(victim) == before
        cache = Cache(cache_dir)
        cache.verify()
        cache.gc(grace=0)
        cache.prune(max_bytes=0)
        export(tmp_path / "again", cache_dir)
        Cache(cache_dir).clear()

    assert files_under(victim) == before
    assert sorted(p.name for p in victim.iterdir()) == sorted(Path(p).parts[0] for p in before)
    assert files_under(tmp_path / "out") == clean
    assert files_under(tmp_path / "again") == clean


def test_a_store_repaired_after_a_planted_symlink_serves_hits_again(tmp_path, warm):
    cache_dir, clean = warm
    victim = tmp_path / "victim"
    victim.mkdir()
    _blobs_to(cache_dir, victim)

    with pytest.warns(RuntimeWarning, match="symbolic link"):
        export(tmp_path / "out", cache_dir)
    reset()
    export(tmp_path / "again", cache_dir)

    assert CALLS == []
    assert list(victim.iterdir()) == []
    assert not (cache_dir / "blobs").is_symlink()


# --------------------------------------------------------------------------- shared directory


@pytest.mark.parametrize("umask", [0o002, 0o022])
def test_the_index_honours_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        Cache(tmp_path / "cache").close()
    finally:
        os.umask(old)
    index = tmp_path / "cache" / "index"
    assert stat.S_IMODE(index.stat().st_mode) & 0o777 == 0o777 & ~umask
    assert stat.S_IMODE((index / "cache.db").stat().st_mode) == 0o666 & ~umask


MEMBER = """
import json, os, sys, warnings
sys.path.insert(0, sys.argv[3])
os.umask(0o002)
warnings.simplefilter("error")  # a well set-up shared cache is no cause for a warning
from pathlib import Path
from graphbuild.engine.artifact_store import Cache
from tests.test_cache_integrity import export
from tests.engine_helpers import CALLS
cache = Cache(sys.argv[1])
export(Path(sys.argv[2]), cache)
print(json.dumps({"calls": CALLS, "writable": cache.writable, "hits": cache.stats().hits}))
"""


def _as_member(uid: int, gid: int) -> list[str]:
    if os.geteuid() != 0:
        pytest.skip("needs root to run as two members of one group")
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv: cannot act as two users")
    member = [setpriv, f"--reuid={uid}", f"--regid={gid}", f"--groups={gid}", "--"]
    probe = subprocess.run(
        [*member, sys.executable, "-c", "import diskcache, xxhash, graphbuild"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd="/",
        timeout=120,
    )
    if probe.returncode != 0:
        pytest.skip(
            "another user cannot import this Python environment (a venv in a private "
            f"directory?), so it cannot act as a second group member: {probe.stderr[-200:]}"
        )
    return member


def test_a_group_shared_cache_directory_gives_a_second_member_hits(tmp_path):
    base = Path(tempfile.mkdtemp(prefix="gb-group-", dir="/tmp"))
    gid = 61000
    try:
        base.chmod(0o755)
        shared = base / "cache"
        shared.mkdir()
        os.chown(shared, 0, gid)
        shared.chmod(0o2775)  # the documented set-up: chmod g+s, umask 002
        script = base / "member.py"
        script.write_text(textwrap.dedent(MEMBER))
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(base)}
        results = []
        for uid in (61001, 61002):
            out = base / f"out{uid}"
            out.mkdir()
            os.chown(out, uid, gid)
            proc = subprocess.run(
                [
                    *_as_member(uid, gid),
                    sys.executable,
                    str(script),
                    str(shared),
                    str(out / "n"),
                    str(ROOT),
                ],
                capture_output=True,
                text=True,
                env=env,
                cwd=base,
                timeout=300,
            )
            assert proc.returncode == 0, proc.stderr
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    finally:
        shutil.rmtree(base, ignore_errors=True)

    first, second = results
    assert first["calls"] == ["weights", "note"]
    assert second["calls"] == []  # every stage hit
    assert second["writable"] is True and second["hits"] == 2


def test_a_cache_whose_index_alone_is_read_only_is_read_with_a_warning(warm):
    cache_dir, clean = warm
    base = Path(tempfile.mkdtemp(prefix="gb-ro-", dir="/tmp"))
    try:
        shared = base / "cache"
        shutil.copytree(cache_dir, shared)
        out = base / "out"
        out.mkdir()
        script = base / "reader.py"
        script.write_text(textwrap.dedent(READER).replace('"error"', '"always"'))
        for p in [shared / "index", *(shared / "index").rglob("*")]:
            p.chmod(0o555 if p.is_dir() else 0o444)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(base)}
        proc = subprocess.run(
            [*_as_reader(), sys.executable, str(script), str(shared), str(out / "net"), str(ROOT)],
            capture_output=True,
            text=True,
            env=env,
            cwd=base,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout.strip().splitlines()[-1])
        assert doc["calls"] == []  # every stage hit
        assert "index" in proc.stderr and "not writable" in proc.stderr
        assert files_under(out / "net") == clean
    finally:
        for p in [base, *base.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        shutil.rmtree(base)


# --------------------------------------------------------------------------- damage, maintenance


def test_an_index_that_is_a_regular_file_is_quarantined_and_rebuilt(tmp_path, warm):
    cache_dir, clean = warm
    shutil.rmtree(cache_dir / "index")
    (cache_dir / "index").write_text("not a directory")

    with pytest.warns(RuntimeWarning, match="was damaged"):
        cache = Cache(cache_dir)
    reset()
    export(tmp_path / "out", cache)
    reset()
    export(tmp_path / "again", Cache(cache_dir))

    assert cache.quarantined is not None and cache.quarantined.read_text() == "not a directory"
    assert CALLS == []  # the fresh index serves hits
    assert files_under(tmp_path / "again") == clean


def test_verify_on_a_read_only_cache_reports_without_repairing(warm):
    cache_dir, _ = warm
    base = Path(tempfile.mkdtemp(prefix="gb-ro-", dir="/tmp"))
    try:
        shared = base / "cache"
        shutil.copytree(cache_dir, shared)
        blob = next(p for p in (shared / "blobs").rglob("*") if p.is_file())
        blob.write_bytes(b"flipped")
        for p in [shared, *shared.rglob("*")]:
            p.chmod(0o555 if p.is_dir() else 0o444)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(base)}
        proc = subprocess.run(
            [
                *_as_reader(),
                sys.executable,
                "-m",
                "graphbuild",
                "cache",
                "verify",
                "--json",
                "--cache-dir",
                str(shared),
            ],
            capture_output=True,
            text=True,
            env=env,
            cwd=base,
            timeout=300,
        )
        assert proc.returncode == 1, proc.stdout + proc.stderr  # it found corruption
        doc = json.loads(proc.stdout)
        assert len(doc["corrupt"]) >= 2  # the blob and the entry naming it
        assert doc["removed_blobs"] == doc["removed_entries"] == 0
        assert any("read-only" in n for n in doc["notes"])
        assert blob.read_bytes() == b"flipped"
    finally:
        for p in [base, *base.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        shutil.rmtree(base)


OPENER = """
import json, sys, time, warnings
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from graphbuild.engine.artifact_store import Cache
sync = Path(sys.argv[2])
(sync / f"ready-{sys.argv[4]}").touch()
while not (sync / "go").exists():
    time.sleep(0.001)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    cache = Cache(sys.argv[1])
    cache.index.set_json("m:probe" + sys.argv[4], {"x": 1})
print(json.dumps({"writable": cache.writable, "warnings": [str(w.message) for w in caught]}))
"""


def test_processes_opening_a_damaged_index_at_once_quarantine_it_once(tmp_path, warm):
    cache_dir, _ = warm
    for p in (cache_dir / "index").glob("cache.db-*"):
        p.unlink()
    _random(cache_dir / "index" / "cache.db")
    script, sync = tmp_path / "opener.py", tmp_path / "sync"
    script.write_text(textwrap.dedent(OPENER))
    sync.mkdir()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(cache_dir), str(sync), str(ROOT), str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(4)
    ]
    deadline = time.time() + 120
    while len(list(sync.glob("ready-*"))) < 4 and time.time() < deadline:
        time.sleep(0.01)
    (sync / "go").touch()
    docs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        docs.append(json.loads(out.strip().splitlines()[-1]))

    assert all(d["writable"] for d in docs), docs
    assert len(list(cache_dir.glob("index.damaged-*"))) == 1
    assert {k for k in Cache(cache_dir).index.keys("m:probe")} == {f"m:probe{i}" for i in range(4)}


def test_stats_on_a_damaged_index_reports_it_and_moves_nothing(tmp_path, warm):
    cache_dir, _ = warm
    for p in (cache_dir / "index").glob("cache.db-*"):
        p.unlink()
    _truncate(cache_dir / "index" / "cache.db")

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "graphbuild",
            "cache",
            "stats",
            "--json",
            "--cache-dir",
            str(cache_dir),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )

    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["damaged"] and doc["quarantined"] is None
    assert list(cache_dir.glob("index.damaged-*")) == []
    assert doc["blobs"] > 0
