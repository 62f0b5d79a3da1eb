"""place outputs: the final files, written whole or not at all.

Files are written into a temporary directory beside the output directory and moved into
place one by one, ``graphbuild.lock.json`` last; a failed or killed export leaves the output
directory as it was. The output directory then holds exactly the current export: the
files an earlier export of the model placed there (its lock file lists them, and the cache's
stamp) and this one does not go in the same step (another format's ``_ctx_qnn.bin`` is not
left to be shipped); a file graphbuild never wrote stays. A stamp in the cache remembers what was placed (product digests, file
sizes, mtimes, inodes): when nothing changed and nobody touched the files, a warm export
places nothing and loads nothing. A user editing an output file changes its mtime, so the
next export writes it again from the cache.

A model file is rebuilt from the one it replaces where it can: the stamp records where each
tensor's bytes lie in it and their digest, and :func:`graphbuild.onnx.save.write_model` (an
ONNX model) or :func:`~graphbuild.onnx.save.write_segments` (any
:class:`~graphbuild.onnx.save.SegmentedFile`, a GGUF file) copies the unchanged ones in the
kernel and reads each copy back against its digest, so only changed tensors are written and
an edited file contributes nothing it should not.

Names read from the cache decide no path by themselves: a file artifact's name must be a plain
name the pipeline declares (``Pipeline.output_files``; by default ``<model_name>.*``), and a
placement stamp naming anything else is ignored (docs/design.md, invariant 11).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from graphbuild.cache.manifest import InvalidManifest, check_placement_stamp
from graphbuild.cache.names import is_placed_path, is_plain_name
from graphbuild.engine.artifact_store import Cache
from graphbuild.engine.codecs import FileArtifact
from graphbuild.engine.events import RunReport
from graphbuild.engine.pipeline import Pipeline
from graphbuild.engine.toolchain import pipeline_tools, toolchain_versions
from graphbuild.errors import ExportError
from graphbuild.hashing import digest_bytes, digest_json
from graphbuild.output.directory import LOCK_FILE, check_output_directory

__all__ = ["LOCK_FILE", "FilePlacement", "check_output_directory", "json_safe", "place_outputs"]


@dataclass(frozen=True)
class FilePlacement:
    """Where and how to place: the directory, the model name, external data."""

    out_dir: Path
    model_name: str
    external_data: bool | str | None
    header: dict[str, Any]  # target, format, model_name, pipeline: written into the lock


def place_outputs(
    pipeline: Pipeline, result: Any, placement: FilePlacement, cache: Cache | None
) -> tuple[dict[str, Path], dict[str, Any]]:
    """Place every product stage's output and the lock file; returns (kind -> path, lock)."""
    report: RunReport = result.report
    products = {s: report[s].digest for s in pipeline.products if report[s].digest}
    stamp_key = digest_json([str(placement.out_dir.resolve()), placement.model_name])
    stamp = cache.placement(stamp_key) if cache is not None else None
    earlier = _earlier_files(placement, stamp)
    if stamp is not None and not _valid_stamp(stamp, pipeline, placement):
        stamp = None  # damaged, planted or another format's: place everything afresh
    if (
        stamp is not None
        and _unchanged(stamp, products, placement)
        and earlier <= {f["name"] for _, f in stamp["files"]}
    ):
        placed = dict(stamp["files"])  # a list of pairs: keeps the products' order
        files = {kind: placement.out_dir / f["name"] for kind, f in placed.items()}
        lock = _lock(pipeline, report, placement, placed)
        _write_lock_if_changed(placement.out_dir, lock)
        return {**files, "lock": placement.out_dir / LOCK_FILE}, lock
    reusable = _reusable(stamp, products, placement) if stamp is not None else {}
    previous = _previous_files(stamp, placement) if stamp is not None else []
    files, digests, lock = _place(
        pipeline, result, placement, products, reusable, previous, earlier
    )
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


def allowed_name(name: Any, pipeline: Pipeline, placement: FilePlacement) -> bool:
    """True for a plain file name the pipeline may place: one it declares in
    ``output_files`` (or, declaring none, ``<model_name>.<suffix>``), or the ONNX model's
    own files; never the lock file."""
    from graphbuild.onnx.save import is_data_file

    if not is_placed_path(name) or name == LOCK_FILE:
        return False
    if not is_plain_name(name):  # in a folder: only a name the pipeline declares
        return pipeline.output_files is not None and (
            name in pipeline.output_files
            or any(is_data_file(name, f) for f in pipeline.output_files if f.endswith(".onnx"))
        )
    model = placement.model_name
    if name == f"{model}.onnx" or is_data_file(name, f"{model}.onnx"):
        return True
    if pipeline.output_files is not None:
        return name in pipeline.output_files or any(
            is_data_file(name, f) for f in pipeline.output_files if f.endswith(".onnx")
        )
    return name.startswith(model + ".") and len(name) > len(model) + 1


