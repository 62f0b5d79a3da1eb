"""place outputs: the final files, written whole or not at all.

Files are written into a temporary directory beside the output directory and moved into
place one by one, ``graphbuild.lock.json`` last; a failed or killed export leaves the output
directory as it was. A stamp in the cache remembers what was placed (product digests, file
sizes, mtimes, inodes): when nothing changed and nobody touched the files, a warm export
places nothing and loads nothing. A user editing an output file changes its mtime, so the
next export writes it again from the cache.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..artifacts import FileArtifact
from ..cache import Cache
from ..hashing import Hasher, digest_json
from ..pipeline import Pipeline
from ..scheduler import RunReport, toolchain_versions
from .bind import BoundModel, save_model

LOCK_FILE = "graphbuild.lock.json"


@dataclass(frozen=True)
class Placement:
    """Where and how to place: the directory, the model name, external data."""

    out_dir: Path
    model_name: str
    external_data: bool | None
    header: dict[str, Any]  # target, format, model_name, pipeline: written into the lock


def place_outputs(
    pipeline: Pipeline, result: Any, placement: Placement, cache: Cache | None
) -> tuple[dict[str, Path], dict[str, Any]]:
    """Place every product stage's output and the lock file; returns (kind -> path, lock)."""
    report: RunReport = result.report
    products = {s: report[s].digest for s in pipeline.products if report[s].digest}
    stamp_key = digest_json([str(placement.out_dir.resolve()), placement.model_name])
    stamp = cache.placement(stamp_key) if cache is not None else None
    if stamp is not None and _unchanged(stamp, products, placement):
        placed = dict(stamp["files"])  # a list of pairs: keeps the products' order
        files = {kind: placement.out_dir / f["name"] for kind, f in placed.items()}
        lock = _lock(pipeline, report, placement, placed)
        _write_lock_if_changed(placement.out_dir, lock)
        return {**files, "lock": placement.out_dir / LOCK_FILE}, lock
    files, digests, lock = _place(pipeline, result, placement, products)
    if cache is not None:
        cache.record_placement(
            stamp_key,
            {
                "products": products,
                "external_data": placement.external_data,
                "files": [[kind, {**digests[kind], **_stat(p)}] for kind, p in files.items()],
            },
        )
    return {**files, "lock": placement.out_dir / LOCK_FILE}, lock


def _unchanged(stamp: dict[str, Any], products: dict[str, str], placement: Placement) -> bool:
    if stamp.get("products") != products or stamp.get("external_data") != placement.external_data:
        return False
    for _, f in stamp.get("files", []):
        path = placement.out_dir / f["name"]
        if _stat(path) != {k: f.get(k) for k in ("bytes", "mtime_ns", "inode")}:
            return False
    return True


def _stat(path: Path) -> dict[str, Any]:
    try:
        st = path.stat()
    except OSError:
        return {}
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def _place(
    pipeline: Pipeline, result: Any, placement: Placement, products: Mapping[str, str]
) -> tuple[dict[str, Path], dict[str, dict[str, Any]], dict[str, Any]]:
    out_dir = placement.out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        written: dict[str, Path] = {}
        for sink in products:
            value = result.outputs.get(sink)
            if value is None or not _placeable(value):
                continue
            items = value.items() if isinstance(value, Mapping) else [(sink, value)]
            for kind, item in items:
                for path in _write(item, tmp, placement):
                    written[_kind(path.name, placement.model_name, kind)] = path
        digests = {
            kind: {"name": p.name, "xxh3_128": _file_digest(p)} for kind, p in written.items()
        }
        lock = _lock(pipeline, result.report, placement, digests, written)
        (tmp / LOCK_FILE).write_text(_lock_text(lock))
        out_dir.mkdir(parents=True, exist_ok=True)
        final: dict[str, Path] = {}
        stale = {f"{placement.model_name}.onnx.data"} - {p.name for p in written.values()}
        for kind, path in written.items():
            final[kind] = out_dir / path.name
            os.replace(path, final[kind])
        for name in stale:
            (out_dir / name).unlink(missing_ok=True)
        os.replace(tmp / LOCK_FILE, out_dir / LOCK_FILE)
        return final, digests, lock
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _placeable(value: Any) -> bool:
    if isinstance(value, (BoundModel, FileArtifact)):
        return True
    return isinstance(value, Mapping) and bool(value) and all(map(_placeable, value.values()))


def _write(item: Any, tmp: Path, placement: Placement) -> list[Path]:
    if isinstance(item, BoundModel):
        target = tmp / f"{placement.model_name}.onnx"
        return list(save_model(item, target, external_data=placement.external_data))
    path = tmp / item.name
    path.write_bytes(item.data)
    return [path]


def _kind(filename: str, model_name: str, fallback: str) -> str:
    if filename.startswith(model_name + "."):
        return filename[len(model_name) + 1 :]
    return fallback


def _file_digest(path: Path) -> str:
    h = Hasher()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _lock(
    pipeline: Pipeline,
    report: RunReport,
    placement: Placement,
    digests: Mapping[str, Mapping[str, Any]],
    paths: Mapping[str, Path] | None = None,
) -> dict[str, Any]:
    """graphbuild.lock.json: every output's digest, every stage's key and reads, versions.
    Deterministic for a given build, so a warm rebuild writes the same bytes."""
    files = {}
    for kind, f in digests.items():
        size = f.get("bytes")
        if size is None and paths is not None:
            size = paths[kind].stat().st_size
        files[f["name"]] = {"xxh3_128": f["xxh3_128"], "bytes": size}
    return {
        **placement.header,
        "toolchain": toolchain_versions(),
        "files": dict(sorted(files.items())),
        "stages": {
            s.name: {
                "key": s.key,
                "output": s.digest,
                "reads": list(pipeline._stage(s.name).reads or ["<everything>"]),
                "depends_on": pipeline.dependencies(s.name),
            }
            for s in report.stages
        },
    }


def _lock_text(lock: dict[str, Any]) -> str:
    return json.dumps(lock, indent=2, sort_keys=True) + "\n"


def _write_lock_if_changed(out_dir: Path, lock: dict[str, Any]) -> None:
    path = out_dir / LOCK_FILE
    text = _lock_text(lock)
    try:
        if path.read_text() == text:
            return
    except OSError:
        pass
    fd, tmp = tempfile.mkstemp(prefix=f".{LOCK_FILE}.", dir=out_dir)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
