"""A hostile cache, fuzzed: whoever can write to a cache can change anything in it. Hypothesis
mutates a warm cache of a tiny export (manifests, index rows, explain records, placement
stamps, the database's settings, blobs and their names, symbolic links into a victim's
directory) and checks the invariants that must survive any of it:

- nothing outside the cache and the output directories is written, changed or removed;
- an export gives exactly the clean export's files, or a clear (typed) error;
- never a traceback, from the export or from any maintenance command.

One exception to the second: a manifest edited and then given a matching digest again (what a
writer who knows the format does) is a consistent entry, and the cache cannot tell it from a
real one (README, "Team cache": digest checks make entries self-consistent, not trustworthy).
After such a plant the export must still place only the files the pipeline declares, each
matching the lock file; that they equal a clean export's is not promised.

The default suite runs a few dozen examples; ``-m slow`` runs a few hundred.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from graphbuild.engine.artifact_store import Cache
from graphbuild.errors import GraphbuildError
from graphbuild.hashing import digest_bytes
from tests.test_cache_integrity import export, files_under, redigest

DIGEST_A, DIGEST_0 = "a" * 32, "0" * 32


def _victim_values(victim: Path) -> list[Any]:
    """Values a hostile writer would try: paths into the victim's directory, names that are
    not digests, wrong JSON types, numbers out of range, deep nesting."""
    deep: Any = "x"
    for _ in range(80):
        deep = [deep]
    return [
        None, True, -1, 0, 2**70, 1.5, float("nan"), "", ".", "..", str(victim / "owned.txt"),
        "../../victim/owned.txt", "..//" + str(victim / "secret.txt"), DIGEST_A, DIGEST_0,
        "A" * 32, [], {}, [[]], [[DIGEST_0, -5]], [[DIGEST_A, 2**63]], {"name": str(victim)},
        {"name": "net.txt"}, "net.txt", ".bashrc", "x" * 300, deep, {"tensors": 1},
    ]  # fmt: skip


# --------------------------------------------------------------------------- mutations


def _rows(cache: Path, like: str) -> list[tuple[str, str]]:
    with sqlite3.connect(str(cache / "index" / "cache.db")) as conn:
        return sorted(
            (k, v)
            for k, v in conn.execute("SELECT key, value FROM Cache WHERE key LIKE ?", (like,))
            if isinstance(k, str) and isinstance(v, str)
        )


def _set_row(cache: Path, key: str, value: Any) -> None:
    with sqlite3.connect(str(cache / "index" / "cache.db")) as conn:
        conn.execute("UPDATE Cache SET value = ? WHERE key = ?", (value, key))


def _walk_and_replace(data: st.DataObject, obj: Any, values: list[Any], depth: int = 0) -> Any:
    """``obj`` with one value somewhere inside replaced (or a key added); the top level is
    always entered, so a record stays a record with one field changed."""
    here = depth > 0 and data.draw(st.booleans())
    if isinstance(obj, dict) and obj and not here:
        key = data.draw(st.sampled_from(sorted(obj) + ["planted"]))
        obj[key] = _walk_and_replace(data, obj.get(key), values, depth + 1)
        return obj
    if isinstance(obj, list) and obj and not here:
        i = data.draw(st.integers(0, len(obj) - 1))
        obj[i] = _walk_and_replace(data, obj[i], values, depth + 1)
        return obj
    return data.draw(st.sampled_from(values))


def mutate_record(data: st.DataObject, cache: Path, victim: Path, like: str) -> bool:
    """A manifest, an explain record or a placement stamp, changed somewhere inside;
    manifests sometimes made self-consistent again, as a writer who knows the format would
    (True then: a consistent plant)."""
    rows = _rows(cache, like)
    if not rows:
        return False
    key, text = data.draw(st.sampled_from(rows))
    record = _walk_and_replace(data, json.loads(text), _victim_values(victim))
    planted = False
    if like == "m:%" and isinstance(record, dict) and data.draw(st.booleans()):
        with contextlib.suppress(Exception):  # not an artifact any more: stays as it is
            redigest(record["artifact"])
            planted = True
    _set_row(cache, key, json.dumps(record, allow_nan=True))
    return planted


_COLUMNS = {
    "mode": [0, 1, 2, 3, 4, 99, None, "x"],
    "filename": [None, "../../victim/secret.txt", "ab/cd/" + "0" * 28 + ".val", 7],
    "value": [b"\x80\x04K.", 5, 1.5, None, "[]", '{"key": 1}', "garbage", "{"],
    "raw": [0, 2, None],
    "key": [b"m:x", 5, None],
}


def mutate_row(data: st.DataObject, cache: Path, victim: Path) -> None:
    """One column of one index row set to what diskcache would never write."""
    column = data.draw(st.sampled_from(sorted(_COLUMNS)))
    value = data.draw(st.sampled_from(_COLUMNS[column]))
    like = data.draw(st.sampled_from(["m:%", "stat:%", "last:%", "placed:%"]))
    with sqlite3.connect(str(cache / "index" / "cache.db")) as conn:
        conn.execute(
            f"UPDATE Cache SET {column} = ? WHERE rowid = "  # noqa: S608 - column from a list
            "(SELECT rowid FROM Cache WHERE key LIKE ? ORDER BY rowid LIMIT 1)",
            (value, like),
        )


def mutate_settings(data: st.DataObject, cache: Path, victim: Path) -> None:
    """diskcache's settings table: what it reads back as attributes and PRAGMAs."""
    key = data.draw(st.sampled_from(["sqlite_mmap_size", "_sql", "disk_evil", "count"]))
    value = data.draw(st.sampled_from(["x; DROP TABLE Cache", -1, None, 2**62]))
    with sqlite3.connect(str(cache / "index" / "cache.db")) as conn:
        conn.execute("INSERT OR REPLACE INTO Settings VALUES (?, ?)", (key, value))