def _valid_stamp(stamp: Any, pipeline: Pipeline, placement: FilePlacement) -> bool:
    """A placement stamp as :func:`place_outputs` writes it (``check_placement_stamp``, which
    ``cache verify`` runs too), naming only files this pipeline may place."""
    try:
        check_placement_stamp(stamp)
    except InvalidManifest:
        return False
    return all(allowed_name(f["name"], pipeline, placement) for _, f in stamp["files"])


def _earlier_files(placement: FilePlacement, stamp: Any) -> set[str]:
    """The files an earlier export of this model placed in the output directory: those its
    lock file lists, and those the cache's placement stamp records (whatever the format they
    were placed for). Each is a name an export may place (a file, or a file in one folder),
    never the lock; a lock of another model names none."""
    names: set[str] = set()
    try:
        lock = json.loads((placement.out_dir / LOCK_FILE).read_text())
    except (OSError, ValueError):
        lock = None
    if type(lock) is dict and lock.get("model_name") == placement.model_name:
        listed = lock.get("files")
        names.update(listed if type(listed) is dict else ())
    with contextlib.suppress(InvalidManifest):  # none, damaged or planted: names nothing
        names.update(f["name"] for _, f in check_placement_stamp(stamp)["files"])
    return {n for n in names if is_placed_path(n) and n != LOCK_FILE}


def _previous_files(stamp: dict[str, Any], placement: FilePlacement) -> list[Any]:
    """The placed model files whose tensor ranges the stamp records: a new model file copies
    its unchanged tensors from them (verified as copied, so a file edited since is safe), and
    links a data file an intact one holds the same bytes of."""
    from graphbuild.onnx.save import PreviousFile, TensorRange

    return [
        PreviousFile(
            placement.out_dir / f["name"],
            [TensorRange(*r) for r in f["ranges"]],
            intact=_intact(f, placement),
        )
        for _, f in stamp.get("files", [])
        if f.get("ranges")
    ]


def _intact(f: Mapping[str, Any], placement: FilePlacement) -> bool:
    path = placement.out_dir / f["name"]
    return _stat(path) == {k: f.get(k) for k in ("bytes", "mtime_ns", "inode")}


def _unchanged(stamp: dict[str, Any], products: dict[str, str], placement: FilePlacement) -> bool:
    if stamp.get("products") != products or stamp.get("external_data") != placement.external_data:
        return False
    return all(_intact(f, placement) for _, f in stamp.get("files", []))


def _reusable(
    stamp: dict[str, Any], products: dict[str, str], placement: FilePlacement
) -> dict[str, list[tuple[str, dict[str, Any]]]]:
    """Products whose output is unchanged and whose placed files are intact: their files
    are linked into the new output directory instead of being loaded and written again."""
    if stamp.get("external_data") != placement.external_data:
        return {}
    out: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for kind, f in stamp.get("files", []):
        sink = f.get("product")
        if sink is not None and stamp.get("products", {}).get(sink) == products.get(sink):
            out.setdefault(sink, []).append((kind, f))
    return {
        sink: files for sink, files in out.items() if all(_intact(f, placement) for _, f in files)
    }


def _stat(path: Path) -> dict[str, Any]:
    try:
        st = path.stat()
    except OSError:
        return {}
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def _place(
    pipeline: Pipeline,
    result: Any,
    placement: FilePlacement,
    products: Mapping[str, str],
    reusable: Mapping[str, list[tuple[str, dict[str, Any]]]],
    previous: list[Any],
    earlier: AbstractSet[str] = frozenset(),
) -> tuple[dict[str, Path], dict[str, dict[str, Any]], dict[str, Any]]:
    """Write the products into a temporary directory and make it the output directory's
    contents: the files of ``earlier`` exports this one does not place go with it."""
    from graphbuild.onnx.save import SegmentedFile

    out_dir = placement.out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_temps(out_dir)
    tmp = Path(
        tempfile.mkdtemp(
            prefix=f".{out_dir.name}.{os.getpid()}.", suffix=".tmp", dir=out_dir.parent
        )
    )
    committed = False
    try:
        written: dict[str, Path] = {}
        digests: dict[str, dict[str, Any]] = {}
        for sink in products:
            if sink in reusable:
                for kind, f in reusable[sink]:
                    written[kind] = tmp / f["name"]
                    written[kind].parent.mkdir(exist_ok=True)
                    os.link(out_dir / f["name"], written[kind])
                    digests[kind] = {"name": f["name"], "xxh3_128": f["xxh3_128"], "product": sink}
                continue
            value = result.outputs.get(sink)
            if value is None or not _placeable(value):
                continue
            items = value.items() if isinstance(value, Mapping) else [(sink, value)]
            for kind, item in items:
                name = _model_file(kind, item) if isinstance(value, Mapping) else None
                named = item.name if isinstance(item, (FileArtifact, SegmentedFile)) else name
                if named is not None and not allowed_name(named, pipeline, placement):
                    raise ExportError(
                        f"stage '{sink}' produced a file named {named[:200]!r}, which "
                        f"is not one the pipeline declares ({_declared(pipeline, placement)}); "
                        "a file artifact's name must be a plain file name listed in "
                        "Pipeline.output_files"
                    )
                for path, digest, ranges in _write(item, tmp, placement, previous, name):
                    placed = path.relative_to(tmp).as_posix()  # a folder's file: folder/name
                    # a named model's files (its data files too) are known by their names
                    kind_of = placed if name else _kind(placed, placement.model_name, kind)
                    written[kind_of] = path
                    digests[kind_of] = {"name": placed, "xxh3_128": digest, "product": sink}
                    if ranges:
                        digests[kind_of]["ranges"] = ranges
            # let this product go before the next is loaded: a product recomputed to be
            # placed (a rematerialized one) is held by nothing else
            value = items = item = None
        lock = _lock(pipeline, result.report, placement, digests, written)
        (tmp / LOCK_FILE).write_text(_lock_text(lock))
        ours = {p.relative_to(tmp).as_posix() for p in written.values()}
        stale = (_data_files(out_dir, placement.model_name) | earlier) - ours
        _commit(tmp, out_dir, ours | {LOCK_FILE}, stale)
        committed = True
        return {kind: out_dir / p.relative_to(tmp) for kind, p in written.items()}, digests, lock
    finally:
        if committed:  # tmp holds the replaced files now: nobody waits for their removal
            _release_links(tmp)
            _remove_in_background(tmp)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- commit


def _commit(tmp: Path, out_dir: Path, ours: set[str], stale: set[str]) -> None:
    """Make ``tmp``'s files the contents of ``out_dir`` in one step where the platform
    allows: a new directory is renamed into place; an existing one (holding files only) is
    atomically exchanged with ``tmp`` after the files we do not own are hard-linked across.
    Otherwise files are moved one by one and moved back if a move fails. Another export
    that creates the same new directory first (between our look and our rename) makes it an
    existing one: ours then replaces its contents whole, and both exports succeed."""
    if not out_dir.exists():
        _fsync_dir(tmp)
        tmp.chmod(0o777 & ~_umask())
        try:
            os.replace(tmp, out_dir)
            return
        except OSError as err:
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not out_dir.is_dir():
                raise
    entries = list(os.scandir(out_dir))
    ours = _top_level(ours)
    stale = _top_level(stale) - ours  # a folder of both is ours: replaced whole
    if (
        _exchange is not None
        and all(not e.is_dir(follow_symlinks=False) or e.name in ours | stale for e in entries)
        and not os.path.ismount(out_dir)  # a mount point cannot be renamed (EBUSY)
    ):
        for e in entries:
            if e.name not in ours and e.name not in stale:
                os.link(e.path, tmp / e.name, follow_symlinks=False)
        shutil.copymode(out_dir, tmp)
        _fsync_dir(tmp)
        _exchange(tmp, out_dir)  # tmp now holds the previous contents
        return
    _move_files(tmp, out_dir, ours, stale)


def _top_level(names: set[str]) -> set[str]:
    """The entries of the output directory that ``names`` are in: a file, or the folder of a
    file in one. An export owns its folders whole: each is replaced as one entry."""
    return {name.split("/")[0] for name in names}


def _move_files(tmp: Path, out_dir: Path, ours: set[str], stale: set[str]) -> None:
    """Per-entry fallback (a file, or a folder the export owns): the lock last; on a failure
    the moved entries are put back."""
    backup = tmp / ".previous"
    backup.mkdir()
    moved: list[str] = []
    names = sorted(ours - {LOCK_FILE}) + [LOCK_FILE]
    try:
        for name in names + sorted(stale):
            if (out_dir / name).exists():
                os.replace(out_dir / name, backup / name)
            moved.append(name)
            if name in ours:
                os.replace(tmp / name, out_dir / name)
    except BaseException:
        for name in reversed(moved):
            if (backup / name).exists():
                os.replace(backup / name, out_dir / name)
            elif name in ours:
                (out_dir / name).unlink(missing_ok=True)
        raise