def _blob_files(cache: Path) -> list[Path]:
    return sorted(p for p in (cache / "blobs").glob("??/*") if p.is_file() and not p.is_symlink())


def mutate_blob(data: st.DataObject, cache: Path, victim: Path) -> None:
    """A blob flipped, cut, emptied, removed, renamed, turned into a directory or a link."""
    blobs = _blob_files(cache)
    if not blobs:
        return
    path = data.draw(st.sampled_from(blobs))
    how = data.draw(
        st.sampled_from(["flip", "truncate", "empty", "delete", "link", "dir", "rename"])
    )
    raw = path.read_bytes()
    if how == "flip" and raw:
        i = data.draw(st.integers(0, len(raw) - 1))
        path.write_bytes(raw[:i] + bytes([raw[i] ^ 0xFF]) + raw[i + 1 :])
    elif how == "truncate":
        path.write_bytes(raw[: len(raw) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "delete":
        path.unlink()
    elif how == "link":
        path.unlink()
        path.symlink_to(victim / "secret.txt")
    elif how == "dir":
        path.unlink()
        path.mkdir()
        (path / "inside").write_text("planted")
    elif how == "rename":
        path.rename(path.with_name(path.name[:-1] + "Z"))


def mutate_links(data: st.DataObject, cache: Path, victim: Path) -> None:
    """One of the store's own directories or files replaced by a link into the victim's."""
    where = data.draw(st.sampled_from(["shard", "blobs", "tmp", "index", "db", "marker"]))
    if where == "shard":
        shard = sorted(p for p in (cache / "blobs").iterdir() if p.name != "tmp")[0]
        shutil.rmtree(shard)
        shard.symlink_to(victim / "dir", target_is_directory=True)
    elif where == "blobs":
        shutil.rmtree(cache / "blobs")
        (cache / "blobs").symlink_to(victim / "dir", target_is_directory=True)
    elif where == "tmp":
        shutil.rmtree(cache / "blobs" / "tmp", ignore_errors=True)
        (cache / "blobs" / "tmp").symlink_to(victim / "dir", target_is_directory=True)
    elif where == "index":
        shutil.rmtree(cache / "index")
        (cache / "index").symlink_to(victim / "dir", target_is_directory=True)
    elif where == "db":
        for p in (cache / "index").glob("cache.db*"):
            p.unlink()
        (cache / "index" / "cache.db").symlink_to(victim / "other.db")
    elif where == "marker":
        (cache / "CACHEDIR.TAG").unlink()
        (cache / "CACHEDIR.TAG").symlink_to(victim / "secret.txt")


MUTATIONS = {
    "manifest": lambda d, c, v: mutate_record(d, c, v, "m:%"),
    "explain-record": lambda d, c, v: mutate_record(d, c, v, "last:%"),
    "placement-stamp": lambda d, c, v: mutate_record(d, c, v, "placed:%"),
    "row": mutate_row,
    "settings": mutate_settings,
    "blob": mutate_blob,
    "link": mutate_links,
    "drop-manifest": lambda d, c, v: (
        _set_row(c, d.draw(st.sampled_from(_rows(c, "m:%")))[0], None) if _rows(c, "m:%") else None
    ),
}


# records are where most of a hostile writer's choices are: drawn more often
WEIGHTED = sorted(MUTATIONS) + ["manifest"] * 3 + ["explain-record", "placement-stamp"]


# --------------------------------------------------------------------------- the check


def snapshot(root: Path, skip: set[str]) -> dict[str, Any]:
    """Everything under ``root`` but the skipped top-level names: kind, bytes, link target."""
    out: dict[str, Any] = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root)
        if rel.parts[0] in skip:
            continue
        if p.is_symlink():
            out[str(rel)] = ("link", os.readlink(p))
        elif p.is_dir():
            out[str(rel)] = ("dir",)
        else:
            out[str(rel)] = ("file", p.read_bytes(), p.stat().st_mtime_ns)
    return out


def assert_consistent(out: Path) -> None:
    """Only the declared files, each the one the lock file names."""
    placed = files_under(out)
    assert set(placed) == {"net.txt", "graphbuild.lock.json"}
    lock = json.loads(placed["graphbuild.lock.json"])
    assert set(lock["files"]) == {"net.txt"}
    assert lock["files"]["net.txt"]["xxh3_128"] == digest_bytes(placed["net.txt"])


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory) -> tuple[Path, dict[str, bytes]]:
    root = tmp_path_factory.mktemp("fuzz-base")
    export(root / "clean", root / "cache")
    export(root / "placed", root / "cache")  # a placement stamp to mutate
    return root / "cache", files_under(root / "clean")