def _load_exchange():
    """``renameat2(RENAME_EXCHANGE)`` (Linux 3.15+, glibc 2.28+), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return None
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    at_fdcwd, rename_exchange = -100, 2

    def exchange(a: Path, b: Path) -> None:
        if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), str(b))

    return exchange


_exchange = _load_exchange()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(path: Path) -> None:
    for entry in os.scandir(path):
        if entry.is_dir(follow_symlinks=False):
            _fsync_dir(Path(entry.path))
        elif entry.is_file(follow_symlinks=False):
            fd = os.open(entry.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _release_links(replaced: Path) -> None:
    """Remove, now, the replaced files' names that the new output still links (an unchanged
    file linked across, a data file an intact one was linked for): a name only, no blocks to
    free, and the new file is left with one link, which onnx requires of external data (it
    refuses a file with more than one as a possible hard-link attack)."""
    folders = [replaced, replaced / ".previous"]
    for directory in folders:
        try:
            entries = list(os.scandir(directory))
        except OSError:
            continue
        folders += [Path(e.path) for e in entries if e.is_dir(follow_symlinks=False)]
        for entry in entries:
            try:
                if entry.is_file(follow_symlinks=False) and entry.stat().st_nlink > 1:
                    os.unlink(entry.path)
            except OSError:
                pass  # the background removal takes it


def _remove_in_background(path: Path) -> None:
    """Remove the directory of the files an export replaced on a thread of its own: freeing
    a large file's blocks takes the file system a while (with online discard, most of a
    weights-only export's placing), and the new files are in place already. Not a daemon,
    so the interpreter finishes it before exiting; a process killed first leaves the
    directory to the next export's :func:`_remove_abandoned_temps`."""
    threading.Thread(
        target=shutil.rmtree,
        args=(path,),
        kwargs={"ignore_errors": True},
        name="graphbuild-remove-replaced",
    ).start()


def _remove_abandoned_temps(out_dir: Path) -> None:
    """Temporary directories of exports that were killed (their process is gone)."""
    for tmp in out_dir.parent.glob(f".{out_dir.name}.*.tmp"):
        parts = tmp.name[len(out_dir.name) + 2 :].split(".")
        if parts and parts[0].isdigit() and not _alive(int(parts[0])):
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _data_files(out_dir: Path, model_name: str) -> set[str]:
    """The data files of ``<model_name>.onnx`` in ``out_dir``: a new model file replaces
    them all (one layout's files must not outlive a change to another)."""
    from graphbuild.onnx.save import is_data_file

    try:
        names = os.listdir(out_dir)
    except OSError:
        return set()
    return {n for n in names if is_data_file(n, f"{model_name}.onnx")}


def _declared(pipeline: Pipeline, placement: FilePlacement) -> str:
    if pipeline.output_files is not None:
        return ", ".join(sorted(pipeline.output_files)) or "none"
    return f"{placement.model_name}.<suffix>"


def _placeable(value: Any) -> bool:
    from graphbuild.onnx.bind import BoundModel
    from graphbuild.onnx.save import SegmentedFile

    if isinstance(value, (BoundModel, FileArtifact, SegmentedFile)):
        return True
    return isinstance(value, Mapping) and bool(value) and all(map(_placeable, value.values()))


def _model_file(kind: str, item: Any) -> str | None:
    """A model a product maps a file name to (``{"prompt_ar128_cl4096_2_of_3.onnx": model}``)
    is placed under that name; a model alone, as ``<model_name>.onnx``."""
    from graphbuild.onnx.bind import BoundModel

    return kind if isinstance(item, BoundModel) and kind.endswith(".onnx") else None


def _write(
    item: Any, tmp: Path, placement: FilePlacement, previous: list[Any], name: str | None = None
) -> list[tuple[Path, str, list[list[Any]]]]:
    """Write one product's files into ``tmp``: (path, xxh3-128, tensor ranges) each; a
    model under ``name`` when given."""
    from graphbuild.onnx.bind import BoundModel
    from graphbuild.onnx.save import SegmentedFile, write_model, write_segments

    if isinstance(item, BoundModel):
        target = tmp / (name or f"{placement.model_name}.onnx")
        saved = write_model(item, target, external_data=placement.external_data, previous=previous)
    elif isinstance(item, SegmentedFile):
        saved = [write_segments(tmp / item.name, item.segments(), previous)]
    else:
        path = tmp / item.name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(item.data)
        return [(path, digest_bytes(item.data), [])]
    return [(f.path, f.digest, [[r.offset, r.length, r.digest] for r in f.ranges]) for f in saved]


def _kind(filename: str, model_name: str, fallback: str) -> str:
    if filename.startswith(model_name + "."):
        return filename[len(model_name) + 1 :]
    return fallback


def _lock(
    pipeline: Pipeline,
    report: RunReport,
    placement: FilePlacement,
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
        "toolchain": {**toolchain_versions(), **pipeline_tools(pipeline)},
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


def json_safe(value: Any) -> Any:
    """``value`` with non-finite floats as strings ("inf", "nan") and tuples as lists: JSON
    has no spelling for them, and readers other than Python's reject ``Infinity``."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


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