def _victim(base: Path) -> Path:
    victim = base / "victim"
    (victim / "dir").mkdir(parents=True)
    (victim / "dir" / "keep.txt").write_text("the victim's")
    (victim / "secret.txt").write_text('{"key": "not for the cache"}')
    with sqlite3.connect(str(victim / "other.db")) as conn:
        conn.execute("CREATE TABLE mine (x)")
    return victim


# what the cache commands do: stats, ls, show and verify --no-repair only look
OPERATIONS = [
    ("stats", False, {}),
    ("entries", False, {}),
    ("verify", False, {"repair": False}),
    ("verify", True, {}),
    ("gc", True, {"grace": 0}),
    ("prune", True, {"max_bytes": 10**9}),
    ("clear", True, {}),
]


def check_hostile_cache(data: st.DataObject, warm_cache: tuple[Path, dict[str, bytes]]) -> None:
    base = Path(tempfile.mkdtemp(prefix="gb-fuzz-"))
    try:
        victim = _victim(base)
        cache = base / "cache"
        shutil.copytree(warm_cache[0], cache, symlinks=True)
        kinds = data.draw(st.lists(st.sampled_from(WEIGHTED), min_size=1, max_size=3))
        planted = False
        for kind in kinds:
            # one mutation can undo the ground for the next (an index turned into a link)
            with contextlib.suppress(OSError, sqlite3.Error):
                planted = bool(MUTATIONS[kind](data, cache, victim)) or planted
        before = snapshot(base, {"cache"})

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the cache warns about what it repaired
            for out in ("out", "again"):
                try:
                    export(base / out, cache)
                except GraphbuildError:
                    assert not (base / out).exists()  # a clear error places nothing
                    continue
                if planted:
                    assert_consistent(base / out)
                else:
                    assert files_under(base / out) == warm_cache[1], kinds
            for op, repair, args in OPERATIONS:
                try:
                    c = Cache(cache, repair=repair)
                    getattr(c, op)(**args)
                    c.close()
                except GraphbuildError:
                    continue

        after = snapshot(base, {"cache", "out", "again"})
        assert after == before, kinds
    finally:
        shutil.rmtree(base, ignore_errors=True)


_SETTINGS = dict(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)


@settings(max_examples=30, **_SETTINGS)
@given(data=st.data())
def test_a_hostile_cache_never_leads_outside_never_gives_a_wrong_output_never_a_traceback(
    data, warm_cache
):
    check_hostile_cache(data, warm_cache)


@pytest.mark.slow
@settings(max_examples=400, **{**_SETTINGS, "derandomize": False})
@given(data=st.data())
def test_a_hostile_cache_fuzzed_at_length(data, warm_cache):
    check_hostile_cache(data, warm_cache)
